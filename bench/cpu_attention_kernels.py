"""The CPU attention kernels on the bench model's shapes, against torch SDPA, one layer.

Decode: 64 sequences of 328 tokens (the 64-request workload's mean context), blocks
scattered over a pool eight times that size (as an 8-layer pool spreads them). Prefill:
one 2048-token chunk holding eight whole prompts of 102-512 tokens. 8 query heads over 4
KV heads of 64, a bfloat16 cache of 16-token blocks. The reference is what the torch
path does: gather each sequence's K/V into dense tensors, then
``scaled_dot_product_attention`` (causal for prefill); its output checks ours.

Run:  OMP_WAIT_POLICY=PASSIVE .venv/bin/python bench/cpu_attention_kernels.py
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from inference_engine.builtin.attention.cpu_decode_kernel import paged_decode_attention
from inference_engine.builtin.attention.cpu_prefill_kernel import paged_prefill_attention

HEADS, KV_HEADS, DIM, BLOCK = 8, 4, 64, 16
SCALE = DIM**-0.5


def median_ms(fn, repeats: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    """[T, heads, d] queries over [L, kv_heads, d] keys/values (GQA by repetition)."""
    group = HEADS // KV_HEADS
    k = k.float().repeat_interleave(group, 1).transpose(0, 1)
    v = v.float().repeat_interleave(group, 1).transpose(0, 1)
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k, v, is_causal=causal,
                                         scale=SCALE)
    return out.transpose(0, 1)


def gathered(cache: torch.Tensor, table: torch.Tensor, length: int) -> torch.Tensor:
    return cache[table].reshape(-1, KV_HEADS, DIM)[:length]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=100)
    args = parser.parse_args()
    torch.set_flush_denormal(True)
    gen = torch.Generator().manual_seed(0)

    n, length = 64, 328
    nblk = (length + BLOCK - 1) // BLOCK
    pool_blocks = n * nblk * 8
    pool = torch.randn(pool_blocks, 2, BLOCK, KV_HEADS, DIM, generator=gen).to(torch.bfloat16)
    k, v = pool[:, 0], pool[:, 1]
    tables = torch.randperm(pool_blocks, generator=gen)[: n * nblk].view(n, nblk)
    q = torch.randn(n, HEADS, DIM, generator=gen)
    lens = torch.full((n,), length, dtype=torch.long)

    def ours_decode():
        return paged_decode_attention(q, k, v, tables, lens, SCALE, None)

    def torch_decode():
        return torch.cat([sdpa(q[s : s + 1], gathered(k, tables[s], length),
                               gathered(v, tables[s], length), False) for s in range(n)])

    err = (ours_decode() - torch_decode()).abs().max().item()
    ours_ms, ref_ms = median_ms(ours_decode, args.repeats), median_ms(torch_decode, args.repeats)
    print(f"decode, {n} x {length} tokens: ours {ours_ms:.3f} ms, torch gather + SDPA "
          f"{ref_ms:.3f} ms ({ref_ms / ours_ms:.1f}x), max |diff| {err:.1e}")

    plens = [512, 400, 300, 256, 200, 150, 128, 102]
    pblk = max((p + BLOCK - 1) // BLOCK for p in plens)
    ppool = torch.randn(len(plens) * pblk, 2, BLOCK, KV_HEADS, DIM,
                        generator=gen).to(torch.bfloat16)
    pk, pv = ppool[:, 0], ppool[:, 1]
    ptables = torch.arange(len(plens) * pblk).view(len(plens), pblk)
    pq = torch.randn(sum(plens), HEADS, DIM, generator=gen)

    def ours_prefill():
        return paged_prefill_attention(pq, pk, pv, ptables, plens, plens, SCALE, None)

    def torch_prefill():
        outs, at = [], 0
        for s, p in enumerate(plens):
            outs.append(sdpa(pq[at : at + p], gathered(pk, ptables[s], p),
                             gathered(pv, ptables[s], p), True))
            at += p
        return torch.cat(outs)

    err = (ours_prefill() - torch_prefill()).abs().max().item()
    ours_ms = median_ms(ours_prefill, args.repeats // 4)
    ref_ms = median_ms(torch_prefill, args.repeats // 4)
    print(f"prefill, {sum(plens)}-token chunk: ours {ours_ms:.3f} ms, torch gather + SDPA "
          f"{ref_ms:.3f} ms ({ref_ms / ours_ms:.1f}x), max |diff| {err:.1e}")


if __name__ == "__main__":
    main()
