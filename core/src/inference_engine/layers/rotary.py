"""Rotary position embeddings (neox layout, Llama/Qwen) with their scaling types.

Frequencies follow transformers' ``ROPE_INIT_FUNCTIONS`` for each
``rope_type`` (default, linear, dynamic, yarn, llama3) and
``partial_rotary_factor`` rotates only the leading dims of each head. cos/sin
are precomputed for every position once; a step looks its positions up once
(:meth:`RotaryEmbedding.lookup`) and every layer reuses that table.

Dynamic NTK. transformers recomputes the base whenever a forward pass sees a
sequence longer than ``max_position_embeddings`` (``seq_len = max position +
1``) and keeps the rotation of keys already in its cache. Within the
original context that means the plain frequencies, which is what we use.
Beyond it we give position ``p`` the frequencies transformers uses for a
sequence of length ``p + 1``: exactly what it does when generating one token
at a time. (transformers' prefill of a prompt longer than the original
context rotates all prompt positions with the whole prompt's base; we do not
copy that, since it would make cached keys depend on how a prompt is chunked.)
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from inference_engine.layers.cpu_fused import fused_rope
from inference_engine.layers.fused_op_choice import choose_fused_op

__all__ = ["RotaryEmbedding", "RotaryTable", "inv_frequencies", "rope_parameters",
           "rotate_cpu", "rotate_impl", "rotate_torch"]

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3")



def rotate_torch(table: RotaryTable, x: torch.Tensor) -> torch.Tensor:
    """The torch reference of :meth:`RotaryTable.rotate`: a rotated copy of ``x [T, heads,
    head_dim]`` (any strides), neox halves, partial rotary leaving the tail as it is.

    ``out = x * cos + rotate_half(x) * sin`` as one multiply and two fused
    multiply-adds, with no concatenation: ``x * cos`` is rounded to the dtype, then
    each multiply-add once.
    """
    if table.rot_dim == table.head_dim:
        out = x * table.cos
        out_1, out_2 = out.chunk(2, dim=-1)
        x_1, x_2 = x.chunk(2, dim=-1)
        out_1.addcmul_(x_2, table.neg_sin)
        out_2.addcmul_(x_1, table.sin)
        return out
    r, h = table.rot_dim, table.rot_dim // 2
    out = x.clone()
    rot = out[..., :r]
    rot.mul_(table.cos)
    rot[..., :h].addcmul_(x[..., h:r], table.neg_sin)
    rot[..., h:].addcmul_(x[..., :h], table.sin)
    return out


def rotate_cpu(table: RotaryTable, x: torch.Tensor) -> torch.Tensor:
    """:func:`rotate_torch` by one pass of the C++ kernel where it applies (float32 CPU)."""
    if table.rows is not None and x.dim() == 3:
        fused = fused_rope(x, table.rows)
        if fused is not None:
            return fused
    return rotate_torch(table, x)


RotateFn = Callable[["RotaryTable", torch.Tensor], torch.Tensor]


@dataclass(frozen=True, slots=True)
class RotaryTable:
    """cos/sin of one step's positions, shared by every layer of that step."""

    # [T, 1, rot_dim]: cos of each angle, repeated for both halves.
    cos: torch.Tensor
    # [T, 1, rot_dim // 2]: -sin (first half) and sin (second half) of each angle.
    neg_sin: torch.Tensor
    sin: torch.Tensor
    rot_dim: int
    head_dim: int
    # [T, 2 * rot_dim]: the rows cos/neg_sin/sin are views of (the fused kernels' input).
    rows: torch.Tensor | None = None
    # The rotation's implementation, bound by RotaryEmbedding when it was built.
    impl: RotateFn = field(default=rotate_cpu, compare=False, repr=False)

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        """A rotated copy of ``x [T, heads, head_dim]`` (any strides); neox halves.

        By the implementation the rotary embedding chose when it was built (the C++
        or Triton kernel in one pass, else :func:`rotate_torch`).
        """
        return self.impl(self, x)


