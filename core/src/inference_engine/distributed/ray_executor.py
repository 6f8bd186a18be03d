"""The multi-node executor: rank 0 in the engine process, one Ray actor per other rank.

Start a cluster first (``ray start --head`` on one node, ``ray start --address
HEAD:6379`` on the others), then run the engine on any node with
``--distributed-executor-backend ray``: ``ray.init()`` joins the running cluster
(or ``RAY_ADDRESS``), places one actor per rank with the platform's resources (one
GPU each), and the ranks meet over torch.distributed at this node's address. Each
runner call goes to every actor as a Ray task; rank 0 runs it meanwhile and then
collects the tasks, so an actor's failure is raised here.
"""

from __future__ import annotations

import logging
from typing import Any

from inference_engine.config import EngineConfig
from inference_engine.distributed.executor import DistributedExecutor, RankFailedError, free_port
from inference_engine.distributed.worker import RankWorker, share_cpu_threads

__all__ = ["RayExecutor"]

logger = logging.getLogger(__name__)


class _RankActor:
    """The body of a rank's Ray actor (wrapped with ``ray.remote`` when the executor starts)."""

    def __init__(self) -> None:
        self.worker: RankWorker | None = None

    def start(self, config: EngineConfig, rank: int, world_size: int, init_method: str,
              local_world_size: int) -> int:
        import os

        # Ray shows each actor only its own device(s): the rank's device is index 0 here.
        self.worker = RankWorker(config, rank, world_size, 0, init_method, None,
                                 local_world_size=local_world_size)
        return os.getpid()

    def call(self, method: str, args: tuple[Any, ...]) -> None:
        assert self.worker is not None, "start() first"
        self.worker.call(method, args)

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()


class RayExecutor(DistributedExecutor):
    """Ranks ``1 .. world - 1`` as Ray actors; this process is rank 0.

    Raises:
        ValueError: Ray is not installed (``pip install inference-engine[ray]``).
        RankFailedError: an actor failed to start.
    """

    def __init__(self, config: EngineConfig, platform: Any) -> None:
        try:
            import ray
        except ImportError as exc:
            raise ValueError("--distributed-executor-backend ray needs Ray: pip install "
                             "'inference-engine[ray]'") from exc
        from inference_engine.distributed.parallel_state import init_parallel

        self._ray = ray
        if not ray.is_initialized():
            ray.init(log_to_driver=True)  # joins a running cluster (ray start) or RAY_ADDRESS
        par = config.parallel
        world = par.world_size
        host = ray.util.get_node_ip_address()
        init_method = f"tcp://{host}:{free_port()}"
        actor_cls = ray.remote(**platform.ray_actor_resources())(_RankActor)
        self._actors = [actor_cls.options(name=None).remote() for _ in range(1, world)]
        self._pending: list[Any] = []
        self._closed = False
        # On one node the ranks share its cores (across nodes, assume one rank per node).
        local = world if len([n for n in ray.nodes() if n.get("Alive")]) == 1 else 1
        starts = [actor.start.remote(config, rank, world, init_method, local)
                  for rank, actor in enumerate(self._actors, 1)]
        share_cpu_threads(local)
        init_parallel(0, world, par.tensor_parallel_size, par.data_parallel_size,
                      par.enable_expert_parallel, platform.distributed_backend(), init_method,
                      0, par.all2all_backend, par.collective_timeout)
        self._starts = starts
        self.pids: list[int] = []

    def _ready(self) -> None:
        if self._starts:
            starts, self._starts = self._starts, []
            try:
                self.pids = self._ray.get(starts)
            except Exception as exc:
                raise RankFailedError(f"a Ray rank failed to start: {exc}") from exc

    def send(self, method: str, args: tuple[Any, ...]) -> None:
        if self._closed:
            raise RankFailedError("the distributed executor is shut down")
        self._ready()
        self._pending = [actor.call.remote(method, args) for actor in self._actors]

    def finish(self) -> None:
        pending, self._pending = self._pending, []
        try:
            self._ray.get(pending)
        except Exception as exc:
            raise RankFailedError(f"a Ray rank failed: {exc}") from exc

    def dead_ranks(self) -> list[str]:
        dead = []
        for rank, ref in enumerate(self._pending, 1):
            ready, _ = self._ray.wait([ref], timeout=0)
            if ready:
                try:
                    self._ray.get(ready[0])
                except Exception as exc:  # noqa: BLE001 - described, not raised
                    dead.append(f"rank {rank} ({type(exc).__name__})")
        return dead

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        ray = self._ray
        try:
            ray.get([a.close.remote() for a in self._actors], timeout=10)
        except Exception:  # noqa: BLE001 - the actors go away below in any case
            pass
        for actor in self._actors:
            ray.kill(actor)
        from inference_engine.distributed.parallel_state import destroy_parallel

        destroy_parallel()
