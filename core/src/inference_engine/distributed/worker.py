"""One rank of a distributed engine outside the engine process: its model shard and runner.

The engine process is rank 0 and schedules; every other rank holds a
:class:`RankWorker` (in a spawned process, a Ray actor, or ``torchrun``'s
process) that builds the same model shard and :class:`ModelRunner` and runs
the runner calls the engine sends it (:data:`MIRRORED_CALLS`: KV allocation,
the profiling run, each step's forward), so its collectives meet rank 0's.
Workers never sample: the gathered logits are only read on rank 0.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from inference_engine.config import EngineConfig

__all__ = ["MIRRORED_CALLS", "RankWorker", "rank_device_ids"]

logger = logging.getLogger(__name__)

# ModelRunner methods that every rank must run in step with rank 0 (each may run collectives).
MIRRORED_CALLS = ("allocate_kv_cache", "release_kv_cache", "execute_batch", "profile_run",
                  "allocate_state_cache")


def rank_device_ids(config: EngineConfig, local_rank: int) -> list[int] | None:
    """The one device a local rank drives: ``--device-ids``' entry for it, else its index."""
    ids = config.parallel.device_ids
    if isinstance(ids, list) and ids:
        return [ids[local_rank]]
    if local_rank == 0:
        return None
    from inference_engine.platforms.selection import select_platform

    # Without --device-ids local rank r takes device r (the host's one device on the CPU).
    return [local_rank % max(1, select_platform(config.parallel.platform).device_count())]


def share_cpu_threads(local_world_size: int) -> None:
    """Give each of the ranks on this host an equal share of the intra-op threads (ranks that
    all used every core would slow each other down several-fold)."""
    torch.set_num_threads(max(1, torch.get_num_threads() // max(1, local_world_size)))


class RankWorker:
    """Rank ``rank`` of ``world_size``: joins the groups, loads its shard, runs runner calls.

    Args:
        config: the engine's config (the same on every rank).
        init_method: the rendezvous (``tcp://host:port`` or ``env://``).
        device_ids: the device this rank drives (see :func:`rank_device_ids`).
    """

    def __init__(self, config: EngineConfig, rank: int, world_size: int, local_rank: int,
                 init_method: str, device_ids: list[int] | None,
                 local_world_size: int = 1) -> None:
        from inference_engine.distributed.parallel_state import init_parallel
        from inference_engine.engine.loader import load_model
        from inference_engine.engine.model_runner import ModelRunner
        from inference_engine.platforms.selection import select_platform, set_current_platform

        share_cpu_threads(local_world_size)
        par = config.parallel
        self.platform = select_platform(par.platform, device_ids)
        set_current_platform(self.platform)
        self.platform.set_up_process()
        if config.model.seed is not None:
            torch.manual_seed(config.model.seed)
        init_parallel(rank, world_size, par.tensor_parallel_size, par.data_parallel_size,
                      par.enable_expert_parallel, self.platform.distributed_backend(),
                      init_method, local_rank, par.all2all_backend, par.collective_timeout)
        loaded = load_model(config.model, config.quant, self.platform, show_progress=False)
        sched = config.scheduler
        self.runner = ModelRunner(
            loaded.model, self.platform, config.cache.block_size, loaded.max_model_len,
            sched.max_num_seqs or self.platform.default_max_num_seqs(),
            sched.max_num_batched_tokens, enforce_eager=True)
        self.rank = rank

    def call(self, method: str, args: tuple[Any, ...]) -> None:
        """Run one mirrored runner call (its result stays here: rank 0 has the same)."""
        if method not in MIRRORED_CALLS:
            raise ValueError(f"rank {self.rank}: {method!r} is not a mirrored runner call")
        getattr(self.runner, method)(*args)

    def close(self) -> None:
        from inference_engine.distributed.parallel_state import destroy_parallel

        destroy_parallel()


def engine_device_ids(config: EngineConfig) -> list[int] | None:
    """The devices the engine process's own platform binds: all of ``--device-ids`` on one
    rank, else the device of this process's rank (rank 0, or torchrun's LOCAL_RANK)."""
    par = config.parallel
    if par.executor_backend == "uni":
        return par.device_ids if isinstance(par.device_ids, list) else None
    # A DP rank the data-parallel front end started: its TP group's first rank.
    local_rank = (par.data_parallel_rank or 0) * par.tensor_parallel_size
    if par.executor_backend == "external_launcher":
        from inference_engine.distributed.parallel_state import torchrun_env

        env = torchrun_env()
        local_rank = env[2] if env is not None else 0
    return rank_device_ids(config, local_rank)
