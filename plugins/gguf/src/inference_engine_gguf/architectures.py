"""From GGUF metadata to a Hugging Face config: one entry per ``general.architecture``.

llama.cpp names hyper-parameters ``{arch}.attention.head_count`` and writes
only what its own graph needs; the engine's models are built from a
transformers config. :data:`ARCHITECTURES` says which registered model each
GGUF architecture becomes and how its tensors are named there
(:mod:`inference_engine_gguf.tensor_names`); :func:`build_hf_config` reads the
common keys and then the architecture's own ones (experts, routing, MLA ranks,
Granite's multipliers, sliding windows), always from metadata, never from
the file name.

What llama.cpp's converter (``convert_hf_to_gguf.py``) changes on the way in,
and is undone here or in the weight format:

- ``llama`` and ``granitemoe``: q/k rows permuted from rotate-half to
  interleaved pairs (:func:`~inference_engine_gguf.tensor_names.unpermute_rows`).
- ``deepseek2`` (DeepSeek-V2, and V3/R1 with sigmoid gating and ``exp_probs_b``): MLA
  written as MQA: ``head_count_kv`` is 1 and
  ``key_length``/``value_length`` are the latent sizes (the per-head sizes are
  ``key_length_mla``/``value_length_mla``); ``kv_b_proj`` split into
  ``attn_k_b`` (transposed) and ``attn_v_b``.
- ``glm4moe``: ``block_count`` counts the next-token-prediction (MTP) layers too.
- ``gpt-oss``: no ``layer_types``; llama.cpp hard-codes sliding-window attention
  on even layers, and the SwiGLU clamp (alpha 1.702, limit 7.0).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gguf.constants import ExpertGatingFuncType

from inference_engine_gguf.gguf_file import GGUFFile, GGUFFileError

__all__ = [
    "ARCHITECTURES",
    "ArchitectureSpec",
    "UnknownArchitectureError",
    "architecture_spec",
    "build_hf_config",
]


class UnknownArchitectureError(ValueError):
    """``general.architecture`` names an architecture this plugin cannot map."""


class _Meta:
    """``{arch}.name`` metadata of one file, with defaults and required keys."""

    def __init__(self, gguf: GGUFFile) -> None:
        self.gguf = gguf
        self.arch = gguf.architecture

    def key(self, name: str, default: Any = None) -> Any:
        value = self.gguf.get(f"{self.arch}.{name}", default)
        return value[0] if isinstance(value, list) and name.endswith("_length") else value

    def need(self, name: str) -> Any:
        return self.gguf.require(f"{self.arch}.{name}")

    def has_tensor(self, name: str) -> bool:
        return name in self.gguf.tensors

    def unsupported(self, what: str) -> GGUFFileError:
        return GGUFFileError(f"{self.gguf.path}: {what} is not supported")


# Reads an architecture's own hyper-parameters into the config dict (already holding
# the common ones).
HParamReader = Callable[[_Meta, dict[str, Any]], None]


@dataclass(frozen=True, slots=True)
class ArchitectureSpec:
    """How one ``general.architecture`` maps onto a registered model."""

    # transformers model_type and architecture class name.
    model_type: str
    hf_architecture: str
    # Whether llama.cpp's converter permuted q/k rows (llama-style rope).
    permutes_qk: bool = False
    # The MLP's module name in the model's checkpoints ("mlp" or "block_sparse_moe").
    mlp_name: str = "mlp"
    # The MoE router projection's module name under the MLP ("gate"; gpt-oss "router").
    gate_name: str = "gate"
    # Per-expert checkpoint names of (gate, up, down): transformers' or Mixtral's w1/w3/w2.
    expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    # Where ``exp_probs_b`` (the routing correction bias) lives: "gate", "block" or None.
    correction_bias: str | None = None
    # The architecture's own hyper-parameters (experts, routing, ...).
    read_hparams: HParamReader | None = field(default=None, compare=False)


def _gating(meta: _Meta, default: ExpertGatingFuncType,
            allowed: ExpertGatingFuncType) -> None:
    """Refuse a gating function the registered model does not implement."""
    value = meta.key("expert_gating_func")
    gating = ExpertGatingFuncType(int(value)) if value is not None else default
    if gating != allowed:
        raise meta.unsupported(
            f"expert gating {gating.name.lower()} for {meta.arch} (the registered model "
            f"routes with {allowed.name.lower()})")


def _groups(meta: _Meta) -> tuple[int, int]:
    return int(meta.key("expert_group_count", 1) or 1), int(
        meta.key("expert_group_used_count", 1) or 1)


def _qwen3moe(meta: _Meta, config: dict[str, Any]) -> None:
    """Every layer sparse, as llama.cpp's qwen3moe graph builds it."""
    config.update(
        num_experts=int(meta.need("expert_count")),
        num_experts_per_tok=int(meta.need("expert_used_count")),
        moe_intermediate_size=int(meta.need("expert_feed_forward_length")),
        # llama.cpp's qwen3moe graph renormalises the top-k routing weights.
        norm_topk_prob=bool(meta.key("expert_weights_norm", True)),
        decoder_sparse_step=1, mlp_only_layers=[])


