"""The ASGI application: routes, error handlers, auth and CORS around a :class:`ModelServing`."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import Response

from inference_engine import __version__
from inference_engine.config import ServerConfig
from inference_engine.engine.async_client import AsyncLLM, EngineDeadError
from inference_engine.entrypoints.openai.chat import create_chat_completion, render_chat
from inference_engine.entrypoints.openai.completions import create_completion
from inference_engine.entrypoints.openai.errors import (
    APIError,
    InternalErrorMiddleware,
    JSONResponse,
    error_response,
    from_api_error,
    status_phrase,
)
from inference_engine.entrypoints.openai.metrics import ServerMetrics
from inference_engine.entrypoints.openai.protocol import (
    AbortRequest,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    normalize_messages,
    parse_body,
)
from inference_engine.entrypoints.openai.request_body import decode_json, read_body, read_json
from inference_engine.entrypoints.openai.security import APIKeyMiddleware
from inference_engine.entrypoints.openai.server_load import ServerLoad, ServerLoadMiddleware
from inference_engine.entrypoints.openai.serving import ModelServing
from inference_engine.entrypoints.openai.transcriptions import add_speech_routes
from inference_engine.lora.serving import ServedLoRAs, add_lora_routes

__all__ = ["build_app", "make_parser_factory"]

logger = logging.getLogger(__name__)

def make_parser_factory(config: ServerConfig, architecture: str, model_name: str) -> Any:
    """The :class:`PipelineFactory` for the server's parser flags, or None.

    With ``--enable-auto-tool-choice`` and no parser named, the pair comes from
    the model's architecture (:func:`default_parsers`).

    Raises:
        UnknownNameError: a parser name nobody registered.
    """
    from inference_engine.parsing import PipelineFactory, default_parsers

    tool, reasoning = config.tool_call_parser, config.reasoning_parser
    if config.enable_auto_tool_choice and tool is None and reasoning is None:
        tool, reasoning = default_parsers(architecture, model_name)
        if tool or reasoning:
            logger.info("parsers picked for %s: tool %s, reasoning %s", architecture, tool,
                        reasoning)
        else:
            logger.warning("--enable-auto-tool-choice: no default parsers for %s; name them "
                           "with --tool-call-parser / --reasoning-parser", architecture)
    if tool is None and reasoning is None:
        return None
    return PipelineFactory(tool, reasoning, config.tool_call_streaming)


def _inline_refs(node: Any, defs: dict[str, Any]) -> Any:
    """``node`` with pydantic's local ``#/$defs/X`` references replaced by their schemas."""
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#/$defs/"):
            return _inline_refs(defs[ref.removeprefix("#/$defs/")], defs)
        return {k: _inline_refs(v, defs) for k, v in node.items() if k != "$defs"}
    if isinstance(node, list):
        return [_inline_refs(v, defs) for v in node]
    return node


def _body_schema(model_cls: type[Any]) -> dict[str, Any]:
    """OpenAPI ``requestBody`` for a route that parses its body itself (for clients, fuzzers).

    References are inlined: in an OpenAPI document ``#/$defs`` would point at
    the document's root, not at the body schema.
    """
    schema = model_cls.model_json_schema()
    schema = _inline_refs(schema, schema.get("$defs", {}))
    return {"requestBody": {"required": True, "content": {
        "application/json": {"schema": schema}}}}


