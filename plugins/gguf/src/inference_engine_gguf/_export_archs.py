"""What llama.cpp's converter writes per architecture: metadata keys and tensor layouts.

Used by :func:`inference_engine_gguf.export.export_to_gguf`. Each
:class:`ArchLayout` says, as ``convert_hf_to_gguf.py`` does for that model
class, which hyper-parameters the file gets on top of the common ones
(``TextModel.set_gguf_parameters``) and which transformers tensors are split,
transposed or renamed on the way (:class:`Split`). Every other tensor takes
the name ``gguf.get_tensor_name_map`` gives it.

The transformers names here are the in-memory (v5) ones: stacked experts
``experts.gate_up_proj [E, 2I, K]`` (gate rows, then up rows) and
``experts.down_proj [E, K, I]``; gpt-oss keeps its own ``[E, K, 2I]`` with
gate/up columns interleaved.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import gguf
import numpy as np
from gguf import GGUFWriter
from gguf.constants import ExpertGatingFuncType

__all__ = ["ARCH_LAYOUTS", "DEEPSEEK2_BEFORE_KV_B_SPLIT", "ArchLayout", "Split",
           "hparams_of", "write_hparams"]

# The config as a dict (``config.to_dict()``), possibly adjusted by ``ArchLayout.prepare``.
Hparams = dict[str, Any]


@dataclass(frozen=True, slots=True)
class Split:
    """One transformers tensor written as one or more GGML tensors, and read back."""

    # GGML names under ``blk.N.`` (leaf included), one per part.
    parts: tuple[str, ...]
    # The transformers tensor -> the parts, in order.
    split: Callable[[np.ndarray, Hparams], list[np.ndarray]]
    # The parts (as stored, dequantized) -> the transformers tensor.
    join: Callable[[list[np.ndarray], Hparams], np.ndarray]


def _rename(ggml_name: str) -> Split:
    return Split((ggml_name,), lambda x, hp: [x], lambda parts, hp: parts[0])


def _gate_up_halves(x: np.ndarray, hp: Hparams) -> list[np.ndarray]:
    half = x.shape[1] // 2  # [E, 2I, K]: gate rows, then up rows
    return [x[:, :half], x[:, half:]]


def _concat_rows(parts: list[np.ndarray], hp: Hparams) -> np.ndarray:
    return np.concatenate(parts, axis=1)


def _deinterleave(x: np.ndarray, hp: Hparams) -> list[np.ndarray]:
    """gpt-oss ``[..., 2I]`` with gate/up alternating -> gate ``[..., I]``, up ``[..., I]``."""
    return [x[..., 0::2], x[..., 1::2]]


def _interleave(parts: list[np.ndarray], hp: Hparams) -> np.ndarray:
    gate, up = parts
    return np.stack((gate, up), axis=-1).reshape(*gate.shape[:-1], -1)


def _transpose(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(np.swapaxes(x, -1, -2))


def _split_kv_b(x: np.ndarray, hp: Hparams) -> list[np.ndarray]:
    """``kv_b_proj [H * (nope + v), rank]`` -> ``k_b [H, rank, nope]`` (transposed, for
    llama.cpp's absorbed MLA) and ``v_b [H, v, rank]``."""
    kv = x.reshape(hp["num_attention_heads"], -1, x.shape[-1])
    nope = hp["qk_nope_head_dim"]
    return [_transpose(kv[:, :nope]), np.ascontiguousarray(kv[:, nope:])]


def _join_kv_b(parts: list[np.ndarray], hp: Hparams) -> np.ndarray:
    k_b, v_b = parts
    return np.concatenate((np.swapaxes(k_b, 1, 2), v_b), axis=1).reshape(-1, v_b.shape[-1])


STACKED_EXPERTS: tuple[tuple[str, Split], ...] = (
    (r"experts\.gate_up_proj", Split(("ffn_gate_exps.weight", "ffn_up_exps.weight"),
                                     _gate_up_halves, _concat_rows)),
    (r"experts\.down_proj", _rename("ffn_down_exps.weight")),
)
_GPT_OSS: tuple[tuple[str, Split], ...] = (
    (r"mlp\.experts\.gate_up_proj", Split(
        ("ffn_gate_exps.weight", "ffn_up_exps.weight"),
        lambda x, hp: [_transpose(p) for p in _deinterleave(x, hp)],  # [E, I, K] each
        lambda parts, hp: _interleave([_transpose(p) for p in parts], hp))),
    (r"mlp\.experts\.gate_up_proj_bias", Split(("ffn_gate_exps.bias", "ffn_up_exps.bias"),
                                               _deinterleave, _interleave)),
    (r"mlp\.experts\.down_proj", Split(("ffn_down_exps.weight",),
                                       lambda x, hp: [_transpose(x)],
                                       lambda parts, hp: _transpose(parts[0]))),
    (r"mlp\.experts\.down_proj_bias", _rename("ffn_down_exps.bias")),
    (r"self_attn\.sinks", _rename("attn_sinks.weight")),
)
_CORRECTION_BIAS = (r"(mlp|mlp\.gate)\.e_score_correction_bias", _rename("exp_probs_b.bias"))


# ------------------------------------------------------------------ hyper-parameters


def hparams_of(cfg: Any) -> Hparams:
    """The config as ``convert_hf_to_gguf`` sees ``config.json``, rope settings merged."""
    hp = cfg.to_dict()
    rope = dict(hp.get("rope_parameters") or {})
    rope.update(hp.get("rope_scaling") or {})
    hp["rope_parameters"] = rope
    hp.setdefault("rope_theta", rope.get("rope_theta", 10000.0))
    return hp


def _head_dim(hp: Hparams) -> int:
    return hp.get("head_dim") or hp["hidden_size"] // hp["num_attention_heads"]


def _write_common(w: GGUFWriter, hp: Hparams) -> None:
    """``TextModel.set_gguf_parameters``: the keys every architecture gets."""
    w.add_block_count(hp.get("block_count", hp["num_hidden_layers"]))
    w.add_context_length(hp["max_position_embeddings"])
    w.add_embedding_length(hp["hidden_size"])
    if hp.get("intermediate_size") is not None:
        w.add_feed_forward_length(hp["intermediate_size"])
    w.add_head_count(hp["num_attention_heads"])
    w.add_head_count_kv(hp["num_key_value_heads"])
    rope = hp["rope_parameters"]
    kind = rope.get("rope_type")
    if kind == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["factor"])
    elif kind == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        for key, add in (("attention_factor", w.add_rope_scaling_yarn_attn_factor),
                         ("beta_fast", w.add_rope_scaling_yarn_beta_fast),
                         ("beta_slow", w.add_rope_scaling_yarn_beta_slow)):
            if rope.get(key) is not None:
                add(rope[key])
    w.add_rope_freq_base(float(hp["rope_theta"]))
    w.add_layer_norm_rms_eps(hp["rms_norm_eps"])
    experts = hp.get("num_local_experts", hp.get("num_experts"))
    if experts is not None:
        w.add_expert_count(experts)
    if hp.get("num_experts_per_tok") is not None:
        w.add_expert_used_count(hp["num_experts_per_tok"])
    if hp.get("n_group") is not None:
        w.add_expert_group_count(hp["n_group"])
    if hp.get("topk_group") is not None:
        w.add_expert_group_used_count(hp["topk_group"])
    gating = {"sigmoid": ExpertGatingFuncType.SIGMOID,
              "softmax": ExpertGatingFuncType.SOFTMAX}.get(hp.get("scoring_func") or "")
    if gating is not None:
        w.add_expert_gating_func(gating)
    if hp.get("head_dim") is not None:
        w.add_key_length(hp["head_dim"])
        w.add_value_length(hp["head_dim"])


