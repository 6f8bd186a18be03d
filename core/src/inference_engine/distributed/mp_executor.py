"""The one-node executor: rank 0 in the engine process, one spawned process per other rank.

Workers are started with the ``spawn`` context (CUDA cannot be forked), each
driving one local device (``--device-ids``); the engine sends each runner call
over a pipe, then runs it itself, and the model's collectives keep the ranks in
step. A worker that dies is found before the next call (its pipe and process)
or by the collective it leaves waiting (which fails, within the timeout).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

from inference_engine.config import EngineConfig
from inference_engine.distributed.executor import DistributedExecutor, RankFailedError, free_port
from inference_engine.distributed.worker import RankWorker, rank_device_ids, share_cpu_threads

__all__ = ["MultiprocExecutor"]

logger = logging.getLogger(__name__)


def _worker_main(config: EngineConfig, rank: int, world_size: int, init_method: str,
                 conn: Connection) -> None:
    """A spawned rank: build, report ready (or the error), then run calls until told to stop."""
    try:
        worker = RankWorker(config, rank, world_size, rank, init_method,
                            rank_device_ids(config, rank), local_world_size=world_size)
    except BaseException as exc:
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        raise
    conn.send(("ready", None))
    try:
        while True:
            try:
                message = conn.recv()
            except EOFError:  # the engine process is gone
                break
            if message is None:
                break
            method, args = message
            worker.call(method, args)
    finally:
        worker.close()


class MultiprocExecutor(DistributedExecutor):
    """Spawns ranks ``1 .. world - 1`` on this node and joins them as rank 0.

    Raises:
        RankFailedError: a worker failed to start (its error is in the message).
    """

    def __init__(self, config: EngineConfig, platform: Any) -> None:
        from inference_engine.distributed.parallel_state import init_parallel

        par = config.parallel
        world = par.world_size
        # The first rank of this engine's TP group: 0, or (a DP rank started by the
        # data-parallel front end) dp_rank x tp, its workers the next tp - 1 ranks.
        first = (par.data_parallel_rank or 0) * par.tensor_parallel_size
        init_method = par.data_parallel_init_method or f"tcp://127.0.0.1:{free_port()}"
        ctx = mp.get_context("spawn")
        self._procs: list[Any] = []
        self._conns: list[Connection] = []
        self._closed = False
        self._first_rank = first
        for rank in range(first + 1, first + par.tensor_parallel_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_worker_main, name=f"inference-engine-rank{rank}",
                               args=(config, rank, world, init_method, child), daemon=True)
            proc.start()
            child.close()
            self._procs.append(proc)
            self._conns.append(parent)
        share_cpu_threads(world)
        self._ready = False
        # Join in a helper thread so that a worker dying before it joins is an error now,
        # not after the rendezvous timeout.
        failure: list[BaseException] = []

        def join() -> None:
            try:
                init_parallel(first, world, par.tensor_parallel_size, par.data_parallel_size,
                              par.enable_expert_parallel, platform.distributed_backend(),
                              init_method, first, par.all2all_backend, par.collective_timeout)
            except BaseException as exc:  # noqa: BLE001 - reported below
                failure.append(exc)

        joiner = threading.Thread(target=join, name="rank0-join", daemon=True)
        joiner.start()
        while joiner.is_alive():
            joiner.join(0.1)
            if joiner.is_alive() and self.dead_ranks():
                errors = self._startup_errors()
                self.shutdown(leave_group=False)
                raise RankFailedError(f"{', '.join(self.dead_ranks())} exited before joining: "
                                      f"{errors or 'no error reported'}")
        if failure:
            self.shutdown(leave_group=False)
            raise RankFailedError(f"the ranks did not join: {failure[0]}") from failure[0]

    def _startup_errors(self) -> str:
        found = []
        for rank, conn in enumerate(self._conns, self._first_rank + 1):
            try:
                if conn.poll(0):
                    status, detail = conn.recv()
                    if status == "error":
                        found.append(f"rank {rank}: {detail}")
            except (EOFError, OSError):
                pass
        return "; ".join(found)

    def wrap_runner(self, runner: Any) -> Any:
        """Rank 0's runner mirrored to the workers; a DP rank's also in lockstep with the
        other DP ranks' (only the first rank of each TP group takes part in the rounds)."""
        from inference_engine.distributed.data_parallel import LockstepRunner
        from inference_engine.distributed.parallel_state import parallel_state

        driver = super().wrap_runner(runner)
        dp = parallel_state().dp
        return LockstepRunner(driver, dp) if dp.size > 1 else driver

    @property
    def pids(self) -> list[int]:
        """Process ids of ranks 1.. (tests kill one to check failure handling)."""
        return [p.pid for p in self._procs]

    def _wait_ready(self) -> None:
        """Each worker has built its shard (or says why it could not)."""
        for rank, (proc, conn) in enumerate(zip(self._procs, self._conns, strict=True),
                                            self._first_rank + 1):
            while not conn.poll(0.1):
                if not proc.is_alive():
                    raise RankFailedError(f"rank {rank} exited while loading "
                                          f"(exit code {proc.exitcode})")
            status, detail = conn.recv()
            if status != "ready":
                raise RankFailedError(f"rank {rank} failed to load the model: {detail}")
        self._ready = True

    def send(self, method: str, args: tuple[Any, ...]) -> None:
        if self._closed:
            raise RankFailedError("the distributed executor is shut down")
        if not self._ready:
            self._wait_ready()
        dead = self.dead_ranks()
        if dead:
            raise RankFailedError(f"{', '.join(dead)} died; the engine cannot run steps")
        for rank, conn in enumerate(self._conns, self._first_rank + 1):
            try:
                conn.send((method, args))
            except (BrokenPipeError, ConnectionResetError, OSError) as exc:
                raise RankFailedError(f"rank {rank} is unreachable ({exc})") from exc

    def dead_ranks(self) -> list[str]:
        # A rank that died a moment ago may not be reaped yet: give it a few milliseconds.
        for proc in self._procs:
            proc.join(timeout=0.005) if proc.exitcode is None else None
        return [f"rank {rank} (pid {p.pid}, exit code {p.exitcode})"
                for rank, p in enumerate(self._procs, self._first_rank + 1) if not p.is_alive()]

    def shutdown(self, leave_group: bool = True) -> None:
        if self._closed:
            return
        self._closed = True
        for conn in self._conns:
            try:
                conn.send(None)
            except OSError:
                pass
        deadline = time.monotonic() + 10
        for proc in self._procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=5)
        for conn in self._conns:
            conn.close()
        if leave_group:
            from inference_engine.distributed.parallel_state import destroy_parallel

            destroy_parallel()
