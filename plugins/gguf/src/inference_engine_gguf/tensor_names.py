"""GGML tensor names (``blk.N.attn_q.weight``) to the checkpoint names the models load.

The engine's models load tensors by transformers checkpoint name; the MLP's
module name, the router's and the experts' names differ per architecture and
come from its :class:`~inference_engine_gguf.architectures.ArchitectureSpec`.

Three kinds of GGML tensor do not map one to one:

- stacked experts ``ffn_{gate,up,down}_exps`` ``[E, N, K]``: one name per expert;
- pairs llama.cpp's converter split from one transformers tensor, rebuilt by
  :func:`combine_parts`: DeepSeek-V2's ``attn_k_b`` + ``attn_v_b`` ->
  ``kv_b_proj``, gpt-oss's expert biases ``ffn_gate_exps.bias`` +
  ``ffn_up_exps.bias`` -> ``experts.gate_up_proj_bias``;
- leafless parameters (``attn_sinks.weight`` -> ``self_attn.sinks``,
  ``exp_probs_b.bias`` -> ``e_score_correction_bias``).
"""

from __future__ import annotations

import re
from functools import cache

import torch

from inference_engine_gguf.architectures import ArchitectureSpec
from inference_engine_gguf.gguf_file import GGUFFileError

__all__ = ["block_index", "combine_parts", "combined_target", "expert_part", "hf_tensor_names",
           "is_qk_weight", "unpermute_rows"]

_GLOBAL_NAMES: dict[str, str] = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z_0-9]+)\.(weight|bias)$")
# Any per-block tensor, including GLM-4-MoE's ``blk.N.nextn.eh_proj.weight``.
_ANY_BLOCK_RE = re.compile(r"^blk\.(\d+)\.")
# GGML tensors that carry no weights of the transformers model.
_SKIPPED = frozenset({"rope_freqs.weight"})
_EXPERT_PARTS = {"ffn_gate_exps": 0, "ffn_up_exps": 1, "ffn_down_exps": 2}
# (GGML part, leaf) -> (what the pair rebuilds, this part's key).
_COMBINED: dict[tuple[str, str], tuple[str, str]] = {
    ("attn_k_b", "weight"): ("self_attn.kv_b_proj.weight", "k_b"),
    ("attn_v_b", "weight"): ("self_attn.kv_b_proj.weight", "v_b"),
    ("ffn_gate_exps", "bias"): ("{mlp}.experts.gate_up_proj_bias", "gate"),
    ("ffn_up_exps", "bias"): ("{mlp}.experts.gate_up_proj_bias", "up"),
}


@cache
def _block_names(spec: ArchitectureSpec) -> dict[str, str]:
    """GGML per-block tensor -> module path (or leafless parameter) under ``model.layers.N``."""
    mlp = spec.mlp_name
    names = {
        "attn_norm": "input_layernorm",
        "ffn_norm": "post_attention_layernorm",
        "post_attention_norm": "post_attention_layernorm",  # glm4moe, gpt-oss
        "attn_q": "self_attn.q_proj",
        "attn_k": "self_attn.k_proj",
        "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj",
        "attn_q_norm": "self_attn.q_norm",
        "attn_k_norm": "self_attn.k_norm",
        # DeepSeek-V2 multi-head latent attention.
        "attn_q_a": "self_attn.q_a_proj",
        "attn_q_a_norm": "self_attn.q_a_layernorm",
        "attn_q_b": "self_attn.q_b_proj",
        "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
        "attn_kv_a_norm": "self_attn.kv_a_layernorm",
        "attn_kv_b": "self_attn.kv_b_proj",  # files from before the k_b/v_b split
        "ffn_gate": f"{mlp}.gate_proj",
        "ffn_up": f"{mlp}.up_proj",
        "ffn_down": f"{mlp}.down_proj",
        "ffn_gate_shexp": f"{mlp}.shared_experts.gate_proj",
        "ffn_up_shexp": f"{mlp}.shared_experts.up_proj",
        "ffn_down_shexp": f"{mlp}.shared_experts.down_proj",
        "ffn_gate_inp": f"{mlp}.{spec.gate_name}",
    }
    return names


