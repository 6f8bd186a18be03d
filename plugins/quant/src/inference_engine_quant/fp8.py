"""``fp8``: checkpoints with ``quantization_config.quant_method == "fp8"``.

Two schemes (quant-formats.md sections 3, 4 and 8):

* per-tensor (vLLM ``fp8``): ``weight`` F8_E4M3 ``[N, K]``, ``weight_scale`` F32
  scalar, ``input_scale`` F32 scalar when ``activation_scheme == "static"``;
  dynamic activations are quantized per token (``amax / 448``).
* block-wise (DeepSeek-V3 / HF FineGrainedFP8, ``weight_block_size: [128, 128]``):
  ``weight_scale_inv`` F32 ``[ceil(N/128), ceil(K/128)]`` (a multiplier despite
  the name); activations quantized per token and 128-column group.

Tensors are read as the checkpoint stores them: ``[N, K]`` unless
``quantization_config.weight_layout == "KN"`` (what ``inference-engine
quantize`` writes: every tensor of the layer transposed, scales included),
and transposed once after loading into the engine's (K, N) layout.

Fused layers (qkv, gate/up) get one scale per part on disk. Per-tensor parts
keep their own scales (expanded to one per output column, so no
requantization); static input scales of the parts are merged by their max,
as vLLM does, since the parts share one input. Block scales of parts whose
row counts are not multiples of the block are expanded to one row each.

On a plain (16/32-bit) checkpoint, ``--quantization fp8`` quantizes online to
the same per-tensor form, one scale per checkpoint tensor (per fused part),
so the result equals loading what ``inference-engine quantize --method fp8``
writes; activations are then dynamic per token.

Layers named in ``ignored_layers`` / ``modules_to_not_convert`` / ``ignore``
(exact names, ``fnmatch`` wildcards, or substrings as transformers matches
them) stay unquantized.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from inference_engine.builtin.quant.unquantized import UnquantizedMethod
from inference_engine.interfaces.quant import QuantMethod
from torch import nn

from inference_engine_quant.checkpoint_names import checkpoint_module_names, is_ignored
from inference_engine_quant.fp8_linear import (
    apply_fp8_linear,
    finalize_fp8_layer,
    fp8_kernel_description,
)
from inference_engine_quant.fp8_math import quantize_weight_per_tensor

__all__ = ["Fp8Method", "checkpoint_module_names", "current_platform_or_none"]

_FP8_DTYPES = (torch.float8_e4m3fn,)


def current_platform_or_none(options: dict[str, Any]) -> Any:
    """The platform given as the ``platform`` option, else the engine's current one."""
    platform = options.get("platform")
    if platform is not None:
        return platform
    try:
        from inference_engine.platforms.selection import current_platform
    except ImportError:
        from inference_engine.platforms.selection import select_platform

        return select_platform()
    return current_platform()


