"""Executors: how the ranks of a distributed engine are started and driven.

- ``mp`` (:mod:`.mp_executor`, one node): the engine process is rank 0; it spawns
  one process per other local device and sends each the runner calls it makes.
- ``ray`` (:mod:`.ray_executor`, several nodes): the same, the other ranks being
  Ray actors placed one per device across the cluster.
- ``external_launcher`` (``torchrun``, SPMD): every rank is a whole engine run by
  the same program; each schedules the same requests alike and samples the same
  tokens (same seed), and the model's collectives keep them in step.

:class:`DriverRunner` stands in for rank 0's model runner: the calls every rank
must make together (:data:`~.worker.MIRRORED_CALLS`) are sent to the workers
first, then run here. A worker that has died turns the next call (or the
collective it was part of) into :class:`RankFailedError`, never a hang: the
collectives carry a timeout (``collective_timeout``).
"""

from __future__ import annotations

import logging
import socket
from abc import ABC, abstractmethod
from typing import Any

from inference_engine.config import EngineConfig
from inference_engine.distributed.worker import MIRRORED_CALLS

__all__ = ["DistributedExecutor", "DriverRunner", "RankFailedError", "start_executor"]

logger = logging.getLogger(__name__)


class RankFailedError(RuntimeError):
    """A rank of the distributed engine died or failed: its requests cannot finish."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class DistributedExecutor(ABC):
    """The other ranks of this engine, as rank 0 sees them."""

    @abstractmethod
    def send(self, method: str, args: tuple[Any, ...]) -> None:
        """Start ``runner.method(*args)`` on every other rank (rank 0 runs it next).

        Raises:
            RankFailedError: a rank has died.
        """

    def finish(self) -> None:  # noqa: B027 - optional
        """After rank 0 ran a call: collect the other ranks' completion (raises their error)."""

    @abstractmethod
    def dead_ranks(self) -> list[str]:
        """The ranks known to have died, described (``rank 1 (pid 123, exit -9)``)."""

    @abstractmethod
    def shutdown(self) -> None:
        """Stop the workers and leave the process group (idempotent)."""

    def wrap_runner(self, runner: Any) -> Any:
        return DriverRunner(runner, self)


class DriverRunner:
    """Rank 0's :class:`~inference_engine.engine.model_runner.ModelRunner`, mirroring the
    collective calls to the other ranks (every other attribute is the runner's own)."""

    def __init__(self, runner: Any, executor: DistributedExecutor) -> None:
        self._runner = runner
        self._executor = executor

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._runner, name)
        if name not in MIRRORED_CALLS:
            return attr

        def mirrored(*args: Any) -> Any:
            self._executor.send(name, args)
            try:
                result = attr(*args)
            except Exception as exc:
                dead = self._executor.dead_ranks()
                if dead:
                    raise RankFailedError(f"{', '.join(dead)} died during {name}: "
                                          f"{type(exc).__name__}: {exc}") from exc
                raise
            self._executor.finish()
            return result

        return mirrored


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