def _granitemoe(meta: _Meta, config: dict[str, Any]) -> None:
    """Experts as wide as ``feed_forward_length``; Granite's four multipliers."""
    if meta.key("expert_shared_feed_forward_length") is not None:
        raise meta.unsupported("a GraniteMoeShared model (shared experts)")
    # llama.cpp uses 1/sqrt(head_dim) when the file has no attention scale;
    # transformers' GraniteMoe always multiplies by attention_multiplier.
    head_dim = config["head_dim"]
    config.update(
        num_local_experts=int(meta.need("expert_count")),
        num_experts_per_tok=int(meta.need("expert_used_count")),
        embedding_multiplier=float(meta.key("embedding_scale", 1.0)),
        residual_multiplier=float(meta.key("residual_scale", 1.0)),
        attention_multiplier=float(meta.key("attention.scale", head_dim**-0.5)),
        logits_scaling=float(meta.key("logit_scale", 1.0)))


def _routed_experts(meta: _Meta) -> dict[str, Any]:
    """The DeepSeek-style MoE settings (DeepSeek-V2, GLM-4 MoE): experts, shared experts,
    leading dense layers, weight scale/normalisation and group-limited routing."""
    groups, groups_used = _groups(meta)
    return dict(
        n_routed_experts=int(meta.need("expert_count")),
        num_experts_per_tok=int(meta.need("expert_used_count")),
        moe_intermediate_size=int(meta.need("expert_feed_forward_length")),
        n_shared_experts=int(meta.key("expert_shared_count", 0)),
        first_k_dense_replace=int(meta.key("leading_dense_block_count", 0)),
        routed_scaling_factor=float(meta.key("expert_weights_scale", 1.0)),
        norm_topk_prob=bool(meta.key("expert_weights_norm", False)),
        n_group=groups, topk_group=groups_used,
    )


def _deepseek2(meta: _Meta, config: dict[str, Any]) -> None:
    """MLA sizes from the ``*_mla`` keys (or the older per-head ``key_length``).

    llama.cpp writes DeepSeek-V3 (and R1) as ``deepseek2`` too: sigmoid expert gating
    and a routing correction bias (``exp_probs_b``) tell it apart, and it becomes the
    registered ``DeepseekV3ForCausalLM`` (noaux_tc routing)."""
    gating = meta.key("expert_gating_func")
    v3 = (gating is not None and ExpertGatingFuncType(int(gating)) == ExpertGatingFuncType.SIGMOID
          ) or any(name.endswith(".exp_probs_b.bias") for name in meta.gguf.tensors)
    if v3:
        _gating(meta, ExpertGatingFuncType.SIGMOID, ExpertGatingFuncType.SIGMOID)
        config.update(model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"],
                      scoring_func="sigmoid")
    else:
        _gating(meta, ExpertGatingFuncType.SOFTMAX, ExpertGatingFuncType.SOFTMAX)
    heads = config["num_attention_heads"]
    rope = int(meta.need("rope.dimension_count"))
    key_mla = meta.key("attention.key_length_mla")
    if key_mla is not None:  # current converter: key_length is the latent + rope width
        nope, v_dim = int(key_mla) - rope, int(meta.need("attention.value_length_mla"))
    else:  # older files store kv_b whole and the per-head sizes in key/value_length
        nope, v_dim = int(meta.need("attention.key_length")) - rope, int(
            meta.need("attention.value_length"))
    q_lora = meta.key("attention.q_lora_rank")
    config.update(
        # MLA: transformers expects as many KV heads as heads (llama.cpp writes 1).
        num_key_value_heads=heads,
        kv_lora_rank=int(meta.need("attention.kv_lora_rank")),
        q_lora_rank=int(q_lora) if q_lora else None,
        qk_rope_head_dim=rope, qk_nope_head_dim=nope, v_head_dim=v_dim,
        qk_head_dim=nope + rope, head_dim=rope,
        **_routed_experts(meta),
        topk_method="noaux_tc" if v3 else (
            "group_limited_greedy" if _groups(meta)[0] > 1 else "greedy"),
        attention_bias=False)
    log_mul = meta.key("rope.scaling.yarn_log_multiplier")
    scaling = config.get("rope_scaling")
    if scaling is not None and scaling["rope_type"] == "yarn" and log_mul:
        # The converter writes 0.1 * mscale_all_dim; released V2 configs set mscale equal.
        scaling["mscale_all_dim"] = scaling["mscale"] = float(log_mul) / 0.1


