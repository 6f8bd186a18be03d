"""Data parallelism without torchrun: one front end feeding several DP engines.

``LLM(model, data_parallel_size=D)`` / ``serve -dp D`` with the ``mp`` or ``ray``
executor: :func:`make_engine` starts DP ranks ``1 .. D - 1`` as engines of their own
(a spawned process each, or a Ray actor each) and builds DP rank 0 in this process.
Every DP engine has its own scheduler and KV cache over its TP group (``mp``: each
spawns its TP workers); all ``tp x D`` ranks meet in one torch.distributed world so
expert-parallel MoE layers span them.

:class:`DataParallelFrontEnd` stands where an :class:`~inference_engine.engine.llm_engine.LLMEngine`
stands (LLM, the server's engine thread): every attribute not its own is DP rank 0's.
It sends each new request to the DP rank with the shortest queue (fewest unfinished
requests it sent there; ties to the lowest rank), as vLLM's DP coordinator balances
by its engines' queues, and runs steps in rounds: each round every DP engine runs one
engine step (the remote ones at the same time as rank 0) followed by the lockstep
barrier (:class:`~.data_parallel.LockstepRunner`: a rank with nothing to run joins a
forward round with a dummy forward), and the round's outputs are merged. A DP rank that
dies turns the round into :class:`~.executor.RankFailedError` (the server fails its
requests and ``/health`` answers 503), as a dead TP rank does.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import multiprocessing as mp
from abc import ABC, abstractmethod
from multiprocessing.connection import Connection
from typing import Any

from inference_engine.config import EngineConfig
from inference_engine.distributed.executor import RankFailedError, free_port
from inference_engine.outputs import RequestOutput

__all__ = ["DataParallelFrontEnd", "make_engine"]

logger = logging.getLogger(__name__)


def make_engine(config: EngineConfig, show_progress: bool = True) -> Any:
    """The engine ``config`` asks for: a :class:`DataParallelFrontEnd` for more than one DP
    rank under the ``mp`` / ``ray`` executor, else an ``LLMEngine``."""
    from inference_engine.engine.llm_engine import LLMEngine

    par = config.parallel
    if par.data_parallel_size > 1 and par.executor_backend in ("mp", "ray"):
        return DataParallelFrontEnd(config, show_progress)
    return LLMEngine(config, show_progress=show_progress)


def rank_config(config: EngineConfig, dp_rank: int, init_method: str) -> EngineConfig:
    """``config`` for the engine of one DP rank (its rank and the world's rendezvous)."""
    par = dataclasses.replace(config.parallel, data_parallel_rank=dp_rank,
                              data_parallel_init_method=init_method)
    return dataclasses.replace(config, parallel=par)


@dataclasses.dataclass
class RoundResult:
    """What one DP engine reports after a round: its outputs and whether it has work left."""

    outputs: list[RequestOutput]
    unfinished: bool


def run_round(engine: Any) -> RoundResult:
    """One engine step of a DP engine, then the lockstep barrier (dummy forward if needed)."""
    outputs = engine.step() if engine.has_unfinished_requests() else []
    engine.runner.end_round()
    return RoundResult(outputs, engine.has_unfinished_requests())


class RemoteDPRank(ABC):
    """A DP engine outside this process, as the front end drives it."""

    rank: int

    @abstractmethod
    def call(self, method: str, *args: Any) -> Any:
        """``engine.method(*args)`` there, now (the engine is between rounds); its result,
        or its exception raised here."""

    @abstractmethod
    def start_round(self) -> None:
        """Start one round there (:func:`run_round`); :meth:`finish_round` collects it."""

    @abstractmethod
    def finish_round(self) -> RoundResult:
        """The round's result. Raises: RankFailedError: the rank died or failed."""

    @abstractmethod
    def wait_ready(self) -> None:
        """The engine is built. Raises: RankFailedError: it failed to start."""

    @abstractmethod
    def dead(self) -> str | None:
        """A description of the rank if it has died, else None."""

    @abstractmethod
    def shutdown(self) -> None:
        """Stop the engine (idempotent)."""


def _dp_engine_main(config: EngineConfig, conn: Connection) -> None:
    """A spawned DP rank: build its engine, then answer calls and rounds until told to stop."""
    from inference_engine.engine.llm_engine import LLMEngine

    if config.parallel.tensor_parallel_size > 1:
        # Started as a daemon (ended with the front end); it spawns its own TP workers,
        # which multiprocessing allows only to a process that is not one.
        mp.current_process().daemon = False
    try:
        engine = LLMEngine(config, show_progress=False)
    except BaseException as exc:
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        raise
    conn.send(("ok", None))
    try:
        while True:
            try:
                message = conn.recv()
            except EOFError:  # the front end is gone
                break
            if message is None:
                break
            try:
                if message[0] == "round":
                    result: Any = run_round(engine)
                else:
                    _, method, args = message
                    result = getattr(engine, method)(*args)
            except Exception as exc:  # noqa: BLE001 - sent to the front end
                conn.send(("error", _picklable(exc)))
                if message[0] == "round":  # a failed step leaves the collectives unusable
                    break
                continue
            conn.send(("ok", result))
    finally:
        engine.shutdown()


def _picklable(exc: BaseException) -> BaseException:
    import pickle

    try:
        pickle.dumps(exc)
        return exc
    except Exception:  # noqa: BLE001 - replaced by a description
        return RuntimeError(f"{type(exc).__name__}: {exc}")


class MpDPRank(RemoteDPRank):
    """A DP rank in a spawned process of this node (a daemon: it ends with this process)."""

    def __init__(self, config: EngineConfig, rank: int) -> None:
        ctx = mp.get_context("spawn")
        self.rank = rank
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_dp_engine_main, args=(config, child),
                                 name=f"inference-engine-dp{rank}", daemon=True)
        self._proc.start()
        child.close()
        self._closed = False

    @property
    def pid(self) -> int:
        return int(self._proc.pid)

    def _receive(self, what: str) -> Any:
        while not self._conn.poll(0.1):
            if not self._proc.is_alive() and not self._conn.poll(0):
                raise RankFailedError(f"{self.dead()} died during {what}")
        try:
            status, result = self._conn.recv()
        except (EOFError, OSError) as exc:
            raise RankFailedError(f"{self.dead() or f'data-parallel rank {self.rank}'} died "
                                  f"during {what}") from exc
        if status == "error":
            if isinstance(result, BaseException):
                raise result
            raise RankFailedError(f"data-parallel rank {self.rank}: {result}")
        return result

    def _send(self, message: Any) -> None:
        if self._closed:
            raise RankFailedError("the data-parallel engines are shut down")
        try:
            self._conn.send(message)
        except (BrokenPipeError, ConnectionResetError, OSError) as exc:
            raise RankFailedError(f"{self.dead() or f'data-parallel rank {self.rank}'} is "
                                  f"unreachable ({exc})") from exc

    def call(self, method: str, *args: Any) -> Any:
        self._send(("call", method, args))
        return self._receive(method)

    def start_round(self) -> None:
        self._send(("round",))

    def finish_round(self) -> RoundResult:
        try:
            return self._receive("a step")
        except RankFailedError:
            raise
        except Exception as exc:
            raise RankFailedError(f"data-parallel rank {self.rank} failed a step: "
                                  f"{type(exc).__name__}: {exc}") from exc

    def wait_ready(self) -> None:
        try:
            self._receive("start-up")
        except RankFailedError as exc:
            raise RankFailedError(f"data-parallel rank {self.rank} failed to start: {exc}") from exc

    def dead(self) -> str | None:
        if self._proc.exitcode is None:
            self._proc.join(timeout=0.005)
        if self._proc.is_alive():
            return None
        return (f"data-parallel rank {self.rank} (pid {self._proc.pid}, exit code "
                f"{self._proc.exitcode})")

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._conn.send(None)
        except OSError:
            pass
        self._proc.join(timeout=15)
        if self._proc.is_alive():
            self._proc.terminate()
            self._proc.join(timeout=5)
        self._conn.close()


