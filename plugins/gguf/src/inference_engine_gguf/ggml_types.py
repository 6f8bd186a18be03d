"""The GGML tensor types this plugin can hold and dequantize, and their block geometry.

A GGML tensor is stored row by row; each row (``ne0`` = K elements) is a run of
fixed-size blocks of ``block_size`` values packed into ``type_size`` bytes.
"""

from __future__ import annotations

from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

__all__ = [
    "FLOAT_TYPES",
    "SUPPORTED_TYPES",
    "UnsupportedGGMLTypeError",
    "block_geometry",
    "check_supported",
    "row_bytes",
]

T = GGMLQuantizationType

# Plain float types: held as torch float tensors of their own dtype.
FLOAT_TYPES: frozenset[GGMLQuantizationType] = frozenset({T.F32, T.F16, T.BF16})

# Every type :mod:`inference_engine_gguf.dequant` handles, in the order docs list them.
SUPPORTED_TYPES: tuple[GGMLQuantizationType, ...] = (
    T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1,
    T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.IQ4_NL, T.IQ4_XS,
    *((T.MXFP4,) if hasattr(T, "MXFP4") else ()),
)


class UnsupportedGGMLTypeError(ValueError):
    """A tensor uses a GGML type this plugin cannot dequantize."""


def check_supported(qtype: int | GGMLQuantizationType,
                    tensor_name: str = "") -> GGMLQuantizationType:
    """The type as an enum member, or an error naming it and the supported ones.

    Raises:
        UnsupportedGGMLTypeError: for types outside :data:`SUPPORTED_TYPES`.
    """
    try:
        member = T(int(qtype))
    except ValueError:
        member = None
    if member not in SUPPORTED_TYPES:
        name = member.name if member is not None else f"<unknown GGML type id {int(qtype)}>"
        where = f" (tensor {tensor_name!r})" if tensor_name else ""
        supported = ", ".join(t.name for t in SUPPORTED_TYPES)
        raise UnsupportedGGMLTypeError(
            f"GGML quantization type {name}{where} is not supported by "
            f"inference-engine-gguf-plugin; supported types: {supported}"
        )
    return member


def block_geometry(qtype: GGMLQuantizationType) -> tuple[int, int]:
    """``(values per block, bytes per block)``."""
    return GGML_QUANT_SIZES[qtype]


def row_bytes(qtype: GGMLQuantizationType, num_values: int) -> int:
    """Bytes one row of ``num_values`` takes.

    Raises:
        ValueError: if the row is not a whole number of blocks.
    """
    block_size, type_size = block_geometry(qtype)
    if num_values % block_size:
        raise ValueError(
            f"a row of {num_values} values is not a multiple of {qtype.name}'s block "
            f"size {block_size}"
        )
    return num_values // block_size * type_size