def _glm4moe(meta: _Meta, config: dict[str, Any]) -> None:
    """Partial rotary from ``rope.dimension_count``; MTP layers are not part of the model."""
    _gating(meta, ExpertGatingFuncType.SIGMOID, ExpertGatingFuncType.SIGMOID)
    nextn = int(meta.key("nextn_predict_layers", 0))
    config.update(
        num_hidden_layers=config["num_hidden_layers"] - nextn,
        num_nextn_predict_layers=nextn,
        partial_rotary_factor=_rotary_fraction(meta, config),
        **_routed_experts(meta),
        use_qk_norm=meta.has_tensor("blk.0.attn_q_norm.weight"),
        attention_bias=meta.has_tensor("blk.0.attn_q.bias"))


def _minimax_m2(meta: _Meta, config: dict[str, Any]) -> None:
    """Every layer sparse; partial rotary from ``rope.dimension_count``."""
    _gating(meta, ExpertGatingFuncType.SIGMOID, ExpertGatingFuncType.SIGMOID)
    rotary = int(meta.key("rope.dimension_count", config["head_dim"]))
    config.update(
        num_local_experts=int(meta.need("expert_count")),
        num_experts_per_tok=int(meta.need("expert_used_count")),
        intermediate_size=int(meta.need("expert_feed_forward_length")),
        rotary_dim=rotary, partial_rotary_factor=rotary / config["head_dim"])


def _gpt_oss(meta: _Meta, config: dict[str, Any]) -> None:
    """Sliding window on even layers (llama.cpp's pattern 2); YaRN without truncation."""
    layers = config["num_hidden_layers"]
    pattern = meta.key("attention.sliding_window_pattern", 2)
    if isinstance(pattern, list):
        sliding = [bool(p) for p in pattern]
    else:
        pattern = int(pattern)
        sliding = [pattern == 0 or i % pattern < pattern - 1 for i in range(layers)]
    config.update(
        num_local_experts=int(meta.need("expert_count")),
        num_experts_per_tok=int(meta.need("expert_used_count")),
        intermediate_size=int(meta.need("expert_feed_forward_length")),
        sliding_window=int(meta.need("attention.sliding_window")),
        layer_types=["sliding_attention" if s else "full_attention" for s in sliding],
        attention_bias=meta.has_tensor("blk.0.attn_q.bias"),
        # Hard-coded in llama.cpp's gpt-oss graph too; the file has no keys for them.
        swiglu_alpha=1.702, swiglu_limit=7.0)
    scaling = config.get("rope_scaling")
    if scaling is None:
        # Said outright: transformers' GptOssConfig otherwise defaults to YaRN (factor 32).
        config["rope_scaling"] = {"rope_type": "default"}
    elif scaling["rope_type"] == "yarn":
        # gpt-oss's reference YaRN does not round the correction range (llama.cpp does).
        scaling["truncate"] = False


def _rotary_fraction(meta: _Meta, config: dict[str, Any]) -> float:
    return int(meta.key("rope.dimension_count", config["head_dim"])) / config["head_dim"]