def build_app(engine: AsyncLLM, config: ServerConfig, parsers: Any = None,
              shutdown_engine: bool = True) -> FastAPI:
    """The OpenAI-compatible app serving ``engine``.

    Args:
        engine: a started :class:`AsyncLLM`.
        config: front-end settings (names, auth, CORS, parsers).
        parsers: a :class:`PipelineFactory` (see :func:`make_parser_factory`), or None.
        shutdown_engine: stop the engine when the app shuts down.
    """
    names = config.served_model_names or [engine.engine.config.model.model]
    if config.chat_template is not None:  # --chat-template replaces the tokenizer's own
        engine.tokenizer.chat_template = config.chat_template
    metrics = ServerMetrics(names[0], vllm_names=config.vllm_metric_names)
    load = ServerLoad()
    serving = ModelServing(engine, names, metrics, parsers, config.enable_auto_tool_choice,
                           config.trust_request_chat_template)
    serving.loras = ServedLoRAs(engine, names)
    serving.loras.add_at_startup(config.lora_modules)
    limit = serving.max_body_bytes

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        yield
        serving.close()
        speech.close()
        if shutdown_engine and engine.is_running:
            with contextlib.suppress(Exception):
                aborted = await engine.abort_all()
                if aborted:
                    logger.info("aborted %d unfinished request(s) at shutdown", len(aborted))
            engine.shutdown()

    app = FastAPI(title="inference-engine", version=__version__, lifespan=lifespan)
    app.state.serving = serving

    @app.exception_handler(APIError)
    async def _api_error(_request: Request, exc: APIError) -> Response:
        return from_api_error(exc)

    @app.exception_handler(HTTPException)
    async def _http_error(_request: Request, exc: HTTPException) -> Response:
        detail = exc.detail if isinstance(exc.detail, str) else status_phrase(exc.status_code)
        return error_response(detail, exc.status_code, headers=exc.headers)

    @app.exception_handler(EngineDeadError)
    async def _dead(_request: Request, exc: EngineDeadError) -> Response:
        return error_response(str(exc), 503)

    # ---- OpenAI ---------------------------------------------------------------
    @app.get("/v1/models")
    async def list_models() -> Response:
        data = [{"id": name, "object": "model", "created": serving.created,
                 "owned_by": "inference-engine", "root": serving.model_root, "parent": None,
                 "max_model_len": serving.max_model_len} for name in names]
        data += serving.loras.model_cards(serving.created, serving.max_model_len)
        return JSONResponse({"object": "list", "data": data})

    @app.post("/v1/completions", openapi_extra=_body_schema(CompletionRequest))
    async def completions(request: Request) -> Response:
        body = parse_body(CompletionRequest, await read_json(request, limit))
        return await create_completion(serving, body, request)

    @app.post("/v1/chat/completions", openapi_extra=_body_schema(ChatCompletionRequest))
    async def chat_completions(request: Request) -> Response:
        body = parse_body(ChatCompletionRequest, await read_json(request, limit))
        return await create_chat_completion(serving, body, request)

    # ---- tokenizer --------------------------------------------------------------
    @app.post("/tokenize", openapi_extra=_body_schema(TokenizeRequest))
    async def tokenize(request: Request) -> Response:
        body = parse_body(TokenizeRequest, await read_json(request, limit))
        serving.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError("give exactly one of prompt or messages")
        if body.prompt is not None:
            ids = await serving.encode(body.prompt, body.add_special_tokens)
        else:
            ids = await render_chat(serving, normalize_messages(body.messages), body.tools,
                                    body.add_generation_prompt, body.chat_template_kwargs,
                                    chat_template=body.chat_template)
        out: dict[str, Any] = {"count": len(ids), "max_model_len": serving.max_model_len,
                               "tokens": ids}
        if body.return_token_strs:
            out["token_strs"] = await serving.off_loop(serving.tokenizer.convert_ids_to_tokens,
                                                       ids)
        return JSONResponse(out)

    @app.post("/detokenize", openapi_extra=_body_schema(DetokenizeRequest))
    async def detokenize(request: Request) -> Response:
        body = parse_body(DetokenizeRequest, await read_json(request, limit))
        serving.check_model(body.model)
        bad = [t for t in body.tokens if not 0 <= t < serving.vocab_size]
        if bad:
            raise APIError(f"token ids outside the vocabulary [0, {serving.vocab_size}): "
                           f"{bad[:8]}", param="tokens")
        return JSONResponse({"prompt": await serving.off_loop(serving.tokenizer.decode,
                                                              body.tokens)})

    # ---- engine control -----------------------------------------------------------
    @app.post("/pause")
    async def pause() -> Response:
        await engine.pause()
        return JSONResponse({"paused": True})

    @app.post("/resume")
    async def resume() -> Response:
        await engine.resume()
        return JSONResponse({"paused": False})

    @app.get("/is_paused")
    async def is_paused() -> Response:
        return JSONResponse({"is_paused": await engine.is_paused()})

    @app.post("/abort_requests", openapi_extra={
        "requestBody": {**_body_schema(AbortRequest)["requestBody"], "required": False}})
    async def abort_requests(request: Request) -> Response:
        raw = await read_body(request, limit)
        body = parse_body(AbortRequest, decode_json(raw)) if raw.strip() else AbortRequest()
        if body.request_ids is None:
            aborted = await engine.abort_all()
        else:
            wanted = set(body.request_ids)
            live = await engine.request_ids()
            # A completions request with several prompts runs as "<id>-<i>".
            targets = [rid for rid in live if rid in wanted or
                       (rid.rpartition("-")[0] in wanted and rid.rpartition("-")[2].isdigit())]
            aborted = await engine.abort(targets) if targets else []
        return JSONResponse({"aborted": aborted})

    # ---- operations -----------------------------------------------------------------
    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> Response:
        if engine.is_running:
            return JSONResponse({"status": "ok"})
        return error_response("the engine is not running", 503)

    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping() -> Response:  # vLLM's (SageMaker's) name for the health check
        return await health()

    @app.get("/load")
    async def server_load() -> Response:
        return JSONResponse({"server_load": load.in_flight})

    @app.get("/version")
    async def version() -> Response:
        return JSONResponse({"version": __version__})

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        stats = await engine.stats() if engine.is_running else {}
        return Response(metrics.render(stats),
                        media_type="text/plain; version=0.0.4; charset=utf-8")

    add_lora_routes(app, serving.loras)
    speech = add_speech_routes(app, serving, int(config.max_audio_file_size_mb * (1 << 20)),
                               config.max_audio_seconds)

    app.add_middleware(ServerLoadMiddleware, load=load)
    # Added first so it is innermost: its 500s pass through auth and CORS like any answer.
    app.add_middleware(InternalErrorMiddleware)
    if config.auth_enabled:
        app.add_middleware(APIKeyMiddleware, api_keys=config.api_keys)
    if config.enable_cors:
        # Added last so it is outermost: preflights and 401s get CORS headers too.
        app.add_middleware(CORSMiddleware, allow_origins=config.cors_allow_origins,
                           allow_methods=config.cors_allow_methods,
                           allow_headers=config.cors_allow_headers,
                           allow_credentials=config.cors_allow_credentials)
    return app
