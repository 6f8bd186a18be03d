"""Diffusion sampling settings: the checkpoint's generation config, overridden per request.

Keys are transformers' ``DiffusionGemmaGenerationConfig`` fields (``entropy_bound`` is
its ``sampler_config.entropy_bound``) plus ``start_canvas``; a request overrides them
through ``SamplingParams(extra_args={...})`` (the server's ``extra_body``) with exactly
these names.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

__all__ = ["DIFFUSION_KEYS", "DiffusionSettings"]


@dataclass(frozen=True, slots=True)
class DiffusionSettings:
    """How one request denoises each block (defaults: transformers' generate defaults)."""

    # Decoder passes per block at most (the schedule's N).
    max_denoising_steps: int = 48
    # Accept the lowest-entropy positions while sum(H) - max(H) stays within this.
    entropy_bound: float = 0.1
    # Temperature at the last step and at the first: T = t_min + (t_max - t_min) * step / N.
    t_min: float = 0.4
    t_max: float = 0.8
    # Stop a block early once its argmax canvas is unchanged over this many steps ...
    stability_threshold: int = 1
    # ... and the mean entropy of the scaled logits is below this.
    confidence_threshold: float = 0.005
    # A block's first canvas: "random" (uniform vocabulary ids, as transformers) or "pad"
    # (every slot the pad id; with a near-zero temperature this makes runs repeatable).
    start_canvas: str = "random"

    def __post_init__(self) -> None:
        def is_int(v: Any) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        def is_num(v: Any) -> bool:
            return isinstance(v, (int, float)) and not isinstance(v, bool)

        if not is_int(self.max_denoising_steps) or self.max_denoising_steps <= 0:
            raise ValueError(f"max_denoising_steps must be a positive integer, got "
                             f"{self.max_denoising_steps!r}")
        if not is_num(self.entropy_bound) or self.entropy_bound <= 0:
            raise ValueError(f"entropy_bound must be a number > 0, got {self.entropy_bound!r}")
        for name in ("t_min", "t_max"):
            value = getattr(self, name)
            if not is_num(value) or value < 0:
                raise ValueError(f"{name} must be a number >= 0, got {value!r}")
        if self.t_max <= self.t_min:
            raise ValueError(f"t_max must be greater than t_min, got t_max={self.t_max} and "
                             f"t_min={self.t_min}")
        if not is_int(self.stability_threshold) or self.stability_threshold < 0:
            raise ValueError(f"stability_threshold must be an integer >= 0, got "
                             f"{self.stability_threshold!r}")
        if not is_num(self.confidence_threshold) or self.confidence_threshold <= 0:
            raise ValueError(f"confidence_threshold must be a number > 0, got "
                             f"{self.confidence_threshold!r}")
        if self.start_canvas not in ("random", "pad"):
            raise ValueError(f"start_canvas must be 'random' or 'pad', got "
                             f"{self.start_canvas!r}")

    @classmethod
    def from_generation_config(cls, config: dict[str, Any]) -> DiffusionSettings:
        """The checkpoint's ``generation_config.json`` values (unset ones keep the defaults).

        Raises:
            ValueError: a value out of range, naming it.
        """
        values: dict[str, Any] = {}
        for key in ("max_denoising_steps", "t_min", "t_max", "stability_threshold",
                    "confidence_threshold"):
            if config.get(key) is not None:
                values[key] = config[key]
        sampler = config.get("sampler_config")
        if isinstance(sampler, dict) and sampler.get("entropy_bound") is not None:
            values["entropy_bound"] = sampler["entropy_bound"]
        return cls(**values)

    def with_overrides(self, extra_args: dict[str, Any] | None) -> DiffusionSettings:
        """These settings with a request's ``extra_args`` applied.

        Raises:
            ValueError: an unknown key (named, with the known ones) or a bad value.
        """
        if not extra_args:
            return self
        unknown = sorted(set(extra_args) - set(DIFFUSION_KEYS))
        if unknown:
            raise ValueError(f"unknown diffusion setting(s) {', '.join(map(repr, unknown))} in "
                             f"extra_args; known: {', '.join(DIFFUSION_KEYS)}")
        return dataclasses.replace(self, **extra_args)

    def temperature(self, step: int) -> float:
        """The schedule at ``step`` (N .. 1: steps *remaining*, as transformers counts)."""
        return self.t_min + (self.t_max - self.t_min) * (step / self.max_denoising_steps)


# The per-request keys, in documentation order.
DIFFUSION_KEYS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(DiffusionSettings))
