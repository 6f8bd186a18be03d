"""The built-in quantization method: dense weights in the model dtype."""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from inference_engine.interfaces.quant import QuantMethod
from inference_engine.layers.cpu_gemv import bf16_gemv_weight, small_batch_linear
from inference_engine.layers.linear import copy_into_rows

__all__ = ["UnquantizedMethod"]


class UnquantizedMethod(QuantMethod):
    """``weight [N, K]`` in the compute dtype, applied with ``F.linear``.

    The weight's ``weight_loader(param, loaded, shard_id=None)`` copies a
    checkpoint tensor into the whole weight, or into the rows of one fused part
    (``"q"``, ``"k"``, ``"v"``, or ``0``/``1`` for gate/up) of the layer.
    """

    multiplies_packed_bf16 = True
    supports_tensor_parallel = True  # copy_into_rows narrows to the rank's slice

    name = "unquantized"

    def create_weights(
        self,
        layer: nn.Module,
        prefix: str,
        input_size: int,
        output_sizes: list[int],
        params_dtype: torch.dtype,
    ) -> None:
        weight = nn.Parameter(
            torch.empty(sum(output_sizes), input_size, dtype=params_dtype), requires_grad=False
        )
        weight.weight_loader = partial(  # type: ignore[attr-defined]
            _load_weight, layer, name=f"{prefix}.weight"
        )
        layer.register_parameter("weight", weight)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """On CPU, store float32 weights column-major (``W^T`` contiguous).

        The logical shape stays ``[N, K]``; ``F.linear`` then hands oneDNN/MKL
        a plain ``x @ B`` product, measured 3-20% faster for 1-16 rows (decode)
        and no slower for prefill on AVX-512 CPUs. Loading again still works:
        the weight loader writes row slices through any strides (and drops
        the bf16 copy below until this runs again).

        Float32 weights that are exactly bfloat16 values (a bfloat16
        checkpoint, which the CPU computes in float32) also get a bfloat16
        copy, ``layer.gemv_weight``, that decode-sized batches multiply from
        (:mod:`inference_engine.layers.cpu_gemv`): half the bytes per step;
        so do large batches on CPUs with a bf16 GEMM when bf16 was asked for.
        """
        weight = getattr(layer, "weight", None)
        if weight is not None and weight.device.type == "cpu" and weight.dtype == torch.float32:
            layer.gemv_weight = bf16_gemv_weight(weight.data)
            weight.data = weight.data.t().contiguous().t()

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        gemv_weight = getattr(layer, "gemv_weight", None)
        if gemv_weight is not None:
            return small_batch_linear(x, layer.weight, gemv_weight, bias,
                                      bf16_gemm=getattr(layer, "bf16_gemm", False))
        return F.linear(x, layer.weight, bias)


def _load_weight(layer: nn.Module, param: torch.Tensor, loaded: torch.Tensor,
                 shard_id: int | str | None = None, *, name: str) -> None:
    layer.gemv_weight = None  # stale once the weight changes
    copy_into_rows(layer, param, loaded, shard_id, name)
