"""What completions and chat share: the model's limits, sampling defaults, request ids,
engine streams with metrics, and client-disconnect handling."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from starlette.requests import Request

from inference_engine.engine.async_client import AsyncLLM, EngineDeadError
from inference_engine.entrypoints.openai.errors import APIError
from inference_engine.entrypoints.openai.metrics import RequestTimer, ServerMetrics
from inference_engine.entrypoints.openai.protocol import SamplingFields
from inference_engine.lora.request import LoRARequest
from inference_engine.lora.serving import ServedLoRAs
from inference_engine.outputs import CompletionOutput, RequestOutput
from inference_engine.sampling_params import SamplingParams

__all__ = [
    "ChoiceCursor",
    "ChoiceDelta",
    "EngineRequest", "ModelServing", "merged", "run_until_disconnected", "timed"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

# A client-chosen request id goes into a response header: visible ASCII only.
_REQUEST_ID = re.compile(r"[\x21-\x7e]{1,256}")
# Margin on the prompt character bound for normalizers that shorten text (NFKC
# composing a letter and its accent into one character, and the like).
_NORMALIZER_MARGIN = 4
# Request bodies: room for the longest prompt in the worst JSON escaping (a
# "\\uXXXX" surrogate pair is 12 bytes for one character), within fixed bounds.
_MIN_BODY_BYTES = 1 << 20
_MAX_BODY_BYTES = 64 << 20


def longest_token_chars(tokenizer: Any) -> int:
    """Characters in the vocabulary's longest token string (at least 1).

    Token strings spell bytes (byte-level BPE) or pieces, never fewer characters
    than the text they stand for, so no text longer than ``max_model_len`` times
    this can fit in ``max_model_len`` tokens.
    """
    tokens = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    return max((len(t) for t in tokens if isinstance(t, str)), default=1) or 1

# Sampling fields a model's generation_config.json may set as request defaults (vLLM does too).
_GENERATION_DEFAULTS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                        "max_new_tokens")


@dataclass
class ChoiceDelta:
    """What one choice gained since the last chunk."""

    text: str
    token_ids: list[int]
    # Logprobs of those tokens, or None when the request asked for none.
    logprobs: list[Any] | None
    # Characters of the choice's text sent before this delta.
    text_offset: int


class ChoiceCursor:
    """How much of one streamed choice has been sent; outputs are cumulative."""

    def __init__(self) -> None:
        self.text = 0
        self.tokens = 0

    def advance(self, completion: CompletionOutput) -> ChoiceDelta | None:
        """The unsent part of ``completion``; None when nothing new (and not finished)."""
        text = completion.text[self.text:]
        tokens = completion.token_ids[self.tokens:]
        if not text and not tokens and not completion.finished:
            return None
        logprobs = None if completion.logprobs is None else completion.logprobs[self.tokens:]
        delta = ChoiceDelta(text, tokens, logprobs, self.text)
        self.text, self.tokens = len(completion.text), len(completion.token_ids)
        return delta


@dataclass
class EngineRequest:
    """One engine request behind an API request (a completions prompt or a chat)."""

    engine_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    # The adapter the request's ``model`` names; None: the base model.
    lora_request: LoRARequest | None = None


class ModelServing:
    """The served model as the API sees it; shared by every endpoint."""

    def __init__(self, engine: AsyncLLM, model_names: Sequence[str], metrics: ServerMetrics,
                 parsers: Any = None, enable_auto_tool_choice: bool = False,
                 trust_request_chat_template: bool = False) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        inner = engine.engine
        self.max_model_len: int = inner.max_model_len
        self.vocab_size: int = inner.model.ctx.hf_config.vocab_size
        self.architecture: str = inner.loaded.architecture
        self.model_names = list(model_names)
        self.model_root = inner.config.model.model
        self.metrics = metrics
        self.parsers = parsers
        self.enable_auto_tool_choice = enable_auto_tool_choice
        # A request's own ``chat_template`` is rendered (--trust-request-chat-template).
        self.trust_request_chat_template = trust_request_chat_template
        # The LoRA adapters served as model names (set by the app; None: LoRA off).
        self.loras: ServedLoRAs | None = None
        self.created = int(time.time())
        # Text longer than this cannot fit the context: refused before tokenizing.
        self.max_prompt_chars = (self.max_model_len * longest_token_chars(self.tokenizer)
                                 * _NORMALIZER_MARGIN)
        self.max_body_bytes = min(_MAX_BODY_BYTES,
                                  max(_MIN_BODY_BYTES, 12 * self.max_prompt_chars))
        # Tokenizing and templating run here, never on the event loop (a long prompt
        # would stall every other request and /health); one thread keeps the
        # tokenizer used by one request at a time on this side.
        self._tokenizer_thread = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="tokenizer")
        gen = inner.loaded.generation_config
        self.sampling_defaults = {k: gen[k] for k in _GENERATION_DEFAULTS
                                  if isinstance(gen.get(k), (int, float))
                                  and not isinstance(gen.get(k), bool)}
        if self.sampling_defaults:
            logger.info("sampling defaults from generation_config.json: %s",
                        self.sampling_defaults)

    @property
    def model_name(self) -> str:
        return self.model_names[0]

    def response_model(self, requested: str | None) -> str:
        """The ``model`` a response reports: the LoRA adapter's name when ``requested``
        selects one (as vLLM does), else the base model's first name."""
        if requested is not None and self.loras is not None and self.loras.lookup(requested):
            return requested
        return self.model_name

    def check_model(self, name: str | None) -> LoRARequest | None:
        """The LoRA adapter ``name`` selects (None: the base model); 404 for a name not
        served."""
        lora = self.loras.lookup(name) if self.loras is not None else None
        if lora is not None:
            return lora
        if name is not None and name not in self.model_names:
            served = self.model_names + (list(self.loras.adapters) if self.loras else [])
            raise APIError(f"the model {name!r} does not exist; this server serves "
                           f"{', '.join(repr(n) for n in served)}", status=404,
                           param="model")
        return None

    def new_request_id(self, prefix: str, given: str | None) -> str:
        """The client's ``request_id`` (checked: it is echoed in ``X-Request-Id``) or a new one."""
        if given is not None:
            if not _REQUEST_ID.fullmatch(given):
                raise APIError("request_id must be 1-256 visible ASCII characters (no spaces or "
                               "control characters)", param="request_id")
            return given
        return f"{prefix}-{uuid.uuid4().hex}"

    # ---- prompts and sampling ---------------------------------------------
    def check_text_length(self, num_chars: int, param: str) -> None:
        """A 400 for text that cannot fit the context, before any time is spent on it."""
        if num_chars > self.max_prompt_chars:
            raise APIError(f"{param} has {num_chars} characters; this model's context of "
                           f"{self.max_model_len} tokens cannot hold more than "
                           f"{self.max_prompt_chars}", param=param)

    async def off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        """Run tokenizer work on the tokenizer thread; the event loop stays free."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_thread, fn,
                                                                *args)

    def close(self) -> None:
        self._tokenizer_thread.shutdown(wait=False, cancel_futures=True)

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    async def encode(self, text: str, add_special_tokens: bool = True,
                     param: str = "prompt") -> list[int]:
        """Token ids of ``text``, refused early (400) when it is too long to fit."""
        self.check_text_length(len(text), param)
        return await self.off_loop(self._encode, text, add_special_tokens)

    def check_prompt(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise APIError("the prompt is empty", param="prompt")
        if len(token_ids) >= self.max_model_len:
            raise APIError(f"this model's maximum context length is {self.max_model_len} tokens; "
                           f"the prompt has {len(token_ids)} tokens, leaving no room to generate",
                           param="prompt")
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise APIError(f"prompt token ids outside the vocabulary [0, {self.vocab_size}): "
                           f"{bad[:8]}", param="prompt")

    def sampling_params(self, body: SamplingFields, prompt_len: int, max_tokens: int | None,
                        logprobs: int | None, max_tokens_field: str = "max_tokens",
                        **extra: Any) -> SamplingParams:
        """The request's :class:`SamplingParams`; unset fields take the model's defaults.

        Raises:
            APIError: a value out of range, or more tokens asked than the context holds.
        """
        room = self.max_model_len - prompt_len
        if max_tokens is None:
            max_tokens = min(room, int(self.sampling_defaults.get("max_new_tokens", room)))
        elif isinstance(max_tokens, int) and max_tokens > room:
            raise APIError(
                f"this model's maximum context length is {self.max_model_len} tokens; the "
                f"request asks for {max_tokens} output tokens after a {prompt_len}-token prompt "
                f"(at most {room} fit)", param=max_tokens_field)
        fields: dict[str, Any] = {}
        # A block-diffusion model samples on its own schedule: the checkpoint's token-sampling
        # defaults do not apply (the engine refuses the fields when a client sends them).
        diffusion = getattr(self.engine.engine, "diffusion", None) is not None
        for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty"):
            value = getattr(body, name)
            if value is None and not diffusion:
                value = self.sampling_defaults.get(name)
            if value is not None:
                fields[name] = value
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(body, name) is not None:
                fields[name] = getattr(body, name)
        try:
            return SamplingParams(
                n=body.n, seed=body.seed, stop=body.stop, stop_token_ids=body.stop_token_ids,
                ignore_eos=body.ignore_eos, min_tokens=body.min_tokens, max_tokens=max_tokens,
                logprobs=logprobs, skip_special_tokens=body.skip_special_tokens,
                include_stop_str_in_output=body.include_stop_str_in_output, **fields, **extra)
        except ValueError as exc:
            field = str(exc).split(" ", 1)[0]
            message = str(exc)
            if field == "max_tokens":
                field = max_tokens_field
                message = message.replace("max_tokens", max_tokens_field, 1)
            raise APIError(message, param=field) from None

    # ---- running ---------------------------------------------------------------
    async def start(self, requests: list[EngineRequest]) -> list[AsyncIterator[RequestOutput]]:
        """Queue every engine request; if one is refused, abort the ones already queued.

        Raises:
            APIError: the engine refused a request (400) or is not running (503).
        """
        streams = []
        try:
            for r in requests:
                streams.append(await self.engine.add_request(
                    {"prompt": r.prompt, "prompt_token_ids": r.prompt_token_ids}, r.params,
                    request_id=r.engine_id, lora_request=r.lora_request))
        except BaseException as exc:
            if streams:
                with contextlib.suppress(Exception):
                    await self.engine.abort([r.engine_id for r in requests[:len(streams)]])
            for stream in streams:
                await stream.aclose()
            if isinstance(exc, EngineDeadError):
                raise APIError(str(exc), status=503) from None
            if isinstance(exc, ValueError):
                raise APIError(str(exc)) from None
            raise
        return streams


async def merged(
    streams: list[AsyncIterator[RequestOutput]],
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several output streams as items arrive; closing this closes them all.

    Outputs are cumulative, so each stream keeps only its latest unread output:
    a slow consumer holds one output per stream, never a backlog.
    """
    if len(streams) == 1:
        async with contextlib.aclosing(streams[0]) as only:  # type: ignore[type-var]
            async for item in only:
                yield 0, item
        return
    latest: dict[int, RequestOutput] = {}
    ended: set[int] = set()
    errors: list[Exception] = []
    wake = asyncio.Event()

    async def pump(index: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async with contextlib.aclosing(stream):  # type: ignore[type-var]
                async for item in stream:
                    latest[index] = item
                    wake.set()
        except Exception as exc:  # handed to the consumer
            errors.append(exc)
        ended.add(index)
        wake.set()

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        while True:
            if errors:
                raise errors[0]
            if latest:
                index = next(iter(latest))  # the longest-waiting stream first
                yield index, latest.pop(index)
            elif len(ended) == len(tasks):
                return
            else:
                wake.clear()
                await wake.wait()
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def timed(serving: ModelServing, streams: list[AsyncIterator[RequestOutput]],
                prompt_lens: list[int], arrival: float) -> AsyncIterator[tuple[int, RequestOutput]]:
    """:func:`merged` with TTFT / inter-token latency and token counters recorded."""
    timers = [RequestTimer(serving.metrics, arrival) for _ in streams]
    finished = [False] * len(streams)
    try:
        async with contextlib.aclosing(merged(streams)) as items:
            async for index, output in items:
                timers[index].observe(sum(len(o.token_ids) for o in output.outputs))
                if output.finished and not finished[index]:
                    finished[index] = True
                    timers[index].finish(prompt_lens[index],
                                         [o.finish_reason for o in output.outputs])
                yield index, output
    finally:
        # Closed early (client gone, error): those requests were aborted.
        for index, done in enumerate(finished):
            if not done:
                timers[index].finish(prompt_lens[index], ["abort"])


async def run_until_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await ``work``; if the client disconnects first, cancel it (aborting its requests)."""
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(watch())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        watcher.cancel()
        raise
    if not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        raise APIError("the client disconnected", status=499)
    watcher.cancel()
    return task.result()