def _rope_dims(hp: Hparams, fraction: float = 1.0) -> int:
    return int(_head_dim(hp) * fraction)


def _llama(w: GGUFWriter, hp: Hparams) -> None:
    w.add_rope_dimension_count(_rope_dims(hp))


def _qwen3moe(w: GGUFWriter, hp: Hparams) -> None:
    _llama(w, hp)
    w.add_expert_feed_forward_length(hp["moe_intermediate_size"])
    w.add_expert_weights_norm(bool(hp["norm_topk_prob"]))


def _granite_prepare(hp: Hparams) -> None:
    hp.pop("head_dim", None)  # GraniteModel ignores head_dim: no key_length in the file


def _granitemoe(w: GGUFWriter, hp: Hparams) -> None:
    """GraniteModel's four multipliers, written only when set (non-zero)."""
    _llama(w, hp)
    for key, add in (("attention_multiplier", w.add_attention_scale),
                     ("embedding_multiplier", w.add_embedding_scale),
                     ("residual_multiplier", w.add_residual_scale),
                     ("logits_scaling", w.add_logit_scale)):
        if hp.get(key):
            add(hp[key])
    if hp.get("shared_intermediate_size"):
        w.add_expert_shared_feed_forward_length(hp["shared_intermediate_size"])


def _deepseek2_prepare(hp: Hparams) -> None:
    # Released V2 configs say ``"scoring_func": "softmax"`` (transformers drops it).
    hp.setdefault("scoring_func", "softmax")
    hp["num_key_value_heads"] = 1  # MLA written as MQA over the latent
    hp.pop("head_dim", None)  # key/value_length are the latent sizes, written below


