"""Building blocks model plugins assemble: linear layers, norms, rotary, attention, MLP.

Model plugins import shared layers from here only. A Llama-family model is a
subclass of :class:`DecoderForCausalLM` overriding its named methods
(``make_attention``, ``make_mlp``, ``embed``, ``compute_logits``...; attention
variants subclass :class:`DecoderAttention` or :class:`QKNormAttention`); other
architectures compose the pieces (fused linears, :class:`Attention`,
:class:`RotaryEmbedding`, :func:`load_checkpoint_weights`).
"""

from inference_engine.layers.attention import Attention
from inference_engine.layers.decoder import (
    DecoderAttention,
    DecoderForCausalLM,
    DecoderLayer,
    DecoderModel,
    DecoderOptions,
    NormRotateQK,
    QKNormAttention,
    head_dim_of,
)
from inference_engine.layers.embedding import LMHead, VocabEmbedding
from inference_engine.layers.linear import (
    LinearBase,
    MergedColumnLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowLinear,
    ShardId,
    copy_into_rows,
)
from inference_engine.layers.mlp import GatedMLP
from inference_engine.layers.norm import RMSNorm, rms_normalize
from inference_engine.layers.rotary import (
    RotaryEmbedding,
    RotaryTable,
    inv_frequencies,
    rope_parameters,
)
from inference_engine.layers.weights import (
    STACKED_PARAMS,
    checkpoint_names,
    load_checkpoint_weights,
)

__all__ = [
    "STACKED_PARAMS",
    "Attention",
    "DecoderAttention",
    "DecoderForCausalLM",
    "DecoderLayer",
    "DecoderModel",
    "DecoderOptions",
    "GatedMLP",
    "LMHead",
    "LinearBase",
    "MergedColumnLinear",
    "NormRotateQK",
    "QKNormAttention",
    "QKVParallelLinear",
    "RMSNorm",
    "ReplicatedLinear",
    "RotaryEmbedding",
    "RotaryTable",
    "RowLinear",
    "ShardId",
    "VocabEmbedding",
    "checkpoint_names",
    "copy_into_rows",
    "head_dim_of",
    "inv_frequencies",
    "load_checkpoint_weights",
    "rms_normalize",
    "rope_parameters",
]
