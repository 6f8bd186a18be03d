"""Every decoder layer of a CPU decode step in one C++ call.

At batch 1 a small model's decode step is short (the bench model's matrices are read
in ~1.5 ms) and getting from one kernel to the next through Python — module calls,
the per-layer dispatch, views, the kernels' argument parsing — cost as much again
(profile and figures in ``docs/benchmarks.md``, "CPU single stream"). For the models
that are exactly the shared Llama-family decoder on the CPU kernels (bf16 weights in
the packed GEMV layout, RMSNorms, optional per-head q/k norm, neox rotary, the
``cpu_paged`` backend on a float32 or bfloat16 cache, the gated SiLU MLP), the layer
loop of a pure-decode step runs in ``csrc/cpu_decode_step.cpp``. It calls the same
kernels through the plain-pointer entry points their extensions export, in the same
order on the same inputs, so its numbers are the layer loop's bit for bit (tested);
the GIL is released while it runs.

Chosen once, when the model runner binds the KV cache
(:meth:`~inference_engine.interfaces.model.CausalLM.kv_cache_bound`):
:func:`build_decode_step` returns None, with the reason logged at debug level, for
anything else (other layer types, quantized or unpacked weights, sinks, another
backend, a float8 cache, ``INFERENCE_ENGINE_CPU_KERNELS=0``), and those models keep
the layer loop.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import torch

from inference_engine.builtin.attention.cpu_decode_kernel import KERNEL_CACHE_DTYPES, decode_kernel
from inference_engine.builtin.attention.cpu_paged import CpuPagedAttentionBackend
from inference_engine.cpu_extensions import CpuKernelBuild, load_cpu_kernel
from inference_engine.interfaces.attention import AttentionMetadata
from inference_engine.layers.cpu_fused import fused_kernels
from inference_engine.layers.cpu_gemv import gemv_kernel, gemv_max_rows, is_packed
from inference_engine.layers.rotary import RotaryTable, rotate_cpu

__all__ = ["DECODE_STEP_BUILD", "CpuDecodeStep", "build_decode_step", "decode_step_blocker",
           "linear_spec"]

logger = logging.getLogger(__name__)


DECODE_STEP_BUILD = CpuKernelBuild("inference_engine_cpu_decode_step", ("cpu_decode_step.cpp",),
                                   "the CPU whole-step decode kernel")


def _step_module() -> Any | None:
    return load_cpu_kernel(DECODE_STEP_BUILD)


class CpuDecodeStep:
    """The bound C++ step: ``run`` replaces the layer loop of a pure-decode step."""

    def __init__(self, step: Any, max_rows: int) -> None:
        self._step = step
        self.max_rows = max_rows

    @property
    def kernel(self) -> Any:
        """The bound C++ object (the greedy window binds its model ends onto it)."""
        return self._step

    def applies(self, hidden: torch.Tensor, metadata: AttentionMetadata) -> bool:
        """A pure-decode step (one token per sequence) small enough for the GEMV kernel."""
        return (metadata.num_decodes == metadata.num_seqs == hidden.shape[0] <= self.max_rows
                and hidden.dtype == torch.float32 and not metadata.is_graph_step)

    def run(self, hidden: torch.Tensor, rope: RotaryTable,
            metadata: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """The last layer's ``(mlp output, residual)`` for embedded tokens ``hidden [n, D]``."""
        n = hidden.shape[0]
        if metadata.slot_blocks is None:
            blocks = torch.div(metadata.slot_mapping, metadata.block_size, rounding_mode="floor")
            offsets = metadata.slot_mapping - blocks * metadata.block_size
        else:
            blocks, offsets = metadata.slot_blocks, metadata.slot_offsets
        out, residual = self._step.run(hidden.contiguous(), rope.rows, metadata.block_tables[:n],
                                       metadata.seq_lens[:n], blocks[:n].contiguous(),
                                       offsets[:n].contiguous())
        return out, residual


