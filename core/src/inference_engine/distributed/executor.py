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

from inference_engine.distributed.worker import MIRRORED_CALLS

__all__ = ["DistributedExecutor", "DriverRunner", "RankFailedError"]

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