def rope_parameters(config: Any) -> dict[str, Any]:
    """The rope settings of an HF config as one flat dict.

    Reads ``config.rope_parameters`` (transformers v5) and falls back to the
    legacy ``rope_scaling`` / ``rope_theta`` / ``partial_rotary_factor``
    attributes. The result always has ``rope_type``, ``rope_theta`` and
    ``partial_rotary_factor``; scaled types get ``original_max_position_embeddings``
    defaulted to ``max_position_embeddings`` as transformers does.
    """
    params = dict(getattr(config, "rope_parameters", None) or {})
    legacy = getattr(config, "rope_scaling", None)
    if isinstance(legacy, dict):
        for key, value in legacy.items():
            params.setdefault(key, value)
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    if params.get("rope_theta") is None:
        params["rope_theta"] = getattr(config, "rope_theta", None) or 10000.0
    if params.get("partial_rotary_factor") is None:
        params["partial_rotary_factor"] = getattr(config, "partial_rotary_factor", None) or 1.0
    max_position = getattr(config, "max_position_embeddings", None)
    if params["rope_type"] in ("llama3", "yarn") and max_position is not None:
        original = getattr(config, "original_max_position_embeddings", None)
        if original is not None:
            params["original_max_position_embeddings"] = original
        params.setdefault("original_max_position_embeddings", max_position)
    return params


def _base_inv_freq(base: float, rot_dim: int) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, rot_dim, 2, dtype=torch.int64).float() / rot_dim))


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def inv_frequencies(
    params: dict[str, Any], rot_dim: int, max_position: int
) -> tuple[torch.Tensor, float]:
    """Inverse frequencies ``[rot_dim // 2]`` (float32) and the cos/sin scaling.

    For ``dynamic`` these are the frequencies within the original context
    (see the module docstring for longer sequences).

    Args:
        params: from :func:`rope_parameters`.
        rot_dim: rotated dims per head (``head_dim * partial_rotary_factor``).
        max_position: the config's ``max_position_embeddings``.

    Raises:
        ValueError: for a rope type this engine does not implement.
    """
    rope_type = params["rope_type"]
    base = float(params["rope_theta"])
    inv = _base_inv_freq(base, rot_dim)
    if rope_type in ("default", "dynamic"):
        return inv, 1.0
    if rope_type == "linear":
        return inv / float(params["factor"]), 1.0
    if rope_type == "llama3":
        return _llama3(params, inv), 1.0
    if rope_type == "yarn":
        return _yarn(params, rot_dim, base, max_position)
    raise ValueError(
        f"unsupported rope_type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
    )


