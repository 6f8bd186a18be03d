"""Which implementation of the small fused layer ops a layer binds when it is built.

RMSNorm (with its residual add), SiLU-and-multiply and rotary each exist as
``"cpu"`` (the C++ kernels of :mod:`~inference_engine.layers.cpu_fused`, which
fall through to torch for what they do not cover), ``"triton"``
(:mod:`~inference_engine.layers.triton_fused`, one launch per op) and
``"torch"`` (plain torch ops, the reference). A layer asks
:func:`choose_fused_op` once in its constructor and stores the function it
picked, so ``forward`` never probes the device (vLLM's CustomOp idea).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from inference_engine.interfaces.platform import Platform

__all__ = ["FUSED_OP_KERNELS", "choose_fused_op"]

logger = logging.getLogger(__name__)

# The implementations the layers provide, by the names platforms list them under.
FUSED_OP_KERNELS = ("cpu", "triton", "torch")

# What layers did before platforms listed kernels: the CPU kernels where they apply, else
# torch. Safe on any device, so it is the answer whenever the platform cannot be asked.
_FALL_THROUGH = "cpu"


def _process_platform() -> Platform | None:
    """The process's platform (the engine's, else auto-selected); None when none is usable."""
    from inference_engine.platforms.selection import current_platform

    try:
        return current_platform()
    except (IndexError, LookupError, ValueError):  # no platform registered or present
        return None


def choose_fused_op(device: torch.device | str | None,
                    platform: Platform | None = None) -> str:
    """The fused-op implementation for a layer whose tensors live on ``device``.

    Args:
        device: where the layer's parameters (and so its activations) live; None: unknown.
        platform: whose ``fused_op_kernels()`` to choose from; None: the process's current
            platform.

    Returns:
        One of :data:`FUSED_OP_KERNELS`: the first of the platform's list that the layers
        implement (``"torch"`` when none is). ``"cpu"`` (the fall-through that works on
        any device, as layers behaved before this choice existed) when there is no
        platform, the device is unknown, or the device type is not the platform's.
    """
    platform = platform if platform is not None else _process_platform()
    if platform is None or device is None:
        return _FALL_THROUGH
    if torch.device(device).type != platform.device_type:
        return _FALL_THROUGH
    kernels = getattr(platform, "fused_op_kernels", None)
    if kernels is None:  # a minimal stand-in platform without the list
        return _FALL_THROUGH
    return next((k for k in kernels() if k in FUSED_OP_KERNELS), "torch")
