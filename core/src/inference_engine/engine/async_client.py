"""``AsyncLLM``: the engine on a background thread, streaming to asyncio callers.

The engine is only ever touched by its own thread; callers send commands
through a queue and receive each request's outputs on an asyncio queue, so an
event loop (the server) never blocks on a forward pass.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any

from inference_engine.config import EngineConfig
from inference_engine.engine.llm_engine import LLMEngine, PromptInput
from inference_engine.lora.request import LoRARequest
from inference_engine.outputs import RequestOutput
from inference_engine.sampling_params import SamplingParams

__all__ = ["AsyncLLM", "EngineDeadError"]

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine thread stopped; no request can be served."""


class _Stream:
    """One request's outputs on their way to its event loop, holding at most one.

    Outputs are cumulative (each holds all text and tokens so far), so an unread
    output is replaced by the next: a client that reads slowly costs one pending
    output, not one per step (backpressure without stalling the engine). An
    exception or the finished output is never replaced.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._pending: RequestOutput | BaseException | None = None
        self._ready = asyncio.Event()

    def offer(self, item: RequestOutput | BaseException) -> None:
        """Hand over ``item`` (on the stream's loop)."""
        pending = self._pending
        if isinstance(pending, BaseException) or (isinstance(pending, RequestOutput)
                                                  and pending.finished):
            return
        self._pending = item
        self._ready.set()

    def put(self, item: RequestOutput | BaseException) -> None:
        """Hand over ``item`` from another thread."""
        self.loop.call_soon_threadsafe(self.offer, item)

    async def get(self) -> RequestOutput | BaseException:
        """The latest output (or error) not yet taken; waits for one."""
        while self._pending is None:
            self._ready.clear()
            await self._ready.wait()
        item, self._pending = self._pending, None
        return item


def _deliver(items: list[tuple[_Stream, Any]]) -> None:
    for stream, item in items:
        stream.offer(item)


class AsyncLLM:
    """Asynchronous front of :class:`LLMEngine`."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._commands: queue.Queue[tuple[Callable[[], Any], concurrent.futures.Future[Any]]] = (
            queue.Queue()
        )
        self._streams: dict[str, _Stream] = {}
        self._ids = itertools.count()
        self._stopped = threading.Event()
        self._dead: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_config(cls, config: EngineConfig, show_progress: bool = True) -> AsyncLLM:
        from inference_engine.distributed.dp_frontend import make_engine

        return cls(make_engine(config, show_progress=show_progress))

    @classmethod
    def from_model(cls, model: str, **kwargs: Any) -> AsyncLLM:
        return cls.from_config(EngineConfig.from_kwargs(model, **kwargs))

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and self._dead is None

    # ---- the engine thread -------------------------------------------------
    def _loop(self) -> None:
        engine = self.engine
        while not self._stopped.is_set():
            busy = engine.has_unfinished_requests() and not engine.is_paused
            try:
                # Idle: sleep until a command arrives; busy: only take what is queued.
                command = self._commands.get_nowait() if busy else self._commands.get(timeout=1.0)
            except queue.Empty:
                command = None
            while command is not None:
                fn, future = command
                try:
                    future.set_result(fn())
                except BaseException as exc:  # reported to the caller, not fatal
                    future.set_exception(exc)
                try:
                    command = self._commands.get_nowait()
                except queue.Empty:
                    command = None
            if self._stopped.is_set():
                break
            if not engine.has_unfinished_requests() or engine.is_paused:
                continue
            try:
                outputs = engine.step()
            except BaseException as exc:
                logger.exception("engine step failed; failing all requests")
                self._dead = exc
                for stream in self._streams.values():
                    stream.put(EngineDeadError(f"engine step failed: {exc!r}"))
                self._streams.clear()
                return
            self._dispatch(outputs)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        # One wake-up per event loop per step, not one per request.
        batches: dict[asyncio.AbstractEventLoop, list[tuple[_Stream, Any]]] = {}
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue
            batches.setdefault(stream.loop, []).append((stream, output))
            if output.finished:
                del self._streams[output.request_id]
        for loop, items in batches.items():
            try:
                loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:  # that loop is closed: nobody is listening
                pass

    async def _call(self, fn: Callable[[], Any]) -> Any:
        if self._dead is not None or not self._thread.is_alive():
            raise EngineDeadError(f"the engine is not running ({self._dead!r})")
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._commands.put((fn, future))
        return await asyncio.wrap_future(future)

    # ---- public API ----------------------------------------------------------
    async def add_request(
        self,
        prompt: PromptInput,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Queue a request now; return the iterator of its outputs.

        Errors in the request (empty or too long prompt, duplicate id) raise
        here, before anything streams, so a server can still answer 400. The
        caller must iterate the result (or :meth:`abort` the id): leaving the
        iteration early aborts the request, never starting it does not.
        """
        rid = request_id if request_id is not None else f"async-{next(self._ids)}"
        stream = _Stream(asyncio.get_running_loop())

        def add() -> str:
            if rid in self._streams:
                raise ValueError(f"request id {rid!r} is already in use")
            self.engine.add_request(prompt, sampling_params, request_id=rid,
                                    lora_request=lora_request)
            self._streams[rid] = stream
            return rid

        await self._call(add)
        return self._iterate(rid, stream)

    async def _iterate(self, rid: str, stream: _Stream) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while True:
                item = await stream.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished and self.is_running:
                self._commands.put((lambda: self._abort_now([rid]), concurrent.futures.Future()))

    async def generate(
        self,
        prompt: PromptInput,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's latest output whenever it changed; the last is finished.

        Outputs are cumulative: one a slow reader did not take is replaced by the next.

        Leaving the iteration early (a client that went away) aborts the request.
        """
        outputs = await self.add_request(prompt, sampling_params, request_id, lora_request)
        async for output in outputs:
            yield output

    def _abort_now(self, request_ids: list[str]) -> list[RequestOutput]:
        outputs = self.engine.abort_request(request_ids)
        self._dispatch(outputs)
        for rid in request_ids:
            self._streams.pop(rid, None)
        return outputs

    async def abort(self, request_ids: str | list[str]) -> list[str]:
        """Abort requests; their streams end with finish_reason "abort". Returns ids found."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        outputs = await self._call(lambda: self._abort_now(ids))
        return [o.request_id for o in outputs]

    async def request_ids(self) -> list[str]:
        """Ids of the requests the engine holds (unfinished)."""
        return await self._call(self.engine.request_ids)

    async def abort_all(self) -> list[str]:
        """Abort every request the engine holds; returns their ids."""
        return await self._call(lambda: [o.request_id for o in
                                         self._abort_now(self.engine.request_ids())])

    async def pause(self) -> None:
        await self._call(self.engine.pause)

    async def resume(self) -> None:
        await self._call(self.engine.resume)

    async def is_paused(self) -> bool:
        return self.engine.is_paused

    async def add_lora(self, lora_request: LoRARequest) -> bool:
        """Read and check an adapter on the engine thread (``ValueError`` names a problem)."""
        return await self._call(lambda: self.engine.add_lora(lora_request))

    async def remove_lora(self, lora_int_id: int) -> bool:
        return await self._call(lambda: self.engine.remove_lora(lora_int_id))

    async def stats(self) -> dict[str, float]:
        return await self._call(self.engine.stats)

    def shutdown(self) -> None:
        self._stopped.set()
        self._commands.put((lambda: None, concurrent.futures.Future()))
        self._thread.join(timeout=30)
