"""Plugin discovery: entry points -> pluggy manager -> :class:`Registry`.

Each entry point of the group ``inference_engine`` is loaded in its own
``try`` so one broken plugin is recorded (and warned about) while the rest keep
working. The core's built-ins arrive through the core's own entry point.
Loading is idempotent per process: :func:`get_plugins` caches the result.
"""

from __future__ import annotations

import logging
import types
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import importlib_metadata
import pluggy

from inference_engine import hookspecs
from inference_engine.registry import KINDS, Registry

__all__ = ["PluginInfo", "PluginSet", "get_plugins", "load_plugins", "reset_plugins"]

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = hookspecs.PROJECT_NAME


@dataclass
class PluginInfo:
    """What list-plugins reports about one plugin."""

    # Entry-point name (the plugin's name).
    name: str
    # Distribution that declares the entry point ("" for in-process plugins).
    distribution: str
    version: str
    # The module the entry point names.
    module: str
    # "ok" or "error".
    status: str = "ok"
    error: str | None = None
    # kind -> names this plugin registered.
    provides: dict[str, list[str]] = field(
        default_factory=lambda: {kind: [] for kind in KINDS.values()}
    )

    def as_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "distribution": self.distribution,
            "version": self.version,
            "module": self.module,
            "status": self.status,
            "error": self.error,
            "provides": {k: list(v) for k, v in self.provides.items()},
        }


@dataclass
class PluginSet:
    """The loaded plugins of one process."""

    manager: pluggy.PluginManager
    registry: Registry
    infos: list[PluginInfo]

    @property
    def hook(self) -> Any:
        """The pluggy hook relay, for decision hooks (call with keywords only)."""
        return self.manager.hook

    def errors(self) -> list[PluginInfo]:
        return [info for info in self.infos if info.status != "ok"]

    def warn_about_errors(self) -> None:
        """Log every broken plugin once; called at engine start."""
        for info in self.errors():
            logger.warning("plugin %r (%s) failed: %s", info.name, info.distribution, info.error)


def _new_manager() -> pluggy.PluginManager:
    manager = pluggy.PluginManager(hookspecs.PROJECT_NAME)
    manager.add_hookspecs(hookspecs)
    return manager


# (name, distribution, version, module, loader) of one plugin that may be registered.
_Candidate = tuple[str, str, str, str, Callable[[], Any]]


def _discover() -> list[_Candidate]:
    """(name, distribution, version, module, loader) for every entry point, sorted."""
    found = []
    seen: set[tuple[str, str]] = set()
    for ep in importlib_metadata.entry_points(group=ENTRY_POINT_GROUP):
        dist = ep.dist.name if ep.dist is not None else ""
        version = ep.dist.version if ep.dist is not None else ""
        if (ep.name, dist) in seen:  # the same dist visible twice on sys.path
            continue
        seen.add((ep.name, dist))
        found.append((ep.name, dist, version, ep.value, ep.load))
    # Built-ins first, then alphabetical, so clash reports are deterministic.
    found.sort(key=lambda item: (item[0] != "builtin", item[0]))
    return found


def load_plugins(
    only: Iterable[str] | None = None,
    extra: Mapping[str, object] | None = None,
    use_entry_points: bool = True,
) -> PluginSet:
    """Discover, register and collect every plugin's specs.

    Args:
        only: restrict to these plugin names (``INFERENCE_ENGINE_PLUGINS``);
            an unknown name is a ``ValueError`` that lists the known ones.
        extra: in-process plugins (name -> module or object with hookimpls),
            registered after the entry points; used by tests and embedders.
        use_entry_points: set False to load only ``extra`` (tests).

    Returns:
        A fresh :class:`PluginSet`. Broken plugins are recorded, not raised.
    """
    candidates = _discover() if use_entry_points else []
    for name, obj in (extra or {}).items():
        module = getattr(obj, "__name__", type(obj).__name__)
        candidates.append((name, "", "", module, lambda obj=obj: obj))

    skipped: list[_Candidate] = []
    if only is not None:
        wanted = [n for n in (s.strip() for s in only) if n]
        known = {c[0] for c in candidates}
        unknown = [n for n in wanted if n not in known]
        if unknown:
            raise ValueError(
                f"INFERENCE_ENGINE_PLUGINS names unknown plugin(s) {', '.join(unknown)}; "
                f"installed plugins: {', '.join(sorted(known)) or '<none>'}"
            )
        skipped = [c for c in candidates if c[0] not in wanted]
        candidates = [c for c in candidates if c[0] in wanted]

    plugin_set = _register(candidates)
    plugin_set.registry.provider_of = _UnloadedProviders(skipped)
    return plugin_set


