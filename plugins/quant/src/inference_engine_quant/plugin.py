"""Registrations of inference-engine-quant; targets stay strings until used.

Nothing is registered until the code behind a name exists and works. Each
method adds its own line to the list below.
"""

from __future__ import annotations

from typing import Any

from inference_engine import hookimpl
from inference_engine.registry import Spec


@hookimpl
def ie_register_quantization_methods() -> list[Spec]:
    return [
        Spec("fp8", "inference_engine_quant.fp8:Fp8Method",
             "FP8 E4M3 checkpoints: per-tensor or 128x128 block scales"),
        Spec("ptpc_fp8", "inference_engine_quant.ptpc_fp8:PtpcFp8Method",
             "Online FP8: per-channel weight, per-token activation scales"),
        Spec("mxfp4", "inference_engine_quant.mxfp4:Mxfp4Method",
             "MXFP4 (E2M1 + E8M0 per 32): gpt-oss-style checkpoints or online, kept packed"),
        Spec("mxfp8", "inference_engine_quant.mxfp8_method:Mxfp8Method",
             "Online MXFP8 (E4M3 + E8M0 per 32), weight-only"),
        Spec("nvfp4", "inference_engine_quant.nvfp4_method:Nvfp4Method",
             "Online NVFP4 (E2M1 + E4M3 per 16 + FP32 global), weight-only W4A16"),
        Spec("modelopt", "inference_engine_quant.modelopt:ModelOptMethod",
             "ModelOpt checkpoints: NVFP4, FP8, MXFP8, MIXED_PRECISION per layer"),
        Spec("awq", "inference_engine_quant.awq:AwqMethod",
             "AWQ checkpoints (GEMM layout, 4-bit, zero points): int weight-only GEMM"),
        Spec("compressed-tensors",
             "inference_engine_quant.compressed_tensors_method:CompressedTensorsMethod",
             "compressed-tensors checkpoints: FP8 (tensor/channel/block), INT8 W8A8, "
             "W4A16/W8A16 pack-quantized"),
        Spec("gptq", "inference_engine_quant.gptq:GptqMethod",
             "GPTQ checkpoints (4/8-bit, g_idx/desc_act, sym/asym): int weight-only GEMM"),
    ]


@hookimpl
def ie_kernel_tuning_config(op_name: str, platform: Any, shape: dict[str, int]) -> dict | None:
    """Launch configs of the quantized kernels from measured per-arch tables (none shipped
    yet); None where no table covers the (arch, op), so the kernel's default applies."""
    arch_name = getattr(platform, "arch_name", None)
    if not callable(arch_name):
        return None
    from inference_engine_quant.tuning_tables import tuned_config

    return tuned_config(op_name, arch_name(), shape)
