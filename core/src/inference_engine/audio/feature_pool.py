"""Feature extraction off the event loop, batched across requests, on a pool of threads.

Requests hand their windows to :meth:`FeaturePool.extract`; every window
queued before the loop gets round to the batch (the same loop turn, or while
the previous batch is still running) is computed in that one batch, cut into
small parts spread over one worker thread per CPU core. torch releases the GIL
inside its kernels, so the workers run in parallel.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from inference_engine.audio.whisper_features import CLIPS_PER_OP, WhisperFeatures

__all__ = ["FeaturePool", "default_num_workers"]


def default_num_workers() -> int:
    """One worker per CPU core this process may use."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


@dataclass
class _Pending:
    clips: list[np.ndarray]
    future: asyncio.Future[torch.Tensor]


class FeaturePool:
    """Computes features for many requests at once, never on the event loop."""

    def __init__(self, features: WhisperFeatures, num_workers: int | None = None) -> None:
        self.features = features
        self.num_workers = num_workers or default_num_workers()
        self._executor = concurrent.futures.ThreadPoolExecutor(
            self.num_workers, thread_name_prefix="audio-features")
        self._queue: list[_Pending] = []
        self._running = False
        # The draining task (held: the loop keeps only a weak reference to tasks).
        self._drain_task: asyncio.Task[None] | None = None
        # Clips computed, and batches run (how much batching happened).
        self.num_clips = 0
        self.num_batches = 0

    async def extract(self, clips: list[np.ndarray]) -> torch.Tensor:
        """``[len(clips), feature_size, num_frames]`` features of mono windows."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[torch.Tensor] = loop.create_future()
        self._queue.append(_Pending(list(clips), future))
        if not self._running:
            self._running = True
            self._drain_task = loop.create_task(self._drain())
        return await future

    async def _drain(self) -> None:
        """Run batches until the queue is empty; requests queued meanwhile join the next."""
        try:
            while self._queue:
                await asyncio.sleep(0)  # let requests of this loop turn join the batch
                batch, self._queue = self._queue, []
                try:
                    results = await self._compute([c for p in batch for c in p.clips])
                except Exception as exc:  # noqa: BLE001 - handed to every waiting request
                    for pending in batch:
                        if not pending.future.done():
                            pending.future.set_exception(exc)
                    continue
                start = 0
                for pending in batch:
                    end = start + len(pending.clips)
                    if not pending.future.done():  # its request may have been cancelled
                        pending.future.set_result(results[start:end])
                    start = end
        finally:
            self._running = False

    async def _compute(self, clips: list[np.ndarray]) -> torch.Tensor:
        loop = asyncio.get_running_loop()
        parts = [clips[i : i + CLIPS_PER_OP] for i in range(0, len(clips), CLIPS_PER_OP)]
        results = await asyncio.gather(*(
            loop.run_in_executor(self._executor, self.features, part) for part in parts))
        self.num_clips += len(clips)
        self.num_batches += 1
        return torch.cat(results)

    async def run(self, fn: Any, *args: Any) -> Any:
        """``fn(*args)`` on a worker (audio decoding), never on the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def extract_sync(self, clips: list[np.ndarray]) -> torch.Tensor:
        """The same batch computed from plain (non-async) code, on the pool."""
        parts = [clips[i : i + CLIPS_PER_OP] for i in range(0, len(clips), CLIPS_PER_OP)]
        return torch.cat(list(self._executor.map(self.features, parts)))

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
