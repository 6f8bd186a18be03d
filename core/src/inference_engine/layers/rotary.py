"""Rotary position embeddings (neox layout) with the rope scaling types of Llama/Qwen.

Frequencies follow the published formulas for each ``rope_type``: default,
linear, dynamic (NTK; transformers' frequencies within the original context,
see ``inv_frequencies``), yarn and llama3; ``partial_rotary_factor`` rotates
only the leading dims of each head.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

__all__ = ["RotaryEmbedding", "inv_frequencies", "rope_parameters"]


def rope_parameters(config: Any) -> dict[str, Any]:
    """The rope settings of an HF config (v5 ``rope_parameters`` or legacy fields)."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    legacy = getattr(config, "rope_scaling", None)
    if legacy and not params.get("rope_type"):
        params.update(legacy)
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    params.setdefault("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
    return params


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def inv_frequencies(params: dict[str, Any], rot_dim: int, max_position: int) -> tuple[torch.Tensor, float]:
    """(inverse frequencies ``[rot_dim // 2]``, attention scaling of cos/sin)."""
    base = float(params["rope_theta"])
    rope_type = params["rope_type"]
    exponents = torch.arange(0, rot_dim, 2, dtype=torch.int64).float() / rot_dim
    inv = 1.0 / (base**exponents)
    if rope_type == "default":
        return inv, 1.0
    factor = params.get("factor")
    if factor is None:
        original_len = params.get("original_max_position_embeddings")
        factor = max_position / original_len if original_len else 1.0
    factor = float(factor)
    if rope_type == "linear":
        return inv / factor, 1.0
    if rope_type == "dynamic":
        # transformers recomputes the base only once a sequence outgrows the
        # original context; within it (what we serve) the frequencies are the
        # unscaled ones.
        return inv, 1.0
    original = int(params.get("original_max_position_embeddings") or max_position)
    if rope_type == "llama3":
        low_ff = float(params.get("low_freq_factor", 1.0))
        high_ff = float(params.get("high_freq_factor", 4.0))
        low_wavelen = original / low_ff
        high_wavelen = original / high_ff
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (original / wavelen - low_ff) / (high_ff - low_ff)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled), 1.0
    if rope_type == "yarn":
        attention = params.get("attention_factor")
        mscale, mscale_all = params.get("mscale"), params.get("mscale_all_dim")
        if attention is None:
            if mscale and mscale_all:
                attention = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all)
            else:
                attention = _yarn_mscale(factor)
        beta_fast = float(params.get("beta_fast") or 32)
        beta_slow = float(params.get("beta_slow") or 1)

        def correction_dim(rotations: float) -> float:
            return rot_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

        low, high = correction_dim(beta_fast), correction_dim(beta_slow)
        if params.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, rot_dim - 1)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(rot_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        extrapolation = 1 - ramp
        inv = (inv / factor) * (1 - extrapolation) + inv * extrapolation
        return inv, float(attention)
    raise ValueError(
        f"unsupported rope_type {rope_type!r}; supported: default, linear, dynamic, yarn, llama3"
    )


class RotaryEmbedding(nn.Module):
    """Rotates the leading ``rot_dim`` dims of each head of flat q/k by position."""

    def __init__(self, head_dim: int, max_position: int, params: dict[str, Any],
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.rot_dim = int(head_dim * float(params.get("partial_rotary_factor", 1.0)))
        inv, scaling = inv_frequencies(params, self.rot_dim, max_position)
        positions = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(positions, inv)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos_cache", (emb.cos() * scaling).to(dtype), persistent=False)
        self.register_buffer("sin_cache", (emb.sin() * scaling).to(dtype), persistent=False)
        self._positions: torch.Tensor | None = None
        self._cos = self._sin = self.cos_cache[:0]

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = self.rot_dim // 2
        if self.rot_dim == self.head_dim:
            x1, x2 = x[..., :half], x[..., half:]
            return x * cos + torch.cat((-x2, x1), dim=-1) * sin
        rot, rest = x[..., : self.rot_dim], x[..., self.rot_dim :]
        x1, x2 = rot[..., :half], rot[..., half:]
        return torch.cat((rot * cos + torch.cat((-x2, x1), dim=-1) * sin, rest), dim=-1)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``q [T, H, D]``, ``k [T, KV, D]`` rotated by ``positions [T]``."""
        # Every layer shares this module and the step's positions: look them up once.
        if self._positions is not positions:
            self._cos = self.cos_cache.index_select(0, positions).unsqueeze(1)
            self._sin = self.sin_cache.index_select(0, positions).unsqueeze(1)
            self._positions = positions
        cos, sin = self._cos, self._sin
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)
