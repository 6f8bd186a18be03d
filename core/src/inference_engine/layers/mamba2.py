"""The Mamba-2 mixer over the flat batch of a step, with its per-sequence state.

``in_proj`` splits into the gate ``z``, the conv input ``xBC`` and ``dt``; a causal
depthwise conv (kernel ``conv_kernel``) with SiLU runs over ``xBC``, continuing each
sequence from the last ``conv_kernel - 1`` inputs kept in its conv state; ``x``,
``B`` and ``C`` (``n_groups`` groups of ``B``/``C`` shared by the heads) then feed the
selective scan (:mod:`.ssd_scan`: the chunked SSD form for prefill chunks, the
one-step recurrence for decodes) whose float32 SSM state also lives per sequence;
a gated, group-wise RMSNorm and ``out_proj`` finish. Math and names follow
transformers' ``NemotronHMamba2Mixer`` (its pure-torch path).

The two states are declared through :meth:`Mamba2Mixer.state_cache_spec` (the
engine's per-sequence state pool, docs/engine.md) and bound by the model runner
to ``state_cache``. Decodes come first in a step; they update their states in one
batched call, prefill chunks one sequence at a time for the conv and in one call
for the scan. The layer is not graph-safe (it reads the step's host lists).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from inference_engine.interfaces.attention import AttentionMetadata
from inference_engine.interfaces.model import ModelContext
from inference_engine.interfaces.state_cache import StateCacheSpec, StateTensorSpec
from inference_engine.layers.causal_conv1d import choose_conv_update
from inference_engine.layers.fused_op_choice import choose_fused_op
from inference_engine.layers.linear import ReplicatedLinear, RowLinear
from inference_engine.layers.ssd_scan import choose_ssd_kernels

__all__ = ["GatedRMSNorm", "Mamba2Config", "Mamba2Mixer"]


class GatedRMSNorm(nn.Module):
    """``weight * rmsnorm_per_group(x * silu(z))``, statistics in float32 (Mamba-2's norm)."""

    def __init__(self, hidden_size: int, group_size: int, eps: float,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)
        self.group_size = group_size
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        """``x [T, I]`` (float32), ``gate [T, I]`` -> ``[T, I]`` in ``out_dtype``."""
        h = x.float() * F.silu(gate.float())
        t = h.shape[0]
        grouped = h.view(t, -1, self.group_size)
        grouped = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + self.eps)
        # The weight multiplies in float32 and only the product is rounded (as transformers).
        return (self.weight * grouped.view(t, -1)).to(out_dtype)


class Mamba2Config:
    """The mixer's sizes, read once from a transformers config (Nemotron-H's names)."""

    def __init__(self, cfg: object) -> None:
        self.hidden_size: int = cfg.hidden_size
        self.num_heads: int = cfg.mamba_num_heads
        self.head_dim: int = cfg.mamba_head_dim
        self.state_size: int = cfg.ssm_state_size
        self.n_groups: int = cfg.n_groups
        self.conv_kernel: int = cfg.conv_kernel
        self.chunk_size: int = cfg.chunk_size
        self.use_conv_bias: bool = bool(cfg.use_conv_bias)
        self.use_bias: bool = bool(getattr(cfg, "use_bias", False))
        self.eps: float = cfg.layer_norm_epsilon
        self.activation: str = getattr(cfg, "mamba_hidden_act", "silu")
        limit = tuple(getattr(cfg, "time_step_limit", (0.0, float("inf"))))
        self.time_step_limit: tuple[float, float] = (float(limit[0]), float(limit[1]))
        ssm_dtype = getattr(cfg, "mamba_ssm_cache_dtype", "float32")
        self.ssm_state_dtype: torch.dtype = getattr(torch, str(ssm_dtype).removeprefix("torch."))
        self.intermediate_size = self.num_heads * self.head_dim
        self.conv_dim = self.intermediate_size + 2 * self.n_groups * self.state_size

    def check(self, prefix: str) -> None:
        """Raises ValueError naming what the mixer does not implement."""
        if self.activation != "silu":
            raise ValueError(f"{prefix}: mamba_hidden_act {self.activation!r} is not supported "
                             f"(only 'silu')")
        if self.num_heads % self.n_groups:
            raise ValueError(f"{prefix}: mamba_num_heads ({self.num_heads}) is not a multiple "
                             f"of n_groups ({self.n_groups})")
        if self.conv_kernel < 2:
            raise ValueError(f"{prefix}: conv_kernel must be at least 2, got {self.conv_kernel}")
        if self.ssm_state_dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"{prefix}: mamba_ssm_cache_dtype {self.ssm_state_dtype} is not "
                             f"supported")


