"""``--device-ids``: parse the flag and check it against the platform's devices.

Devices are chosen by index on the selected platform; the engine never sets
``CUDA_VISIBLE_DEVICES`` (or its ROCm/XPU siblings). When such a variable is
set by the user, indices are relative to the devices it leaves visible, and a
one-line notice says so.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

__all__ = [
    "InvalidDeviceIdsError",
    "describe_available",
    "parse_device_ids",
    "validate_device_ids",
    "visible_devices_notice",
]

logger = logging.getLogger(__name__)

_NOTICED: set[str] = set()


class InvalidDeviceIdsError(ValueError):
    """``--device-ids`` names devices that do not exist, or names one twice."""


def parse_device_ids(value: str | Sequence[int] | None) -> list[int] | None:
    """``"0,2"`` (or ``[0, 2]``) -> ``[0, 2]``; None or ``""`` -> None (the default device).

    Raises:
        InvalidDeviceIdsError: a non-integer, negative or repeated id.
    """
    if value is None:
        return None
    if isinstance(value, str):
        parts = [p.strip() for p in value.split(",")]
        if not any(parts):
            return None
        ids = []
        for part in parts:
            try:
                ids.append(int(part))
            except ValueError:
                raise InvalidDeviceIdsError(
                    f"--device-ids: {part!r} is not a device index; expected a comma-separated "
                    f"list such as 0,2"
                ) from None
    else:
        ids = []
        for item in value:
            if isinstance(item, bool) or not isinstance(item, int):
                raise InvalidDeviceIdsError(
                    f"device_ids: {item!r} is not a device index (an int)"
                )
            ids.append(item)
        if not ids:
            return None
    negative = [i for i in ids if i < 0]
    if negative:
        raise InvalidDeviceIdsError(
            f"--device-ids must be non-negative, got {', '.join(map(str, negative))}"
        )
    repeated = sorted({i for i in ids if ids.count(i) > 1})
    if repeated:
        raise InvalidDeviceIdsError(
            f"--device-ids lists device {', '.join(map(str, repeated))} more than once"
        )
    return ids


def describe_available(platform_name: str, names: Sequence[str]) -> str:
    """``"cuda has 2 devices: 0 (NVIDIA H100), 1 (NVIDIA H100)"``."""
    if not names:
        return f"{platform_name} has no devices"
    listed = ", ".join(f"{i} ({n})" for i, n in enumerate(names))
    plural = "device" if len(names) == 1 else "devices"
    return f"{platform_name} has {len(names)} {plural}: {listed}"


def validate_device_ids(ids: Sequence[int], platform_name: str, names: Sequence[str],
                        visible: Sequence[tuple[str, str]] = ()) -> list[int]:
    """Check parsed ids against the platform's visible devices.

    Raises:
        InvalidDeviceIdsError: an id is out of range; the message lists what exists.
    """
    checked = parse_device_ids(list(ids)) or []
    missing = [i for i in checked if i >= len(names)]
    if missing:
        where = ""
        if visible:
            env = ", ".join(f"{k}={v}" for k, v in visible)
            where = f" (indices are relative to the devices {env} leaves visible)"
        raise InvalidDeviceIdsError(
            f"--device-ids {','.join(map(str, checked))}: no device "
            f"{', '.join(map(str, missing))}; {describe_available(platform_name, names)}{where}"
        )
    return checked


def visible_devices_notice(visible: Sequence[tuple[str, str]]) -> str | None:
    """Log, once per variable and value, that device ids are relative to the visible set."""
    if not visible:
        return None
    env = ", ".join(f"{k}={v}" for k, v in visible)
    message = (f"{env} is set: device ids (--device-ids) index the devices it leaves visible, "
               f"not physical device numbers")
    if env not in _NOTICED:
        _NOTICED.add(env)
        logger.warning(message)
    return message
