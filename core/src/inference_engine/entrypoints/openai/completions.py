"""``POST /v1/completions``: one engine request per prompt, ``n`` samples each."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from inference_engine.entrypoints.openai.errors import APIError, JSONResponse
from inference_engine.entrypoints.openai.logprobs_format import (
    completion_logprobs,
    prompt_logprobs_json,
)
from inference_engine.entrypoints.openai.protocol import CompletionRequest
from inference_engine.entrypoints.openai.request_sampling import (
    extra_sampling_kwargs,
    truncate_prompt_ids,
)
from inference_engine.entrypoints.openai.serving import (
    ChoiceCursor,
    EngineRequest,
    ModelServing,
    run_until_disconnected,
    timed,
)
from inference_engine.entrypoints.openai.streaming import (
    DONE,
    EngineStreamingResponse,
    sse,
    sse_error,
)
from inference_engine.outputs import RequestOutput

__all__ = ["create_completion"]


def _usage(prompt_lens: list[int], outputs: list[RequestOutput | None]) -> dict[str, Any]:
    completion = sum(len(c.token_ids) for o in outputs if o is not None for c in o.outputs)
    cached = sum(o.num_cached_tokens for o in outputs if o is not None)
    prompt = sum(prompt_lens)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


async def create_completion(serving: ModelServing, body: CompletionRequest,
                            raw: Request) -> Response:
    """Validate, queue every prompt, then stream SSE or return the whole response."""
    arrival = time.perf_counter()
    body.check()
    lora = serving.check_model(body.model)
    prompts = body.prompts()
    request_id = serving.new_request_id("cmpl", body.request_id)
    requests = []
    extra = extra_sampling_kwargs(body)
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, str):
            text, ids = prompt, await serving.encode(prompt, body.add_special_tokens)
        else:
            text, ids = None, list(prompt)
        if body.truncate_prompt_tokens is not None:
            text, ids = None, truncate_prompt_ids(ids, body.truncate_prompt_tokens,
                                                  serving.max_model_len)
        serving.check_prompt(ids)
        params = serving.sampling_params(body, len(ids), body.max_tokens, body.logprobs,
                                         prompt_logprobs=body.prompt_logprobs, **extra)
        engine_id = request_id if len(prompts) == 1 else f"{request_id}-{i}"
        requests.append(EngineRequest(engine_id, text, ids, params, lora))
    streams = await serving.start(requests)
    run = _Completion(serving, body, request_id, requests)
    stream_items = timed(serving, streams, [len(r.prompt_token_ids) for r in requests], arrival)
    if body.stream:
        return EngineStreamingResponse(run.events(stream_items), run.release,
                                       headers={"X-Request-Id": request_id})
    try:
        payload = await run_until_disconnected(raw, run.whole(stream_items))
    finally:
        await run.release()
    return JSONResponse(payload, headers={"X-Request-Id": request_id})


class _Completion:
    """One completions request in flight: its engine requests and how far each choice got."""

    def __init__(self, serving: ModelServing, body: CompletionRequest, request_id: str,
                 requests: list[EngineRequest]) -> None:
        self.serving = serving
        self.body = body
        self.request_id = request_id
        self.requests = requests
        self.created = int(time.time())
        self.finished: set[int] = set()

    async def release(self) -> None:
        unfinished = [r.engine_id for i, r in enumerate(self.requests) if i not in self.finished]
        if unfinished:
            with contextlib.suppress(Exception):
                await self.serving.engine.abort(unfinished)

    def _prompt_text(self, index: int) -> str:
        request = self.requests[index]
        if request.prompt is not None:
            return request.prompt
        return self.serving.tokenizer.decode(request.prompt_token_ids)

    def _choice(self, prompt_index: int, completion: Any, text: str,
                token_ids: list[int], positions: list[Any] | None,
                text_offset: int, output: RequestOutput | None = None) -> dict[str, Any]:
        """One choice; ``output`` given: its prompt_logprobs go with it (when asked)."""
        logprobs = None
        if self.body.logprobs is not None and positions is not None:
            logprobs = completion_logprobs(token_ids, positions, self.body.logprobs,
                                           self.serving.tokenizer, text_offset,
                                           self.body.return_tokens_as_token_ids)
        choice = {
            "index": prompt_index * self.body.n + completion.index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": completion.finish_reason,
            "stop_reason": completion.stop_reason,
        }
        if self.body.prompt_logprobs is not None and output is not None:
            choice["prompt_logprobs"] = prompt_logprobs_json(output.prompt_logprobs)
        return choice

    def _header(self, obj: str = "text_completion") -> dict[str, Any]:
        return {"id": self.request_id, "object": obj, "created": self.created,
                "model": self.serving.response_model(self.body.model)}

    def _note(self, index: int, output: RequestOutput,
              finals: list[RequestOutput | None]) -> None:
        """Keep a prompt's final output; an engine-side error ends the response."""
        if output.finished:
            self.finished.add(index)
            finals[index] = output
            if output.error:
                raise APIError(output.error)

    async def whole(self, items: AsyncIterator[tuple[int, RequestOutput]]) -> dict[str, Any]:
        finals: list[RequestOutput | None] = [None] * len(self.requests)
        async with contextlib.aclosing(items):  # type: ignore[type-var]
            async for index, output in items:
                self._note(index, output, finals)
        choices = []
        for index, output in enumerate(finals):
            assert output is not None
            prefix = self._prompt_text(index) if self.body.echo else ""
            for completion in output.outputs:
                choices.append(self._choice(index, completion, prefix + completion.text,
                                            completion.token_ids, completion.logprobs,
                                            len(prefix), output))
        choices.sort(key=lambda c: c["index"])
        payload = self._header()
        payload["choices"] = choices
        payload["usage"] = _usage([len(r.prompt_token_ids) for r in self.requests], finals)
        return payload

    async def events(self, items: AsyncIterator[tuple[int, RequestOutput]]) -> AsyncIterator[bytes]:
        n = self.body.n
        cursors = [[ChoiceCursor() for _ in range(n)] for _ in self.requests]
        echoed = [[not self.body.echo] * n for _ in self.requests]
        # A choice's first chunk carries the prompt's logprobs (vLLM's streaming shape).
        started = [[False] * n for _ in self.requests]
        finals: list[RequestOutput | None] = [None] * len(self.requests)
        latest: list[RequestOutput | None] = [None] * len(self.requests)
        options = self.body.stream_options
        continuous = options is not None and options.include_usage \
            and options.continuous_usage_stats
        prompt_lens = [len(r.prompt_token_ids) for r in self.requests]
        try:
            async with contextlib.aclosing(items):  # type: ignore[type-var]
                async for index, output in items:
                    self._note(index, output, finals)
                    latest[index] = output
                    choices = []
                    for completion in output.outputs:
                        i = completion.index
                        delta = cursors[index][i].advance(completion)
                        if delta is None:
                            continue
                        text = delta.text
                        if not echoed[index][i]:
                            text = self._prompt_text(index) + text
                            echoed[index][i] = True
                        choices.append(self._choice(
                            index, completion, text, delta.token_ids, delta.logprobs,
                            delta.text_offset, None if started[index][i] else output))
                        started[index][i] = True
                    if choices:
                        chunk = self._header()
                        chunk["choices"] = choices
                        if continuous:
                            chunk["usage"] = _usage(prompt_lens, latest)
                        yield sse(chunk)
            if options is not None and options.include_usage:
                chunk = self._header()
                chunk["choices"] = []
                chunk["usage"] = _usage([len(r.prompt_token_ids) for r in self.requests], finals)
                yield sse(chunk)
        except Exception as exc:
            yield sse_error(exc)
        yield DONE
