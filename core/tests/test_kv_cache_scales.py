"""Per-tensor float8 KV-cache scales: the formula, and the checkpoint names they load from."""

from __future__ import annotations

import math

import pytest
import torch
from inference_engine.builtin.attention.attention_reference import (
    paged_attention_reference,
    write_kv_cache_reference,
)
from inference_engine.builtin.attention.torch_sdpa import TorchSDPABackend
from inference_engine.interfaces.attention import AttentionMetadata
from inference_engine.layers.attention import Attention
from inference_engine.testing import cpu_llm, make_tiny_model
from safetensors.torch import load_file, save_file

FP8 = torch.float8_e4m3fn
HEADS, KV_HEADS, DIM, BLOCK = 4, 2, 16, 4


def _step(seqs: list[tuple[int, int]], tables: list[list[int]]) -> AttentionMetadata:
    """Metadata for sequences given as (cached tokens, new tokens), decodes first."""
    query_lens = [new for _, new in seqs]
    seq_lens = [cached + new for cached, new in seqs]
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    slots = [tables[i][pos // BLOCK] * BLOCK + pos % BLOCK
             for i, (cached, new) in enumerate(seqs) for pos in range(cached, cached + new)]
    width = max(map(len, tables))
    return AttentionMetadata(
        num_tokens=starts[-1], num_decodes=sum(n == 1 for n in query_lens),
        query_start_loc=torch.tensor(starts), seq_lens=torch.tensor(seq_lens),
        slot_mapping=torch.tensor(slots),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables]),
        block_size=BLOCK, query_lens_list=query_lens, seq_lens_list=seq_lens,
    )


def test_float8_cache_stores_and_reads_through_its_scales():
    """torch_sdpa on a float8 cache equals the reference formula (``clamp(x / scale)`` stored,
    times the scale read) byte for byte in the cache, and the scales matter."""
    torch.manual_seed(0)
    k_scale, v_scale = 0.02, 0.5  # keys reach ~8.9 = 448 * 0.02; values ~224
    tables = [[3, 1], [5, 6, 2]]
    outputs = {}
    for scales in ((k_scale, v_scale), (1.0, 1.0)):
        backend = TorchSDPABackend(HEADS, DIM, KV_HEADS, 1 / math.sqrt(DIM))
        backend.k_scale, backend.v_scale = scales
        cache = torch.zeros(8, BLOCK, KV_HEADS, DIM).to(FP8), torch.zeros(8, BLOCK, KV_HEADS,
                                                                            DIM).to(FP8)
        expect = cache[0].clone(), cache[1].clone()
        # A prefill of each, then a decode of the first beside a chunk of the second.
        for seqs in ([(0, 6), (0, 3)], [(6, 1), (3, 5)]):
            md = _step(seqs, tables)
            q = torch.randn(md.num_tokens, HEADS, DIM)
            k = 3 * torch.randn(md.num_tokens, KV_HEADS, DIM)
            v = 40 * torch.randn(md.num_tokens, KV_HEADS, DIM)
            got = backend.forward(q, k, v, cache, md).view(md.num_tokens, HEADS, DIM)
            write_kv_cache_reference(k, v, *expect, md.slot_mapping, *scales)
            want = paged_attention_reference(q, *expect, md.block_tables, md.seq_lens,
                                             md.query_start_loc, 1 / math.sqrt(DIM),
                                             k_scale=scales[0], v_scale=scales[1])
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
            for ours, ref in zip(cache, expect, strict=True):
                assert torch.equal(ours.view(torch.uint8), ref.view(torch.uint8))
        outputs[scales] = got
    assert not torch.allclose(outputs[(k_scale, v_scale)], outputs[(1.0, 1.0)], atol=1e-2)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("llama_kv_scales"), "llama")


def _with_tensors(src, dst, extra: dict[str, torch.Tensor]):
    """A copy of checkpoint ``src`` at ``dst`` with ``extra`` tensors added."""
    import shutil

    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    tensors.update(extra)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def _layer_scales(llm) -> list[tuple[float, float]]:
    layers = [m for m in llm.engine.model.modules() if isinstance(m, Attention)]
    return [(m.backend.k_scale, m.backend.v_scale) for m in layers]


@pytest.mark.parametrize("k_name, v_name", [
    ("self_attn.k_scale", "self_attn.v_scale"),
    ("self_attn.k_proj.k_scale", "self_attn.v_proj.v_scale"),  # ModelOpt
    ("self_attn.k_proj.output_scale", "self_attn.v_proj.output_scale"),  # compressed-tensors
    ("self_attn.kv_scale", None),  # one for both
])
def test_checkpoint_scales_reach_a_float8_cache(tiny_llama, tmp_path, k_name, v_name):
    extra = {}
    for layer in range(2):
        extra[f"model.layers.{layer}.{k_name}"] = torch.tensor(0.25 + layer)
        if v_name:
            extra[f"model.layers.{layer}.{v_name}"] = torch.tensor([0.125 * (layer + 1)])
    path = _with_tensors(tiny_llama, tmp_path / "ckpt", extra)
    llm = cpu_llm(path, kv_cache_dtype="fp8")
    if v_name:
        assert _layer_scales(llm) == [(0.25, 0.125), (1.25, 0.25)]
    else:
        assert _layer_scales(llm) == [(0.25, 0.25), (1.25, 1.25)]
    # The same checkpoint with a bfloat16 cache loads too; the scales do not apply there.
    plain = cpu_llm(path, kv_cache_dtype="bfloat16")
    assert _layer_scales(plain) == [(1.0, 1.0), (1.0, 1.0)]


def test_checkpoint_scales_change_what_a_float8_cache_holds(tiny_llama, tmp_path):
    """Scales that clip every key (448 * 1e-4 = 0.045) change the logprobs: they are used."""
    tiny = {f"model.layers.{i}.self_attn.k_scale": torch.tensor(1e-4) for i in range(2)}
    path = _with_tensors(tiny_llama, tmp_path / "clipped", tiny)
    from inference_engine import SamplingParams

    params = SamplingParams(max_tokens=4, temperature=0.0, logprobs=1)
    prompt = "hello world, the cat sat on"
    base = cpu_llm(tiny_llama, kv_cache_dtype="fp8").generate([prompt], params)[0].outputs[0]
    clipped = cpu_llm(path, kv_cache_dtype="fp8").generate([prompt], params)[0].outputs[0]
    first = [next(iter(lp.values())).logprob for lp in base.logprobs]
    second = [next(iter(lp.values())).logprob for lp in clipped.logprobs]
    assert first != second


def test_bad_checkpoint_scales_are_named(tiny_llama, tmp_path):
    per_head = {"model.layers.0.self_attn.k_scale": torch.ones(KV_HEADS)}
    path = _with_tensors(tiny_llama, tmp_path / "per_head", per_head)
    with pytest.raises(ValueError, match=r"model.layers.0.self_attn.k_scale.*per-tensor"):
        cpu_llm(path, kv_cache_dtype="fp8")
    negative = {"model.layers.1.self_attn.v_scale": torch.tensor(-2.0)}
    path = _with_tensors(tiny_llama, tmp_path / "negative", negative)
    with pytest.raises(ValueError, match=r"layers.1.*v_scale -2.0 is not a positive"):
        cpu_llm(path, kv_cache_dtype="fp8")

