"""Decode step time of sparse attention vs a dense twin for one layer on a long context.

``--model dsa`` (default): DSA sparse MLA vs dense MLA.

One DeepSeek-V3.2-shaped attention layer (``SparseMLAAttention`` with its
lightning indexer; random weights) over a paged pool whose blocks are filled
with random latents and indexer keys for ``--context`` tokens. The parts of a
decode step of ``--batch`` sequences are timed: the indexer (scores over every
cached key + top-k), attention over the ``--topk`` selected latents gathered
from the pool, attention over all cached latents by the same code (the dense
cost sparsity replaces), the dense MLA decode the engine runs below top-k
(SDPA over the gathered blocks), and the whole sparse layer step (projections
included).
Default sizes are DeepSeek-V3.2's (128 heads, kv rank 512, rope 64, nope 128, v 128,
q rank 1536, indexer 64 heads x 128); ``--heads``/``--index-heads`` shrink them.

``--model msa``: one MiniMax-M3 sparse (MSA) attention layer (``MiniMaxM3Attention`` with
its block indexer; 64 heads, 4 KV heads x 128, indexer 4 x 128, blocks of 128, 16 kept =
2048 keys): the indexer (block scores + top-k), attention over the kept blocks gathered
from the pool, the same code over every block, the engine's dense GQA decode through the
attention backend (what a dense twin runs), and the whole sparse layer step.

``--model csa``: one DeepSeek-V4-Flash-shaped compressed sparse attention (CSA) layer
(``DeepseekV4Attention``: 64 heads x 512, one shared K=V head, sliding window 128, one
compressed entry per 4 tokens, indexer 64 x 128 keeping ``--topk`` entries, default 512):
the indexer (its compressor's step write, scores over every entry + top-k), attention over
the window and the kept entries gathered from the pool, the same code over the window and
every entry (an HCA-style dense twin of the compressed branch), single-head K=V attention
over all raw tokens by the same code (a dense MQA twin), and the whole sparse layer step.

Run:  .venv/bin/python bench/sparse_attention.py [--model msa|csa] [--context 8192 --topk 2048]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import transformers
from inference_engine.builtin.attention.torch_sdpa import TorchSDPABackend
from inference_engine.builtin.quant.unquantized import UnquantizedMethod
from inference_engine.engine.kv_cache import KVCachePool
from inference_engine.interfaces.model import ModelContext
from inference_engine.layers.decoder import DecoderOptions
from inference_engine.layers.rotary import RotaryEmbedding, rope_parameters
from inference_engine.layers.sparse_mla import SparseMLAAttention
from inference_engine.testing_parity import Seq, make_step


def build_layer(args: argparse.Namespace, topk: int, device: torch.device,
                dtype: torch.dtype) -> tuple[SparseMLAAttention, KVCachePool, object]:
    config = transformers.DeepseekV32Config(
        hidden_size=args.hidden, num_attention_heads=args.heads, num_key_value_heads=args.heads,
        q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, index_n_heads=args.index_heads, index_head_dim=128, index_topk=topk,
        num_hidden_layers=1, max_position_embeddings=args.context + 16)
    ctx = ModelContext(config, dtype, UnquantizedMethod(), TorchSDPABackend, device)
    torch.manual_seed(0)
    layer = SparseMLAAttention(ctx, "model.layers.0.self_attn").to(device)
    with torch.no_grad():
        for param in layer.parameters():
            param.normal_(0, 0.02)
    blocks_per_seq = -(-(args.context + 1) // args.block_size)
    specs = [layer.kv_cache_spec(), layer.indexer.kv_cache_spec()]
    pool = KVCachePool(specs, args.block_size, args.batch * blocks_per_seq + 1, device)
    layer.kv_cache = pool.layer_views(0)
    layer.indexer.kv_cache = pool.layer_views(1)
    gen = torch.Generator(device=device).manual_seed(1)
    for view in (layer.kv_cache[0], layer.indexer.kv_cache[0]):
        view.copy_(torch.randn(view.shape, generator=gen, device=device, dtype=view.dtype))
    return layer, pool, config


def time_parts(layer: SparseMLAAttention, config: object, args: argparse.Namespace,
               device: torch.device, dtype: torch.dtype) -> dict[str, float]:
    """Median seconds of each part of a decode step at ``--context`` cached tokens."""
    blocks_per_seq = -(-(args.context + 1) // args.block_size)
    seqs = [Seq([0] * (args.context + 1), args.context,
                list(range(1 + i * blocks_per_seq, 1 + (i + 1) * blocks_per_seq)))
            for i in range(args.batch)]
    _, positions, metadata = make_step(seqs, args.block_size)
    for name in ("query_start_loc", "seq_lens", "block_tables", "slot_blocks", "slot_offsets"):
        setattr(metadata, name, getattr(metadata, name).to(device))
    rope = RotaryEmbedding(64, args.context + 16, rope_parameters(config),
                           dtype).to(device).lookup(positions.to(device))
    hidden = torch.randn(args.batch, args.hidden, device=device, dtype=dtype)
    q_nope = torch.randn(args.batch, args.heads, 128, device=device, dtype=dtype)
    q_pe = torch.randn(args.batch, args.heads, 64, device=device, dtype=dtype)
    (cache,) = layer.kv_cache
    everything = torch.arange(args.context + 1, device=device).expand(args.batch, -1)
    with torch.inference_mode():
        q_latent = layer.q_a_layernorm(layer.q_a_proj(hidden))
        selected = layer.indexer(hidden, q_latent, rope, metadata)
        parts = {
            "indexer (scores + top-k)": lambda: layer.indexer(hidden, q_latent, rope, metadata),
            f"attend top-{args.topk} (gathered)": lambda: layer._attend_selected(
                q_nope, q_pe, cache, metadata.block_tables, selected),
            f"attend all {args.context + 1} (same path)": lambda: layer._attend_selected(
                q_nope, q_pe, cache, metadata.block_tables, everything),
            "whole sparse layer step": lambda: layer(hidden, rope, metadata),
        }
        if args.mla_dense:
            parts["dense MLA decode (absorbed)"] = lambda: layer._decode_absorbed(
                q_nope, q_pe, cache, metadata)
        times = {}
        for name, fn in parts.items():
            samples = []
            for i in range(args.warmup + args.iters):
                sync(device)
                start = time.perf_counter()
                fn()
                sync(device)
                if i >= args.warmup:
                    samples.append(time.perf_counter() - start)
            times[name] = statistics.median(samples)
    return times


def median_times(parts: dict[str, object], args: argparse.Namespace,
                 device: torch.device) -> dict[str, float]:
    """Median seconds of each ``parts`` callable after ``--warmup`` runs."""
    times = {}
    for name, fn in parts.items():
        samples = []
        for i in range(args.warmup + args.iters):
            sync(device)
            start = time.perf_counter()
            fn()
            sync(device)
            if i >= args.warmup:
                samples.append(time.perf_counter() - start)
        times[name] = statistics.median(samples)
    return times


def time_msa(args: argparse.Namespace, device: torch.device,
             dtype: torch.dtype) -> tuple[dict[str, float], str, str]:
    """MiniMax-M3 MSA decode parts; returns (times, sparse part names..., dense name)."""
    from inference_engine.layers.block_sparse_attention import block_sparse_decode
    from inference_engine_models.minimax_m3 import MiniMaxM3Attention, step_positions

    block = 128
    config = transformers.MiniMaxM3VLTextConfig(
        hidden_size=6144, num_attention_heads=64, num_key_value_heads=4, head_dim=128,
        index_n_heads=4, index_head_dim=128, index_block_size=block,
        index_topk_blocks=max(1, args.topk // block), index_local_blocks=1, num_hidden_layers=1,
        layer_types=["minimax_m3_sparse"], mlp_layer_types=["dense"],
        rope_parameters={"rope_type": "default", "rope_theta": 5e6,
                         "partial_rotary_factor": 0.5},
        max_position_embeddings=args.context + 16)
    ctx = ModelContext(config, dtype, UnquantizedMethod(), TorchSDPABackend, device)
    torch.manual_seed(0)
    layer = MiniMaxM3Attention(ctx, "model.layers.0.self_attn", 0, DecoderOptions(
        False, False, False)).to(device)
    with torch.no_grad():
        for param in layer.parameters():
            param.normal_(0, 0.02)
    blocks_per_seq = -(-(args.context + 1) // args.block_size)
    specs = [layer.attn.kv_cache_spec(), layer.indexer.kv_cache_spec()]
    pool = KVCachePool(specs, args.block_size, args.batch * blocks_per_seq + 1, device)
    layer.attn.kv_cache = pool.layer_views(0)
    layer.indexer.kv_cache = pool.layer_views(1)
    gen = torch.Generator(device=device).manual_seed(1)
    for view in (*layer.attn.kv_cache, *layer.indexer.kv_cache):
        view.copy_(torch.randn(view.shape, generator=gen, device=device, dtype=view.dtype))
    seqs = [Seq([0] * (args.context + 1), args.context,
                list(range(1 + i * blocks_per_seq, 1 + (i + 1) * blocks_per_seq)))
            for i in range(args.batch)]
    _, positions, metadata = make_step(seqs, args.block_size)
    for name in ("query_start_loc", "seq_lens", "block_tables", "slot_blocks", "slot_offsets"):
        setattr(metadata, name, getattr(metadata, name).to(device))
    positions = positions.to(device)
    rope = RotaryEmbedding(128, args.context + 16, rope_parameters(config),
                           dtype).to(device).lookup(positions)
    hidden = torch.randn(args.batch, config.hidden_size, device=device, dtype=dtype)
    q = torch.randn(args.batch, 64, 128, device=device, dtype=dtype)
    kv = torch.randn(args.batch, 4, 128, device=device, dtype=dtype)
    k_cache, v_cache = layer.attn.kv_cache
    num_blocks = -(-(args.context + 1) // block)
    everything = torch.arange(num_blocks, device=device).expand(args.batch, 4, -1)
    kept = f"attend {config.index_topk_blocks} kept blocks (gathered)"
    dense = "dense GQA decode (attention backend)"
    with torch.inference_mode():
        step_positions(metadata, device)
        selection = layer.indexer(hidden, positions, rope, metadata)
        parts = {
            "indexer (block scores + top-k)": lambda: layer.indexer(hidden, positions, rope,
                                                                    metadata),
            kept: lambda: block_sparse_decode(q, k_cache, v_cache, selection,
                                              metadata.block_tables, metadata.seq_lens, block,
                                              layer.attn.scale),
            f"attend all {num_blocks} blocks (same path)": lambda: block_sparse_decode(
                q, k_cache, v_cache, everything, metadata.block_tables, metadata.seq_lens,
                block, layer.attn.scale),
            dense: lambda: layer.attn(q, kv, kv, metadata),
            "whole sparse layer step": lambda: layer(hidden, rope, metadata),
        }
        times = median_times(parts, args, device)
    return times, kept, dense


def time_csa(args: argparse.Namespace, device: torch.device,
             dtype: torch.dtype) -> tuple[dict[str, float], str, str, str]:
    """DeepSeek-V4 CSA decode parts; returns (times, indexer, kept, dense names)."""
    from inference_engine.layers.compressed_attention import sink_attention
    from inference_engine.layers.kv_compressor import paged_rows
    from inference_engine.layers.tail_rope import TailRope
    from inference_engine_models.deepseek_v4 import DeepseekV4Attention

    csa = "compressed_sparse_attention"
    config = transformers.DeepseekV4Config(
        hidden_size=4096, num_attention_heads=64, head_dim=512, q_lora_rank=1024, o_groups=8,
        o_lora_rank=1024, index_n_heads=64, index_head_dim=128, index_topk=args.topk,
        sliding_window=128, num_hidden_layers=1, layer_types=[csa], mlp_layer_types=["moe"],
        compress_rates={csa: 4, "heavily_compressed_attention": 128},
        rope_parameters={"rope_type": "yarn", "factor": 16.0,
                         "original_max_position_embeddings": 65536},
        max_position_embeddings=max(args.context + 16, 1 << 20))
    ctx = ModelContext(config, dtype, UnquantizedMethod(), TorchSDPABackend, device)
    torch.manual_seed(0)
    rot_dim = int(config.head_dim * config.partial_rotary_factor)
    ropes = {label: TailRope(config.rope_parameters[label], rot_dim,
                             config.max_position_embeddings) for label in ("main", "compress")}
    layer = DeepseekV4Attention(ctx, "model.layers.0.attn", csa, ropes).to(device)
    with torch.no_grad():
        for param in layer.parameters():
            if param.is_floating_point():
                param.normal_(0, 0.02)
    blocks_per_seq = -(-(args.context + 1) // args.block_size)
    owners = [layer, layer.compressor, layer.indexer.compressor]
    pool = KVCachePool([m.kv_cache_spec() for m in owners], args.block_size,
                       args.batch * blocks_per_seq + 1, device)
    gen = torch.Generator(device=device).manual_seed(1)
    for i, owner in enumerate(owners):
        owner.kv_cache = pool.layer_views(i)
        view = owner.kv_cache[0]
        view.copy_(torch.randn(view.shape, generator=gen, device=device, dtype=view.dtype))
    seqs = [Seq([0] * (args.context + 1), args.context,
                list(range(1 + i * blocks_per_seq, 1 + (i + 1) * blocks_per_seq)))
            for i in range(args.batch)]
    _, positions, metadata = make_step(seqs, args.block_size)
    for name in ("query_start_loc", "seq_lens", "block_tables", "slot_blocks", "slot_offsets"):
        setattr(metadata, name, getattr(metadata, name).to(device))
    positions = positions.to(device)
    rope_cs = {label: rope.cos_sin(positions) for label, rope in ropes.items()}
    hidden = torch.randn(args.batch, config.hidden_size, device=device, dtype=dtype)
    q = torch.randn(args.batch, 64, 512, device=device, dtype=dtype)
    q_res = torch.randn(args.batch, config.q_lora_rank, device=device, dtype=dtype)
    num = (args.context + 1) // 4
    everything = torch.arange(num, device=device).expand(args.batch, -1)
    (cache,) = layer.kv_cache
    rows = torch.arange(args.batch, device=device)[:, None].expand(-1, args.context + 1)
    raw_pos = torch.arange(args.context + 1, device=device).expand(args.batch, -1)
    all_tokens = torch.ones(args.batch, args.context + 1, dtype=torch.bool, device=device)
    indexer = "indexer (compress + scores + top-k)"
    kept = f"attend window + top-{args.topk} entries"
    dense = f"attend all {args.context + 1} tokens (MQA, same code)"
    with torch.inference_mode():
        selection = layer.indexer(hidden, q_res, positions, rope_cs["compress"], metadata)
        parts = {
            indexer: lambda: layer.indexer(hidden, q_res, positions, rope_cs["compress"],
                                           metadata),
            kept: lambda: layer._decode(q, positions, selection, metadata),
            f"attend window + all {num} entries": lambda: layer._decode(
                q, positions, everything, metadata),
            dense: lambda: sink_attention(
                q, paged_rows(cache, metadata.block_tables, rows, raw_pos), all_tokens,
                layer.attn_sink, layer.scale),
            "whole sparse layer step": lambda: layer(hidden, positions, rope_cs, metadata),
        }
        times = median_times(parts, args, device)
    return times, indexer, kept, dense


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="dsa", choices=["dsa", "msa", "csa"])
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--topk", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=128)
    parser.add_argument("--index-heads", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--no-mla-dense", dest="mla_dense", action="store_false",
                        help="skip the engine's dense MLA decode (on CPU in bf16 it expands the "
                             "latents per head: ~5 GB per sequence at 8k x 128 heads)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=5)
    args = parser.parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    if args.model == "msa":
        print(f"MSA: context {args.context}, kept keys {args.topk}, batch {args.batch}, "
              f"{args.dtype} on {device}")
        times, kept, dense = time_msa(args, device, dtype)
        for name, seconds in times.items():
            print(f"{name:44s} {seconds * 1e3:9.2f} ms")
        sparse = times["indexer (block scores + top-k)"] + times[kept]
        print(f"sparse (indexer + kept-block attention) / dense GQA decode: "
              f"{sparse / times[dense]:.2f}")
        return
    if args.model == "csa":
        print(f"CSA: context {args.context}, kept entries {args.topk}, batch {args.batch}, "
              f"{args.dtype} on {device}")
        times, indexer, kept, dense = time_csa(args, device, dtype)
        for name, seconds in times.items():
            print(f"{name:44s} {seconds * 1e3:9.2f} ms")
        sparse = times[indexer] + times[kept]
        print(f"sparse (indexer + window/kept-entry attention) / dense MQA over all tokens: "
              f"{sparse / times[dense]:.2f}")
        return
    print(f"context {args.context}, top-k {args.topk}, batch {args.batch}, heads {args.heads}, "
          f"indexer heads {args.index_heads}, {args.dtype} on {device}")
    layer, _, config = build_layer(args, args.topk, device, dtype)
    times = time_parts(layer, config, args, device, dtype)
    for name, seconds in times.items():
        print(f"{name:40s} {seconds * 1e3:9.2f} ms")
    sparse = times["indexer (scores + top-k)"] + times[f"attend top-{args.topk} (gathered)"]
    dense = times[f"attend all {args.context + 1} (same path)"]
    print(f"sparse (indexer + top-k attention) / dense attention, same path: "
          f"{sparse / dense:.2f}")

if __name__ == "__main__":
    main()