def decode_step_blocker(model: torch.nn.Module) -> str | None:
    """Why the C++ step cannot run the layers of ``model`` (a
    :class:`~inference_engine.layers.decoder.DecoderModel`), or None when it can; the
    layers answer for their own structure (``DecoderLayer.cpu_decode_blocker``)."""
    if model.rotary_emb._rotate is not rotate_cpu:
        return "the rotary embedding does not use the CPU kernel"
    if model.rotary_emb.cos_sin_cache.dtype != torch.float32:
        return "the rotary table is not float32"
    if not model.layers:
        return "no layers"
    for i, layer in enumerate(model.layers):
        where = f"layer {i}"
        ask = getattr(layer, "cpu_decode_blocker", None)
        blocker = f"{type(layer).__name__} has no C++ decode step" if ask is None else ask()
        if blocker is not None:
            return f"{where}: {blocker}"
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            if norm.weight.dtype != torch.float32:
                return f"{where}: float32 norm weights expected"
        if layer.input_layernorm.eps != layer.post_attention_layernorm.eps:
            return f"{where}: its two norms differ in eps"
        attn = layer.self_attn
        if attn.q_norm is not None and (
                attn.qk_norm_weight is None or attn.qk_norm_weight.dtype != torch.float32
                or attn.q_norm.eps != attn.k_norm.eps):
            return f"{where}: per-head q/k norm weights are not ready"
        if attn.sinks is not None:
            return f"{where} has attention sinks"
        backend = attn.attn.backend
        if type(backend) is not CpuPagedAttentionBackend or backend.sinks is not None:
            return f"{where}: attention backend {type(backend).__name__} is not cpu_paged"
        cache = attn.attn.kv_cache
        if cache is None or cache[0].dtype not in KERNEL_CACHE_DTYPES or cache[0].shape[1] > 16:
            return f"{where}: no float32/bfloat16 KV cache in blocks of at most 16 bound"
        for proj in _projections(layer):
            if proj.lora is not None:
                return f"{where}: {proj.prefix} has LoRA adapters (added in Python each step)"
            spec = linear_spec(proj)
            if isinstance(spec, str):
                return f"{where}: {spec}"
            if proj.bias is not None and proj.bias.dtype != torch.float32:
                return f"{where}: {proj.prefix} bias is not float32"
    first = model.layers[0].self_attn
    for layer in model.layers:
        a = layer.self_attn
        if (a.num_heads, a.num_kv_heads, a.head_dim) != (first.num_heads, first.num_kv_heads,
                                                         first.head_dim):
            return "the layers' head counts differ"
    return None


def linear_spec(proj: torch.nn.Module) -> torch.Tensor | tuple[int, int, Any] | str:
    """What the C++ step multiplies ``proj`` by: its packed bf16 copy (unquantized), the
    product its quantization method provides as a C function
    (:meth:`~inference_engine.interfaces.quant.QuantMethod.cpu_linear_entry`), or why
    neither exists."""
    method = proj.quant_method
    if method.multiplies_packed_bf16:
        packed = getattr(proj, "gemv_weight", None)
        if packed is None or not is_packed(packed):
            return f"{proj.prefix} has no packed bf16 weight"
        return packed
    entry = method.cpu_linear_entry(proj)
    if entry is None:
        return f"{proj.prefix}: {type(method).__name__} gives the CPU step no product"
    return (entry.function, entry.context, entry.owner)


def _entry_points() -> dict[str, int] | None:
    points: dict[str, int] = {}
    for module in (gemv_kernel(), fused_kernels(), decode_kernel()):
        if module is None:
            return None
        points.update(module.entry_points())
    return points


def build_decode_step(model: torch.nn.Module) -> CpuDecodeStep | None:
    """The C++ step bound to ``model``'s weights and caches, or None (reason logged)."""
    reason = decode_step_blocker(model)
    points = _entry_points() if reason is None else None
    module = _step_module() if points is not None else None
    if reason is None and module is None:
        reason = "the CPU kernels are not built"
    if reason is not None:
        logger.debug("decode steps run layer by layer: %s", reason)
        return None
    first = model.layers[0]
    attn0, mlp0 = first.self_attn, first._modules[first.mlp_name]
    step = module.DecodeStep(points, attn0.num_heads, attn0.num_kv_heads, attn0.head_dim,
                             first.input_layernorm.hidden_size, mlp0.intermediate_size)
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer._modules[layer.mlp_name]
        qk_norm = getattr(attn, "qk_norm_weight", None)
        qk_eps = attn.q_norm.eps if qk_norm is not None else 0.0
        k_cache, v_cache = attn.attn.kv_cache
        backend = attn.attn.backend

        def bias(proj: Any) -> torch.Tensor | None:
            return None if proj.bias is None else proj.bias.data.contiguous()

        step.add_layer(
            layer.input_layernorm.weight.data, layer.post_attention_layernorm.weight.data,
            float(layer.input_layernorm.eps),
            linear_spec(attn.qkv_proj), bias(attn.qkv_proj),
            None if qk_norm is None else qk_norm.reshape(-1), float(qk_eps),
            linear_spec(attn.o_proj), bias(attn.o_proj),
            linear_spec(mlp.gate_up_proj), bias(mlp.gate_up_proj),
            linear_spec(mlp.down_proj), bias(mlp.down_proj),
            k_cache, v_cache, float(backend.scale), int(backend.sliding_window or 0))
    # The packed bf16 GEMV serves up to gemv_max_rows() rows (larger batches multiply
    # otherwise, with other roundings); provided products take any batch.
    gemv = any(isinstance(linear_spec(proj), torch.Tensor) for layer in model.layers
               for proj in _projections(layer))
    max_rows = gemv_max_rows() if gemv else sys.maxsize
    logger.debug("decode steps of up to %s sequences run as one C++ call",
                 max_rows if gemv else "any number of")
    return CpuDecodeStep(step, max_rows)


def _projections(layer: torch.nn.Module) -> tuple[torch.nn.Module, ...]:
    attn, mlp = layer.self_attn, layer._modules[layer.mlp_name]
    return attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj
