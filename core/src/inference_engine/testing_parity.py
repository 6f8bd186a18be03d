"""Model-level parity helpers: our model beside a transformers one, stepped by hand.

Used by the model plugins' tests. A transformers model is randomised and
saved, our model is built through a :class:`ModelContext` and loaded from the
saved safetensors (the names a real checkpoint has), every cache-holding
layer gets views into a real :class:`KVCachePool` (so per-layer cache specs
are exercised), and hand-built steps run through it. Also the greedy check
with the near-tie rule used by the engine parity tests.
"""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
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

__all__ = ["BACKENDS", "Seq", "Twin", "assert_greedy_matches", "build_twin", "hf_greedy",
           "hf_logits", "make_step", "randomize", "run_step", "saved_tensors"]

BACKENDS = {"torch_sdpa": TorchSDPABackend, "paged": CpuPagedAttentionBackend}


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


def assert_greedy_matches(model: torch.nn.Module, prompt_ids: list[int], ours: Sequence[int],
                          ref: Sequence[int], tie: float = 1e-4) -> None:
    """Equal greedy tokens, except at a genuine near-tie of the reference (top-2 within ``tie``).

    After a genuine tie the continuations may legitimately diverge, so the check stops there.
    """
    for pos, (a, b) in enumerate(zip(ours, ref, strict=True)):
        if a == b:
            continue
        logits = hf_logits(model, list(prompt_ids) + list(ref[:pos]))[-1]
        top2 = logits.topk(2)
        gap = float(top2.values[0] - top2.values[1])
        assert gap < tie and {a, b} <= set(top2.indices.tolist()), (
            f"token {pos} differs ({a} vs reference {b}) and the reference's top-2 gap is {gap:.2e}"
        )
        return
