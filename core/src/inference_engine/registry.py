"""Spec records, name clashes and lazy resolution of registered targets.

A registry maps ``(kind, name)`` to the :class:`Spec` a plugin registered. The
target stays a ``"module:attr"`` string until :meth:`Registry.resolve` is
called, so listing plugins imports nothing heavy.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "KINDS",
    "REMOVED_ARCHITECTURES",
    "DuplicateNameError",
    "RegisteredSpec",
    "Registry",
    "RemovedArchitectureError",
    "Spec",
    "UnknownNameError",
]

# Registration hook name -> kind key (also the key in list-plugins' "provides").
KINDS: dict[str, str] = {
    "ie_register_platforms": "platforms",
    "ie_register_models": "models",
    "ie_register_quantization_methods": "quantization",
    "ie_register_attention_backends": "attention_backends",
    "ie_register_weight_formats": "weight_formats",
    "ie_register_tool_parsers": "tool_parsers",
    "ie_register_reasoning_parsers": "reasoning_parsers",
    "ie_register_proposers": "proposers",
}

# Architectures deliberately dropped: they fail with this message, never as "unknown".
REMOVED_ARCHITECTURES: dict[str, str] = {
    "Ernie4_5ForCausalLM": "ERNIE 4.5",
    "Ernie4_5_MoeForCausalLM": "ERNIE 4.5 MoE",
    "XverseForCausalLM": "Xverse",
    "Dots1ForCausalLM": "Dots1",
}


@dataclass(frozen=True, slots=True)
class Spec:
    """One thing a plugin registers; cheap to build, resolved on first use."""

    # Registration name: lower snake case, or an HF architecture name for models.
    name: str
    # Lazy import target, "package.module:attr".
    target: str
    # One-line description shown by list-plugins.
    description: str = ""
    # Name of the plugin whose registration of the same name this one replaces.
    overrides: str | None = None

    def __post_init__(self) -> None:
        module, sep, attr = self.target.partition(":")
        if not self.name or not sep or not module or not attr:
            raise ValueError(
                f"Spec {self.name!r}: target must look like 'module:attr', got {self.target!r}"
            )


@dataclass(frozen=True, slots=True)
class RegisteredSpec:
    """A spec together with who registered it."""

    spec: Spec
    # Entry-point name of the registering plugin.
    plugin: str
    # Distribution that ships the plugin ("" when registered in-process).
    distribution: str


class DuplicateNameError(ValueError):
    """Two plugins registered the same name in one kind without ``overrides``."""


class UnknownNameError(KeyError):
    """A name nobody registered; the message lists what exists."""

    def __str__(self) -> str:  # KeyError quotes its message; we want it plain.
        return str(self.args[0]) if self.args else ""


class RemovedArchitectureError(ValueError):
    """An architecture that this engine no longer supports, on purpose."""


@dataclass
class Registry:
    """All registered specs, by kind and name."""

    by_kind: dict[str, dict[str, RegisteredSpec]] = field(
        default_factory=lambda: {kind: {} for kind in KINDS.values()}
    )
    # (kind, name) -> the distribution that provides it though it is not loaded here (a
    # plugin left out by INFERENCE_ENGINE_PLUGINS), or None; only asked to word an error.
    provider_of: Callable[[str, str], str | None] = field(
        default=lambda kind, name: None, repr=False
    )
    _resolved: dict[tuple[str, str], Any] = field(default_factory=dict, repr=False)

    def add(self, kind: str, spec: Spec, plugin: str, distribution: str = "") -> None:
        """Add one spec, refusing a clash unless one side declares ``overrides``.

        Raises:
            DuplicateNameError: naming both plugins and their distributions.
        """
        if kind not in self.by_kind:
            raise ValueError(f"unknown kind {kind!r}; kinds are {sorted(self.by_kind)}")
        entries = self.by_kind[kind]
        new = RegisteredSpec(spec, plugin, distribution)
        old = entries.get(spec.name)
        if old is None:
            entries[spec.name] = new
            return
        if spec.overrides == old.plugin:
            entries[spec.name] = new
            return
        if old.spec.overrides == plugin:
            return  # the existing registration already replaces this one
        raise DuplicateNameError(
            f"{kind} name {spec.name!r} is registered twice: by plugin {old.plugin!r} "
            f"(distribution {old.distribution or '<none>'}) and by plugin {plugin!r} "
            f"(distribution {distribution or '<none>'}); one of them must declare "
            f"overrides=<other plugin> or be removed"
        )

    def names(self, kind: str) -> list[str]:
        """Sorted names registered in ``kind``."""
        return sorted(self.by_kind[kind])

    def get(self, kind: str, name: str) -> RegisteredSpec:
        """The registration of ``name`` in ``kind``.

        Raises:
            RemovedArchitectureError: for architectures dropped on purpose.
            UnknownNameError: listing the registered names and, when an installed
                distribution that is not loaded provides the name, the ``pip install``
                line.
        """
        entry = self.by_kind.get(kind, {}).get(name)
        if entry is not None:
            return entry
        if kind == "models" and name in REMOVED_ARCHITECTURES:
            raise RemovedArchitectureError(
                f"architecture {name!r} ({REMOVED_ARCHITECTURES[name]}) was removed from "
                f"inference-engine and is no longer supported; use an older release or "
                f"convert the model to a supported architecture"
            )
        available = ", ".join(self.names(kind)) or "<none>"
        message = f"unknown {kind.rstrip('s').replace('_', ' ')} {name!r}; registered: {available}"
        provider = self.provider_of(kind, name)
        if provider is not None:
            message += f". It is provided by {provider}: pip install {provider}"
        raise UnknownNameError(message)

    def resolve(self, kind: str, name: str) -> Any:
        """Import and return the target object of ``name`` in ``kind`` (cached)."""
        key = (kind, name)
        if key not in self._resolved:
            entry = self.get(kind, name)
            module_name, _, attr = entry.spec.target.partition(":")
            try:
                module = importlib.import_module(module_name)
                obj = module
                for part in attr.split("."):
                    obj = getattr(obj, part)
            except (ImportError, AttributeError) as exc:
                raise ImportError(
                    f"{kind} {name!r} from plugin {entry.plugin!r}: cannot import target "
                    f"{entry.spec.target!r}: {exc}"
                ) from exc
            self._resolved[key] = obj
        return self._resolved[key]
