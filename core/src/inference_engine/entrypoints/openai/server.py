"""Run the app under uvicorn on a real socket, with graceful shutdown that exits 0."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import threading
from collections.abc import Iterator

import uvicorn

from inference_engine.config import EngineConfig, ServerConfig
from inference_engine.engine.async_client import AsyncLLM

__all__ = ["run_server"]

logger = logging.getLogger(__name__)

# After the drain timeout the engine's requests are aborted; their streams then
# end with finish_reason "abort" and [DONE]. uvicorn cancels whatever is still
# writing this long after that (a client that stopped reading).
ABORT_GRACE_SECONDS = 5.0


class _Server(uvicorn.Server):
    """uvicorn's server, draining through the engine and exiting 0 on a signal.

    On SIGINT/SIGTERM new connections are refused and in-flight requests run
    on for ``drain_timeout`` seconds (0: not at all); then every engine request
    is aborted so each response ends properly (an abort finish and ``[DONE]``)
    instead of being cut by a cancelled task. uvicorn re-raises the signal once
    it has shut down, which makes the process die of it; a server that drained
    cleanly exits 0 instead.
    """

    def __init__(self, config: uvicorn.Config, engine: AsyncLLM, drain_timeout: float) -> None:
        super().__init__(config)
        self.engine = engine
        self.drain_timeout = drain_timeout

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        aborter = asyncio.ensure_future(self._abort_after(self.drain_timeout))
        try:
            await super().shutdown(sockets)
        finally:
            aborter.cancel()

    async def _abort_after(self, delay: float) -> None:
        await asyncio.sleep(delay)
        if not self.engine.is_running:
            return
        aborted = await self.engine.abort_all()
        if aborted:
            logger.warning("shutdown: %d request(s) still running after %gs; aborted them",
                           len(aborted), delay)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        signals = (signal.SIGINT, signal.SIGTERM)
        original = {sig: signal.signal(sig, self.handle_exit) for sig in signals}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)


def run_server(engine_config: EngineConfig, config: ServerConfig,
               show_progress: bool = True) -> None:
    """Check the parser flags, load the model, serve until SIGINT/SIGTERM.

    Raises:
        UnknownNameError: an unknown parser (before the model is loaded).
        ValueError, OSError: a bad engine setting or an unreadable model.
    """
    from inference_engine.entrypoints.openai.app import build_app, make_parser_factory
    from inference_engine.parsing import PipelineFactory

    # Named parsers are checked before the (slow) model load.
    if config.tool_call_parser or config.reasoning_parser:
        PipelineFactory(config.tool_call_parser, config.reasoning_parser,
                        config.tool_call_streaming)
    engine = AsyncLLM.from_config(engine_config, show_progress=show_progress)
    try:
        loaded = engine.engine.loaded
        parsers = make_parser_factory(config, loaded.architecture, engine_config.model.model)
        app = build_app(engine, config, parsers)
        server = _Server(uvicorn.Config(
            app, host=config.host, port=config.port, log_level=config.log_level,
            timeout_graceful_shutdown=config.shutdown_timeout + ABORT_GRACE_SECONDS,
            access_log=config.log_level == "debug",
        ), engine, config.shutdown_timeout)
        logger.info("serving %s on http://%s:%d (%s)", engine_config.model.model, config.host,
                    config.port, engine.engine.capacity_message)
        server.run()
    finally:
        if engine.is_running:
            engine.shutdown()