def _llama3(params: dict[str, Any], inv: torch.Tensor) -> torch.Tensor:
    factor = float(params["factor"])
    low_ff = float(params["low_freq_factor"])
    high_ff = float(params["high_freq_factor"])
    original = params["original_max_position_embeddings"]
    low_wavelen, high_wavelen = original / low_ff, original / high_ff
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (original / wavelen - low_ff) / (high_ff - low_ff)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn(params: dict[str, Any], rot_dim: int, base: float,
          max_position: int) -> tuple[torch.Tensor, float]:
    original = params["original_max_position_embeddings"]
    factor = params.get("factor")
    if factor is None:  # DeepSeek-V3 style: the factor is the context ratio
        factor = max_position / original
    factor = float(factor)
    attention = params.get("attention_factor")
    mscale, mscale_all = params.get("mscale"), params.get("mscale_all_dim")
    if attention is None:
        if mscale and mscale_all:
            attention = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all)
        else:
            attention = _yarn_mscale(factor)
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return rot_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rot_dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = ((torch.arange(rot_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    pos_freqs = base ** (torch.arange(0, rot_dim, 2).float() / rot_dim)
    inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv, float(attention)


def _angles(params: dict[str, Any], rot_dim: int, max_position: int,
            num_positions: int) -> tuple[torch.Tensor, float]:
    """Rotation angles ``[num_positions, rot_dim // 2]`` (float32) and the scaling."""
    inv, scaling = inv_frequencies(params, rot_dim, max_position)
    positions = torch.arange(num_positions, dtype=torch.float32)
    angles = torch.outer(positions, inv)
    if params["rope_type"] == "dynamic" and num_positions > max_position:
        # Position p >= max_position: the NTK base for a sequence of length p + 1.
        factor = float(params["factor"])
        base = float(params["rope_theta"])
        seq_len = torch.arange(max_position + 1, num_positions + 1, dtype=torch.float32)
        scale = (factor * seq_len / max_position) - (factor - 1)
        bases = base * scale ** (rot_dim / (rot_dim - 2))
        exponents = torch.arange(0, rot_dim, 2, dtype=torch.int64).float() / rot_dim
        long_inv = 1.0 / (bases[:, None] ** exponents[None, :])
        angles[max_position:] = positions[max_position:, None] * long_inv
    return angles, scaling


class RotaryEmbedding(nn.Module):
    """Rotates the leading ``rot_dim`` dims of each q/k head by position (neox halves).

    Args:
        head_dim: dims per head.
        max_position: ``max_position_embeddings`` of the config; the cache
            covers it (times ``factor`` for dynamic NTK, which extends it).
        params: from :func:`rope_parameters`.
        dtype: the compute dtype; the cache is rounded to it as transformers
            rounds its cos/sin to the activations' dtype.
        min_positions: positions the cache must cover at least (the engine's
            max_model_len when it exceeds ``max_position``).
    """

    def __init__(self, head_dim: int, max_position: int, params: dict[str, Any],
                 dtype: torch.dtype, min_positions: int = 0) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.rot_dim = int(head_dim * float(params.get("partial_rotary_factor") or 1.0))
        if self.rot_dim % 2 or self.rot_dim <= 0:
            raise ValueError(f"rotary dims must be even and positive, got {self.rot_dim}")
        self.rope_type = params["rope_type"]
        num_positions = max_position
        if self.rope_type == "dynamic":
            num_positions = int(max_position * float(params["factor"]))
        num_positions = max(num_positions, min_positions)
        self.max_position = num_positions
        angles, scaling = _angles(params, self.rot_dim, max_position, num_positions)
        cos = angles.cos() * scaling
        sin = angles.sin() * scaling
        # One row per position: [cos | cos | -sin | sin], so a step needs a single lookup.
        table = torch.cat((cos, cos, -sin, sin), dim=-1).to(dtype)
        self.register_buffer("cos_sin_cache", table, persistent=False)
        # The rotation's implementation, chosen once for the device the table lives on;
        # every RotaryTable this module looks up carries it.
        self.fused_op = choose_fused_op(table.device)
        self._rotate: RotateFn = rotate_impl(self.fused_op)
        self._rotate_qk: Callable[..., tuple[torch.Tensor, torch.Tensor]] = (
            _rotate_qk_impl(self.fused_op))

    def lookup(self, positions: torch.Tensor) -> RotaryTable:
        """cos/sin of ``positions [T]``; do it once per step and hand it to every layer."""
        flat = self.cos_sin_cache.index_select(0, positions)
        rows = flat.unsqueeze(1)
        r, h = self.rot_dim, self.rot_dim // 2
        return RotaryTable(rows[..., :r], rows[..., r:r + h], rows[..., r + h:], r, self.head_dim,
                           flat, self._rotate)

    def forward(self, positions: torch.Tensor, q: torch.Tensor,
                k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotated copies of ``q [T, H*D]`` and ``k [T, KV*D]`` (or ``[T, heads, D]``)."""
        return self._rotate_qk(self.lookup(positions), q, k)

    def extra_repr(self) -> str:
        return (f"type={self.rope_type}, rot_dim={self.rot_dim}/{self.head_dim}, "
                f"positions={self.max_position}, fused_op={self.fused_op}")


def rotate_impl(fused_op: str) -> RotateFn:
    """The rotation of a :func:`~inference_engine.layers.fused_op_choice.choose_fused_op`
    answer, ``(table, x) -> rotated x``."""
    if fused_op == "triton":
        from inference_engine.layers.triton_fused import rotary

        return rotary
    return rotate_cpu if fused_op == "cpu" else rotate_torch


def _rotate_each(table: RotaryTable, q: torch.Tensor,
                 k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    t, d = q.shape[0], table.head_dim
    q_rot = table.rotate(q.view(t, -1, d))
    k_rot = table.rotate(k.view(t, -1, d))
    return q_rot.view(q.shape), k_rot.view(k.shape)


def _rotate_qk_impl(fused_op: str) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    if fused_op == "triton":  # q and k in one launch
        from inference_engine.layers.triton_fused import rotary_qk

        return rotary_qk
    return _rotate_each