def _register(candidates: list[_Candidate]) -> PluginSet:
    """A fresh manager with each candidate registered and its specs collected."""
    manager = _new_manager()
    registry = Registry()
    infos: list[PluginInfo] = []
    for name, dist, version, module, loader in candidates:
        info = PluginInfo(name=name, distribution=dist, version=version, module=module)
        infos.append(info)
        try:
            plugin = loader()
            if manager.is_registered(plugin):
                raise ValueError(f"module {module} is already registered by another plugin")
            manager.register(plugin, name=name)
        except Exception as exc:  # noqa: BLE001 - one broken plugin must not stop the rest
            info.status, info.error = "error", f"{type(exc).__name__}: {exc}"
            continue
        _collect_specs(manager, plugin, info, registry)
    return PluginSet(manager=manager, registry=registry, infos=infos)


def _collect_specs(
    manager: pluggy.PluginManager, plugin: object, info: PluginInfo, registry: Registry
) -> None:
    """Call each registration hook of one plugin and add its specs atomically."""
    collected: list[tuple[str, Any]] = []
    # The plugin's own answers: every other plugin is left out of the hook call.
    others = [p for p in manager.get_plugins() if p is not plugin]
    try:
        for hook_name, kind in KINDS.items():
            for specs in manager.subset_hook_caller(hook_name, remove_plugins=others)():
                if not isinstance(specs, (list, tuple)):
                    raise TypeError(f"{hook_name} must return a list of Spec, got {specs!r}")
                collected.extend((kind, spec) for spec in specs)
        staged = Registry()
        staged.by_kind = {k: dict(v) for k, v in registry.by_kind.items()}
        for kind, spec in collected:
            staged.add(kind, spec, info.name, info.distribution)
    except Exception as exc:  # noqa: BLE001
        info.status, info.error = "error", f"{type(exc).__name__}: {exc}"
        manager.unregister(plugin)
        return
    registry.by_kind = staged.by_kind
    for kind, spec in collected:
        if spec.name not in info.provides[kind]:
            info.provides[kind].append(spec.name)


class _UnloadedProviders:
    """Which installed plugin left out of this process registers a name, by its own hooks.

    The left-out plugins are loaded (into a manager of their own) only when an unknown
    name needs the answer for its error message, never at start-up.
    """

    def __init__(self, candidates: list[_Candidate]) -> None:
        self._candidates = candidates
        self._providers: dict[tuple[str, str], str] | None = None

    def __call__(self, kind: str, name: str) -> str | None:
        if self._providers is None:
            self._providers = {}
            for info in _register(self._candidates).infos:
                for provided_kind, names in info.provides.items():
                    for provided in names:
                        self._providers.setdefault((provided_kind, provided), info.distribution)
        return self._providers.get((kind, name)) or None


_CACHED: PluginSet | None = None


def get_plugins() -> PluginSet:
    """The process-wide plugin set, loaded on first call (idempotent)."""
    global _CACHED
    if _CACHED is None:
        from inference_engine.config import plugin_filter_from_env

        _CACHED = load_plugins(only=plugin_filter_from_env())
    return _CACHED


def reset_plugins(plugin_set: PluginSet | None = None) -> None:
    """Drop (or replace) the cached plugin set; for tests."""
    global _CACHED
    _CACHED = plugin_set


def module_with_hooks(name: str, **functions: Any) -> types.ModuleType:
    """Build an in-process plugin module from hookimpl functions (tests, embedders)."""
    module = types.ModuleType(name)
    for attr, fn in functions.items():
        setattr(module, attr, fn)
    return module
