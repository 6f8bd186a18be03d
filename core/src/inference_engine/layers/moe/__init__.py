"""Mixture-of-experts: routing, sorted token dispatch, grouped expert GEMMs, shared experts.

:class:`SparseMoeBlock` is what a decoder layer uses; :class:`FusedMoE` holds
the experts (weights from the quant method) and picks its kernel once, when
built, from the platform's ``moe_kernels()``: the Triton grouped GEMM
(:mod:`.triton_moe`) or the torch path (:mod:`.torch_experts`);
:func:`fused_moe_reference` is the plain ground truth both are tested against.
Routing and dispatch read nothing back to the host (see
:mod:`inference_engine.testing_sync`).
"""

from inference_engine.layers.moe.activation import (
    GELU_TANH,
    RELU2,
    SILU,
    ExpertActivation,
    expert_activation,
    gated_activation,
)
from inference_engine.layers.moe.block import SparseMoeBlock
from inference_engine.layers.moe.dispatch import ExpertDispatch, align_block_size, sort_by_expert
from inference_engine.layers.moe.layer import FusedMoE
from inference_engine.layers.moe.method import FusedMoEMethod, UnquantizedFusedMoEMethod
from inference_engine.layers.moe.reference import fused_moe_reference
from inference_engine.layers.moe.router import RouterSpec, route
from inference_engine.layers.moe.torch_experts import fused_moe_torch

__all__ = [
    "GELU_TANH",
    "RELU2",
    "SILU",
    "ExpertActivation",
    "ExpertDispatch",
    "FusedMoE",
    "FusedMoEMethod",
    "RouterSpec",
    "SparseMoeBlock",
    "UnquantizedFusedMoEMethod",
    "align_block_size",
    "fused_moe_reference",
    "expert_activation",
    "fused_moe_torch",
    "gated_activation",
    "route",
    "sort_by_expert",
]
