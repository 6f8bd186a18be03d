"""Run the app under uvicorn on a real socket, with graceful shutdown that exits 0."""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from collections.abc import Iterator
import uvicorn

from inference_engine.config import EngineConfig, ServerConfig
from inference_engine.engine.async_client import AsyncLLM

__all__ = ["run_server"]

logger = logging.getLogger(__name__)


class _Server(uvicorn.Server):
    """uvicorn's server without re-raising the signal after a graceful stop.

    uvicorn re-raises SIGINT/SIGTERM once it has shut down, which makes the
    process die of the signal; a server that drained cleanly should exit 0.
    """

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
            timeout_graceful_shutdown=int(config.shutdown_timeout) or None,
            access_log=config.log_level == "debug",
        ))
        logger.info("serving %s on http://%s:%d (%s)", engine_config.model.model, config.host,
                    config.port, engine.engine.capacity_message)
        server.run()
    finally:
        if engine.is_running:
            engine.shutdown()

