"""Mamba-2's selective state update: the chunked SSD scan (prefill) and the one-step
recurrence (decode), over a per-sequence state pool. Torch references.

The recurrence, per head ``h`` with ``P`` channels and an ``N``-wide state::

    state_t = exp(dt_t * A_h) * state_{t-1} + (dt_t * x_t) B_t^T        # [P, N]
    y_t     = state_t C_t + D_h * x_t                                   # [P]

``B`` and ``C`` are shared by the ``H / G`` heads of a group. The chunked form
(state space duality) computes a chunk of ``chunk_size`` positions at once: an
attention-like masked product inside the chunk plus the state carried in from
the chunks before, then the chunk's final state. Both forms read the initial
state from, and write the final state to, each sequence's slot of ``ssm_state``
(``[num_slots, H, P, N]`` float32); a sequence without computed context starts
from zeros. :mod:`.triton_ssd_scan` has the same two functions as Triton kernels.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

__all__ = ["SSDKernels", "choose_ssd_kernels", "ssd_chunk_scan_one", "ssd_chunk_scan_torch",
           "ssm_decode_step_torch"]


def _segment_sum(a: torch.Tensor) -> torch.Tensor:
    """``a [..., L]`` -> ``[..., L, L]`` with ``sum(a[s+1..l])`` at ``[l, s]`` for ``s <= l``,
    ``-inf`` above the diagonal (so its exp is the causal decay mask)."""
    length = a.shape[-1]
    cum = torch.cumsum(a, dim=-1)
    seg = cum[..., :, None] - cum[..., None, :]
    causal = torch.ones(length, length, dtype=torch.bool, device=a.device).tril()
    return seg.masked_fill(~causal, float("-inf"))


def ssd_chunk_scan_one(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                       C: torch.Tensor, chunk_size: int,
                       initial: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's chunked scan, without the ``D`` skip.

    Args:
        x: ``[L, H, P]``; dt: ``[L, H]`` (after bias, softplus and clamp); A: ``[H]``.
        B, C: ``[L, H, N]`` (already repeated per head).
        initial: ``[H, P, N]`` or None (zeros).

    Returns:
        ``(y [L, H, P], final state [H, P, N])``, float32.
    """
    length, heads, p = x.shape
    n = B.shape[-1]
    pad = (-length) % chunk_size
    x, dt, B, C = (F.pad(t.float(), (0, 0) * (t.dim() - 1) + (0, pad)) for t in (x, dt, B, C))
    chunks = x.shape[0] // chunk_size
    # [c, l, ...]: chunk index, position in the chunk.
    xdt = (x * dt[..., None]).view(chunks, chunk_size, heads, p)
    a = (dt * A.float()).view(chunks, chunk_size, heads).permute(0, 2, 1)  # [c, H, l]
    Bc = B.view(chunks, chunk_size, heads, n)
    Cc = C.view(chunks, chunk_size, heads, n)
    a_cum = torch.cumsum(a, dim=-1)  # [c, H, l]
    # 1. Inside each chunk: (C B^T masked by the decay) applied to x dt.
    decay_in = torch.exp(_segment_sum(a))  # [c, H, l, s]
    scores = torch.einsum("clhn,cshn->chls", Cc, Bc) * decay_in
    y = torch.einsum("chls,cshp->clhp", scores, xdt)
    # 2. Each chunk's own contribution to the state at its end.
    decay_to_end = torch.exp(a_cum[..., -1:] - a_cum)  # [c, H, l]
    chunk_states = torch.einsum("clhn,chl,clhp->chpn", Bc, decay_to_end, xdt)
    # 3. The state entering each chunk: carried across chunks with each chunk's total decay.
    state = (initial.float() if initial is not None
             else torch.zeros(heads, p, n, dtype=torch.float32, device=x.device))
    entering = []
    for c in range(chunks):
        entering.append(state)
        state = state * torch.exp(a_cum[c, :, -1])[:, None, None] + chunk_states[c]
    start = torch.stack(entering)  # [c, H, P, N]
    # 4. The entering state read out by C, decayed to each position.
    y = y + torch.einsum("clhn,chpn,chl->clhp", Cc, start, torch.exp(a_cum))
    return y.reshape(chunks * chunk_size, heads, p)[:length], state