@cache
def _leafless(spec: ArchitectureSpec) -> dict[tuple[str, str], str]:
    names = {("attn_sinks", "weight"): "self_attn.sinks"}
    if spec.correction_bias == "gate":
        names["exp_probs_b", "bias"] = f"{spec.mlp_name}.{spec.gate_name}.e_score_correction_bias"
    elif spec.correction_bias == "block":
        names["exp_probs_b", "bias"] = f"{spec.mlp_name}.e_score_correction_bias"
    return names


def block_index(ggml_name: str) -> int | None:
    """N of ``blk.N.*`` tensors, else None."""
    match = _ANY_BLOCK_RE.match(ggml_name)
    return int(match.group(1)) if match else None


def expert_part(ggml_name: str) -> tuple[int, str] | None:
    """``(layer, "gate" | "up" | "down")`` for a stacked expert *weight*, else None."""
    match = _BLOCK_RE.match(ggml_name)
    if match is None or match.group(3) != "weight" or match.group(2) not in _EXPERT_PARTS:
        return None
    return int(match.group(1)), match.group(2)[4:-5]


def combined_target(ggml_name: str, spec: ArchitectureSpec) -> tuple[str, str] | None:
    """``(transformers name, part key)`` for a tensor that is one part of a split pair."""
    match = _BLOCK_RE.match(ggml_name)
    if match is None:
        return None
    layer, part, leaf = match.groups()
    target = _COMBINED.get((part, leaf))
    if target is None:
        return None
    name, key = target
    return f"model.layers.{layer}.{name.format(mlp=spec.mlp_name)}", key


def combine_parts(hf_name: str, parts: dict[str, torch.Tensor]) -> torch.Tensor | None:
    """The transformers tensor rebuilt from its dense GGML parts, or None until all arrived.

    - ``kv_b_proj``: ``k_b [H, rank, nope]`` (llama.cpp stores it transposed for
      absorbed attention) and ``v_b [H, v, rank]`` -> ``[H * (nope + v), rank]``.
    - ``experts.gate_up_proj_bias``: gate and up ``[E, I]`` -> ``[E, 2I]`` with gate
      and up interleaved, the layout gpt-oss checkpoints store (its model file
      de-interleaves it on load).
    """
    if hf_name.endswith("kv_b_proj.weight"):
        if not {"k_b", "v_b"} <= parts.keys():
            return None
        k_b, v_b = parts["k_b"], parts["v_b"]  # [H, rank, nope], [H, v, rank]
        if k_b.dim() != 3 or v_b.dim() != 3 or k_b.shape[:2] != (v_b.shape[0], v_b.shape[2]):
            shapes = {k: tuple(v.shape) for k, v in parts.items()}
            raise GGUFFileError(f"the GGUF parts of {hf_name} do not fit together: {shapes}")
        return torch.cat((k_b.transpose(1, 2), v_b), dim=1).reshape(-1, v_b.shape[2]).contiguous()
    if not {"gate", "up"} <= parts.keys():
        return None
    gate, up = parts["gate"], parts["up"]
    return torch.stack((gate, up), dim=-1).reshape(gate.shape[0], -1).contiguous()


def hf_tensor_names(ggml_name: str, spec: ArchitectureSpec,
                    num_experts: int = 0) -> list[str] | None:
    """The transformers name(s) of a GGML tensor, or None for tensors to skip.

    Stacked expert weights map to one name per expert (``num_experts`` of
    them); a part of a split pair maps to the rebuilt tensor's name.

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
        combined = combined_target(ggml_name, spec)
        if combined is not None:
            return [combined[0]]
        if (part, leaf) in _leafless(spec):
            return [f"{prefix}.{_leafless(spec)[part, leaf]}"]
        names = _block_names(spec)
        if part in names:
            return [f"{prefix}.{names[part]}.{leaf}"]
        if part in _EXPERT_PARTS:
            base = f"{prefix}.{spec.mlp_name}.experts"
            if leaf == "bias":  # only down's bias is not a pair
                return [f"{base}.down_proj_bias"]
            name = spec.expert_names[_EXPERT_PARTS[part]]
            return [f"{base}.{e}.{name}.weight" for e in range(num_experts)]
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
