"""Starting the executor a distributed engine's configuration asks for.

Apart from :mod:`.executor` (the base classes), so the executors depend on the base
and only this module on them (no import circle).
"""

from __future__ import annotations

from typing import Any

from inference_engine.config import EngineConfig
from inference_engine.distributed.executor import DistributedExecutor

__all__ = ["start_executor"]


def start_executor(config: EngineConfig) -> DistributedExecutor | None:
    """Join (or start) the distributed job ``config.parallel`` describes; None for one rank.

    Called by the engine before it builds the model (layers read the groups when built).

    Raises:
        ValueError: external_launcher outside torchrun, or sizes that do not match it.
    """
    from inference_engine.distributed.parallel_state import init_parallel, torchrun_env
    from inference_engine.platforms.selection import current_platform

    par = config.parallel
    world = par.world_size
    backend = par.executor_backend
    if world == 1 and backend != "external_launcher":
        return None
    if config.lora.enable_lora:
        raise ValueError("--enable-lora with tensor/expert parallelism is not implemented")
    platform = current_platform()
    if backend == "external_launcher":
        env = torchrun_env()
        if env is None:
            raise ValueError("--distributed-executor-backend external_launcher: RANK and "
                             "WORLD_SIZE are not set; start the program with torchrun")
        rank, env_world, local_rank = env
        if env_world != world:
            raise ValueError(f"torchrun started {env_world} processes but tensor_parallel_size "
                             f"x data_parallel_size is {world}")
        init_parallel(rank, world, par.tensor_parallel_size, par.data_parallel_size,
                      par.enable_expert_parallel, platform.distributed_backend(), "env://",
                      local_rank, par.all2all_backend, par.collective_timeout)
        return _ExternalLauncher()
    if par.data_parallel_size > 1 and backend in ("mp", "ray"):
        if par.data_parallel_rank is None:
            raise ValueError("--data-parallel-size > 1 with the mp / ray executor: build the "
                             "engine with inference_engine.distributed.dp_frontend.make_engine "
                             "(LLM and serve do), which starts one engine per DP rank")
        if par.tensor_parallel_size == 1:
            return _DataParallelRank(config, platform)
    if backend == "ray":
        from inference_engine.distributed.ray_executor import RayExecutor

        return RayExecutor(config, platform)
    from inference_engine.distributed.mp_executor import MultiprocExecutor

    return MultiprocExecutor(config, platform)


class _ExternalLauncher(DistributedExecutor):
    """torchrun started every rank: nothing to send, every rank runs its own engine (with
    data parallelism, its DP rank's requests, forwards in lockstep with the other DP ranks)."""

    def send(self, method: str, args: tuple[Any, ...]) -> None:
        return None

    def dead_ranks(self) -> list[str]:
        return []

    def wrap_runner(self, runner: Any) -> Any:
        from inference_engine.distributed.data_parallel import LockstepRunner
        from inference_engine.distributed.parallel_state import parallel_state

        dp = parallel_state().dp
        return LockstepRunner(runner, dp) if dp.size > 1 else runner

    def shutdown(self) -> None:
        from inference_engine.distributed.parallel_state import destroy_parallel

        destroy_parallel()


class _DataParallelRank(_ExternalLauncher):
    """One DP rank of one rank (no TP workers) started by the data-parallel front end: joins
    the world as rank ``data_parallel_rank``; its forwards run in lockstep with the other DP
    ranks' (:class:`~.data_parallel.LockstepRunner`), as under torchrun."""

    def __init__(self, config: EngineConfig, platform: Any) -> None:
        from inference_engine.distributed.parallel_state import init_parallel
        from inference_engine.distributed.worker import share_cpu_threads

        par = config.parallel
        rank = par.data_parallel_rank
        share_cpu_threads(par.world_size)
        init_parallel(rank, par.world_size, 1, par.data_parallel_size,
                      par.enable_expert_parallel, platform.distributed_backend(),
                      par.data_parallel_init_method, rank, par.all2all_backend,
                      par.collective_timeout)
