"""Manifold-constrained hyper-connections (mHC, DeepSeek-V4): ``hc_mult`` residual streams.

Instead of one residual stream a token carries ``N = hc_mult`` streams
``x [T, N, D]``. Before each block (attention or MLP) a learned one-layer
projection of the RMS-normalised, flattened streams gives three weights:
``pre [T, N]`` collapses the streams into the block's input, ``post [T, N]``
spreads the block's output back over them, and ``comb [T, N, N]`` (projected
onto doubly-stochastic matrices by Sinkhorn-Knopp) mixes the old streams::

    x'[k] = post[k] * block(sum_j pre[j] x[j]) + sum_j comb[j, k] x[j]

:class:`HyperHead` collapses the streams once more before the final norm. All of
it runs in float32 (transformers keeps these modules in float32).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["HyperConnection", "HyperHead", "sinkhorn", "unweighted_rms_norm"]


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / rms(x)`` over the last dim (the scale computed in float32, applied in x's dtype)."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


def sinkhorn(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Alternate column and row normalisation of positive ``comb [..., N, N]`` (columns
    first, ``iters`` column passes in all), as DeepSeek-V4 does."""
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


class HyperConnection(nn.Module):
    """The ``pre`` / ``post`` / ``comb`` weights of one block (``hc_{attn,ffn}_{fn,base,scale}``
    in checkpoints; the parameters are set by the owner under those names).

    Args:
        hc_mult: streams ``N``.
        hidden_size: ``D``.
        sinkhorn_iters: Sinkhorn-Knopp iterations.
        eps: ``hc_eps``, the floor added to ``pre``/``comb`` and the Sinkhorn sums.
        norm_eps: the flattened streams' RMSNorm epsilon (``rms_norm_eps``).
    """

    def __init__(self, hc_mult: int, hidden_size: int, sinkhorn_iters: int, eps: float,
                 norm_eps: float) -> None:
        super().__init__()
        n = hc_mult
        self.hc_mult = n
        self.sinkhorn_iters = sinkhorn_iters
        self.eps = eps
        self.norm_eps = norm_eps
        self.fn = nn.Parameter(torch.zeros((2 + n) * n, n * hidden_size), requires_grad=False)
        self.base = nn.Parameter(torch.zeros((2 + n) * n), requires_grad=False)
        self.scale = nn.Parameter(torch.ones(3), requires_grad=False)

    def forward(self, streams: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``streams [T, N, D]`` -> ``(collapsed [T, D], post [T, N], comb [T, N, N])``;
        ``collapsed`` in the streams' dtype, ``post``/``comb`` float32."""
        n = self.hc_mult
        flat = unweighted_rms_norm(streams.flatten(1).float(), self.norm_eps)
        mixes = F.linear(flat, self.fn.float())
        pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = self.base.float().split([n, n, n * n])
        pre_s, post_s, comb_s = self.scale.float().unbind(0)
        pre = torch.sigmoid(pre_w * pre_s + pre_b) + self.eps
        post = 2 * torch.sigmoid(post_w * post_s + post_b)
        comb = torch.softmax(comb_w.view(-1, n, n) * comb_s + comb_b.view(n, n), dim=-1)
        comb = sinkhorn(comb + self.eps, self.sinkhorn_iters, self.eps)
        collapsed = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
        return collapsed, post, comb

    @staticmethod
    def merge(streams: torch.Tensor, block_out: torch.Tensor, post: torch.Tensor,
              comb: torch.Tensor) -> torch.Tensor:
        """``x'[k] = post[k] * block_out + sum_j comb[j, k] x[j]`` -> ``[T, N, D]``."""
        dtype = streams.dtype
        mixed = torch.matmul(comb.to(dtype).transpose(-1, -2), streams)
        return post.to(dtype).unsqueeze(-1) * block_out.unsqueeze(-2) + mixed


class HyperHead(nn.Module):
    """The final collapse: ``sum_j (sigmoid(hc_fn . norm(x) * scale + base)[j] + eps) x[j]``
    (``hc_head_{fn,base,scale}``)."""

    def __init__(self, hc_mult: int, hidden_size: int, eps: float, norm_eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.norm_eps = norm_eps
        self.hc_fn = nn.Parameter(torch.zeros(hc_mult, hc_mult * hidden_size),
                                  requires_grad=False)
        self.hc_base = nn.Parameter(torch.zeros(hc_mult), requires_grad=False)
        self.hc_scale = nn.Parameter(torch.ones(1), requires_grad=False)

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        """``[T, N, D]`` -> ``[T, D]`` in the streams' dtype."""
        flat = unweighted_rms_norm(streams.flatten(1).float(), self.norm_eps)
        mixes = F.linear(flat, self.hc_fn.float())
        pre = torch.sigmoid(mixes * self.hc_scale.float() + self.hc_base.float()) + self.eps
        return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