def ssd_chunk_scan_torch(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                         C: torch.Tensor, D: torch.Tensor, chunk_size: int,
                         query_start_loc: torch.Tensor, has_initial: torch.Tensor,
                         ssm_state: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """The chunked scan of several sequences laid end to end (prefill chunks).

    Args:
        x: ``[T, H, P]``; dt: ``[T, H]`` float32 (after bias, softplus, clamp); A, D: ``[H]``.
        B, C: ``[T, G, N]``.
        chunk_size: positions per SSD chunk.
        query_start_loc: ``[S + 1]`` int64 offsets of each sequence in the flat batch.
        has_initial: ``[S]`` bool, whether a sequence continues from its slot's state.
        ssm_state: ``[num_slots, H, P, N]`` float32, read and written at ``slots``.
        slots: ``[S]`` int64.

    Returns:
        ``y [T, H, P]`` float32, the ``D`` skip included.
    """
    heads = x.shape[1]
    rep = heads // B.shape[1]
    Bh = B.repeat_interleave(rep, dim=1)
    Ch = C.repeat_interleave(rep, dim=1)
    starts = query_start_loc.tolist()
    flags = has_initial.tolist()
    y = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    for i in range(len(starts) - 1):
        s, e = starts[i], starts[i + 1]
        slot = slots[i : i + 1]
        initial = ssm_state.index_select(0, slot)[0] if flags[i] else None
        y_i, final = ssd_chunk_scan_one(x[s:e], dt[s:e], A, Bh[s:e], Ch[s:e], chunk_size, initial)
        y[s:e] = y_i + D.float()[:, None] * x[s:e].float()
        ssm_state.index_copy_(0, slot, final[None].to(ssm_state.dtype))
    return y


def ssm_decode_step_torch(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                          C: torch.Tensor, D: torch.Tensor, ssm_state: torch.Tensor,
                          slots: torch.Tensor) -> torch.Tensor:
    """One recurrence step for ``n`` sequences (one token each).

    Args:
        x: ``[n, H, P]``; dt: ``[n, H]`` float32; A, D: ``[H]``; B, C: ``[n, G, N]``.
        ssm_state: ``[num_slots, H, P, N]`` float32, updated in place at ``slots``.
        slots: ``[n]`` int64.

    Returns:
        ``y [n, H, P]`` float32.
    """
    heads = x.shape[1]
    rep = heads // B.shape[1]
    Bh = B.float().repeat_interleave(rep, dim=1)  # [n, H, N]
    Ch = C.float().repeat_interleave(rep, dim=1)
    xf = x.float()
    state = ssm_state.index_select(0, slots).float()  # [n, H, P, N]
    decay = torch.exp(dt * A.float())[..., None, None]
    state = state * decay + (dt[..., None] * xf)[..., None] * Bh[:, :, None, :]
    ssm_state.index_copy_(0, slots, state.to(ssm_state.dtype))
    y = torch.einsum("nhpk,nhk->nhp", state, Ch)
    return y + D.float()[:, None] * xf


# (chunk scan, decode step) with the signatures above.
SSDKernels = tuple[Callable[..., torch.Tensor], Callable[..., torch.Tensor]]


def choose_ssd_kernels(fused_op: str, chunk_size: int) -> SSDKernels:
    """The scan and decode step for a
    :func:`~inference_engine.layers.fused_op_choice.choose_fused_op` answer: the Triton
    kernels where the platform runs Triton (the scan only for a power-of-two
    ``chunk_size`` of at least 16, its smallest tile), else the torch references."""
    if fused_op == "triton":
        from inference_engine.layers.triton_ssd_scan import (
            ssd_chunk_scan_triton,
            ssm_decode_step_triton,
        )

        tiles = chunk_size >= 16 and not chunk_size & (chunk_size - 1)
        return (ssd_chunk_scan_triton if tiles else ssd_chunk_scan_torch), ssm_decode_step_triton
    return ssd_chunk_scan_torch, ssm_decode_step_torch
