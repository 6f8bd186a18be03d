"""Block pool layout and block manager behaviour (allocation, sharing, LRU eviction)."""

from __future__ import annotations

import torch

from inference_engine.engine.kv_cache import BlockManager, KVCachePool, chain_hash
from inference_engine.interfaces.attention import KVCacheSpec


def test_pool_views_are_block_contiguous_and_disjoint():
    specs = [KVCacheSpec(2, 2, 4, torch.float32), KVCacheSpec(2, 2, 4, torch.bfloat16)]
    pool = KVCachePool(specs, block_size=4, num_blocks=5, device=torch.device("cpu"))
    k0, v0 = pool.layer_views(0)
    k1, v1 = pool.layer_views(1)
    assert k0.shape == (5, 4, 2, 4) and k1.dtype == torch.bfloat16
    k1[3].fill_(1.0)
    # Only block 3's bytes changed, and only inside layer 1's K slice.
    changed = (pool.storage != 0).nonzero()[:, 0].unique().tolist()
    assert changed == [3]
    assert k0.abs().sum() == 0 and v0.abs().sum() == 0 and v1.abs().sum() == 0
    # One block is one contiguous byte range holding every layer.
    assert pool.storage[3].is_contiguous()
    assert pool.bytes_per_block >= sum(s.bytes_per_block(4) for s in specs)


def test_allocate_free_and_capacity():
    bm = BlockManager(num_blocks=5, block_size=4)
    assert bm.num_free_blocks == 4  # block 0 is the reserved padding block
    assert bm.allocate("a", 9)  # 3 blocks
    assert 0 not in bm.req_blocks["a"]
    assert not bm.allocate("b", 8)  # needs 2, only 1 free: refused, nothing taken
    assert "b" not in bm.req_blocks or bm.req_blocks["b"] == []
    assert bm.num_free_blocks == 1
    bm.free("a")
    assert bm.num_free_blocks == 4


def test_prefix_cache_hits_share_blocks_and_leave_one_token():
    bm = BlockManager(num_blocks=10, block_size=4)
    tokens = list(range(12))
    assert bm.match_prefix("a", tokens) == 0
    bm.allocate("a", 12)
    bm.cache_full_blocks("a", tokens, 12)
    # Same 12 tokens: the last block must be recomputed so the step yields logits.
    assert bm.match_prefix("b", tokens) == 8
    assert bm.req_blocks["b"] == bm.req_blocks["a"][:2]
    # A different second block stops the chain after the first.
    other = tokens[:4] + [99] * 8
    assert bm.match_prefix("c", other) == 4
    assert bm.stats.hit_tokens == 12 and bm.stats.queried_tokens == 36


def test_freed_cached_blocks_evicted_lru():
    bm = BlockManager(num_blocks=4, block_size=2)  # 3 usable blocks
    first = [1, 2, 3, 4]
    bm.allocate("a", 4)
    bm.cache_full_blocks("a", first, 4)
    bm.free("a")
    assert bm.num_free_blocks == 3
    # Still findable after free.
    assert bm.match_prefix("b", first + [5]) == 4
    bm.free("b")
    # Filling the pool evicts cached blocks; then the prefix is gone.
    assert bm.allocate("c", 6)
    bm.free("c")
    assert bm.match_prefix("d", first + [5]) == 0


def test_chain_hash_depends_on_parent():
    assert chain_hash(None, [1, 2]) != chain_hash(chain_hash(None, [0, 0]), [1, 2])
