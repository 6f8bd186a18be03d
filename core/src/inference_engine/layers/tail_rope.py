"""Interleaved rotary on the *trailing* ``rot_dim`` channels of each head (DeepSeek-V4).

V4 lays a head out as ``[nope | rope]`` and rotates consecutive channel pairs
``(x[2i], x[2i+1])`` of the rope slice by ``position * inv_freq[i]`` (GPT-J style
interleaving), unlike :mod:`~inference_engine.layers.rotary`'s leading-slice
half-split tables. The same rotation with ``-sin`` undoes it (V4 un-rotates the
attention output, whose values are the rotated keys).
"""

from __future__ import annotations

import torch

from inference_engine.layers.rotary import inv_frequencies

__all__ = ["TailRope"]


class TailRope:
    """One set of inverse frequencies (``main`` or ``compress`` in V4's ``rope_parameters``).

    Args:
        params: one flat rope dict (``rope_type``, ``rope_theta``, yarn keys...).
        rot_dim: rotated trailing channels per head (even).
        max_position: the config's ``max_position_embeddings`` (yarn's default factor).
    """

    def __init__(self, params: dict, rot_dim: int, max_position: int) -> None:
        params = dict(params)
        if params.get("rope_type") in ("yarn", "llama3"):
            params.setdefault("original_max_position_embeddings", max_position)
        inv, scale = inv_frequencies(params, rot_dim, max_position)
        self.inv_freq = inv  # [rot_dim // 2] float32
        self.scale = scale
        self.rot_dim = rot_dim

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``positions [n]`` -> float32 ``(cos, sin)``, each ``[n, rot_dim // 2]``."""
        freqs = positions.float()[:, None] * self.inv_freq.to(positions.device)[None, :]
        return freqs.cos() * self.scale, freqs.sin() * self.scale

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate ``x [n, ..., D]``'s last ``rot_dim`` channels by per-row ``cos``/``sin``
        (``[n, rot_dim // 2]``; pass ``-sin`` to undo); computed in float32."""
        r = self.rot_dim
        shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (r // 2,)
        c, s = cos.view(shape), sin.view(shape)
        rope = x[..., -r:].float()
        even, odd = rope[..., 0::2], rope[..., 1::2]
        rotated = torch.stack((even * c - odd * s, odd * c + even * s), dim=-1).flatten(-2)
        return torch.cat((x[..., :-r], rotated.to(x.dtype)), dim=-1)
