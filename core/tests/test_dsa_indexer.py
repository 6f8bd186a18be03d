"""The DSA lightning indexer against transformers' DeepSeek-V3.2 / GLM-5 indexers, and its FP8 path.

Our :class:`LightningIndexer` and transformers' indexer module get the same
weights and inputs; with 32 heads (no ReLU ties) the selected positions must be
the same sets, query by query, through our paged index cache. The FP8 path is
checked against its formula (per-row e4m3 with ``amax / 448`` scales) and
against the float32 path (top-k overlap).
"""

from __future__ import annotations

import pytest
import torch
import transformers
from inference_engine.builtin.attention.torch_sdpa import TorchSDPABackend
from inference_engine.builtin.quant.unquantized import UnquantizedMethod
from inference_engine.engine.kv_cache import KVCachePool
from inference_engine.interfaces.model import ModelContext
from inference_engine.layers.dsa_indexer import (
    FP8_MAX,
    LightningIndexer,
    dequantize_fp8_rows,
    quantize_fp8_rows,
)
from inference_engine.layers.rotary import RotaryEmbedding, rope_parameters
from inference_engine.testing_parity import Seq, make_step, randomize
from transformers.models.deepseek_v32 import modeling_deepseek_v32 as hf_v32
from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as hf_glm

SEQ_LEN = 24
TOPK = 8

CASES = {
    "deepseek_v32": (transformers.DeepseekV32Config, hf_v32.DeepseekV32Indexer,
                     hf_v32.DeepseekV32RotaryEmbedding, False),
    "glm_moe_dsa": (transformers.GlmMoeDsaConfig, hf_glm.GlmMoeDsaIndexer,
                    hf_glm.GlmMoeDsaRotaryEmbedding, True),
}


def tiny_config(config_cls: type, **extra) -> object:
    return config_cls(vocab_size=64, hidden_size=64, num_attention_heads=4,
                      num_key_value_heads=4, num_hidden_layers=1, q_lora_rank=32,
                      kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                      index_n_heads=32, index_head_dim=16, index_topk=TOPK,
                      max_position_embeddings=64, **extra)


def build_ours(config: object, hf_indexer: torch.nn.Module, interleaved: bool,
               blocks: list[int]) -> LightningIndexer:
    ctx = ModelContext(config, torch.float32, UnquantizedMethod(), TorchSDPABackend,
                       torch.device("cpu"))
    ours = LightningIndexer(ctx, "model.layers.0.self_attn.indexer", interleaved)
    missing, unexpected = ours.load_state_dict(hf_indexer.state_dict(), strict=False)
    assert not unexpected and set(missing) <= {"rope_perm"}
    pool = KVCachePool([ours.kv_cache_spec()], 4, max(blocks) + 1, torch.device("cpu"))
    ours.kv_cache = pool.layer_views(0)
    return ours


def inputs(config: object) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return (torch.randn(SEQ_LEN, config.hidden_size, generator=gen),
            torch.randn(SEQ_LEN, config.q_lora_rank, generator=gen))


def our_selection(ours: LightningIndexer, config: object, hidden: torch.Tensor,
                  q_resid: torch.Tensor, chunks: list[int], blocks: list[int]) -> torch.Tensor:
    """Prefill in ``chunks`` (lengths), as the engine's chunked prefill does; a chunk whose
    contexts fit in top-k (None: every visible position) is spelled out."""
    rope = RotaryEmbedding(config.qk_rope_head_dim, config.max_position_embeddings,
                           rope_parameters(config), torch.float32)
    out, done = [], 0
    for n in chunks:
        _, positions, metadata = make_step([Seq(list(range(done + n)), done, blocks)])
        with torch.no_grad():
            picked = ours(hidden[done:done + n], q_resid[done:done + n],
                          rope.lookup(positions), metadata)
        if picked is None:
            picked = torch.arange(TOPK).expand(n, TOPK).clone()
            picked[picked > positions[:, None]] = -1
        out.append(picked)
        done += n
    return torch.cat(out)


@pytest.mark.parametrize("arch", list(CASES))
def test_selection_matches_transformers_indexer(arch):
    config_cls, indexer_cls, rotary_cls, interleaved = CASES[arch]
    config = tiny_config(config_cls)
    torch.manual_seed(0)
    hf = randomize(indexer_cls(config, 0))
    hidden, q_resid = inputs(config)
    positions = torch.arange(SEQ_LEN)[None]
    cos_sin = rotary_cls(config)(hidden[None], positions)
    causal = torch.ones(SEQ_LEN, SEQ_LEN, dtype=torch.bool).tril()[None]
    with torch.no_grad():
        ref = hf(hidden[None], q_resid[None], cos_sin, causal, positions)[0]
    blocks = [5, 2, 7, 0, 9, 11]
    ours = build_ours(config, hf, interleaved, blocks)
    got = our_selection(ours, config, hidden, q_resid, [6, 4, 1, 13], blocks)
    for t in range(SEQ_LEN):
        expected = sorted(p for p in ref[t].tolist() if p <= t)
        assert got[t].tolist() == expected + [-1] * (TOPK - len(expected)), t