class _DPEngineActor:
    """The body of a DP rank's Ray actor (wrapped with ``ray.remote`` by :class:`RayDPRank`)."""

    def __init__(self, config: EngineConfig) -> None:
        import os

        from inference_engine.engine.llm_engine import LLMEngine

        self.engine = LLMEngine(config, show_progress=False)
        self.pid = os.getpid()

    def ready(self) -> int:
        return self.pid

    def call(self, method: str, args: tuple[Any, ...]) -> Any:
        return getattr(self.engine, method)(*args)

    def round(self) -> RoundResult:
        return run_round(self.engine)

    def close(self) -> None:
        self.engine.shutdown()


class RayDPRank(RemoteDPRank):
    """A DP rank as a Ray actor placed with the platform's resources (one device)."""

    def __init__(self, config: EngineConfig, rank: int, platform: Any) -> None:
        import ray

        self.rank = rank
        self._ray = ray
        # Ray shows the actor only its own device: index 0 there.
        par = dataclasses.replace(config.parallel, device_ids=None)
        actor_cls = ray.remote(**platform.ray_actor_resources())(_DPEngineActor)
        self._actor = actor_cls.remote(dataclasses.replace(config, parallel=par))
        self._ready = self._actor.ready.remote()
        self._pending: Any = None
        self._closed = False
        self.pid = -1

    def _get(self, ref: Any, what: str) -> Any:
        try:
            return self._ray.get(ref)
        except self._ray.exceptions.RayActorError as exc:
            raise RankFailedError(f"data-parallel rank {self.rank} (Ray actor) died during "
                                  f"{what}: {exc}") from exc

    def call(self, method: str, *args: Any) -> Any:
        return self._get(self._actor.call.remote(method, args), method)

    def start_round(self) -> None:
        self._pending = self._actor.round.remote()

    def finish_round(self) -> RoundResult:
        pending, self._pending = self._pending, None
        try:
            return self._get(pending, "a step")
        except RankFailedError:
            raise
        except Exception as exc:
            raise RankFailedError(f"data-parallel rank {self.rank} failed a step: {exc}") from exc

    def wait_ready(self) -> None:
        try:
            self.pid = int(self._ray.get(self._ready))
        except Exception as exc:
            raise RankFailedError(f"data-parallel rank {self.rank} failed to start: {exc}") from exc

    def dead(self) -> str | None:
        if self._pending is None:
            return None
        ready, _ = self._ray.wait([self._pending], timeout=0)
        if not ready:
            return None
        try:
            self._ray.get(ready[0])
        except Exception as exc:  # noqa: BLE001 - described
            return f"data-parallel rank {self.rank} ({type(exc).__name__})"
        return None

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._ray.get(self._actor.close.remote(), timeout=10)
        except Exception:  # noqa: BLE001 - killed below in any case
            pass
        self._ray.kill(self._actor)


