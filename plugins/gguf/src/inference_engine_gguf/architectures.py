"""From GGUF metadata and GGML tensor names to a Hugging Face config and checkpoint names.

llama.cpp names hyper-parameters ``{arch}.attention.head_count`` and tensors
``blk.N.attn_q.weight``; the engine's models are built from a transformers
config and load tensors by transformers names. This module holds both
translations, one table per direction, and the one layout change llama.cpp's
converter makes: for ``llama`` it permutes the rows of ``attn_q``/``attn_k``
from transformers' rotate-half order to the interleaved order GGML's rope uses.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import torch

from inference_engine_gguf.gguf_file import GGUFFile, GGUFFileError

__all__ = [
    "ARCHITECTURES",
    "ArchitectureSpec",
    "UnknownArchitectureError",
    "architecture_spec",
    "build_hf_config",
    "hf_tensor_names",
    "unpermute_rows",
]


class UnknownArchitectureError(ValueError):
    """``general.architecture`` names an architecture this plugin cannot map."""


@dataclass(frozen=True, slots=True)
class ArchitectureSpec:
    """How one ``general.architecture`` maps onto a registered model."""

    # transformers model_type and architecture class name.
    model_type: str
    hf_architecture: str
    # Whether llama.cpp's converter permuted q/k rows (llama-style rope).
    permutes_qk: bool = False
    # Mixture-of-experts hyper-parameters are read.
    is_moe: bool = False


ARCHITECTURES: dict[str, ArchitectureSpec] = {
    "llama": ArchitectureSpec("llama", "LlamaForCausalLM", permutes_qk=True),
    "qwen2": ArchitectureSpec("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ArchitectureSpec("qwen3", "Qwen3ForCausalLM"),
    "qwen3moe": ArchitectureSpec("qwen3_moe", "Qwen3MoeForCausalLM", is_moe=True),
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
        GGUFFileError: for missing required hyper-parameters or unsupported rope scaling.
    """
    arch = gguf.architecture
    spec = architecture_spec(arch)

    def key(name: str, default: Any = None) -> Any:
        return gguf.get(f"{arch}.{name}", default)

    def need(name: str) -> Any:
        return gguf.require(f"{arch}.{name}")

    hidden = int(need("embedding_length"))
    heads = int(need("attention.head_count"))
    kv_heads = key("attention.head_count_kv", heads)
    if isinstance(kv_heads, list):  # per-layer list in some files
        if len(set(kv_heads)) != 1:
            raise GGUFFileError(
                f"{gguf.path}: per-layer KV head counts {kv_heads} are not supported")
        kv_heads = kv_heads[0]
    embed = gguf.tensors.get("token_embd.weight")
    if embed is None:
        raise GGUFFileError(f"{gguf.path} has no token_embd.weight tensor")
    vocab = embed.shape[0]
    head_dim = int(key("attention.key_length", hidden // heads))
    config: dict[str, Any] = {
        "model_type": spec.model_type,
        "architectures": [spec.hf_architecture],
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "num_hidden_layers": int(need("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(kv_heads),
        "head_dim": head_dim,
        "max_position_embeddings": int(key("context_length", 2048)),
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(key("rope.freq_base", 10000.0)),
        "tie_word_embeddings": "output.weight" not in gguf.tensors,
        "hidden_act": "silu",
        # GGML dequantizes into float32 math; so do we unless --dtype says otherwise.
        "torch_dtype": "float32",
    }
    ffn = key("feed_forward_length")
    if ffn is not None:
        config["intermediate_size"] = int(ffn[0] if isinstance(ffn, list) else ffn)
    if spec.model_type in ("llama", "qwen3"):
        config["attention_bias"] = "blk.0.attn_q.bias" in gguf.tensors
    if spec.is_moe:
        config.update(_moe_config(key, need))
    rope_scaling = _rope_scaling(gguf, key)
    if rope_scaling is not None:
        config["rope_scaling"] = rope_scaling
    for field, meta in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                        ("pad_token_id", "padding_token_id")):
        value = gguf.get(f"tokenizer.ggml.{meta}")
        config[field] = int(value) if value is not None else None
    return config


def _moe_config(key: Any, need: Any) -> dict[str, Any]:
    """Qwen3-MoE hyper-parameters (every layer sparse, as llama.cpp's graph builds it)."""
    return {
        "num_experts": int(need("expert_count")),
        "num_experts_per_tok": int(need("expert_used_count")),
        "moe_intermediate_size": int(need("expert_feed_forward_length")),
        # llama.cpp's qwen3moe graph renormalises the top-k routing weights.
        "norm_topk_prob": bool(key("expert_weights_norm", True)),
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    }


def _rope_scaling(gguf: GGUFFile, key: Any) -> dict[str, Any] | None:
    if "rope_freqs.weight" in gguf.tensors:
        return _llama3_from_factors(gguf, key)
    kind = key("rope.scaling.type")
    if kind in (None, "none"):
        return None
    factor = float(key("rope.scaling.factor", 1.0))
    if kind == "linear":
        return {"rope_type": "linear", "factor": factor}
    if kind == "yarn":
        scaling: dict[str, Any] = {"rope_type": "yarn", "factor": factor}
        original = key("rope.scaling.original_context_length")
        if original is not None:
            scaling["original_max_position_embeddings"] = int(original)
        return scaling
    raise GGUFFileError(f"{gguf.path}: rope scaling type {kind!r} is not supported")


def _llama3_from_factors(gguf: GGUFFile, key: Any) -> dict[str, Any]:
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
    factors = gguf.raw("rope_freqs.weight").double().flatten()
    heads = int(gguf.require(f"{gguf.architecture}.attention.head_count"))
    hidden = int(gguf.require(f"{gguf.architecture}.embedding_length"))
    dim = int(key("rope.dimension_count", key("attention.key_length", hidden // heads)))
    base = float(key("rope.freq_base", 10000.0))
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


# --------------------------------------------------------------------- tensor names

# GGML per-block tensor -> transformers module path under model.layers.N.
_BLOCK_NAMES: dict[str, str] = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",
}
# Stacked expert tensors [E, N, K] -> per-expert transformers names.
_EXPERT_NAMES: dict[str, str] = {
    "ffn_gate_exps": "gate_proj",
    "ffn_up_exps": "up_proj",
    "ffn_down_exps": "down_proj",
}
_GLOBAL_NAMES: dict[str, str] = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z_0-9]+)\.(weight|bias)$")
# GGML tensors that carry no weights of the transformers model.
_SKIPPED = frozenset({"rope_freqs.weight"})


def hf_tensor_names(ggml_name: str, num_experts: int = 0) -> list[str] | None:
    """The transformers name(s) of a GGML tensor, or None for tensors to skip.

    Stacked expert tensors map to one name per expert (``num_experts`` of them).

    Raises:
        GGUFFileError: for a tensor name this mapping does not know.
    """
    if ggml_name in _SKIPPED:
        return None
    if ggml_name in _GLOBAL_NAMES:
        return [_GLOBAL_NAMES[ggml_name]]
    match = _BLOCK_RE.match(ggml_name)
    if match is not None:
        layer, part, leaf = match.groups()
        prefix = f"model.layers.{layer}"
        if part in _BLOCK_NAMES:
            return [f"{prefix}.{_BLOCK_NAMES[part]}.{leaf}"]
        if part in _EXPERT_NAMES:
            return [f"{prefix}.mlp.experts.{e}.{_EXPERT_NAMES[part]}.{leaf}"
                    for e in range(num_experts)]
    raise GGUFFileError(f"GGUF tensor {ggml_name!r} has no mapping to a model weight")


def is_qk_weight(ggml_name: str) -> str | None:
    """``"q"`` or ``"k"`` for ``blk.N.attn_q/attn_k`` weights and biases, else None."""
    match = _BLOCK_RE.match(ggml_name)
    if match is None:
        return None
    return {"attn_q": "q", "attn_k": "k"}.get(match.group(2))


def unpermute_rows(rows: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation (``convert_hf_to_gguf.LlamaModel.permute``).

    The converter maps each head's rows ``[r_0 .. r_{d/2-1} | r_{d/2} .. r_{d-1}]``
    (rotate-half order) to ``[r_0, r_{d/2}, r_1, r_{d/2+1}, ...]`` (interleaved
    pairs). Rows are moved whole, so this works on raw quantized rows too.

    Args:
        rows: ``[num_heads * head_dim, ...]`` (weights, raw blocks or a bias).
        num_heads: heads of this projection (KV heads for ``attn_k``).
    """
    n = rows.shape[0]
    rest = rows.shape[1:]
    head_dim = n // num_heads
    return (rows.reshape(num_heads, head_dim // 2, 2, *rest).transpose(1, 2)
            .reshape(n, *rest).contiguous())
