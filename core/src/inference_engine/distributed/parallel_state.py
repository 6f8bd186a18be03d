"""The process's parallel groups (TP, DP, EP, world), made in one place.

Every rank calls :func:`init_parallel` with the same sizes; it creates the
groups with ``new_group`` in one fixed order, as torch requires. Layers ask
:func:`parallel_state` once, when they are built, for their group's rank and
size; before (or without) :func:`init_parallel` every group is a single rank.

Rank layout (as vLLM): ``rank = dp_rank * tp + tp_rank``; the TP groups are
consecutive ranks, the DP groups stride by ``tp``, and the EP group (with
``--enable-expert-parallel``) spans all ``tp * dp`` ranks.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch.distributed as dist

from inference_engine.config import ALL2ALL_BACKENDS
from inference_engine.distributed.collectives import SINGLE_RANK, GroupCollectives

__all__ = ["ALL2ALL_BACKENDS", "ParallelState", "destroy_parallel", "init_parallel",
           "parallel_state"]



@dataclass
class ParallelState:
    """This process's place in the job and the collectives of each group."""

    rank: int
    world_size: int
    local_rank: int
    world: GroupCollectives
    tp: GroupCollectives
    dp: GroupCollectives
    # The expert-parallel group; a single rank when expert parallelism is off.
    ep: GroupCollectives
    all2all_backend: str = "allgather_reducescatter"

    @property
    def expert_parallel(self) -> bool:
        return self.ep.size > 1


_SINGLE = ParallelState(0, 1, 0, SINGLE_RANK, SINGLE_RANK, SINGLE_RANK, SINGLE_RANK)
_state: ParallelState = _SINGLE


def parallel_state() -> ParallelState:
    """The groups of this process (single ranks when no distributed job was started)."""
    return _state


def _group(ranks: list[int], backend: str, rank: int, timeout: datetime.timedelta
           ) -> GroupCollectives | None:
    """Make the group over ``ranks`` (every rank must call this in the same order); returns
    its collectives on the ranks that belong to it, else None."""
    if len(ranks) == 1:
        # new_group is still collective in torch: keep the call order identical on all ranks.
        dist.new_group(ranks, timeout=timeout)
        if backend != "gloo":
            dist.new_group(ranks, backend="gloo", timeout=timeout)
        return SINGLE_RANK if rank in ranks else None
    group = dist.new_group(ranks, timeout=timeout)
    cpu = group if backend == "gloo" else dist.new_group(ranks, backend="gloo", timeout=timeout)
    if rank not in ranks:
        return None
    return GroupCollectives(group, ranks, cpu, ranks.index(rank))


def init_parallel(rank: int, world_size: int, tensor_parallel_size: int,
                  data_parallel_size: int = 1, enable_expert_parallel: bool = False,
                  backend: str = "gloo", init_method: str = "env://", local_rank: int = 0,
                  all2all_backend: str = "allgather_reducescatter",
                  timeout_s: float = 120.0) -> ParallelState:
    """Join the job (``init_process_group``) and build every group.

    Args:
        backend: ``gloo`` (CPU) or ``nccl`` (GPUs); NCCL groups get a gloo twin for objects.
        init_method: ``env://`` (MASTER_ADDR/PORT, as torchrun sets) or ``tcp://host:port``.
        timeout_s: how long a collective may wait for a peer before it fails (a dead rank
            becomes an error, never a hang).

    Raises:
        ValueError: ``world_size`` is not ``tp * dp`` or the transport is unknown.
    """
    global _state
    if world_size != tensor_parallel_size * data_parallel_size:
        raise ValueError(f"world size {world_size} is not tensor_parallel_size "
                         f"({tensor_parallel_size}) x data_parallel_size ({data_parallel_size})")
    if all2all_backend not in ALL2ALL_BACKENDS:
        raise ValueError(f"--all2all-backend must be one of {', '.join(ALL2ALL_BACKENDS)}, "
                         f"got {all2all_backend!r}")
    timeout = datetime.timedelta(seconds=timeout_s)
    if not dist.is_initialized():
        dist.init_process_group(backend, init_method=init_method, rank=rank,
                                world_size=world_size, timeout=timeout)
    tp, dp = tensor_parallel_size, data_parallel_size
    world = _group(list(range(world_size)), backend, rank, timeout)
    tp_group = dp_group = None
    for d in range(dp):
        g = _group([d * tp + t for t in range(tp)], backend, rank, timeout)
        tp_group = g or tp_group
    for t in range(tp):
        g = _group([d * tp + t for d in range(dp)], backend, rank, timeout)
        dp_group = g or dp_group
    ep_group = world if enable_expert_parallel else SINGLE_RANK
    assert world is not None and tp_group is not None and dp_group is not None
    _state = ParallelState(rank, world_size, local_rank, world, tp_group, dp_group, ep_group,
                           all2all_backend)
    return _state


def destroy_parallel() -> None:
    """Leave the job and go back to single-rank groups."""
    global _state
    _state = _SINGLE
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def torchrun_env() -> tuple[int, int, int] | None:
    """(RANK, WORLD_SIZE, LOCAL_RANK) as torchrun sets them; None outside torchrun."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    return (int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]),
            int(os.environ.get("LOCAL_RANK", "0")))
