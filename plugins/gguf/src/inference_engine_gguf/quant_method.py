"""The ``gguf`` quantization method: linear weights stay in their GGML blocks.

Each linear layer holds its checkpoint tensors exactly as stored in the file
(``uint8 [rows, row_bytes]`` for block types, the float dtype itself for
F32/F16/BF16). A matmul dequantizes the weight in tiles of rows into the
compute dtype and multiplies tile by tile, so at most one tile of dense weight
exists at a time and the model's resident weights are the file's bytes.

Fused layers (q/k/v, gate/up) may mix types (llama.cpp's ``Q4_K_M`` stores some
``attn_v``/``ffn_down`` as Q6_K): adjacent parts of one type share one buffer,
a "segment", and each segment is dequantized on its own.

The token embedding and LM head are not linear layers of the quant method;
:meth:`GGUFMethod.process_model_after_loading` swaps them for
:class:`GGMLEmbedding` / :class:`GGMLLMHead`, which hold the raw blocks too.

``dequantize_at_load`` (opt-in) instead dequantizes everything once at load:
more memory, plain dense matmuls.

``--quant-option accumulate=float64`` (a reference mode) multiplies F32/F16/BF16
tensors in float64 and rounds the result once, for comparing implementations whose
float32 sums differ only in order.

Activations (``--quant-option activations=...``): ``q8`` (the default on CPU) does
llama.cpp's arithmetic for the block types: each activation row is rounded to Q8_K
(K-quants), Q8_0 (Q8_0, Q4_0, Q5_0, MXFP4) or Q8_1 (Q4_1, Q5_1) and multiplied in integers
(:mod:`inference_engine_gguf.q8k_kernels`), so logits follow
llama.cpp's on the same file, and decode is faster. ``float`` keeps activations in the
compute dtype, so the result is the exact product with the dequantized weights (what
transformers computes on them). F16 / BF16 weights in ``q8`` multiply activations rounded
to F16 / BF16 first, as llama.cpp's CPU backend does (in float32 arithmetic). Other devices,
and the 32-value block types where the C++ kernel is not built, always use float.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from gguf.constants import GGMLQuantizationType
from inference_engine.builtin.quant.unquantized import UnquantizedMethod
from inference_engine.cpu_extensions import cpu_kernels_enabled
from inference_engine.interfaces.quant import CpuLinearEntry, QuantMethod
from inference_engine.layers.tp_blocks import check_row_shard_blocks, split_blocks_along_k
from inference_engine.layers.weights import STACKED_PARAMS
from torch import nn

from inference_engine_gguf import cpu_kernels, q8k_kernels
from inference_engine_gguf.dequant import dequantize
from inference_engine_gguf.ggml_types import FLOAT_TYPES, block_geometry, check_supported
from inference_engine_gguf.moe_method import GGMLFusedMoEMethod
from inference_engine_gguf.raw_tensors import FLOAT_DTYPES, empty_raw

__all__ = ["GGMLEmbedding", "GGMLLMHead", "GGUFMethod", "Segment", "model_weight_bytes",
           "raw_rows"]

T = GGMLQuantizationType
# Dense values one dequantized tile may hold (16 MiB of float32).
TILE_VALUES = 1 << 22
RAW_PREFIX = "gguf_raw"
# ``activations`` values: llama.cpp's 8-bit activations for the block types, or float.
ACTIVATION_MODES = ("q8", "float")
# Float weight types whose llama.cpp CPU matmul rounds the activations to the same type.
HALF_TYPES = frozenset({T.F16, T.BF16})
# ``accumulate`` values: float tensors multiplied in the compute dtype, or in float64.
ACCUMULATE_MODES = ("default", "float64")


@dataclass(frozen=True, slots=True)
class Segment:
    """Consecutive output rows of one layer stored in one GGML type."""

    # First output row of the layer this segment holds, and how many rows.
    row_offset: int
    num_rows: int
    qtype: GGMLQuantizationType


def tiled_linear(x: torch.Tensor, raw: torch.Tensor, qtype: GGMLQuantizationType,
                 out: torch.Tensor | None = None, activations: str = "float",
                 accumulate: str = "default") -> torch.Tensor:
    """``x @ W.T`` for ``W`` = dequantize(raw), one tile of rows at a time.

    With ``activations="q8"``, block-type weights on CPU take llama.cpp's route
    (:func:`inference_engine_gguf.q8k_kernels.q8_linear`; K-quants also without the
    kernel). Otherwise, on CPU in float32, block types go to the fused C++ kernel of
    :mod:`inference_engine_gguf.cpu_kernels` when it is built; elsewhere (and for
    float types, other devices and dtypes) torch dequantizes a tile and
    ``F.linear`` multiplies it.

    Args:
        x: ``[T, K]`` activations in the compute dtype.
        raw: stored rows of W, ``[N, ...]``.
        qtype: GGML type of ``raw``.
        out: optional ``[T, N]`` destination (may be a column slice).
        activations: ``"q8"`` or ``"float"`` (see the module docstring).
        accumulate: ``"float64"`` multiplies float-type weights in float64.

    Returns:
        ``[T, N]`` in ``x.dtype``.
    """
    if activations == "q8" and qtype in HALF_TYPES and x.device.type == "cpu":
        # llama.cpp converts the activations of an F16 / BF16 matmul to that type first.
        x = x.to(FLOAT_DTYPES[qtype]).to(x.dtype)
    if activations == "q8" and x.device.type == "cpu" and (
            qtype in q8k_kernels.Q8K_TYPES
            or (qtype in q8k_kernels.Q8_TYPES and q8k_kernels.kernel() is not None)):
        y = q8k_kernels.q8_linear(x, raw, qtype).to(x.dtype)
        return y if out is None else out.copy_(y)
    if cpu_kernels.supports(x, raw, qtype) and cpu_kernels.kernel() is not None:
        y = cpu_kernels.ggml_linear(x, raw, qtype)
        return y if out is None else out.copy_(y)
    n, k = raw.shape[0], x.shape[-1]
    if accumulate == "float64" and qtype in FLOAT_DTYPES:
        if out is None:
            out = x.new_empty(x.shape[0], n)
        tile_rows = max(1, TILE_VALUES // max(k, 1))
        for start in range(0, n, tile_rows):  # one float64 tile of weights at a time
            w = raw[start : start + tile_rows].double()
            out[:, start : start + tile_rows] = F.linear(x.double(), w).to(out.dtype)
        return out
    if qtype == T.F32 and x.dtype == torch.float32 and out is None:
        return F.linear(x, raw)
    tile_rows = max(1, TILE_VALUES // max(k, 1))
    if n <= tile_rows and out is None:
        return F.linear(x, _dense(raw, qtype, x.dtype))
    if out is None:
        out = x.new_empty(x.shape[0], n)
    for start in range(0, n, tile_rows):
        stop = min(n, start + tile_rows)
        out[:, start:stop] = F.linear(x, _dense(raw[start:stop], qtype, x.dtype))
    return out


def _dense(raw: torch.Tensor, qtype: GGMLQuantizationType, dtype: torch.dtype) -> torch.Tensor:
    if raw.dtype == dtype:  # a float type already in the compute dtype
        return raw
    return dequantize(raw, qtype).to(dtype)


class GGUFMethod(QuantMethod):
    """Linear layers whose weights are GGML tensors from a GGUF file.

    ``checkpoint_config`` is the ``quantization_config`` the GGUF weight format
    writes: ``tensor_types`` (checkpoint name -> GGML type name) for the
    linear weights kept raw, ``expert_types`` (MoE layer -> gate/up/down types)
    for experts kept raw, ``embedding_types`` and ``gguf_file`` for the
    embedding swap. Layers none of whose tensors are listed (e.g. a MoE router)
    fall back to dense weights in the compute dtype.
    """

    name = "gguf"
    # Output rows split whole; input columns split at the type's block boundaries.
    supports_tensor_parallel = True
    option_names = frozenset({"activations", "accumulate"})

    def __init__(self, checkpoint_config: dict[str, Any] | None = None, **options: Any) -> None:
        super().__init__(checkpoint_config, **options)
        cfg = self.checkpoint_config
        self.tensor_types = {name: check_supported(T[type_name], name)
                             for name, type_name in cfg.get("tensor_types", {}).items()}
        self.embedding_types = {name: check_supported(T[type_name], name)
                                for name, type_name in cfg.get("embedding_types", {}).items()}
        self.expert_types = {
            prefix: {part: check_supported(T[t], prefix) for part, t in parts.items()}
            for prefix, parts in cfg.get("expert_types", {}).items()
        }
        self.gguf_file: str | None = cfg.get("gguf_file")
        self.dequantize_at_load = bool(options.get("dequantize_at_load", False))
        self.activations = str(options.get("activations", "q8")).lower()
        if self.activations not in ACTIVATION_MODES:
            raise ValueError(f"gguf: activations={options.get('activations')!r} is not one of "
                             f"{', '.join(ACTIVATION_MODES)} (--quant-option activations=...)")
        self.accumulate = str(options.get("accumulate", "default")).lower()
        if self.accumulate not in ACCUMULATE_MODES:
            raise ValueError(f"gguf: accumulate={options.get('accumulate')!r} is not one of "
                             f"{', '.join(ACCUMULATE_MODES)} (--quant-option accumulate=...)")
        self._dense = UnquantizedMethod()

    @classmethod
    def kernel_for(cls, platform: Any) -> str:
        """The C++ fused block matmul for float32 on CPU (unless turned off), else the torch path.

        Does not build the kernel: a failed build at first use still falls back.
        """
        torch_path = "torch GGML dequantize (row tiles) + matmul"
        if getattr(platform, "device_type", "cpu") == "cpu" and cpu_kernels_enabled():
            return ("C++ K-quant x Q8_K integer dot products (activations=q8, the default), "
                    f"C++ fused GGML block matmul (float32); built on first use, else {torch_path}")
        return torch_path

    # ------------------------------------------------------------ preparation
    def create_weights(self, layer: nn.Module, prefix: str, input_size: int,
                       output_sizes: list[int], params_dtype: torch.dtype) -> None:
        names = _part_names(layer, prefix)
        types = [self.tensor_types.get(name) for name in names]
        layer.gguf_dtype = params_dtype  # type: ignore[attr-defined]
        if all(t is None for t in types):
            layer.gguf_segments = None  # type: ignore[attr-defined]
            self._dense.create_weights(layer, prefix, input_size, output_sizes, params_dtype)
            return
        if any(t is None for t in types):
            missing = [n for n, t in zip(names, types, strict=True) if t is None]
            raise ValueError(
                f"{prefix}: the GGUF file lists types for some parts but not {missing}")
        segments: list[Segment] = []
        offset = 0
        for size, qtype in zip(output_sizes, types, strict=True):
            if segments and segments[-1].qtype == qtype:
                last = segments[-1]
                segments[-1] = Segment(last.row_offset, last.num_rows + size, qtype)
            else:
                segments.append(Segment(offset, size, qtype))
            offset += size
        layer.gguf_segments = segments  # type: ignore[attr-defined]
        for qtype in {t for t in types if t not in FLOAT_TYPES}:
            check_row_shard_blocks(layer, block_geometry(qtype)[0], f"GGUF {qtype.name}")
        for i, seg in enumerate(segments):
            raw = empty_raw(seg.qtype, (seg.num_rows, input_size))
            layer.register_buffer(f"{RAW_PREFIX}_{i}", raw)
        # The checkpoint-name bookkeeping works on parameters: one empty
        # placeholder named ``weight`` whose loader writes into the segments.
        placeholder = nn.Parameter(torch.empty(0, dtype=torch.uint8), requires_grad=False)
        placeholder.weight_loader = partial(_load_raw, layer, prefix)  # type: ignore[attr-defined]
        layer.register_parameter("weight", placeholder)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        segments = getattr(layer, "gguf_segments", None)
        if segments is None:
            self._dense.process_weights_after_loading(layer)
            return
        if not self.dequantize_at_load:
            layer.gguf_packed = [self._pack(layer, f"{RAW_PREFIX}_{i}", seg.qtype)
                                 for i, seg in enumerate(segments)]
            layer.gguf_q8_parts = self._q8_parts(layer)
            return
        dense = torch.cat([_dense(_raw(layer, i), seg.qtype, layer.gguf_dtype)
                           for i, seg in enumerate(segments)], dim=0)
        for i in range(len(segments)):
            delattr(layer, f"{RAW_PREFIX}_{i}")
        layer.gguf_segments = None
        layer.weight = nn.Parameter(dense, requires_grad=False)
        self._dense.process_weights_after_loading(layer)

    def _pack(self, module: nn.Module, name: str, qtype: GGMLQuantizationType) -> bool:
        """Replace buffer ``name`` by its packed tiles where the ``q8`` kernel takes them."""
        raw = getattr(module, name)
        if (self.activations != "q8" or qtype not in q8k_kernels.PACKED_TYPES
                or raw.device.type != "cpu" or raw.shape[0] % q8k_kernels.TILE_ROWS
                or not q8k_kernels.packing_available()):
            return False
        setattr(module, name, q8k_kernels.pack_tiles(raw, qtype))
        return True

    def _q8_parts(self, layer: nn.Module) -> q8k_kernels.Q8Parts | None:
        """The one-call q8 form of a layer on CPU whose parts all take one activation
        rounding (Q8_K, Q8_0 or Q8_1: :func:`q8k_kernels.activation_rounding`), else None."""
        segments = layer.gguf_segments
        weights = [_raw(layer, i) for i in range(len(segments))]
        return self._q8_form(weights, [seg.qtype for seg in segments], layer.gguf_packed)

    def _q8_form(self, weights: list[torch.Tensor], qtypes: list[GGMLQuantizationType],
                 packed: list[bool]) -> q8k_kernels.Q8Parts | None:
        if (self.activations != "q8" or weights[0].device.type != "cpu"
                or q8k_kernels.kernel() is None):
            return None
        roundings = {q8k_kernels.activation_rounding(t) for t in qtypes}
        if len(roundings) != 1 or None in roundings:
            return None
        return q8k_kernels.Q8Parts(list(weights), [int(t) for t in qtypes], list(packed))

    def process_model_after_loading(self, model: nn.Module) -> None:
        """Swap the dense token embedding / LM head for raw GGML blocks from the file.

        Not under tensor parallelism: there the dense vocabulary-parallel embedding and
        LM head keep only this rank's vocabulary range (dequantized at load)."""
        from inference_engine.distributed.parallel_state import parallel_state

        if self.dequantize_at_load or not self.gguf_file or parallel_state().tp.size > 1:
            return
        from inference_engine_gguf.format import EMBEDDING_TENSORS
        from inference_engine_gguf.gguf_file import GGUFFile

        ggml_names = {hf: ggml for ggml, hf in EMBEDDING_TENSORS.items()}
        swap = {hf: qtype for hf, qtype in self.embedding_types.items()
                if qtype != T.F32 or (hf == "lm_head.weight" and self.accumulate == "float64")}
        if not swap:
            return
        file = GGUFFile(self.gguf_file)
        raws: dict[str, torch.Tensor] = {}
        embed_name = "model.embed_tokens.weight"
        modules = dict(model.named_modules())
        embed = modules.get("model.embed_tokens")
        head = modules.get("lm_head")
        if embed_name in swap and embed is not None:
            device = embed.weight.device
            raws[embed_name] = file.raw(ggml_names[embed_name]).to(device)
            new_embed = GGMLEmbedding(raws[embed_name], swap[embed_name], embed.weight.dtype)
            _replace(model, "model.embed_tokens", new_embed)
            if head is not None and getattr(head, "is_tied", False):
                _replace(model, "lm_head", GGMLLMHead(raws[embed_name], swap[embed_name],
                                                      embed.weight.dtype, is_tied=True,
                                                      activations=self.activations,
                                                      accumulate=self.accumulate))
        if "lm_head.weight" in swap and head is not None and not getattr(head, "is_tied", False):
            raw = file.raw(ggml_names["lm_head.weight"]).to(head.weight.device)
            new_head = GGMLLMHead(raw, swap["lm_head.weight"], head.weight.dtype,
                                  activations=self.activations, accumulate=self.accumulate)
            new_head.packed = self._pack(new_head, RAW_PREFIX, new_head.qtype)
            new_head.q8_parts = self._q8_form([new_head.gguf_raw], [new_head.qtype],
                                              [new_head.packed])
            _replace(model, "lm_head", new_head)

    def fused_moe_method(self, prefix: str) -> Any | None:
        """Raw GGML experts for MoE layers the file stores that way, else dense (None)."""
        parts = self.expert_types.get(prefix)
        if parts is None:
            return None
        return GGMLFusedMoEMethod(parts["gate"], parts["down"], self.dequantize_at_load,
                                  activations=self.activations)

    # ---------------------------------------------------------------- runtime
    def cpu_linear_entry(self, layer: nn.Module) -> CpuLinearEntry | None:
        """The q8 product of a layer whose parts share one activation rounding (what
        :meth:`apply` runs in one kernel call), for the core's CPU decode step."""
        parts = getattr(layer, "gguf_q8_parts", None)
        ext = q8k_kernels.kernel() if parts is not None else None
        if ext is None:
            return None
        owner = ext.Q8Linear(parts.weights, parts.qtypes, parts.packed, layer.input_size,
                             layer.output_size)
        return CpuLinearEntry(ext.q8_parts_linear_address(), owner.context(), owner)

    def apply(self, layer: nn.Module, x: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
        segments = layer.gguf_segments
        if segments is None:
            return F.linear(x, layer.weight, bias)
        q8_parts = getattr(layer, "gguf_q8_parts", None)
        if q8_parts is not None:  # every part of one activation rounding, q8 on CPU: one call
            xf = x.float()
            y = xf.new_empty(xf.shape[0], layer.output_size)
            q8k_kernels.q8k_parts_linear(xf, q8_parts, y)
            y = y.to(x.dtype)
        else:
            packed = getattr(layer, "gguf_packed", None) or [False] * len(segments)
            if len(segments) == 1 and not packed[0]:
                y = tiled_linear(x, _raw(layer, 0), segments[0].qtype,
                                 activations=self.activations, accumulate=self.accumulate)
            else:
                y = x.new_empty(x.shape[0], layer.output_size)
                for i, seg in enumerate(segments):
                    cols = y[:, seg.row_offset : seg.row_offset + seg.num_rows]
                    self._segment_into(layer, i, packed[i], x, cols)
        if bias is not None:
            y = y + bias
        return y

    def _segment_into(self, layer: nn.Module, i: int, packed: bool, x: torch.Tensor,
                      cols: torch.Tensor) -> None:
        """``cols = x @ W_i.T`` for segment ``i`` of a layer whose parts take different paths."""
        seg = layer.gguf_segments[i]
        if not packed:
            cols.copy_(tiled_linear(x, _raw(layer, i), seg.qtype, activations=self.activations,
                                    accumulate=self.accumulate))
            return
        # Packed tiles exist only where the q8 kernel was built (GGUFMethod._pack).
        out = cols if cols.dtype == torch.float32 else cols.new_empty(cols.shape,
                                                                     dtype=torch.float32)
        part = q8k_kernels.Q8Parts([_raw(layer, i)], [int(seg.qtype)], [True])
        q8k_kernels.q8k_parts_linear(x.float(), part, out)
        if out is not cols:
            cols.copy_(out)

    def weight_memory_bytes(self, layer: nn.Module) -> int:
        """Bytes of the stored blocks (or dense weight) plus the bias."""
        tensors = list(layer.parameters(recurse=False))
        tensors += [b for n, b in layer.named_buffers(recurse=False) if n.startswith(RAW_PREFIX)]
        return sum(t.numel() * t.element_size() for t in tensors)


def _raw(layer: nn.Module, i: int) -> torch.Tensor:
    return getattr(layer, f"{RAW_PREFIX}_{i}")


def raw_rows(layer: nn.Module, i: int) -> torch.Tensor:
    """Segment ``i``'s raw GGML rows, unpacking its tiles if they were packed."""
    raw = _raw(layer, i)
    packed = getattr(layer, "gguf_packed", None)
    if packed is not None and packed[i]:
        return q8k_kernels.unpack_tiles(raw, layer.gguf_segments[i].qtype)
    return raw


def _part_names(layer: nn.Module, prefix: str) -> list[str]:
    """Checkpoint weight names of each part of ``layer`` (one name when unfused)."""
    shard_ids = getattr(layer, "shard_ids", [0])
    if len(shard_ids) <= 1:
        return [f"{prefix}.weight"]
    parent, _, fused = prefix.rpartition(".")
    by_part = {sid: ckpt for ckpt, (mod, sid) in STACKED_PARAMS.items() if mod == fused}
    return [f"{parent}.{by_part[sid]}.weight" for sid in shard_ids]


def _load_raw(layer: nn.Module, prefix: str, param: torch.Tensor, loaded: torch.Tensor,
              shard_id: int | str | None = None) -> None:
    """Copy one checkpoint tensor (stored form) into the rows of its segment."""
    if shard_id is None:
        offset, size = 0, layer.output_size
        where = f"{prefix}.weight"
    else:
        offset, size = layer.shard_rows(shard_id)
        where = f"{prefix}.weight (part {shard_id!r})"
    for i, seg in enumerate(layer.gguf_segments):
        if seg.row_offset <= offset < seg.row_offset + seg.num_rows:
            if getattr(layer, "tp_size", 1) > 1:
                loaded = _tp_slice(layer, loaded, shard_id, seg.qtype)
            target = _raw(layer, i).narrow(0, offset - seg.row_offset, size)
            if target.shape != loaded.shape or target.dtype != loaded.dtype:
                raise ValueError(
                    f"{where}: the GGUF tensor has shape {tuple(loaded.shape)} ({loaded.dtype}), "
                    f"the {seg.qtype.name} layer expects {tuple(target.shape)} ({target.dtype})"
                )
            target.copy_(loaded)
            return
    raise ValueError(f"{where}: rows {offset}:{offset + size} lie in no segment")


def _tp_slice(layer: nn.Module, loaded: torch.Tensor, shard_id: int | str | None,
              qtype: GGMLQuantizationType) -> torch.Tensor:
    """This rank's part of a full GGML tensor: output rows whole (column-parallel), or the
    whole blocks of its input columns (row-parallel; checked to fall on block boundaries
    when the layer was built)."""
    if getattr(layer, "full_input_size", None) is not None and qtype not in FLOAT_TYPES:
        return split_blocks_along_k(layer, loaded, block_geometry(qtype)[1])
    return layer.tp_shard(loaded, shard_id)


class GGMLEmbedding(nn.Module):
    """Token embedding over raw GGML rows: gathers rows, then dequantizes only those."""

    def __init__(self, raw: torch.Tensor, qtype: GGMLQuantizationType, dtype: torch.dtype) -> None:
        super().__init__()
        self.qtype = qtype
        self.dtype = dtype
        self.vocab_size = raw.shape[0]
        self.register_buffer(RAW_PREFIX, raw)

    @property
    def weight(self) -> torch.Tensor:
        """The whole table dequantized (slow; for callers that need the dense matrix)."""
        return _dense(self.gguf_raw, self.qtype, self.dtype)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``input_ids [T]`` -> ``[T, hidden]``."""
        raw = self.gguf_raw
        if (self.qtype in cpu_kernels.KERNEL_TYPES and raw.device.type == "cpu"
                and input_ids.dim() == 1 and cpu_kernels.kernel() is not None):
            return cpu_kernels.dequantize_rows(raw, input_ids, self.qtype).to(self.dtype)
        return _dense(raw.index_select(0, input_ids), self.qtype, self.dtype)

    def extra_repr(self) -> str:
        return f"vocab={self.vocab_size}, type={self.qtype.name}"


class GGMLLMHead(nn.Module):
    """LM head over raw GGML rows (shared with the embedding when tied)."""

    def __init__(self, raw: torch.Tensor, qtype: GGMLQuantizationType, dtype: torch.dtype,
                 is_tied: bool = False, activations: str = "float",
                 accumulate: str = "default") -> None:
        super().__init__()
        self.qtype = qtype
        self.dtype = dtype
        self.is_tied = is_tied
        self.activations = activations
        self.accumulate = accumulate
        # Set by GGUFMethod: the buffer holds q8k_kernels.pack_tiles tiles, not raw rows;
        # and the one-call q8 form of the head, where it applies.
        self.packed = False
        self.q8_parts: q8k_kernels.Q8Parts | None = None
        self.vocab_size = raw.shape[0]
        self.register_buffer(RAW_PREFIX, raw)

    @property
    def weight(self) -> torch.Tensor:
        """The whole matrix dequantized (slow; for callers that need the dense matrix)."""
        raw = q8k_kernels.unpack_tiles(self.gguf_raw, self.qtype) if self.packed else self.gguf_raw
        return _dense(raw, self.qtype, self.dtype)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden [n, hidden]`` -> float32 logits ``[n, vocab]``."""
        if self.q8_parts is not None:  # q8 on CPU (always so when the rows are packed)
            logits = hidden.new_empty(hidden.shape[0], self.vocab_size, dtype=torch.float32)
            q8k_kernels.q8k_parts_linear(hidden.float(), self.q8_parts, logits)
            return logits
        return tiled_linear(hidden, self.gguf_raw, self.qtype, activations=self.activations,
                            accumulate=self.accumulate).float()

    def cpu_linear_entry(self, input_size: int) -> CpuLinearEntry | None:
        """The q8 head as a plain C product (the kernel :meth:`forward` runs on the same
        parts), for the core's multi-step greedy window (``layers/cpu_greedy_window.py``);
        None unless the head runs in the one-call q8 form."""
        ext = q8k_kernels.kernel() if self.q8_parts is not None else None
        if ext is None:
            return None
        parts = self.q8_parts
        owner = ext.Q8Linear(parts.weights, parts.qtypes, parts.packed, input_size,
                             self.vocab_size)
        return CpuLinearEntry(ext.q8_parts_linear_address(), owner.context(), owner)

    def extra_repr(self) -> str:
        return (f"vocab={self.vocab_size}, type={self.qtype.name}, tied={self.is_tied}, "
                f"activations={self.activations}, packed={self.packed}")


def _replace(model: nn.Module, dotted: str, module: nn.Module) -> None:
    parent_name, _, child = dotted.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, module)


def model_weight_bytes(model: nn.Module) -> int:
    """Bytes of every weight the model holds: parameters plus raw GGML buffers, each once."""
    tensors = [p for _, p in model.named_parameters()]
    tensors += [b for n, b in model.named_buffers() if n.rsplit(".", 1)[-1].startswith(RAW_PREFIX)]
    seen: set[int] = set()
    total = 0
    for t in tensors:
        if t.numel() == 0 or t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        total += t.numel() * t.element_size()
    return total