class Fp8Method(QuantMethod):
    """Loads ``fp8`` checkpoints (per-tensor or block) into (K, N) FP8 weights."""

    name = "fp8"
    # Block scales are cut with their rows / columns (whole 128-blocks per rank).
    supports_tensor_parallel = True
    # Name of the block-scale tensor (compressed-tensors FP8 block calls it ``weight_scale``).
    block_scale_name = "weight_scale_inv"

    def __init__(self, checkpoint_config: dict[str, Any] | None = None, **options: Any) -> None:
        super().__init__(checkpoint_config, **options)
        cfg = self.checkpoint_config
        # A plain checkpoint with --quantization fp8: quantize per tensor at load.
        self.online = cfg.get("quant_method") != "fp8"
        if self.online and cfg.get("quant_method") is not None:
            raise ValueError(
                f"--quantization fp8 quantizes a plain checkpoint at load, but this checkpoint is "
                f"already quantized ({cfg.get('quant_method')!r}); drop --quantization to use "
                f"its own method"
            )
        if self.online:
            cfg = {}
        fmt = str(cfg.get("fmt", "e4m3")).lower()
        if fmt not in ("e4m3", "float8_e4m3fn"):
            raise ValueError(f"quantization_config.fmt {fmt!r} is not supported; only e4m3 is")
        block = cfg.get("weight_block_size")
        if block is not None:
            if len(block) != 2 or any(int(b) <= 0 for b in block):
                raise ValueError(
                    f"quantization_config.weight_block_size must be [rows, cols], got {block!r}"
                )
            block = (int(block[0]), int(block[1]))
        self.block_nk: tuple[int, int] | None = block
        self.activation_scheme = str(cfg.get("activation_scheme", "dynamic")).lower()
        if self.activation_scheme not in ("static", "dynamic"):
            raise ValueError(
                f"quantization_config.activation_scheme must be static or dynamic, got "
                f"{self.activation_scheme!r}"
            )
        if block is not None and self.activation_scheme == "static":
            raise ValueError("block-wise fp8 (weight_block_size) supports only "
                             "activation_scheme 'dynamic'")
        layout = str(cfg.get("weight_layout", "NK")).upper()
        if layout not in ("NK", "KN"):
            raise ValueError(f"quantization_config.weight_layout must be NK or KN, got {layout!r}")
        self.layout = layout
        self.ignored = [str(p) for key in ("ignored_layers", "modules_to_not_convert", "ignore")
                        for p in (cfg.get(key) or [])]
        self.dequantize_at_load = bool(options.get("dequantize_at_load", False))
        self._dense = UnquantizedMethod()

    @classmethod
    def kernel_for(cls, platform: Any) -> str:
        return fp8_kernel_description(platform)

    def fused_moe_method(self, prefix: str) -> Any | None:
        """FP8 experts (per expert block or per-tensor scales; online: per row), kept in FP8.

        Raises:
            ValueError: static activation scales on MoE experts.
        """
        from inference_engine_quant.fp8_moe import Fp8FusedMoEMethod

        if is_ignored(prefix, self.ignored):
            return None
        if not self.online and self.activation_scheme == "static":
            raise ValueError(f"{prefix}: FP8 experts with static activation scales are not "
                             f"implemented (the expert GEMM is weight-only)")
        return Fp8FusedMoEMethod(self.block_nk, self.online, self.block_scale_name,
                                 self.dequantize_at_load, self.layout)

    # ------------------------------------------------------------------ create

    def create_weights(self, layer: nn.Module, prefix: str, input_size: int,
                       output_sizes: list[int], params_dtype: torch.dtype) -> None:
        layer.fp8_quantized = not is_ignored(prefix, self.ignored)
        layer.fp8_params_dtype = params_dtype
        if not layer.fp8_quantized or self.online:
            self._dense.create_weights(layer, prefix, input_size, output_sizes, params_dtype)
            return
        n, k = sum(output_sizes), input_size
        shape = (n, k) if self.layout == "NK" else (k, n)
        weight = nn.Parameter(torch.empty(shape, dtype=torch.float8_e4m3fn), requires_grad=False)
        weight.weight_loader = partial(self._load_nk, layer, name=f"{prefix}.weight",
                                       kind="weight")
        layer.register_parameter("weight", weight)
        if self.block_nk is None:
            parts = len(output_sizes)
            scale = nn.Parameter(torch.empty(parts, dtype=torch.float32), requires_grad=False)
            scale.weight_loader = partial(self._load_part_scalar, layer,
                                          name=f"{prefix}.weight_scale")
            layer.register_parameter("weight_scale", scale)
            if self.activation_scheme == "static":
                iscale = nn.Parameter(torch.empty(parts, dtype=torch.float32), requires_grad=False)
                iscale.weight_loader = partial(self._load_part_scalar, layer,
                                               name=f"{prefix}.input_scale")
                layer.register_parameter("input_scale", iscale)
            return
        bn, bk = self.block_nk
        # One scale row per block of bn rows, unless a fused part would split a block.
        row_unit = bn if len(output_sizes) == 1 or all(p % bn == 0 for p in output_sizes) else 1
        layer.fp8_row_unit = row_unit
        grid_nk = (-(-n // row_unit), -(-k // bk))
        grid = grid_nk if self.layout == "NK" else grid_nk[::-1]
        scale = nn.Parameter(torch.empty(grid, dtype=torch.float32), requires_grad=False)
        scale.weight_loader = partial(self._load_nk, layer,
                                      name=f"{prefix}.{self.block_scale_name}",
                                      kind="block_scale")
        layer.register_parameter(self.block_scale_name, scale)

    # ------------------------------------------------------------------ load

    def _load_nk(self, layer: nn.Module, param: torch.Tensor, loaded: torch.Tensor,
                 shard_id: int | str | None = None, *, name: str, kind: str) -> None:
        """Copy a weight or block-scale tensor (all or one fused part), in the file's layout."""
        if kind == "weight":
            if loaded.dtype == torch.uint8:
                loaded = loaded.view(torch.float8_e4m3fn)
            if loaded.dtype not in _FP8_DTYPES:
                raise ValueError(f"{name}: expected an F8_E4M3 tensor for an fp8 checkpoint, "
                                 f"got {loaded.dtype}")
        else:
            loaded = loaded.float()
        target = param.data if self.layout == "NK" else param.data.t()
        loaded_nk = loaded if self.layout == "NK" else loaded.t()
        if getattr(layer, "tp_size", 1) > 1:  # this rank's rows / columns (and their blocks)
            loaded_nk = layer.tp_shard(loaded_nk, shard_id)
        where = name
        if shard_id is not None:
            offset, size = layer.shard_rows(shard_id)
            where = f"{name} (part {shard_id!r})"
            if kind == "block_scale":
                bn = self.block_nk[0]
                expect = (-(-size // bn), target.shape[1])
                if tuple(loaded_nk.shape) != expect:
                    raise ValueError(self._shape_error(where, loaded.shape, expect))
                if layer.fp8_row_unit == 1:
                    loaded_nk = loaded_nk.repeat_interleave(bn, dim=0)[:size]
                    target = target.narrow(0, offset, size)
                else:
                    target = target.narrow(0, offset // bn, expect[0])
            else:
                target = target.narrow(0, offset, size)
        if tuple(target.shape) != tuple(loaded_nk.shape):
            raise ValueError(self._shape_error(where, loaded.shape, tuple(target.shape)))
        target.copy_(loaded_nk)

    def _shape_error(self, where: str, got: torch.Size, expect_nk: tuple[int, ...]) -> str:
        expect = tuple(expect_nk) if self.layout == "NK" else tuple(expect_nk)[::-1]
        return (f"shape mismatch for {where}: the checkpoint tensor has shape {tuple(got)}, "
                f"the model expects {expect} (layout {self.layout})")

    def _load_part_scalar(self, layer: nn.Module, param: torch.Tensor, loaded: torch.Tensor,
                          shard_id: int | str | None = None, *, name: str) -> None:
        """A per-tensor scale: one scalar per fused part."""
        if loaded.numel() != 1:
            raise ValueError(f"shape mismatch for {name}: expected a scalar per-tensor scale, "
                             f"got shape {tuple(loaded.shape)}")
        index = 0 if shard_id is None else layer.shard_ids.index(shard_id)
        if shard_id is None and param.numel() != 1:
            raise ValueError(f"{name}: one scale given for a layer of {param.numel()} parts")
        param.data[index] = loaded.float().reshape(())

    # ------------------------------------------------------------------ finish

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if not getattr(layer, "fp8_quantized", False):
            self._dense.process_weights_after_loading(layer)
            return
        if self.online:
            self._quantize_online(layer)
            return
        weight_kn = layer.weight.data.t() if self.layout == "NK" else layer.weight.data
        k, n = weight_kn.shape
        input_scale = None
        if self.block_nk is None:
            sizes = torch.tensor(layer.output_sizes, device=weight_kn.device)
            scale_kn = layer.weight_scale.data.float().repeat_interleave(sizes).reshape(1, n)
            block_kn = (k, 1)
            if self.activation_scheme == "static":
                input_scale = layer.input_scale.data.float().max()
        else:
            scale = getattr(layer, self.block_scale_name).data.float()
            scale_kn = scale.t() if self.layout == "NK" else scale
            block_kn = (self.block_nk[1], layer.fp8_row_unit)
        finalize_fp8_layer(
            layer, weight_kn, scale_kn, block_kn, input_scale, act_quant=True,
            platform=current_platform_or_none(self.options),
            compute_dtype=layer.fp8_params_dtype, dequantize_at_load=self.dequantize_at_load,
        )

    def _quantize_online(self, layer: nn.Module) -> None:
        """Per-tensor FP8 per fused part, exactly as the ``quantize`` CLI writes it."""
        weight = layer.weight.data
        qs, scales = [], []
        for shard_id in layer.shard_ids:
            offset, size = layer.shard_rows(shard_id)
            q, s = quantize_weight_per_tensor(weight.narrow(0, offset, size))
            qs.append(q)
            scales.append(s.expand(size))
        finalize_fp8_layer(
            layer, torch.cat(qs).t(), torch.cat(scales).reshape(1, -1), (weight.shape[1], 1),
            None, act_quant=True, platform=current_platform_or_none(self.options),
            compute_dtype=layer.fp8_params_dtype, dequantize_at_load=self.dequantize_at_load,
        )

    def apply(self, layer: nn.Module, x: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
        if not getattr(layer, "fp8_quantized", False):
            return self._dense.apply(layer, x, bias)
        return apply_fp8_linear(layer, x, bias)
