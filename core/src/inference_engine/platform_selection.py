"""Pick the hardware platform: the named one, or the present one with top priority."""

from __future__ import annotations

from inference_engine.interfaces.platform import Platform
from inference_engine.plugins import get_plugins

__all__ = ["current_platform", "select_platform", "set_current_platform"]

_CURRENT: Platform | None = None


def select_platform(name: str | None = None, device_ids: list[int] | None = None) -> Platform:
    """Instantiate the platform to run on.

    Raises:
        UnknownNameError: ``name`` is not registered.
        RuntimeError: ``name`` is registered but its hardware is absent.
    """
    registry = get_plugins().registry
    if name is not None:
        cls = registry.resolve("platforms", name)
        if not cls.is_present():
            raise RuntimeError(f"platform {name!r} is registered but no such device is present")
        return cls(device_ids)
    candidates = []
    for platform_name in registry.names("platforms"):
        try:
            cls = registry.resolve("platforms", platform_name)
            if cls.is_present():
                candidates.append(cls)
        except Exception:  # a broken platform plugin must not stop the CPU path
            continue
    candidates.sort(key=lambda c: c.priority, reverse=True)
    return candidates[0](device_ids)


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