def test_fp8_rows_follow_their_formula():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(6, 16, generator=gen) * torch.tensor([1e-3, 0.1, 1, 10, 300, 0])[:, None]
    codes, scale = quantize_fp8_rows(x)
    assert codes.dtype == torch.float8_e4m3fn and scale.shape == (6, 1)
    amax = x.abs().amax(-1, keepdim=True)
    torch.testing.assert_close(scale[:5], amax[:5] / FP8_MAX)
    assert scale[5].item() == 1.0  # an all-zero row
    back = dequantize_fp8_rows(codes, scale)
    # e4m3 keeps 3 mantissa bits: within half a unit of the 4th bit of each row's largest value.
    assert ((back - x).abs() <= amax * 2.0 ** -4 + 1e-12).all()
    # The largest value of each row is exact (it maps to 448).
    top = x.abs().argmax(-1, keepdim=True)
    torch.testing.assert_close(back.gather(1, top)[:5], x.gather(1, top)[:5])


def test_fp8_indexer_keeps_most_of_the_float32_selection():
    config_cls, indexer_cls, _, _ = CASES["deepseek_v32"]
    config = tiny_config(config_cls)
    torch.manual_seed(0)
    hf = randomize(indexer_cls(config, 0))
    hidden, q_resid = inputs(config)
    blocks = [5, 2, 7, 0, 9, 11]
    ref = our_selection(build_ours(config, hf, False, blocks), config, hidden, q_resid,
                        [SEQ_LEN], blocks)
    config.indexer_dtype = "fp8"
    fp8 = build_ours(config, hf, False, blocks)
    assert fp8.fp8 and fp8.kv_cache_spec().head_dim == 16 + 4
    got = our_selection(fp8, config, hidden, q_resid, [SEQ_LEN], blocks)
    overlap = [len(set(a.tolist()) & set(b.tolist()) - {-1}) / len(set(a.tolist()) - {-1})
               for a, b in zip(ref[TOPK:], got[TOPK:], strict=True)]
    assert sum(overlap) / len(overlap) >= 0.9, overlap


def test_fp8_indexer_scores_follow_the_formula():
    """Scores from the packed FP8 cache equal the formula on independently quantised
    q and k: ``sum_h w_h relu(deq(q_h) . deq(k)) / sqrt(H D)``, top-k by the Python spec."""
    config_cls, indexer_cls, rotary_cls, _ = CASES["deepseek_v32"]
    config = tiny_config(config_cls, indexer_dtype="fp8")
    torch.manual_seed(0)
    hf = randomize(indexer_cls(config, 0))
    hidden, q_resid = inputs(config)
    blocks = [5, 2, 7, 0, 9, 11]
    got = our_selection(build_ours(config, hf, False, blocks), config, hidden, q_resid,
                        [SEQ_LEN - 4, 1, 1, 1, 1], blocks)  # then decodes
    # The same q and k as transformers' indexer computes them (half-split rope).
    cos, sin = rotary_cls(config)(hidden[None], torch.arange(SEQ_LEN)[None])
    h, d, r = config.index_n_heads, config.index_head_dim, config.qk_rope_head_dim
    with torch.no_grad():
        q = hf.wq_b(q_resid).view(SEQ_LEN, h, d)
        k = hf.k_norm(hf.wk(hidden))
        q_rot, k_rot = hf_v32.apply_rotary_pos_emb(q[None, ..., :r], k[None, :, None, :r],
                                                   cos, sin, unsqueeze_dim=2)
        q = torch.cat((q_rot[0], q[..., r:]), -1)
        k = torch.cat((k_rot[0, :, 0], k[..., r:]), -1)
        w = hf.weights_proj(hidden) * h ** -0.5
    q, k = dequantize_fp8_rows(*quantize_fp8_rows(q)), dequantize_fp8_rows(*quantize_fp8_rows(k))
    scores = ((torch.einsum("thd,sd->ths", q, k) * d ** -0.5).relu() * w[..., None]).sum(1)
    for t in range(SEQ_LEN):
        row = scores[t, :t + 1].tolist()
        keep = sorted(sorted(range(t + 1), key=lambda i: (-row[i], i))[:TOPK])
        assert got[t].tolist() == keep + [-1] * (TOPK - len(keep)), t


def test_unknown_indexer_dtype_is_named():
    config = tiny_config(transformers.DeepseekV32Config)
    config.indexer_dtype = "int3"
    ctx = ModelContext(config, torch.float32, UnquantizedMethod(), TorchSDPABackend,
                       torch.device("cpu"))
    with pytest.raises(ValueError, match="'int3'"):
        LightningIndexer(ctx, "x", False)
