"""The paged KV pool and the block manager with prefix caching.

The pool is one ``[num_blocks, bytes_per_block]`` byte tensor: a physical block
holds every layer's K and V for ``block_size`` tokens in one contiguous range,
so a block is the unit of allocation, freeing and (later) offload. Each layer
sees strided typed views into its slice of every block.
"""

from __future__ import annotations

import logging
import mmap
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from inference_engine.engine.state_cache import StateSlotManager
from inference_engine.interfaces.attention import KVCacheSpec

__all__ = ["BlockManager", "KVCachePool", "NoFreeBlocksError", "PrefixCacheStats"]

logger = logging.getLogger(__name__)

# Block 0 is never handed out: block tables are padded with it and it stays zero.
NULL_BLOCK = 0


class NoFreeBlocksError(RuntimeError):
    """The pool cannot hold one more block."""


def _zeroed_storage(num_blocks: int, bytes_per_block: int, device: torch.device) -> torch.Tensor:
    """A zero-filled ``[num_blocks, bytes_per_block]`` uint8 pool.

    Zeros matter: some attention paths read slots no token has written yet
    (masked, but NaN garbage times a zero weight is still NaN). On CPU the
    pool is an anonymous memory mapping, which the OS hands out zeroed and
    backs page by page as blocks are used: ``torch.zeros`` wrote every byte
    and made start-up seconds slower for a gigabytes-large default pool.
    """
    if device.type != "cpu" or num_blocks * bytes_per_block == 0:
        return torch.zeros(num_blocks, bytes_per_block, dtype=torch.uint8, device=device)
    mapping = mmap.mmap(-1, num_blocks * bytes_per_block)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        # Transparent huge pages where the kernel allows them ("madvise" mode): a block's
        # first write faults once per 2 MiB instead of once per 4 KiB page. (The
        # development sandbox grants no huge pages, so this is not measured there.)
        mapping.madvise(mmap.MADV_HUGEPAGE)
    storage = torch.frombuffer(mapping, dtype=torch.uint8).view(num_blocks, bytes_per_block)
    return storage  # the tensor keeps the mapping alive through the buffer protocol


def fault_in(storage: torch.Tensor) -> float:
    """Touch every page of a lazily backed pool now; returns the seconds it took.

    A fresh engine otherwise pays the page faults inside its first requests' steps (the
    64-request benchmark ran ~7 % slower on a fresh engine than on a warm one on the
    development VM, ~1 % after this). Writing one zero per page keeps the pool zeroed.
    """
    start = time.perf_counter()
    flat = storage.view(-1)
    if flat.numel():
        flat[:: mmap.PAGESIZE].zero_()
    return time.perf_counter() - start


