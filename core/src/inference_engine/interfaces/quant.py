"""Quantization method interface: owns a linear layer's weights and its matmul."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from inference_engine.interfaces.platform import Platform

__all__ = ["CpuLinearEntry", "QuantMethod"]


@dataclass(frozen=True)
class CpuLinearEntry:
    """A linear layer's product as a plain C function, for C++ code that chains layers
    without Python (the CPU decode step, ``layers/cpu_decode_step.py``).

    ``function`` is the address of ``void f(void* context, const float* x, int64_t ldx,
    int64_t M, float* y)`` computing ``y [M, N] = x [M, K] @ W.T`` (no bias; ``x`` rows
    ``ldx`` apart, ``y`` dense) with the GIL released; ``context`` is the address it is
    called with and ``owner`` the Python object keeping it alive.
    """

    function: int
    context: int
    owner: Any


class QuantMethod(ABC):
    """Creates, loads, converts and applies the weights of linear layers.

    One instance serves a whole model; it may treat layers differently by
    ``prefix`` (mixed precision, excluded layers). Weight preparation
    (:meth:`create_weights`, :meth:`process_weights_after_loading`) is kept
    apart from the runtime op (:meth:`apply`).
    """

    # Keys this method reads from ``--quant-option KEY=VALUE`` (the loader refuses others).
    option_names: frozenset[str] = frozenset()
    # Whether apply() multiplies by the layer's packed bf16 copy ``layer.gemv_weight`` where
    # it has one (the unquantized method on CPU): the CPU decode step runs that GEMV itself.
    multiplies_packed_bf16: bool = False
    # Whether this method's weights load sharded under tensor parallelism: its loaders pass
    # checkpoint tensors through ``layer.tp_shard`` (block scales cut in blocks). Declared
    # by each class itself (the loader does not take a parent's word for a subclass).
    supports_tensor_parallel: bool = False

    def __init__(self, checkpoint_config: dict[str, Any] | None = None, **options: Any) -> None:
        # The checkpoint's ``quantization_config`` (None for online methods).
        self.checkpoint_config = checkpoint_config or {}
        self.options = options

    @abstractmethod
    def create_weights(
        self,
        layer: nn.Module,
        prefix: str,
        input_size: int,
        output_sizes: list[int],
        params_dtype: torch.dtype,
    ) -> None:
        """Register the parameters the checkpoint holds for this layer on ``layer``.

        Args:
            layer: the linear module; parameters get a ``weight_loader`` attribute.
            prefix: the layer's dotted name (``model.layers.0.self_attn.qkv_proj``).
            input_size: K.
            output_sizes: N of each fused part (q, k, v) in order.
            params_dtype: the model's compute dtype.
        """

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Convert loaded weights to their runtime form (repack, quantize online)."""

    def process_model_after_loading(self, model: nn.Module) -> None:
        """Whole-model step after every layer's weights are processed.

        Called once by the loader. A method that also covers modules other than
        linear layers (the GGUF method keeps the token embedding and LM head in
        their quantized blocks) converts or swaps them here; the default does nothing.
        """

    @abstractmethod
    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``x @ W.T + bias`` for ``x: [num_tokens, K]``, returning ``[num_tokens, N]``."""

    def cpu_linear_entry(self, layer: nn.Module) -> CpuLinearEntry | None:
        """The layer's product as a C function for the CPU decode step, or None (the default:
        models with such layers decode layer by layer)."""
        return None

    def weight_memory_bytes(self, layer: nn.Module) -> int:
        """Bytes the layer's weights occupy at run time."""
        return sum(p.numel() * p.element_size() for p in layer.parameters(recurse=False))

    def fused_moe_method(self, prefix: str) -> Any | None:
        """The :class:`~inference_engine.layers.moe.method.FusedMoEMethod` for one MoE layer.

        None (the default) keeps that layer's experts unquantized in the compute dtype.
        """
        return None

    @classmethod
    def kernel_for(cls, platform: Platform) -> str:
        """Short human name of the matmul path this method would use on ``platform``.

        Shown by ``inference-engine env``; methods with device-specific kernels
        override it (e.g. ``"torch._scaled_mm"``, ``"triton fp8 block GEMM"``).
        """
        return "unquantized torch matmul"
