"""``POST /v1/chat/completions``: chat template in, parsed message (reasoning, content,
tool calls) out, whole or streamed."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response

from inference_engine.entrypoints.llm import apply_chat_template
from inference_engine.entrypoints.openai.errors import APIError, JSONResponse
from inference_engine.entrypoints.openai.logprobs_format import (
    chat_logprobs,
    prompt_logprobs_json,
)
from inference_engine.entrypoints.openai.protocol import ChatCompletionRequest
from inference_engine.entrypoints.openai.request_sampling import (
    extra_sampling_kwargs,
    tool_call_constraint,
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
from inference_engine.interfaces.parsers import ParsedDelta
from inference_engine.outputs import CompletionOutput, RequestOutput
from inference_engine.parsing import ParserPipeline, thinking_from_kwargs, to_openai_delta
from inference_engine.structured_output.reasoning import after_reasoning

__all__ = ["create_chat_completion", "render_chat"]


# apply_chat_template's own arguments: set by the server, not through chat_template_kwargs
# (a client template is code run on the server; the rest would collide or change the output).
_RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"})


async def render_chat(serving: ModelServing, messages: list[dict[str, Any]],
                      tools: list[dict[str, Any]] | None, add_generation_prompt: bool,
                      chat_template_kwargs: dict[str, Any] | None,
                      continue_final_message: bool = False,
                      chat_template: str | None = None) -> list[int]:
    """Prompt token ids of a conversation, rendered off the event loop (with the request's
    own ``chat_template`` when given and the server trusts request templates).

    Raises:
        APIError: a reserved template kwarg, an untrusted request template, text too long
            to fit, or a template failure.
    """
    if chat_template is not None and not serving.trust_request_chat_template:
        raise APIError("chat_template: a chat template sent with the request is code run on "
                       "the server; start the server with --trust-request-chat-template to "
                       "allow it", param="chat_template")
    kwargs = dict(chat_template_kwargs or {})
    reserved = sorted(_RESERVED_TEMPLATE_KWARGS.intersection(kwargs))
    if reserved:
        raise APIError(f"chat_template_kwargs may not set {', '.join(reserved)}",
                       param="chat_template_kwargs")
    if continue_final_message:
        kwargs["continue_final_message"] = True
    serving.check_text_length(sum(len(m["content"]) for m in messages
                                  if isinstance(m.get("content"), str)), "messages")
    if tools:  # rendered into the prompt as JSON (at least this long)
        serving.check_text_length(len(orjson.dumps(tools)), "tools")
    try:
        return await serving.off_loop(apply_chat_template, serving.tokenizer, messages, tools,
                                      add_generation_prompt, kwargs, chat_template)
    except APIError:
        raise
    except Exception as exc:  # jinja errors, raise_exception() in templates, bad kwargs
        raise APIError(f"the chat template failed on these messages: {exc}",
                       param="messages") from None


def _tool_choice(serving: ModelServing, body: ChatCompletionRequest) -> Any:
    """The effective tool_choice, checked against the server's parser settings (as vLLM)."""
    choice = body.tool_choice
    if choice is None:
        choice = "auto" if body.tools else "none"
    if not body.tools:
        if choice != "none":
            raise APIError("tool_choice needs tools in the request", param="tool_choice")
        return "none"
    has_parser = serving.parsers is not None and serving.parsers.tool_parser_cls is not None
    if choice == "auto" and not (serving.enable_auto_tool_choice and has_parser):
        raise APIError('"auto" tool choice needs the server started with '
                       '--enable-auto-tool-choice and a --tool-call-parser',
                       param="tool_choice")
    if choice != "none" and not has_parser:
        raise APIError("tool_choice other than none needs the server started with "
                       "--tool-call-parser", param="tool_choice")
    return choice


