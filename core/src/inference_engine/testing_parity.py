"""Model-level parity helpers: our model beside a transformers one, stepped by hand.

Used by the model plugins' tests. A transformers model is randomised and
saved, our model is built through a :class:`ModelContext` and loaded from the
saved safetensors (the names a real checkpoint has), every cache-holding
layer gets views into a real :class:`KVCachePool` (so per-layer cache specs
are exercised), and hand-built steps run through it. Also the greedy check
with the near-tie rule used by the engine parity tests, and the tiny
transformers configs every architecture is tested with (``TINY_CONFIGS``;
``bench/gpu_parity.py`` builds the same models).

NOTE: the transformers references here run on the CPU, so everything that is
compared with them runs there too: :func:`build_twin` builds on the CPU, and
engine tests pin ``platform="cpu"`` (``inference_engine.testing.cpu_llm``),
so the suite means the same on a machine with an accelerator.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from inference_engine.builtin.attention.cpu_paged import CpuPagedAttentionBackend
from inference_engine.builtin.attention.torch_sdpa import TorchSDPABackend
from inference_engine.builtin.quant.unquantized import UnquantizedMethod
from inference_engine.engine.kv_cache import KVCachePool
from inference_engine.engine.model_runner import attention_layers
from inference_engine.interfaces.attention import AttentionMetadata
from inference_engine.interfaces.model import ModelContext

__all__ = ["BACKENDS", "DENSE_CONFIGS", "LOGITS_ATOL", "MOE_CONFIGS", "PARITY_NEW_TOKENS",
           "PARITY_PROMPTS", "TINY_CONFIGS", "Divergence", "Seq",
           "Twin", "assert_greedy_matches", "assert_logits_close", "build_twin",
           "first_divergence", "hf_greedy", "hf_logits", "make_step", "random_tokens",
           "randomize", "run_step", "saved_tensors", "tiny_dense_config"]

BACKENDS = {"torch_sdpa": TorchSDPABackend, "paged": CpuPagedAttentionBackend}

# --------------------------------------------------------------------------- #
# Tiny transformers configs, one per architecture (random weights, no downloads).
# --------------------------------------------------------------------------- #

# architecture -> transformers config class name, for the dense decoders.
DENSE_CONFIGS = {"llama": "LlamaConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config"}


# Prompts (ASCII, accents, code, digits) and length of the engine greedy-parity runs
# (the MoE engine test and bench/gpu_parity.py).
PARITY_PROMPTS = [
    "The quick brown fox",
    "Paged attention stores keys and values in fixed size blocks. Continuous batching mixes",
    "héllo wörld",
    "def add(a, b):",
    "1 2 3",
]
PARITY_NEW_TOKENS = 16

def tiny_dense_config(arch: str, vocab_size: int = 256, **overrides: Any) -> Any:
    """A 2-layer, hidden-64 ``arch`` config (eager attention), ``overrides`` applied."""
    import transformers

    params: dict[str, Any] = dict(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        rms_norm_eps=1e-6, tie_word_embeddings=False, attn_implementation="eager",
    )
    params.update(overrides)
    return getattr(transformers, DENSE_CONFIGS[arch])(**params)


# What every tiny MoE config shares: 2 layers, hidden 64, top-2.
_MOE_COMMON = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6,
                   tie_word_embeddings=False, num_experts_per_tok=2)


def _qwen3_moe(vocab: int) -> Any:
    import transformers

    return transformers.Qwen3MoeConfig(
        vocab_size=vocab, intermediate_size=96, moe_intermediate_size=32, head_dim=16,
        num_experts=8, norm_topk_prob=True, **_MOE_COMMON)


def _granitemoe(vocab: int) -> Any:
    import transformers

    return transformers.GraniteMoeConfig(
        vocab_size=vocab, intermediate_size=32, num_local_experts=8, embedding_multiplier=2.0,
        residual_multiplier=0.5, attention_multiplier=0.2, logits_scaling=4.0, **_MOE_COMMON)


def _glm4_moe(vocab: int) -> Any:
    import transformers

    return transformers.Glm4MoeConfig(
        vocab_size=vocab, intermediate_size=96, moe_intermediate_size=32, head_dim=16,
        n_routed_experts=8, n_shared_experts=1, first_k_dense_replace=1, n_group=2,
        topk_group=1, norm_topk_prob=True, routed_scaling_factor=1.5, use_qk_norm=True,
        attention_bias=True, partial_rotary_factor=0.5, **_MOE_COMMON)


def _minimax_m2(vocab: int) -> Any:
    import transformers

    return transformers.MiniMaxM2Config(
        vocab_size=vocab, intermediate_size=32, head_dim=16, num_local_experts=8,
        rotary_dim=8, **_MOE_COMMON)


def _gpt_oss(vocab: int) -> Any:
    import transformers

    # sliding_window 5 so the 13-token prompts really slide (layer 0 slides, layer 1 is full).
    return transformers.GptOssConfig(
        vocab_size=vocab, intermediate_size=32, head_dim=16, num_local_experts=8,
        sliding_window=5, **_MOE_COMMON)


def _deepseek_v2(vocab: int) -> Any:
    import transformers

    return transformers.DeepseekV2Config(
        vocab_size=vocab, intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8,
        n_shared_experts=1, first_k_dense_replace=1, topk_method="group_limited_greedy",
        n_group=4, topk_group=2, routed_scaling_factor=1.5, kv_lora_rank=32, q_lora_rank=24,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
        **{**_MOE_COMMON, "num_key_value_heads": 4})  # MLA: transformers expects kv heads = heads


# architecture -> (vocab size -> tiny config): 2 layers, 8 experts, top-2, hidden 64.
MOE_CONFIGS: dict[str, Callable[[int], Any]] = {
    "qwen3_moe": _qwen3_moe,
    "granitemoe": _granitemoe,
    "glm4_moe": _glm4_moe,
    "minimax_m2": _minimax_m2,
    "gpt_oss": _gpt_oss,
    "deepseek_v2": _deepseek_v2,
}

# Every architecture of inference-engine-models -> (vocab size -> tiny config).
TINY_CONFIGS: dict[str, Callable[[int], Any]] = {
    "llama": lambda vocab: tiny_dense_config("llama", vocab),
    "qwen2": lambda vocab: tiny_dense_config("qwen2", vocab),
    "qwen3": lambda vocab: tiny_dense_config("qwen3", vocab, head_dim=32),
    **MOE_CONFIGS,
}


def randomize(model: torch.nn.Module, seed: int = 0, std: float = 0.15) -> torch.nn.Module:
    """Every parameter random (norm weights near 1), so no path is a no-op."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen, dtype=torch.float32)
            if "norm" in name:
                param.copy_(1.0 + 0.2 * noise)
            else:
                param.copy_(std * noise)
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(0.1 * torch.randn(buf.shape, generator=gen))
    return model.eval()


def saved_tensors(model: Any) -> dict[str, torch.Tensor]:
    """The tensors ``model.save_pretrained`` writes, by their checkpoint names."""
    from safetensors.torch import load_file

    with tempfile.TemporaryDirectory() as path:
        model.save_pretrained(path)
        tensors: dict[str, torch.Tensor] = {}
        for file in sorted(Path(path).glob("*.safetensors")):
            tensors.update(load_file(file))
    return tensors


@dataclass
class Twin:
    """Our model with every cache-holding layer bound to a pool."""

    model: Any
    pool: KVCachePool


def build_twin(model_cls: type, config: Any, tensors: dict[str, torch.Tensor] | None,
               backend: str = "torch_sdpa", block_size: int = 4,
               num_blocks: int = 16) -> Twin:
    """Build, load (and process-after-load, as the engine's loader does) and bind caches."""
    ctx = ModelContext(config, torch.float32, UnquantizedMethod(), BACKENDS[backend],
                       torch.device("cpu"))
    model = model_cls(ctx).eval()
    if tensors is not None:
        with torch.no_grad():
            model.load_weights(tensors.items())
            for module in model.modules():
                method = getattr(module, "quant_method", None)
                if method is not None:
                    method.process_weights_after_loading(module)
                elif hasattr(module, "process_weights_after_loading"):
                    module.process_weights_after_loading()
    layers = attention_layers(model)
    pool = KVCachePool([layer.kv_cache_spec() for layer in layers], block_size, num_blocks,
                       torch.device("cpu"))
    for i, layer in enumerate(layers):
        layer.kv_cache = pool.layer_views(i)
    return Twin(model, pool)


@dataclass
class Seq:
    """One sequence's part of a step: ``num_cached`` tokens already in its blocks."""

    token_ids: list[int]
    num_cached: int
    block_ids: list[int]


def make_step(seqs: Sequence[Seq],
              block_size: int = 4) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """(input_ids, positions, metadata) of one flat step; decodes must come first."""
    ids, positions, slots, query_lens, seq_lens = [], [], [], [], []
    for s in seqs:
        ids += s.token_ids[s.num_cached:]
        pos = list(range(s.num_cached, len(s.token_ids)))
        positions += pos
        slots += [s.block_ids[p // block_size] * block_size + p % block_size for p in pos]
        query_lens.append(len(pos))
        seq_lens.append(len(s.token_ids))
    num_decodes = 0
    for n in query_lens:
        if n != 1:
            break
        num_decodes += 1
    tables = torch.zeros(len(seqs), max(len(s.block_ids) for s in seqs), dtype=torch.int64)
    for i, s in enumerate(seqs):
        tables[i, : len(s.block_ids)] = torch.tensor(s.block_ids)
    slot = torch.tensor(slots, dtype=torch.int64)
    starts = torch.zeros(len(seqs) + 1, dtype=torch.int64)
    starts[1:] = torch.tensor(query_lens).cumsum(0)
    metadata = AttentionMetadata(
        num_tokens=len(ids), num_decodes=num_decodes, query_start_loc=starts,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int64), slot_mapping=slot,
        block_tables=tables, block_size=block_size, query_lens_list=query_lens,
        seq_lens_list=seq_lens, slot_blocks=slot // block_size, slot_offsets=slot % block_size,
        max_decode_seq_len=max(seq_lens[:num_decodes], default=0),
    )
    return torch.tensor(ids), torch.tensor(positions), metadata


def run_step(twin: Twin, seqs: Sequence[Seq]) -> torch.Tensor:
    """All-position float32 logits ``[num_tokens, vocab]`` of one step."""
    ids, positions, metadata = make_step(seqs, twin.pool.block_size)
    with torch.inference_mode():
        return twin.model.compute_logits(twin.model(ids, positions, metadata))


def hf_greedy(model: Any, prompts: Sequence[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers' greedy continuation of each prompt, run alone (no padding)."""
    continuations = []
    for ids in prompts:
        x = torch.tensor([ids])
        with torch.no_grad():
            out = model.generate(x, do_sample=False, max_new_tokens=max_new_tokens,
                                 attention_mask=torch.ones_like(x))
        continuations.append(out[0, len(ids):].tolist())
    return continuations


def hf_logits(model: torch.nn.Module, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0].float()


# fp32 logits of the engine and transformers on the same weights agree to this.
LOGITS_ATOL = 1e-4


def random_tokens(n: int, seed: int, vocab_size: int = 256) -> list[int]:
    """``n`` token ids drawn from a seeded generator (prompts of the parity tests)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (n,), generator=generator).tolist()


def assert_logits_close(ours: torch.Tensor, ref: torch.Tensor, atol: float = LOGITS_ATOL) -> None:
    """Max abs difference within ``atol``, on reference logits large enough to mean something."""
    assert ref.abs().max() > 0.5, "reference logits too small to compare meaningfully"
    diff = (ours - ref).abs().max().item()
    assert diff <= atol, f"max abs logit difference {diff:.2e} > {atol}"


@dataclass(frozen=True, slots=True)
class Divergence:
    """Where a greedy continuation first leaves the reference's."""

    # Index into the continuations (0: the first generated token).
    position: int
    # Our token and the reference's there.
    ours: int
    ref: int
    # The reference's top-2 logit gap at that position and its top-2 token ids.
    gap: float
    top2_ids: tuple[int, int]
    # A genuine near-tie: gap < tie and both tokens are the reference's top-2.
    is_near_tie: bool


def first_divergence(model: torch.nn.Module, prompt_ids: Sequence[int], ours: Sequence[int],
                     ref: Sequence[int], tie: float = 1e-4) -> Divergence | None:
    """The first position where ``ours`` differs from ``ref`` (None: equal), judged by
    the reference ``model``'s logits there (see :func:`assert_greedy_matches`)."""
    for pos, (a, b) in enumerate(zip(ours, ref, strict=True)):
        if a == b:
            continue
        logits = hf_logits(model, list(prompt_ids) + list(ref[:pos]))[-1]
        top2 = logits.topk(2)
        gap = float(top2.values[0] - top2.values[1])
        top2_ids = tuple(top2.indices.tolist())
        return Divergence(pos, int(a), int(b), gap, top2_ids,
                          gap < tie and {a, b} <= set(top2_ids))
    return None


def assert_greedy_matches(model: torch.nn.Module, prompt_ids: list[int], ours: Sequence[int],
                          ref: Sequence[int], tie: float = 1e-4) -> None:
    """Equal greedy tokens, except at a genuine near-tie of the reference (top-2 within ``tie``).

    After a genuine tie the continuations may legitimately diverge, so the check stops there.
    """
    found = first_divergence(model, prompt_ids, ours, ref, tie)
    assert found is None or found.is_near_tie, (
        f"token {found.position} differs ({found.ours} vs reference {found.ref}) and the "
        f"reference's top-2 gap is {found.gap:.2e}"
    )