class Mamba2Mixer(nn.Module):
    """Mamba-2 over a step's tokens ``[T, hidden]`` -> ``[T, hidden]``.

    Args:
        ctx: the model context.
        prefix: dotted module name (``backbone.layers.0.mixer``), for messages.
        config: the mixer's sizes.

    Raises:
        ValueError: for an activation, grouping or state dtype it does not implement.
    """

    # Reads the step's host lists: a decode step through it cannot be captured in a graph.
    graph_safe = False

    def __init__(self, ctx: ModelContext, prefix: str, config: Mamba2Config) -> None:
        super().__init__()
        config.check(prefix)
        self.prefix = prefix
        self.config = config
        c = config
        self.in_proj = ReplicatedLinear(ctx, c.hidden_size,
                                        c.intermediate_size + c.conv_dim + c.num_heads,
                                        f"{prefix}.in_proj", bias=c.use_bias)
        # The checkpoint's depthwise conv (weight [conv_dim, 1, kernel]); applied by hand.
        self.conv1d = nn.Conv1d(c.conv_dim, c.conv_dim, c.conv_kernel, groups=c.conv_dim,
                                bias=c.use_conv_bias, dtype=ctx.dtype)
        self.conv1d.requires_grad_(False)
        self.dt_bias = nn.Parameter(torch.zeros(c.num_heads, dtype=ctx.dtype), requires_grad=False)
        self.A_log = nn.Parameter(torch.zeros(c.num_heads, dtype=ctx.dtype), requires_grad=False)
        self.D = nn.Parameter(torch.ones(c.num_heads, dtype=ctx.dtype), requires_grad=False)
        self.norm = GatedRMSNorm(c.intermediate_size, c.intermediate_size // c.n_groups, c.eps,
                                 ctx.dtype)
        self.out_proj = RowLinear(ctx, c.intermediate_size, c.hidden_size, f"{prefix}.out_proj",
                                  bias=c.use_bias)
        self.dtype = ctx.dtype
        # (conv state [slots, conv_dim, kernel - 1], SSM state [slots, H, P, N]); bound by
        # the model runner from the per-sequence state pool.
        self.state_cache: tuple[torch.Tensor, torch.Tensor] | None = None
        # Scan, decode step and the decodes' conv update, chosen once for the device the
        # layer is built on.
        self.kernel = choose_fused_op(getattr(ctx, "device", None))
        self._scan, self._decode = choose_ssd_kernels(self.kernel, c.chunk_size)
        self._conv_update = choose_conv_update(self.kernel)

    def state_cache_spec(self) -> StateCacheSpec:
        """Per sequence: the last ``kernel - 1`` conv inputs and the SSM state."""
        c = self.config
        return StateCacheSpec((
            StateTensorSpec((c.conv_dim, c.conv_kernel - 1), self.dtype),
            StateTensorSpec((c.num_heads, c.head_dim, c.state_size), c.ssm_state_dtype),
        ))

    def cpu_decode_blocker(self) -> str:
        """The C++ whole-step decode has no recurrent layers."""
        return "a Mamba-2 mixer (per-sequence recurrent state)"

    # ---- pieces ------------------------------------------------------------------ #
    def _conv_decode(self, xbc: torch.Tensor, conv_state: torch.Tensor,
                     slots: torch.Tensor) -> torch.Tensor:
        """One new input per sequence: ``xbc [n, conv_dim]`` -> conv output ``[n, conv_dim]``."""
        # weight [conv_dim, kernel]
        return self._conv_update(xbc, conv_state, slots, self.conv1d.weight[:, 0, :],
                                 self.conv1d.bias)

    def _conv_prefill(self, xbc: torch.Tensor, conv_state: torch.Tensor, slot: torch.Tensor,
                      has_context: bool) -> torch.Tensor:
        """One sequence's chunk ``xbc [L, conv_dim]`` -> ``[L, conv_dim]``."""
        keep = self.config.conv_kernel - 1
        x = xbc.t().to(conv_state.dtype)  # [conv_dim, L]
        prev = (conv_state.index_select(0, slot)[0] if has_context
                else x.new_zeros(x.shape[0], keep))
        full = torch.cat([prev, x], dim=-1)  # [conv_dim, keep + L]
        conv_state.index_copy_(0, slot, full[None, :, -keep:])
        out = F.conv1d(full[None].to(self.conv1d.weight.dtype), self.conv1d.weight,
                       self.conv1d.bias, groups=self.config.conv_dim)[0]
        return out.t()

    # ---- forward ------------------------------------------------------------------ #
    def forward(self, hidden: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        """``hidden [T, hidden]`` -> ``[T, hidden]``; updates each sequence's states.

        Raises:
            RuntimeError: no state cache is bound, or the step carries no state slots.
        """
        if self.state_cache is None or metadata.state_slots is None:
            raise RuntimeError(f"{self.prefix}: no per-sequence state bound; the model runner "
                               f"binds Mamba2Mixer.state_cache and the step's state_slots")
        c = self.config
        conv_state, ssm_state = self.state_cache
        slots = metadata.state_slots
        t = hidden.shape[0]
        gate, xbc, dt = self.in_proj(hidden).split(
            [c.intermediate_size, c.conv_dim, c.num_heads], dim=-1)
        nd = metadata.num_decodes
        lens = metadata.query_lens_list
        contexts = [s - q for s, q in zip(metadata.seq_lens_list, lens, strict=True)]
        conv_out = torch.empty(t, c.conv_dim, dtype=self.conv1d.weight.dtype,
                               device=hidden.device)
        if nd:
            conv_out[:nd] = self._conv_decode(xbc[:nd], conv_state, slots[:nd])
        pos = nd
        for i in range(nd, len(lens)):
            conv_out[pos : pos + lens[i]] = self._conv_prefill(
                xbc[pos : pos + lens[i]], conv_state, slots[i : i + 1], contexts[i] > 0)
            pos += lens[i]
        conv_out = F.silu(conv_out)
        x, B, C = conv_out.split(
            [c.intermediate_size, c.n_groups * c.state_size, c.n_groups * c.state_size], dim=-1)
        x = x.reshape(t, c.num_heads, c.head_dim)
        B = B.reshape(t, c.n_groups, c.state_size)
        C = C.reshape(t, c.n_groups, c.state_size)
        dt = F.softplus(dt.float() + self.dt_bias.float())
        if c.time_step_limit != (0.0, float("inf")):
            dt = dt.clamp(c.time_step_limit[0], c.time_step_limit[1])
        A = -torch.exp(self.A_log.float())
        D = self.D.float()
        y = torch.empty(t, c.num_heads, c.head_dim, dtype=torch.float32, device=hidden.device)
        if nd:
            y[:nd] = self._decode(x[:nd], dt[:nd], A, B[:nd], C[:nd], D, ssm_state, slots[:nd])
        if nd < len(lens):
            starts = metadata.query_start_loc[nd:] - metadata.query_start_loc[nd]
            has_initial = torch.tensor([ctx > 0 for ctx in contexts[nd:]],
                                       device=hidden.device)
            y[nd:] = self._scan(x[nd:], dt[nd:], A, B[nd:], C[nd:], D, c.chunk_size, starts,
                                has_initial, ssm_state, slots[nd:])
        out = self.norm(y.view(t, c.intermediate_size), gate, hidden.dtype)
        return self.out_proj(out)

    def extra_repr(self) -> str:
        c = self.config
        return (f"heads={c.num_heads}, head_dim={c.head_dim}, state={c.state_size}, "
                f"groups={c.n_groups}, conv_kernel={c.conv_kernel}, chunk={c.chunk_size}, "
                f"kernel={self.kernel}")