async def create_chat_completion(serving: ModelServing, body: ChatCompletionRequest,
                                 raw: Request) -> Response:
    """Validate, render the template, queue, then stream SSE or return the whole message."""
    arrival = time.perf_counter()
    body.check()
    lora = serving.check_model(body.model)
    messages = body.template_messages()
    tool_choice = _tool_choice(serving, body)
    prompt_ids = await render_chat(serving, messages, body.tools, body.add_generation_prompt,
                                   body.chat_template_kwargs, body.continue_final_message,
                                   body.chat_template)
    prompt_ids = truncate_prompt_ids(prompt_ids, body.truncate_prompt_tokens,
                                     serving.max_model_len)
    serving.check_prompt(prompt_ids)
    top_n = (body.top_logprobs or 0) if body.logprobs else None
    extra = extra_sampling_kwargs(body)
    parser_cls = serving.parsers.tool_parser_cls if serving.parsers is not None else None
    forced_calls = tool_call_constraint(parser_cls, body.tools, tool_choice,
                                        body.parallel_tool_calls)
    if forced_calls is not None:
        if "structured_outputs" in extra:
            raise APIError("a forced tool call (tool_choice or strict tools) and another output "
                           "constraint cannot be combined", param="tool_choice")
        extra["structured_outputs"] = forced_calls
    end_marker = _reasoning_end(serving, body)
    if end_marker is not None and "structured_outputs" in extra:
        # As vLLM: the constraint applies once the reasoning section has ended.
        tag = getattr(parser_cls, "call_tag", None)
        extra["structured_outputs"] = after_reasoning(
            extra["structured_outputs"], end_marker, [tag.trigger] if tag else [])
    params = serving.sampling_params(
        body, len(prompt_ids), body.max_new_tokens(), top_n,
        max_tokens_field="max_completion_tokens" if body.max_completion_tokens is not None
        else "max_tokens", prompt_logprobs=body.prompt_logprobs, **extra)
    request_id = serving.new_request_id("chatcmpl", body.request_id)
    run = _Chat(serving, body, request_id, tool_choice, len(prompt_ids))
    # Parsers are made before the request is queued so a bad setting fails as a 400.
    pipelines = [run.pipeline(whole=not body.stream) for _ in range(body.n)]
    streams = await serving.start([EngineRequest(request_id, None, prompt_ids, params,
                                                        lora)])
    items = timed(serving, streams, [len(prompt_ids)], arrival)
    if body.stream:
        return EngineStreamingResponse(run.events(items, pipelines), run.release,
                                       headers={"X-Request-Id": request_id})
    try:
        payload = await run_until_disconnected(raw, run.whole(items, pipelines))
    finally:
        await run.release()
    return JSONResponse(payload, headers={"X-Request-Id": request_id})


def _reasoning_end(serving: ModelServing, body: ChatCompletionRequest) -> str | None:
    """The reasoning parser's end marker when this request's output starts with reasoning
    (a think-marker parser with thinking on), else None."""
    cls = serving.parsers.reasoning_parser_cls if serving.parsers is not None else None
    marker = getattr(cls, "end_marker", None)
    if cls is None or not marker:
        return None
    parser = cls(tokenizer=serving.tokenizer,
                 enable_thinking=thinking_from_kwargs(body.chat_template_kwargs))
    return marker if getattr(parser, "is_thinking", False) else None


def _join(a: ParsedDelta, b: ParsedDelta) -> ParsedDelta:
    return ParsedDelta(reasoning=a.reasoning + b.reasoning, content=a.content + b.content,
                       tool_calls=list(a.tool_calls) + list(b.tool_calls))


