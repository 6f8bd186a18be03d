"""Pick the hardware platform: the named one, or the present one with top priority."""

from __future__ import annotations

import logging

from inference_engine.interfaces.platform import Platform
from inference_engine.plugins import get_plugins

__all__ = [
    "PlatformUnavailableError",
    "current_platform",
    "present_platforms",
    "select_platform",
    "set_current_platform",
]

logger = logging.getLogger(__name__)

_CURRENT: Platform | None = None


class PlatformUnavailableError(ValueError):
    """``--platform NAME`` is registered but its hardware (or torch build) is absent."""


def present_platforms() -> list[type[Platform]]:
    """Registered platforms whose hardware is present, highest priority first.

    A platform plugin that fails to import or to probe is skipped (and logged),
    so a broken accelerator plugin never stops the CPU path.
    """
    registry = get_plugins().registry
    found = []
    for platform_name in registry.names("platforms"):
        try:
            cls = registry.resolve("platforms", platform_name)
            if cls.is_present():
                found.append(cls)
        except Exception as exc:  # noqa: BLE001
            logger.warning("platform %r skipped: %s: %s", platform_name, type(exc).__name__, exc)
    found.sort(key=lambda c: (-c.priority, c.name))
    return found


def select_platform(name: str | None = None, device_ids: list[int] | None = None) -> Platform:
    """Instantiate the platform to run on: ``name``, or the present one with top priority.

    Raises:
        UnknownNameError: ``name`` is not registered (the message says what to install).
        PlatformUnavailableError: ``name`` is registered but its hardware is absent.
        InvalidDeviceIdsError: ``device_ids`` do not exist on the chosen platform.
    """
    if name is not None:
        cls = get_plugins().registry.resolve("platforms", name)
        if not cls.is_present():
            present = ", ".join(c.name for c in present_platforms())
            raise PlatformUnavailableError(
                f"--platform {name}: the platform is installed but no {name} device is usable "
                f"here ({cls.absence_reason()}); present platforms: {present}"
            )
        return cls(device_ids)
    return present_platforms()[0](device_ids)


def current_platform() -> Platform:
    """The platform this process runs on: the engine's, else the auto-selected one.

    Kernels that are not handed a platform (tuning lookups) ask here.
    """
    global _CURRENT
    if _CURRENT is None:
        _CURRENT = select_platform()
    return _CURRENT


def set_current_platform(platform: Platform | None) -> None:
    """Make ``platform`` the process's current one (the engine at start; tests)."""
    global _CURRENT
    _CURRENT = platform
