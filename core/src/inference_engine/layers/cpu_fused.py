"""Fused float32 CPU kernels for the small per-token ops of a decoder layer (and the pick).

A batch-1 decode step spends as long dispatching the ~25 RMSNorms (each a
handful of torch ops: square, mean, rsqrt, multiply, residual add) and the
SiLU-and-multiply as it does computing them. These C++ loops do each in one
call: RMSNorm with an optional residual add and an optional per-row-period
weight (so the q and k heads of a layer are normalised with their own weights
in one pass), ``silu(gate) * up`` on a fused gate/up output, and the greedy
pick (``argmax`` of each row of logits). Built with
``-ffast-math`` (vectorised ``exp``; results within a few float32 ulps).

Float32 CPU tensors only; everything else, or a machine where the build fails
(or ``INFERENCE_ENGINE_CPU_KERNELS=0``), uses the torch ops, which are the
reference these are tested against. The C++ is ``csrc/cpu_fused.cpp``, built on
first use by :mod:`inference_engine.cpu_extensions`.
"""

from __future__ import annotations

from typing import Any

import torch

from inference_engine.cpu_extensions import CpuKernelBuild
from inference_engine.cpu_thread_pool import load_pooled_build

__all__ = ["FUSED_BUILD", "fused_argmax", "fused_kernels", "fused_rms_norm", "fused_rope",
           "fused_silu_and_mul"]

_EMPTY = torch.empty(0)


FUSED_BUILD = CpuKernelBuild("inference_engine_cpu_fused", ("cpu_fused.cpp",),
                             "the CPU fused norm/activation kernels", ("-ffast-math",))


def fused_kernels() -> Any | None:
    """The compiled module, or None where it cannot be built (logged once)."""
    return load_pooled_build(FUSED_BUILD)


def _usable(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and x.dtype == torch.float32 and x.stride(-1) == 1


def fused_rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float,
                   residual: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """``(weight * s / rms(s), s)`` with ``s = x [+ residual]`` in one call, or None (use torch).

    ``x`` and ``residual`` are ``[T, D]`` or ``[T, H, D]`` with contiguous last dims (any
    other strides: column slices of a fused projection work without a copy); ``weight``
    is ``[D]`` or ``[P, D]``, where flattened row ``r`` uses ``weight[r % P]``
    (the q and k heads of a layer with their own weights). The second element
    is None without ``residual``.
    """
    if not _usable(x) or (residual is not None and not _usable(residual)):
        return None
    if weight is not None and not (weight.dtype == torch.float32 and weight.is_contiguous()):
        return None
    module = fused_kernels()
    if module is None:
        return None
    if x.dim() not in (2, 3) or (residual is not None and residual.shape != x.shape):
        return None
    rows = x.unsqueeze(1) if x.dim() == 2 else x  # [T, D] -> [T, 1, D]; [T, H, d] as it is
    res = residual.unsqueeze(1) if residual is not None and residual.dim() == 2 else residual
    out, total = module.rms_norm(rows, _EMPTY if weight is None else weight,
                                 _EMPTY if res is None else res, float(eps))
    return out.view(x.shape), (total.view(x.shape) if residual is not None else None)


def fused_silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor | None:
    """``silu(gate) * up`` for ``gate_up [T, 2I]`` (gate first), or None (use torch)."""
    if gate_up.dim() != 2 or not _usable(gate_up):
        return None
    module = fused_kernels()
    if module is None:
        return None
    return module.silu_and_mul(gate_up)


def fused_rope(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor | None:
    """``x [T, H, D]`` with neox rotary applied from ``table [T, 2R]`` rows
    ``[cos | cos | -sin | sin]`` in one pass, or None (use torch)."""
    if x.dim() != 3 or not _usable(x) or not _usable(table) or table.dim() != 2:
        return None
    module = fused_kernels()
    if module is None:
        return None
    return module.rope_neox(x, table)


def fused_argmax(x: torch.Tensor) -> torch.Tensor | None:
    """``x.argmax(dim=-1)`` for float32 ``x [T, V]`` on CPU, or None (use torch).

    torch's CPU argmax is a scalar loop (timing in ``docs/benchmarks.md``); this is
    a vectorised max and a scan for its first index.
    """
    if x.dim() != 2 or not _usable(x) or x.shape[1] == 0:
        return None
    module = fused_kernels()
    if module is None:
        return None
    return module.argmax_rows(x)