class _Chat:
    """One chat request in flight."""

    def __init__(self, serving: ModelServing, body: ChatCompletionRequest, request_id: str,
                 tool_choice: Any, prompt_len: int) -> None:
        self.serving = serving
        self.body = body
        self.request_id = request_id
        self.tool_choice = tool_choice
        self.prompt_len = prompt_len
        self.created = int(time.time())
        self.finished = False
        self.enable_thinking = thinking_from_kwargs(body.chat_template_kwargs)

    async def release(self) -> None:
        if not self.finished:
            with contextlib.suppress(Exception):
                await self.serving.engine.abort([self.request_id])

    def pipeline(self, whole: bool) -> ParserPipeline | None:
        """This choice's parsers; a whole response parses in ``whole`` mode (rule 5)."""
        factory = self.serving.parsers
        if factory is None:
            return None
        if factory.reasoning_parser_cls is None and self.tool_choice == "none":
            return None
        return factory.create(tokenizer=self.serving.tokenizer, tools=self.body.tools,
                              tool_choice=self.tool_choice,
                              enable_thinking=self.enable_thinking,
                              mode="whole" if whole else None)

    def _finish_reason(self, completion: CompletionOutput, has_calls: bool) -> str | None:
        if has_calls and completion.finish_reason == "stop":
            return "tool_calls"
        return completion.finish_reason

    def _logprobs(self, token_ids: list[int], positions: list[Any] | None) -> Any:
        if not self.body.logprobs or positions is None:
            return None
        return chat_logprobs(token_ids, positions, self.body.top_logprobs or 0,
                             self.serving.tokenizer, self.body.return_tokens_as_token_ids)

    def _usage(self, output: RequestOutput | None) -> dict[str, Any]:
        completion = sum(len(c.token_ids) for c in output.outputs) if output else 0
        return {"prompt_tokens": self.prompt_len, "completion_tokens": completion,
                "total_tokens": self.prompt_len + completion,
                "prompt_tokens_details": {
                    "cached_tokens": output.num_cached_tokens if output else 0}}

    def _header(self, obj: str) -> dict[str, Any]:
        return {"id": self.request_id, "object": obj, "created": self.created,
                "model": self.serving.response_model(self.body.model)}

    async def whole(self, items: AsyncIterator[tuple[int, RequestOutput]],
                    pipelines: list[ParserPipeline | None]) -> dict[str, Any]:
        final: RequestOutput | None = None
        async with contextlib.aclosing(items):  # type: ignore[type-var]
            async for _, output in items:
                if output.finished:
                    self.finished = True
                    final = output
        assert final is not None
        if final.error:
            raise APIError(final.error)
        choices = []
        for completion in final.outputs:
            pipeline = pipelines[completion.index]
            if pipeline is None:
                message: dict[str, Any] = {"role": "assistant", "content": completion.text}
                has_calls = False
            else:
                pipeline.feed(completion.text, completion.token_ids)
                pipeline.finish()
                problem = pipeline.tool_choice_error()
                if problem is not None:
                    raise APIError(problem, param="tool_choice")
                result = pipeline.result()
                message = result.to_openai_message()
                if self.body.parallel_tool_calls is False and message.get("tool_calls"):
                    message["tool_calls"] = message["tool_calls"][:1]  # the first call only
                has_calls = bool(result.tool_calls)
            choices.append({
                "index": completion.index,
                "message": message,
                "logprobs": self._logprobs(completion.token_ids, completion.logprobs),
                "finish_reason": self._finish_reason(completion, has_calls),
                "stop_reason": completion.stop_reason,
            })
        payload = self._header("chat.completion")
        payload["choices"] = choices
        payload["usage"] = self._usage(final)
        if self.body.prompt_logprobs is not None:
            payload["prompt_logprobs"] = prompt_logprobs_json(final.prompt_logprobs)
        return payload

    async def events(self, items: AsyncIterator[tuple[int, RequestOutput]],
                     pipelines: list[ParserPipeline | None]) -> AsyncIterator[bytes]:
        n = self.body.n
        cursors = [ChoiceCursor() for _ in range(n)]
        has_calls = [False] * n
        final: RequestOutput | None = None
        options = self.body.stream_options
        continuous = options is not None and options.include_usage \
            and options.continuous_usage_stats
        # The first chunk with engine output carries the prompt's logprobs (when asked).
        prompt_logprobs_sent = self.body.prompt_logprobs is None
        try:
            first = self._header("chat.completion.chunk")
            first["choices"] = [{"index": i, "delta": {"role": "assistant", "content": ""},
                                 "logprobs": None, "finish_reason": None} for i in range(n)]
            yield sse(first)
            async with contextlib.aclosing(items):  # type: ignore[type-var]
                async for _, output in items:
                    if output.finished:
                        self.finished = True
                        final = output
                        if output.error:
                            raise APIError(output.error)
                    choices = []
                    for completion in output.outputs:
                        i = completion.index
                        step = cursors[i].advance(completion)
                        if step is None:
                            continue
                        text, tokens, positions = step.text, step.token_ids, step.logprobs
                        pipeline = pipelines[i]
                        if pipeline is None:
                            delta: dict[str, Any] | None = {"content": text} if text else None
                        else:
                            parsed = pipeline.feed(text, tokens)
                            if completion.finished:
                                parsed = _join(parsed, pipeline.finish())
                                problem = pipeline.tool_choice_error()
                                if problem is not None:
                                    raise APIError(problem, param="tool_choice")
                            if self.body.parallel_tool_calls is False:
                                parsed.tool_calls = [c for c in parsed.tool_calls
                                                     if c.index == 0]
                            has_calls[i] = has_calls[i] or bool(parsed.tool_calls)
                            delta = to_openai_delta(parsed)
                        logprobs = self._logprobs(tokens, positions)
                        if delta is None and logprobs is None and not completion.finished:
                            continue
                        choices.append({
                            "index": i,
                            "delta": delta or {},
                            "logprobs": logprobs,
                            "finish_reason": self._finish_reason(completion, has_calls[i])
                            if completion.finished else None,
                            **({"stop_reason": completion.stop_reason}
                               if completion.finished else {}),
                        })
                    if choices:
                        chunk = self._header("chat.completion.chunk")
                        chunk["choices"] = choices
                        if continuous:
                            chunk["usage"] = self._usage(output)
                        if not prompt_logprobs_sent:
                            chunk["prompt_logprobs"] = prompt_logprobs_json(
                                output.prompt_logprobs)
                            prompt_logprobs_sent = True
                        yield sse(chunk)
            if options is not None and options.include_usage:
                chunk = self._header("chat.completion.chunk")
                chunk["choices"] = []
                chunk["usage"] = self._usage(final)
                yield sse(chunk)
        except Exception as exc:
            yield sse_error(exc)
        yield DONE