def _deepseek2(w: GGUFWriter, hp: Hparams) -> None:
    """DeepseekV2Model: MLA as MQA (latent key/value lengths, per-head ``*_mla`` ones)."""
    rank, rope = hp["kv_lora_rank"], hp["qk_rope_head_dim"]
    w.add_key_length(rank + rope)
    w.add_value_length(rank)
    w.add_key_length_mla(hp["qk_nope_head_dim"] + rope)
    w.add_value_length_mla(hp["v_head_dim"])
    _deepseek2_common(w, hp)


def _deepseek3_prepare(hp: Hparams) -> None:
    # DeepSeek-V3 routes with sigmoid scores and a correction bias (noaux_tc).
    hp["scoring_func"] = "sigmoid"
    _deepseek2_prepare(hp)


def _deepseek2_before_split_prepare(hp: Hparams) -> None:
    hp.setdefault("scoring_func", "softmax")
    hp.pop("head_dim", None)


def _deepseek2_before_split(w: GGUFWriter, hp: Hparams) -> None:
    """The converter before the k_b/v_b split (early 2025): per-head key/value lengths."""
    w.add_key_length(hp["qk_nope_head_dim"] + hp["qk_rope_head_dim"])
    w.add_value_length(hp["v_head_dim"])
    _deepseek2_common(w, hp)


def _deepseek2_common(w: GGUFWriter, hp: Hparams) -> None:
    w.add_leading_dense_block_count(hp.get("first_k_dense_replace") or 0)
    w.add_vocab_size(hp["vocab_size"])
    if hp.get("q_lora_rank") is not None:
        w.add_q_lora_rank(hp["q_lora_rank"])
    w.add_kv_lora_rank(hp["kv_lora_rank"])
    w.add_expert_feed_forward_length(hp["moe_intermediate_size"])
    w.add_expert_count(hp["n_routed_experts"])
    w.add_expert_shared_count(hp.get("n_shared_experts") or 0)
    if hp.get("routed_scaling_factor") is not None:
        w.add_expert_weights_scale(hp["routed_scaling_factor"])
    if hp.get("norm_topk_prob"):  # written only when true
        w.add_expert_weights_norm(True)
    w.add_rope_dimension_count(hp["qk_rope_head_dim"])
    if hp["rope_parameters"].get("mscale_all_dim") is not None:
        w.add_rope_scaling_yarn_log_mul(0.1 * hp["rope_parameters"]["mscale_all_dim"])


def _glm4moe_prepare(hp: Hparams) -> None:
    # The next-token-prediction layers are blocks too (after the model's own).
    hp["block_count"] = hp["num_hidden_layers"] + (hp.get("num_nextn_predict_layers") or 0)


def _glm4moe(w: GGUFWriter, hp: Hparams) -> None:
    w.add_rope_dimension_count(
        _rope_dims(hp, hp["rope_parameters"].get("partial_rotary_factor", 0.5)))
    w.add_expert_count(hp["n_routed_experts"])
    w.add_expert_feed_forward_length(hp["moe_intermediate_size"])
    w.add_expert_shared_count(hp["n_shared_experts"])
    w.add_leading_dense_block_count(hp["first_k_dense_replace"])
    w.add_expert_gating_func(ExpertGatingFuncType.SIGMOID)
    w.add_expert_weights_scale(hp["routed_scaling_factor"])
    w.add_expert_weights_norm(bool(hp["norm_topk_prob"]))
    w.add_nextn_predict_layers(hp.get("num_nextn_predict_layers") or 0)


def _minimax_m2_prepare(hp: Hparams) -> None:
    # Released configs say ``"scoring_func": "sigmoid"`` (transformers drops it).
    hp.setdefault("scoring_func", "sigmoid")


def _minimax_m2(w: GGUFWriter, hp: Hparams) -> None:
    w.add_expert_feed_forward_length(hp["intermediate_size"])
    # ``rotary_dim`` of released configs; transformers keeps it as a rotary fraction.
    w.add_rope_dimension_count(
        _rope_dims(hp, hp["rope_parameters"].get("partial_rotary_factor", 1.0)))


