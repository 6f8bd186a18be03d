"""Tiny random drafters in the public checkpoint layouts, for tests and benchmarks."""

from __future__ import annotations

import json
from pathlib import Path

import torch

__all__ = ["make_dflash_drafter", "make_eagle3_drafter"]


def make_eagle3_drafter(path: str | Path, target_dir: str | Path, draft_vocab_size: int = 512,
                        seed: int = 0, layer_ids: tuple[int, int, int] | None = None) -> Path:
    """Save a random EAGLE-3 Llama drafter for the target in ``target_dir`` (vLLM's
    ``LlamaForCausalLMEagle3`` layout: ``fc``, ``midlayer.*``, ``norm``, ``lm_head`` over a
    reduced draft vocabulary, ``d2t`` offsets to target ids); returns ``path``."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    target = json.loads((Path(target_dir) / "config.json").read_text())
    h, vocab = target["hidden_size"], target["vocab_size"]
    heads, kv_heads = target["num_attention_heads"], target.get("num_key_value_heads", 1)
    head_dim = target.get("head_dim") or h // heads
    inter = target["intermediate_size"]
    cfg = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
        "hidden_size": h, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
        "head_dim": head_dim, "intermediate_size": inter, "num_hidden_layers": 1,
        "rms_norm_eps": target.get("rms_norm_eps", 1e-6), "rope_theta": 10000.0,
        "vocab_size": vocab, "draft_vocab_size": draft_vocab_size,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(layer_ids)} if layer_ids
        else {},
    }
    gen = torch.Generator().manual_seed(seed)

    def w(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * 0.05

    q_out, kv_out = heads * head_dim, kv_heads * head_dim
    # The draft vocabulary: the first draft_vocab_size target ids, spread (d2t offsets).
    chosen = torch.sort(torch.randperm(vocab, generator=gen)[:draft_vocab_size]).values
    tensors = {
        "fc.weight": w(h, 3 * h),
        "midlayer.hidden_norm.weight": torch.ones(h),
        "midlayer.input_layernorm.weight": torch.ones(h),
        "midlayer.self_attn.q_proj.weight": w(q_out, 2 * h),
        "midlayer.self_attn.k_proj.weight": w(kv_out, 2 * h),
        "midlayer.self_attn.v_proj.weight": w(kv_out, 2 * h),
        "midlayer.self_attn.o_proj.weight": w(h, q_out),
        "midlayer.post_attention_layernorm.weight": torch.ones(h),
        "midlayer.mlp.gate_proj.weight": w(inter, h),
        "midlayer.mlp.up_proj.weight": w(inter, h),
        "midlayer.mlp.down_proj.weight": w(h, inter),
        "norm.weight": torch.ones(h),
        "lm_head.weight": w(draft_vocab_size, h),
        "d2t": chosen - torch.arange(draft_vocab_size),
    }
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    save_file({k: v.contiguous() for k, v in tensors.items()}, path / "model.safetensors")
    return path


def make_dflash_drafter(path: str | Path, target_dir: str | Path, block_size: int = 4,
                        target_layer_ids: tuple[int, ...] = (0, 2), num_layers: int = 1,
                        mask_token_id: int = 5, seed: int = 0) -> Path:
    """Save a random DFlash (v1) drafter for the target in ``target_dir`` (z-lab/dflash's
    ``DFlashDraftModel`` layout: Qwen3-style ``layers.N.*`` with q/k norms, ``fc``,
    ``hidden_norm``, ``norm``; ``dflash_config`` with the target layers, mask token and
    block size); returns ``path``."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    target = json.loads((Path(target_dir) / "config.json").read_text())
    h = target["hidden_size"]
    heads, kv_heads = target["num_attention_heads"], target.get("num_key_value_heads", 1)
    head_dim = target.get("head_dim") or h // heads
    inter = target["intermediate_size"]
    cfg = {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": h,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
        "intermediate_size": inter, "num_hidden_layers": num_layers,
        "rms_norm_eps": target.get("rms_norm_eps", 1e-6), "rope_theta": 10000.0,
        "attention_bias": False, "vocab_size": target["vocab_size"],
        "dflash_config": {"target_layer_ids": list(target_layer_ids),
                          "mask_token_id": mask_token_id, "block_size": block_size},
    }
    gen = torch.Generator().manual_seed(seed)

    def w(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * 0.05

    tensors = {"fc.weight": w(h, len(target_layer_ids) * h), "hidden_norm.weight": torch.ones(h),
               "norm.weight": torch.ones(h)}
    for i in range(num_layers):
        p = f"layers.{i}."
        tensors.update({
            p + "input_layernorm.weight": torch.ones(h),
            p + "post_attention_layernorm.weight": torch.ones(h),
            p + "self_attn.q_proj.weight": w(heads * head_dim, h),
            p + "self_attn.k_proj.weight": w(kv_heads * head_dim, h),
            p + "self_attn.v_proj.weight": w(kv_heads * head_dim, h),
            p + "self_attn.o_proj.weight": w(h, heads * head_dim),
            p + "self_attn.q_norm.weight": torch.ones(head_dim),
            p + "self_attn.k_norm.weight": torch.ones(head_dim),
            p + "mlp.gate_proj.weight": w(inter, h),
            p + "mlp.up_proj.weight": w(inter, h),
            p + "mlp.down_proj.weight": w(h, inter),
        })
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    save_file({k: v.contiguous() for k, v in tensors.items()}, path / "model.safetensors")
    return path
