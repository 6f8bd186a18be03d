"""Registrations of inference-engine-quant; targets stay strings until used.

Nothing is registered until the code behind a name exists and works. Each
method adds its own line to the list below.
"""

from __future__ import annotations

from inference_engine import hookimpl
from inference_engine.registry import Spec


@hookimpl
def ie_register_quantization_methods() -> list[Spec]:
    return [
        Spec("fp8", "inference_engine_quant.fp8:Fp8Method",
             "FP8 E4M3 checkpoints: per-tensor or 128x128 block scales"),
        Spec("ptpc_fp8", "inference_engine_quant.ptpc_fp8:PtpcFp8Method",
             "Online FP8: per-channel weight, per-token activation scales"),
    ]