class KVCachePool:
    """Allocates the block-contiguous pool and hands each layer its views."""

    def __init__(
        self,
        specs: Sequence[KVCacheSpec],
        block_size: int,
        num_blocks: int,
        device: torch.device,
    ) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.specs = list(specs)
        self.layer_offsets: list[int] = []
        offset = 0
        for spec in self.specs:
            elem = torch.empty((), dtype=spec.dtype).element_size()
            offset = -(-offset // elem) * elem  # align each layer's slice to its element size
            self.layer_offsets.append(offset)
            offset += spec.bytes_per_block(block_size)
        self.bytes_per_block = -(-offset // 64) * 64
        self.storage = _zeroed_storage(num_blocks, self.bytes_per_block, device)
        # On CPU the pool is a lazy mapping: its pages are faulted in here, at start-up.
        self.fault_in_seconds = fault_in(self.storage) if device.type == "cpu" else 0.0

    @staticmethod
    def bytes_per_block_for(specs: Sequence[KVCacheSpec], block_size: int) -> int:
        total = sum(s.bytes_per_block(block_size) for s in specs) + 8 * len(specs)
        return -(-total // 64) * 64

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy whole blocks (every layer's K and V) ``source -> destination``, in one device op.

        A forked sample's copy of its parent's partial last block (``BlockManager.fork``).
        """
        if not pairs:
            return
        device = self.storage.device
        src = torch.tensor([s for s, _ in pairs], dtype=torch.int64).to(device)
        dst = torch.tensor([d for _, d in pairs], dtype=torch.int64).to(device)
        self.storage.index_copy_(0, dst, self.storage.index_select(0, src))

    def layer_views(self, layer: int) -> tuple[torch.Tensor, ...]:
        """The layer's tensors, each ``[num_blocks, block_size, heads, head_dim]``."""
        spec = self.specs[layer]
        per_tensor = spec.bytes_per_block(self.block_size) // spec.num_tensors
        views = []
        for t in range(spec.num_tensors):
            start = self.layer_offsets[layer] + t * per_tensor
            raw = self.storage[:, start : start + per_tensor]
            views.append(
                raw.view(spec.dtype).view(self.num_blocks, self.block_size, spec.num_heads, spec.head_dim)
            )
        return tuple(views)


@dataclass
class PrefixCacheStats:
    """Prompt tokens looked up in the prefix cache and how many were found."""

    queried_tokens: int = 0
    hit_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


def chain_hash(parent: int | None, token_ids: Sequence[int]) -> int:
    """Key of a full block: its tokens and, through ``parent``, every token before."""
    return hash((parent, tuple(token_ids)))


class BlockManager:
    """Owns block ids: per-request block lists, reference counts, prefix cache.

    Free cached blocks stay findable by hash until evicted least-recently-used;
    a hit takes them back. Blocks are shared by reference count.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError(f"the KV pool needs at least 2 blocks, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._free: list[int] = list(range(num_blocks - 1, NULL_BLOCK, -1))  # pop() gives low ids first
        self._ref = [0] * num_blocks
        self._block_hash: list[int | None] = [None] * num_blocks
        self._cached: dict[int, int] = {}  # hash -> block id
        self._evictable: OrderedDict[int, None] = OrderedDict()  # free cached blocks, LRU first
        self.req_blocks: dict[str, list[int]] = {}
        self._req_hashes: dict[str, list[int]] = {}
        self.stats = PrefixCacheStats()
        # Per-sequence state slots (hybrid models): a request takes one with its first
        # blocks and gives it back with them. None: the model keeps no such state.
        self.state_slots: StateSlotManager | None = None

    # ---- capacity -------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free) + len(self._evictable)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / (self.num_blocks - 1)

    def blocks_needed(self, request_id: str, num_tokens: int) -> int:
        have = len(self.req_blocks.get(request_id, ()))
        return max(0, -(-num_tokens // self.block_size) - have)

    # ---- prefix cache ---------------------------------------------------
    def match_prefix(self, request_id: str, token_ids: Sequence[int],
                     salt: int | None = None) -> int:
        """Attach cached blocks for the longest cached prefix; return tokens covered.

        At least one token is always left to compute so the step yields logits. ``salt``
        keys what else the K/V depend on (a LoRA adapter): only equal salts share blocks.
        """
        if not self.enable_prefix_caching or request_id in self.req_blocks:
            return 0
        bs = self.block_size
        max_blocks = (len(token_ids) - 1) // bs
        self.stats.queried_tokens += len(token_ids)
        blocks: list[int] = []
        hashes: list[int] = []
        parent: int | None = salt
        for i in range(max_blocks):
            h = chain_hash(parent, token_ids[i * bs : (i + 1) * bs])
            block = self._cached.get(h)
            if block is None:
                break
            blocks.append(block)
            hashes.append(h)
            parent = h
        for block in blocks:
            if self._ref[block] == 0:
                self._evictable.pop(block, None)
            self._ref[block] += 1
        self.req_blocks[request_id] = blocks
        self._req_hashes[request_id] = hashes
        hit = len(blocks) * bs
        self.stats.hit_tokens += hit
        return hit

    def cache_full_blocks(self, request_id: str, token_ids: Sequence[int], num_computed: int,
                          salt: int | None = None) -> None:
        """Register the request's blocks that are now full of computed tokens (``salt``: as
        for :meth:`match_prefix`)."""
        if not self.enable_prefix_caching:
            return
        blocks = self.req_blocks.get(request_id)
        if not blocks:
            return
        hashes = self._req_hashes.setdefault(request_id, [])
        bs = self.block_size
        full = min(num_computed // bs, len(blocks))
        parent = hashes[-1] if hashes else salt
        for i in range(len(hashes), full):
            h = chain_hash(parent, token_ids[i * bs : (i + 1) * bs])
            hashes.append(h)
            parent = h
            block = blocks[i]
            if h not in self._cached and self._block_hash[block] is None:
                self._cached[h] = block
                self._block_hash[block] = h

    # ---- allocation -----------------------------------------------------
    def _take_block(self) -> int:
        if self._free:
            block = self._free.pop()
        elif self._evictable:
            block, _ = self._evictable.popitem(last=False)
            h = self._block_hash[block]
            if h is not None and self._cached.get(h) == block:
                del self._cached[h]
            self._block_hash[block] = None
        else:
            raise NoFreeBlocksError("no free KV blocks")
        self._ref[block] = 1
        return block

    def allocate(self, request_id: str, num_tokens: int) -> bool:
        """Grow the request's table to hold ``num_tokens``; False (and no change) if full."""
        if self.state_slots is None:  # the common decode step: its blocks hold it already
            table = self.req_blocks.get(request_id)
            if table is not None and len(table) * self.block_size >= num_tokens:
                return True
        need = self.blocks_needed(request_id, num_tokens)
        if need > self.num_free_blocks:
            return False
        if self.state_slots is not None and not self.state_slots.can_allocate(request_id):
            return False
        table = self.req_blocks.setdefault(request_id, [])
        for _ in range(need):
            table.append(self._take_block())
        if self.state_slots is not None:
            self.state_slots.allocate(request_id)
        return True

    def fork(self, parent_id: str, child_id: str, num_tokens: int) -> list[tuple[int, int]] | None:
        """Give ``child_id`` the parent's cache of its first ``num_tokens`` tokens (vLLM's
        sequence fork): shares of the full blocks (reference counts: nobody writes a full
        block again) and a fresh block for a partial last one (the parent writes on into its
        own), plus a state slot of its own where the model keeps per-sequence state.

        Returns:
            The ``(source, destination)`` block copies the device must make before either
            sequence computes again (the partial block; the state slot is copied by the
            caller), or None, with nothing taken, when no block or slot is free.

        Raises:
            ValueError: the child holds blocks already, or the parent holds too few.
        """
        if child_id in self.req_blocks:
            raise ValueError(f"cannot fork into {child_id!r}: it holds blocks already")
        parent = self.req_blocks.get(parent_id, [])
        num_full, partial = divmod(num_tokens, self.block_size)
        if len(parent) < num_full + bool(partial):
            raise ValueError(f"cannot fork {num_tokens} tokens of {parent_id!r}: it holds "
                             f"{len(parent)} blocks of {self.block_size}")
        if partial and not self.num_free_blocks:
            return None
        if self.state_slots is not None and not self.state_slots.can_allocate(child_id):
            return None
        table = parent[:num_full]
        for block in table:
            self._ref[block] += 1
        copies = []
        if partial:
            copies.append((parent[num_full], self._take_block()))
            table.append(copies[0][1])
        self.req_blocks[child_id] = table
        if parent_id in self._req_hashes:
            self._req_hashes[child_id] = self._req_hashes[parent_id][:num_full]
        if self.state_slots is not None:
            self.state_slots.allocate(child_id)
        return copies

    def free(self, request_id: str) -> None:
        """Release the request's blocks; cached ones stay findable until evicted."""
        blocks = self.req_blocks.pop(request_id, [])
        self._req_hashes.pop(request_id, None)
        if self.state_slots is not None:
            self.state_slots.free(request_id)
        # Tail blocks first, so the least useful part of a prefix is evicted first.
        for block in reversed(blocks):
            self._ref[block] -= 1
            if self._ref[block] == 0:
                if self._block_hash[block] is not None:
                    self._evictable[block] = None
                else:
                    self._free.append(block)

    def reset_prefix_cache(self) -> None:
        """Forget every free cached block (used blocks keep working)."""
        for block in list(self._evictable):
            self._cached.pop(self._block_hash[block], None)
            self._block_hash[block] = None
            self._free.append(block)
        self._evictable.clear()


def num_blocks_for_memory(memory_bytes: int, bytes_per_block: int) -> int:
    return memory_bytes // bytes_per_block


def log_capacity(num_blocks: int, block_size: int, bytes_per_block: int,
                 dtypes: Sequence[torch.dtype] = (), max_model_len: int | None = None,
                 fault_in_seconds: float = 0.0) -> str:
    """The start-up line: blocks, tokens, how many full-length requests fit at once, and the
    time its pages took to fault in (CPU)."""
    kinds = "/".join(sorted({str(d).removeprefix("torch.") for d in dtypes}))
    tokens = (num_blocks - 1) * block_size
    message = (
        f"KV cache: {num_blocks - 1} blocks of {block_size} tokens "
        f"({bytes_per_block * num_blocks / 2**20:.1f} MiB{', ' + kinds if kinds else ''}), "
        f"up to {tokens} tokens in flight"
    )
    if max_model_len:
        message += (f"; maximum concurrency for {max_model_len}-token requests: "
                    f"{tokens / max_model_len:.2f}x")
    if fault_in_seconds:
        message += f"; pages faulted in at start-up in {fault_in_seconds:.2f} s"
    logger.info(message)
    return message