ARCHITECTURES: dict[str, ArchitectureSpec] = {
    "llama": ArchitectureSpec("llama", "LlamaForCausalLM", permutes_qk=True),
    "qwen2": ArchitectureSpec("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ArchitectureSpec("qwen3", "Qwen3ForCausalLM"),
    "qwen3moe": ArchitectureSpec("qwen3_moe", "Qwen3MoeForCausalLM", read_hparams=_qwen3moe),
    "granitemoe": ArchitectureSpec("granitemoe", "GraniteMoeForCausalLM", permutes_qk=True,
                                   mlp_name="block_sparse_moe", read_hparams=_granitemoe),
    "deepseek2": ArchitectureSpec("deepseek_v2", "DeepseekV2ForCausalLM", correction_bias="gate",
                                  read_hparams=_deepseek2),
    "glm4moe": ArchitectureSpec("glm4_moe", "Glm4MoeForCausalLM", correction_bias="gate",
                                read_hparams=_glm4moe),
    "minimax-m2": ArchitectureSpec("minimax_m2", "MiniMaxM2ForCausalLM",
                                   mlp_name="block_sparse_moe", expert_names=("w1", "w3", "w2"),
                                   correction_bias="block", read_hparams=_minimax_m2),
    "gpt-oss": ArchitectureSpec("gpt_oss", "GptOssForCausalLM", gate_name="router",
                                read_hparams=_gpt_oss),
}


def architecture_spec(arch: str) -> ArchitectureSpec:
    """The mapping for ``general.architecture``.

    Raises:
        UnknownArchitectureError: listing the architectures that are mapped.
    """
    spec = ARCHITECTURES.get(arch)
    if spec is None:
        raise UnknownArchitectureError(
            f"GGUF architecture {arch!r} is not supported by inference-engine-gguf-plugin; "
            f"supported: {', '.join(sorted(ARCHITECTURES))}"
        )
    return spec


# --------------------------------------------------------------------------- config


def build_hf_config(gguf: GGUFFile) -> dict[str, Any]:
    """A transformers ``config.json`` dict for the file's model.

    Raises:
        UnknownArchitectureError: for an unmapped ``general.architecture``.
        GGUFFileError: for missing required hyper-parameters, unsupported rope
            scaling, or a variant of the architecture the registered model lacks.
    """
    meta = _Meta(gguf)
    spec = architecture_spec(meta.arch)
    hidden = int(meta.need("embedding_length"))
    heads = int(meta.need("attention.head_count"))
    kv_heads = meta.gguf.get(f"{meta.arch}.attention.head_count_kv", heads)
    if isinstance(kv_heads, list):  # per-layer list in some files
        if len(set(kv_heads)) != 1:
            raise GGUFFileError(
                f"{gguf.path}: per-layer KV head counts {kv_heads} are not supported")
        kv_heads = kv_heads[0]
    embed = gguf.tensors.get("token_embd.weight")
    if embed is None:
        raise GGUFFileError(f"{gguf.path} has no token_embd.weight tensor")
    config: dict[str, Any] = {
        "model_type": spec.model_type,
        "architectures": [spec.hf_architecture],
        "vocab_size": int(embed.shape[0]),
        "hidden_size": hidden,
        "num_hidden_layers": int(meta.need("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(kv_heads),
        "head_dim": int(meta.key("attention.key_length", hidden // heads)),
        "max_position_embeddings": int(meta.key("context_length", 2048)),
        "rms_norm_eps": float(meta.key("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(meta.key("rope.freq_base", 10000.0)),
        "tie_word_embeddings": "output.weight" not in gguf.tensors,
        "hidden_act": "silu",
        # GGML dequantizes into float32 math; so do we unless --dtype says otherwise.
        "torch_dtype": "float32",
    }
    ffn = meta.key("feed_forward_length")
    if ffn is not None:
        config["intermediate_size"] = int(ffn)
    if spec.model_type in ("llama", "qwen3"):
        config["attention_bias"] = "blk.0.attn_q.bias" in gguf.tensors
    rope_scaling = _rope_scaling(meta)
    if rope_scaling is not None:
        config["rope_scaling"] = rope_scaling
    if spec.read_hparams is not None:
        spec.read_hparams(meta, config)
    for name, meta_key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                           ("pad_token_id", "padding_token_id")):
        value = gguf.get(f"tokenizer.ggml.{meta_key}")
        config[name] = int(value) if value is not None else None
    return config


def _rope_scaling(meta: _Meta) -> dict[str, Any] | None:
    if meta.has_tensor("rope_freqs.weight"):
        return _llama3_from_factors(meta)
    kind = meta.key("rope.scaling.type")
    if kind in (None, "none"):
        return None
    factor = float(meta.key("rope.scaling.factor", 1.0))
    if kind == "linear":
        return {"rope_type": "linear", "factor": factor}
    if kind == "yarn":
        scaling: dict[str, Any] = {"rope_type": "yarn", "factor": factor}
        for name, key in (("original_max_position_embeddings", "original_context_length"),
                          ("beta_fast", "yarn_beta_fast"), ("beta_slow", "yarn_beta_slow"),
                          ("attention_factor", "yarn_attn_factor")):
            value = meta.key(f"rope.scaling.{key}")
            if value is not None:
                scaling[name] = value
        if "original_max_position_embeddings" in scaling:
            scaling["original_max_position_embeddings"] = int(
                scaling["original_max_position_embeddings"])
        return scaling
    raise GGUFFileError(f"{meta.gguf.path}: rope scaling type {kind!r} is not supported")


def _llama3_from_factors(meta: _Meta) -> dict[str, Any]:
    """Llama-3 rope scaling parameters that reproduce the file's ``rope_freqs`` factors.

    llama.cpp's converter turns ``rope_scaling = {rope_type: llama3, factor, low_freq_factor,
    high_freq_factor, original_max_position_embeddings}`` into one divisor per frequency:
    1 for short wavelengths, ``factor`` for long ones, and in between
    ``1 / ((1 - s) / factor + s)`` with ``s = (L / wavelen - low) / (high - low)``. Only
    ``A = L / (high - low)`` and ``B = low / (high - low)`` matter, so they are fitted on
    the in-between factors and written as ``L = A, low = B, high = B + 1``; the result is
    checked against every stored factor.

    Raises:
        GGUFFileError: if no llama3 parameters reproduce the factors.
    """
    gguf = meta.gguf
    factors = gguf.raw("rope_freqs.weight").double().flatten()
    heads = int(meta.need("attention.head_count"))
    hidden = int(meta.need("embedding_length"))
    dim = int(meta.key("rope.dimension_count", meta.key("attention.key_length", hidden // heads)))
    base = float(meta.key("rope.freq_base", 10000.0))
    inv = [1.0 / (base ** (2 * i / dim)) for i in range(dim // 2)]
    wavelen = [2 * math.pi / f for f in inv]
    factor = float(factors.max())
    unsupported = GGUFFileError(
        f"{gguf.path}: rope_freqs.weight does not follow Llama-3 rope scaling; per-frequency "
        f"rope factors of another shape are not supported")
    if len(factors) != len(inv) or factor <= 1.0:
        raise unsupported
    medium = [i for i, f in enumerate(factors.tolist()) if 1.0 + 1e-6 < f < factor - 1e-6]
    if len(medium) < 2:
        raise unsupported
    # s_i = A / wavelen_i - B, least squares over the in-between frequencies.
    xs = [1.0 / wavelen[i] for i in medium]
    ss = [(factor / float(factors[i]) - 1.0) / (factor - 1.0) for i in medium]
    mx, ms = sum(xs) / len(xs), sum(ss) / len(ss)
    a = sum((x - mx) * (s - ms) for x, s in zip(xs, ss, strict=True)) / sum(
        (x - mx) ** 2 for x in xs)
    b = a * mx - ms
    scaling = {"rope_type": "llama3", "factor": factor, "low_freq_factor": b,
               "high_freq_factor": b + 1.0, "original_max_position_embeddings": a}
    for i, stored in enumerate(factors.tolist()):
        s = a / wavelen[i] - b
        expected = 1.0 if s >= 1.0 else factor if s <= 0.0 else 1.0 / ((1 - s) / factor + s)
        if abs(expected - stored) > 1e-4 * stored:
            raise unsupported
    return scaling