def _gpt_oss(w: GGUFWriter, hp: Hparams) -> None:
    w.add_sliding_window(hp["sliding_window"])
    w.add_expert_feed_forward_length(hp["intermediate_size"])


# ------------------------------------------------------------------------ layouts


@dataclass(frozen=True, slots=True)
class ArchLayout:
    """How one transformers ``model_type`` is written."""

    arch: gguf.MODEL_ARCH
    # Arch-specific keys after the common ones.
    write: Callable[[GGUFWriter, Hparams], None]
    # Adjusts the hyper-parameters before anything is written (as the converter does).
    prepare: Callable[[Hparams], None] | None = None
    # q/k rows permuted for GGML's interleaved rope (LlamaModel.permute).
    permutes_qk: bool = False
    # (regex on the name under ``model.layers.N.``, how it is written).
    splits: tuple[tuple[str, Split], ...] = ()

    def split_for(self, layer_name: str) -> Split | None:
        """The :class:`Split` of a tensor named ``layer_name`` under ``model.layers.N.``."""
        return next((s for pattern, s in self.splits if re.fullmatch(pattern, layer_name)), None)


ARCH_LAYOUTS: dict[str, ArchLayout] = {
    "llama": ArchLayout(gguf.MODEL_ARCH.LLAMA, _llama, permutes_qk=True),
    "qwen2": ArchLayout(gguf.MODEL_ARCH.QWEN2, _llama),
    "qwen3": ArchLayout(gguf.MODEL_ARCH.QWEN3, _llama),
    "qwen3_moe": ArchLayout(gguf.MODEL_ARCH.QWEN3MOE, _qwen3moe,
                            splits=tuple((rf"mlp\.{p}", s) for p, s in STACKED_EXPERTS)),
    "granitemoe": ArchLayout(
        gguf.MODEL_ARCH.GRANITE_MOE, _granitemoe, _granite_prepare, permutes_qk=True,
        splits=(*((rf"block_sparse_moe\.{p}", s) for p, s in STACKED_EXPERTS),
                (r"block_sparse_moe\.router\.weight", _rename("ffn_gate_inp.weight")))),
    "deepseek_v2": ArchLayout(
        gguf.MODEL_ARCH.DEEPSEEK2, _deepseek2, _deepseek2_prepare,
        splits=(*((rf"mlp\.{p}", s) for p, s in STACKED_EXPERTS),
                (r"self_attn\.kv_b_proj\.weight",
                 Split(("attn_k_b.weight", "attn_v_b.weight"), _split_kv_b, _join_kv_b)),
                _CORRECTION_BIAS)),
    # llama.cpp writes DeepSeek-V3 with the deepseek2 architecture and layout.
    "deepseek_v3": ArchLayout(
        gguf.MODEL_ARCH.DEEPSEEK2, _deepseek2, _deepseek3_prepare,
        splits=(*((rf"mlp\.{p}", s) for p, s in STACKED_EXPERTS),
                (r"self_attn\.kv_b_proj\.weight",
                 Split(("attn_k_b.weight", "attn_v_b.weight"), _split_kv_b, _join_kv_b)),
                _CORRECTION_BIAS)),
    "glm4_moe": ArchLayout(
        gguf.MODEL_ARCH.GLM4_MOE, _glm4moe, _glm4moe_prepare,
        splits=(*((rf"mlp\.{p}", s) for p, s in STACKED_EXPERTS), _CORRECTION_BIAS)),
    "minimax_m2": ArchLayout(
        gguf.MODEL_ARCH.MINIMAXM2, _minimax_m2, _minimax_m2_prepare,
        splits=(*((rf"mlp\.{p}", s) for p, s in STACKED_EXPERTS), _CORRECTION_BIAS)),
    "gpt_oss": ArchLayout(gguf.MODEL_ARCH.GPT_OSS, _gpt_oss, splits=_GPT_OSS),
}


# Older DeepSeek-V2 files (before llama.cpp split kv_b for absorbed MLA): ``attn_kv_b``
# whole, ``key_length``/``value_length`` per head, ``head_count_kv`` = heads.
DEEPSEEK2_BEFORE_KV_B_SPLIT = ArchLayout(
    gguf.MODEL_ARCH.DEEPSEEK2, _deepseek2_before_split, _deepseek2_before_split_prepare,
    splits=(*((rf"mlp\.{p}", s) for p, s in STACKED_EXPERTS), _CORRECTION_BIAS))


def write_hparams(w: GGUFWriter, layout: ArchLayout, hp: Hparams) -> None:
    """The common keys, then the architecture's own."""
    _write_common(w, hp)
    layout.write(w, hp)
