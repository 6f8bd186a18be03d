"""Every torch.distributed collective the engine uses, in one place.

torch's collective API changes between releases (``all_gather_into_tensor`` and
``reduce_scatter_tensor`` warn in 2.13 in favour of ``*_single``); the layers call
:class:`GroupCollectives` and only this file follows torch. A group of one rank
answers every call locally without touching torch.distributed, so single-process
runs pay nothing and need no process group.
"""

from __future__ import annotations

import pickle
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["CollectiveTimer", "GroupCollectives", "SINGLE_RANK"]


@dataclass
class CollectiveTimer:
    """Wall time and count of the collectives a group ran (bench/distributed.py reads it).

    Off by default: timing a collective means waiting for it (``synchronize``)."""

    enabled: bool = False
    seconds: float = 0.0
    calls: int = 0
    by_op: dict[str, float] = field(default_factory=dict)

    def reset(self) -> None:
        self.seconds, self.calls = 0.0, 0
        self.by_op.clear()


# torch 2.13 deprecates the *_into_tensor / *_tensor names in favour of *_single.
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _sync(t: torch.Tensor) -> None:
    if t.device.type == "cuda":
        torch.cuda.synchronize(t.device)


class GroupCollectives:
    """The collectives of one process group (TP, EP, DP or the world).

    Args:
        group: the torch process group; None for a group of one rank (no-ops).
        ranks: the global ranks in the group, in group-rank order.
        cpu_group: a gloo group over the same ranks for Python objects (step inputs);
            the device group when it is gloo already.
    """

    def __init__(self, group: Any, ranks: list[int], cpu_group: Any = None,
                 rank_in_group: int = 0) -> None:
        self.group = group
        self.cpu_group = cpu_group if cpu_group is not None else group
        self.ranks = list(ranks)
        self.size = len(self.ranks)
        self.rank = rank_in_group
        self.timer = CollectiveTimer()

    @property
    def is_single(self) -> bool:
        return self.size == 1

    def _timed(self, name: str, t: torch.Tensor, start: float) -> None:
        _sync(t)
        elapsed = time.perf_counter() - start
        self.timer.seconds += elapsed
        self.timer.calls += 1
        self.timer.by_op[name] = self.timer.by_op.get(name, 0.0) + elapsed

    # ---- tensors ---------------------------------------------------------------
    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` over the group, in place; returns ``t``."""
        if self.size == 1:
            return t
        start = time.perf_counter() if self.timer.enabled else 0.0
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group)
        if self.timer.enabled:
            self._timed("all_reduce", t, start)
        return t

    def all_gather(self, t: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """Concatenate every rank's ``t`` (same shape on all) along ``dim``, rank order."""
        if self.size == 1:
            return t
        start = time.perf_counter() if self.timer.enabled else 0.0
        t = t.contiguous()
        out = torch.empty((self.size * t.shape[0], *t.shape[1:]), dtype=t.dtype,
                          device=t.device)
        _ALL_GATHER(out, t, group=self.group)
        if dim != 0:
            out = torch.cat(out.chunk(self.size, dim=0), dim=dim)
        if self.timer.enabled:
            self._timed("all_gather", out, start)
        return out

    def reduce_scatter(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t [size * n, ...]`` over the group; rank r keeps rows ``r*n:(r+1)*n``."""
        if self.size == 1:
            return t
        start = time.perf_counter() if self.timer.enabled else 0.0
        t = t.contiguous()
        if t.shape[0] % self.size:
            raise ValueError(f"reduce_scatter: {t.shape[0]} rows do not split over "
                             f"{self.size} ranks")
        out = torch.empty((t.shape[0] // self.size, *t.shape[1:]), dtype=t.dtype,
                          device=t.device)
        _REDUCE_SCATTER(out, t, op=dist.ReduceOp.SUM, group=self.group)
        if self.timer.enabled:
            self._timed("reduce_scatter", out, start)
        return out

    def all_to_all(self, t: torch.Tensor, send_splits: list[int],
                   recv_splits: list[int]) -> torch.Tensor:
        """Rows ``t[sum(send_splits[:r]) : ...]`` go to rank r; returns what every rank sent
        here, in rank order (uneven splits: ``recv_splits[r]`` rows from rank r)."""
        if self.size == 1:
            return t
        start = time.perf_counter() if self.timer.enabled else 0.0
        out = torch.empty((sum(recv_splits), *t.shape[1:]), dtype=t.dtype, device=t.device)
        dist.all_to_all_single(out, t.contiguous(), output_split_sizes=recv_splits,
                               input_split_sizes=send_splits, group=self.group)
        if self.timer.enabled:
            self._timed("all_to_all", out, start)
        return out

    def exchange_counts(self, counts: torch.Tensor) -> torch.Tensor:
        """``counts [size]`` int64 (rows this rank sends to each rank) -> ``[size]`` rows each
        rank sends here (one ``all_to_all_single`` of one element per rank)."""
        if self.size == 1:
            return counts
        out = torch.empty_like(counts)
        dist.all_to_all_single(out, counts.contiguous(), group=self.group)
        return out

    def broadcast(self, t: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Group rank ``src``'s ``t`` on every rank, in place."""
        if self.size == 1:
            return t
        dist.broadcast(t, src=self.ranks[src], group=self.group)
        return t

    # ---- Python objects --------------------------------------------------------
    def broadcast_object(self, obj: Any = None, src: int = 0) -> Any:
        """Group rank ``src``'s picklable ``obj`` on every rank (over the CPU group):
        one length broadcast, then the bytes."""
        if self.size == 1:
            return obj
        if self.rank == src:
            payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
            length = torch.tensor([payload.numel()], dtype=torch.int64)
        else:
            length = torch.zeros(1, dtype=torch.int64)
        dist.broadcast(length, src=self.ranks[src], group=self.cpu_group)
        if self.rank != src:
            payload = torch.empty(int(length.item()), dtype=torch.uint8)
        dist.broadcast(payload, src=self.ranks[src], group=self.cpu_group)
        return obj if self.rank == src else pickle.loads(payload.numpy().tobytes())

    def host_sum(self, values: list[int]) -> list[int]:
        """Sum small host integers over the group on its CPU group (flags, token counts)."""
        if self.size == 1:
            return list(values)
        start = time.perf_counter() if self.timer.enabled else 0.0
        t = torch.tensor(values, dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.cpu_group)
        if self.timer.enabled:  # DP lockstep rounds: the wait for the slowest DP rank
            self._timed("host_sum", t, start)
        return t.tolist()

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's picklable ``obj``, in group-rank order (over the CPU group)."""
        if self.size == 1:
            return [obj]
        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, obj, group=self.cpu_group)
        return out

    def barrier(self) -> None:
        if self.size > 1:
            dist.barrier(group=self.cpu_group)


# The group of a single process: every collective is the identity.
SINGLE_RANK = GroupCollectives(None, [0])