class DataParallelFrontEnd:
    """DP rank 0's engine plus the other DP ranks' engines, behind one engine interface.

    Attributes:
        local: DP rank 0's ``LLMEngine`` (every attribute not defined here is its).
        remotes: the other DP ranks.
        requests_routed: requests sent to each DP rank so far (the balance counters).
    """

    def __init__(self, config: EngineConfig, show_progress: bool = True) -> None:
        from inference_engine.engine.llm_engine import LLMEngine
        from inference_engine.platforms.selection import select_platform

        par = config.parallel
        self.config = config
        size = par.data_parallel_size
        backend = par.executor_backend
        self.remotes: list[RemoteDPRank] = []
        if backend == "ray":
            try:
                import ray
            except ImportError as exc:
                raise ValueError("--distributed-executor-backend ray needs Ray: pip install "
                                 "'inference-engine[ray]'") from exc
            if not ray.is_initialized():
                ray.init(log_to_driver=True)
            host = ray.util.get_node_ip_address()
            platform = select_platform(par.platform)
        else:
            host = "127.0.0.1"
        init_method = f"tcp://{host}:{free_port()}"
        try:
            for rank in range(1, size):
                cfg = rank_config(config, rank, init_method)
                self.remotes.append(RayDPRank(cfg, rank, platform) if backend == "ray"
                                    else MpDPRank(cfg, rank))
            # Joins the world with the remote ranks (they wait for it in the rendezvous).
            self.local = LLMEngine(rank_config(config, 0, init_method),
                                   show_progress=show_progress)
            for remote in self.remotes:
                remote.wait_ready()
        except BaseException:
            self._stop_remotes()
            raise
        self._closed = False
        self._ids = itertools.count()
        # Request id -> the DP rank holding it, while unfinished.
        self._owner: dict[str, int] = {}
        # Unfinished requests per DP rank (its queue length as the front end knows it).
        self.queued = [0] * size
        self.requests_routed = [0] * size
        self._remote_unfinished = [False] * size

    def __getattr__(self, name: str) -> Any:
        if name in ("local", "remotes"):  # not built yet (a failed start)
            raise AttributeError(name)
        return getattr(self.local, name)

    # ---- requests -------------------------------------------------------------
    def _pick_rank(self) -> int:
        return min(range(len(self.queued)), key=lambda r: (self.queued[r], r))

    def add_request(self, prompt: Any, params: Any = None, request_id: str | None = None,
                    final_only: bool = False, lora_request: Any = None) -> str:
        """Queue a request on the DP rank with the shortest queue; returns its id.

        Raises:
            ValueError: what that rank's engine refuses (as ``LLMEngine.add_request``).
        """
        rid = request_id if request_id is not None else f"dp-{next(self._ids)}"
        if rid in self._owner:
            raise ValueError(f"request id {rid!r} is already in use")
        rank = self._pick_rank()
        if rank == 0:
            self.local.add_request(prompt, params, rid, final_only, lora_request)
        else:
            self.remotes[rank - 1].call("add_request", prompt, params, rid, final_only,
                                        lora_request)
            self._remote_unfinished[rank] = True
        self._owner[rid] = rank
        self.queued[rank] += 1
        self.requests_routed[rank] += 1
        return rid

    def _finished(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            if output.finished:
                rank = self._owner.pop(output.request_id, None)
                if rank is not None:
                    self.queued[rank] -= 1

    def abort_request(self, request_ids: str | list[str]) -> list[RequestOutput]:
        """Abort requests on whichever DP ranks hold them; their final outputs."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        by_rank: dict[int, list[str]] = {}
        for rid in ids:
            if rid in self._owner:
                by_rank.setdefault(self._owner[rid], []).append(rid)
        outputs: list[RequestOutput] = []
        for rank, rids in sorted(by_rank.items()):
            outputs += (self.local.abort_request(rids) if rank == 0
                        else self.remotes[rank - 1].call("abort_request", rids))
        self._finished(outputs)
        return outputs

    def has_unfinished_requests(self) -> bool:
        return self.local.has_unfinished_requests() or any(self._remote_unfinished)

    def num_unfinished_requests(self) -> int:
        return sum(self.queued)

    def request_ids(self) -> list[str]:
        return list(self._owner)

    # ---- the round ------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One round: every DP engine steps once (the remote ones meanwhile), then the
        outputs of all of them, DP rank 0's first.

        Raises:
            RankFailedError: a DP rank died or failed its step.
        """
        for remote in self.remotes:
            remote.start_round()
        try:
            local = run_round(self.local)
        except Exception as exc:
            dead = [d for d in (r.dead() for r in self.remotes) if d]
            if dead:
                raise RankFailedError(f"{', '.join(dead)} died during a step: "
                                      f"{type(exc).__name__}: {exc}") from exc
            raise
        outputs = list(local.outputs)
        for remote in self.remotes:
            result = remote.finish_round()
            self._remote_unfinished[remote.rank] = result.unfinished
            outputs += result.outputs
        self._finished(outputs)
        return outputs

    # ---- the rest of the engine interface ---------------------------------------
    def pause(self) -> None:
        self.local.pause()
        for remote in self.remotes:
            remote.call("pause")

    def resume(self) -> None:
        self.local.resume()
        for remote in self.remotes:
            remote.call("resume")

    def expert_load(self) -> dict[int, list[int]]:
        """Per-expert assignments summed over the DP ranks."""
        total = {layer: list(v) for layer, v in self.local.expert_load().items()}
        for remote in self.remotes:
            for layer, counts in remote.call("expert_load").items():
                mine = total.setdefault(layer, [0] * len(counts))
                total[layer] = [a + b for a, b in zip(mine, counts, strict=True)]
        return total

    def stats(self) -> dict[str, Any]:
        """Every DP engine's stats combined (counts summed, KV usage and prefix-cache hit rate
        over all ranks' blocks / lookups, expert load summed), with the front end's per-rank
        queue and routing counts."""
        per_rank = [self.local.stats()] + [remote.call("stats") for remote in self.remotes]
        stats = dict(per_rank[0])
        for key, value in stats.items():
            if key.startswith("num_") or key.endswith("_tokens") or key == "num_preemptions":
                if isinstance(value, int | float):
                    stats[key] = sum(s.get(key, 0) for s in per_rank)
        stats["kv_cache_usage"] = sum(s["kv_cache_usage"] for s in per_rank) / len(per_rank)
        queried = stats.get("prefix_cache_queried_tokens", 0)
        stats["prefix_cache_hit_rate"] = (stats.get("prefix_cache_hit_tokens", 0) / queried
                                          if queried else 0.0)
        load = self.expert_load()
        if load:
            stats["expert_load"] = load
        stats["data_parallel_queued"] = list(self.queued)
        stats["data_parallel_requests_routed"] = list(self.requests_routed)
        return stats

    def _stop_remotes(self) -> None:
        for remote in self.remotes:
            try:
                remote.shutdown()
            except Exception:  # noqa: BLE001 - stopping the rest regardless
                logger.exception("stopping data-parallel rank %d failed", remote.rank)

    def shutdown(self) -> None:
        """Stop every DP engine (idempotent)."""
        if getattr(self, "_closed", True):
            return
        self._closed = True
        self._stop_remotes()
        self.local.shutdown()
