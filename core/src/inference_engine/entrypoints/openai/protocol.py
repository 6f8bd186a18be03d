"""Request bodies of the OpenAI API (plus vLLM's extra sampling fields), validated.

Models are strict: a string where a number belongs is a 400, not a silent
coercion. On completions and chat a field the server does not implement is a 400
naming it, never accepted and ignored (unknown fields of the other endpoints are
ignored). Range checks live in :class:`SamplingParams`; this module only checks
shapes and types.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from inference_engine.entrypoints.openai.errors import APIError

__all__ = [
    "MAX_LOGPROBS",
    "MAX_N",
    "AbortRequest",
    "ChatCompletionRequest",
    "CompletionRequest",
    "DetokenizeRequest",
    "TokenizeRequest",
    "parse_body",
]

# The most top-N logprobs a request may ask for (vLLM's default max_logprobs).
MAX_LOGPROBS = 20
# The most samples one request may ask for.
MAX_N = 128
# Stop strings are matched on the engine thread after every token: their count and
# length bound that work (a request may not slow everyone else down).
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 1024
# JSON Schema's type names (a tool's ``parameters.type``).
_JSON_TYPES = frozenset({"object", "array", "string", "number", "integer", "boolean", "null"})

_ROLES = ("system", "developer", "user", "assistant", "tool")


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Body):
    model_config = ConfigDict(extra="forbid", strict=True)

    include_usage: bool = False
    # vLLM's extension: every chunk carries the usage so far (with include_usage).
    continuous_usage_stats: bool = False


class SamplingFields(_Body):
    """Fields shared by completions and chat completions.

    A field not declared here is a 400 naming it (never accepted and ignored);
    declared fields this server does not implement are refused by name in ``check``.
    """

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: dict[str, Any] | None = None
    user: str | None = None
    # vLLM's extension: the client picks the id (useful with /abort_requests).
    request_id: str | None = None
    # vLLM's extension: logprobs name tokens "token_id:N" instead of their text.
    return_tokens_as_token_ids: bool = False
    # OpenAI's {token id: bias in [-100, 100]}; vLLM's token-level fields.
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = None
    spaces_between_special_tokens: bool = True
    prompt_logprobs: int | None = None
    # vLLM's structured-output fields (see request_sampling.py); response_format above.
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    # xgrammar's structural tag as JSON text (vLLM's field).
    structural_tag: str | None = None
    # vLLM's fields accepted at their "off" value only.
    use_beam_search: bool = False
    priority: int = 0
    # Block-diffusion settings (DiffusionGemma), per request; the engine refuses them for an
    # autoregressive model. Sent through the OpenAI client's extra_body.
    max_denoising_steps: int | None = None
    entropy_bound: float | None = None
    t_min: float | None = None
    t_max: float | None = None
    stability_threshold: int | None = None
    confidence_threshold: float | None = None
    start_canvas: str | None = None

    def check_common(self) -> None:
        if self.use_beam_search:
            raise APIError("use_beam_search is not supported (no beam search); leave it out",
                           param="use_beam_search")
        if self.priority != 0:
            raise APIError("priority is not supported (requests are served first come, first "
                           "served); leave it out or send 0", param="priority")
        if self.prompt_logprobs is not None and not (
                0 <= self.prompt_logprobs <= MAX_LOGPROBS or self.prompt_logprobs == -1):
            raise APIError(f"prompt_logprobs must be between 0 and {MAX_LOGPROBS} or -1 (whole "
                           f"vocabulary), got {self.prompt_logprobs}", param="prompt_logprobs")
        if not 1 <= self.n <= MAX_N:
            raise APIError(f"n must be between 1 and {MAX_N}, got {self.n}", param="n")
        if self.stream_options is not None and not self.stream:
            raise APIError("stream_options is only allowed with stream: true",
                           param="stream_options")
        stops = [self.stop] if isinstance(self.stop, str) else self.stop or []
        if len(stops) > MAX_STOP_STRINGS:
            raise APIError(f"stop: at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}",
                           param="stop")
        longest = max((len(s) for s in stops), default=0)
        if longest > MAX_STOP_CHARS:
            raise APIError(f"stop: a stop string may have at most {MAX_STOP_CHARS} characters, "
                           f"got {longest}", param="stop")


class CompletionRequest(SamplingFields):
    """``POST /v1/completions``."""

    prompt: Any = None
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    # vLLM's extension: add the tokenizer's special tokens (BOS) to text prompts.
    add_special_tokens: bool = True

    def prompts(self) -> list[str | list[int]]:
        """The prompt field as a list of texts or token-id lists.

        Raises:
            APIError: a prompt that is missing, empty, or of the wrong type.
        """
        prompt = self.prompt
        if prompt is None:
            raise APIError("prompt is required", param="prompt")
        if isinstance(prompt, str):
            prompts: list[Any] = [prompt]
        elif isinstance(prompt, list) and prompt and all(_is_token(t) for t in prompt):
            prompts = [prompt]
        elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
            prompts = list(prompt)
        elif isinstance(prompt, list) and prompt and all(
                isinstance(p, list) and all(_is_token(t) for t in p) for p in prompt):
            prompts = list(prompt)
        else:
            raise APIError("prompt must be a string, a list of strings, a list of token ids "
                           "or a list of token-id lists", param="prompt")
        if any(len(p) == 0 for p in prompts):
            raise APIError("prompt must not be empty", param="prompt")
        return prompts

    def check(self) -> None:
        self.check_common()
        if self.suffix:
            raise APIError("suffix is not supported", param="suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise APIError("best_of different from n is not supported", param="best_of")
        if self.logprobs is not None and not (0 <= self.logprobs <= MAX_LOGPROBS
                                              or self.logprobs == -1):
            raise APIError(f"logprobs must be between 0 and {MAX_LOGPROBS} or -1 (whole "
                           f"vocabulary), got {self.logprobs}", param="logprobs")
        if self.echo and self.stream and self.n > 1:
            raise APIError("echo with stream and n > 1 is not supported", param="echo")


class ChatCompletionRequest(SamplingFields):
    """``POST /v1/chat/completions``."""

    messages: Any = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    # A Jinja chat template for this request (vLLM's field): code run on the server, so
    # honoured only with --trust-request-chat-template.
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False

    def check(self) -> None:
        self.check_common()
        if self.top_logprobs is not None:
            if not self.logprobs:
                raise APIError("top_logprobs needs logprobs: true", param="top_logprobs")
            if not (0 <= self.top_logprobs <= MAX_LOGPROBS or self.top_logprobs == -1):
                raise APIError(f"top_logprobs must be between 0 and {MAX_LOGPROBS}, got "
                               f"{self.top_logprobs}", param="top_logprobs")
        if self.tools is not None:
            for i, tool in enumerate(self.tools):
                function = tool.get("function")
                if tool.get("type", "function") != "function" or not isinstance(function, dict) \
                        or not isinstance(function.get("name"), str):
                    raise APIError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": "
                                   f"{{\"name\": ..., \"parameters\": ...}}}}", param="tools")
                if "parameters" in function:
                    problem = _schema_problem(function["parameters"])
                    if problem is not None:
                        raise APIError(f"tools[{i}].function.parameters is not a JSON Schema "
                                       f"object: {problem}", param="tools")
        self._check_tool_choice()
        if self.add_generation_prompt and self.continue_final_message:
            raise APIError("add_generation_prompt and continue_final_message cannot both be true",
                           param="continue_final_message")

    def _check_tool_choice(self) -> None:
        """``tool_choice`` is a known mode or names a function given in ``tools``."""
        choice = self.tool_choice
        if choice is None or choice in ("none", "auto", "required"):
            return
        function = choice.get("function") if isinstance(choice, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) \
                or choice.get("type", "function") != "function":
            raise APIError("tool_choice must be \"none\", \"auto\", \"required\" or "
                           "{\"type\": \"function\", \"function\": {\"name\": ...}}, got "
                           f"{choice!r}"[:300], param="tool_choice")
        names = [t["function"]["name"] for t in self.tools or ()]
        if function["name"] not in names:
            raise APIError(f"tool_choice names the function {function['name']!r}, which is not "
                           f"in tools ({', '.join(map(repr, names)) or 'none given'})"[:300],
                           param="tool_choice")

    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None \
            else self.max_tokens

    def template_messages(self) -> list[dict[str, Any]]:
        """Messages ready for the chat template: text parts joined into strings.

        Raises:
            APIError: no messages, a message without a known role, or non-text content.
        """
        return normalize_messages(self.messages)


def normalize_messages(messages: Any, param: str = "messages") -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise APIError("messages must be a non-empty list", param=param)
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise APIError(f"messages[{i}] must be an object", param=param)
        role = message.get("role")
        if role not in _ROLES:
            raise APIError(f"messages[{i}].role must be one of {', '.join(_ROLES)}, got {role!r}",
                           param=param)
        message = dict(message)
        content = message.get("content")
        if isinstance(content, list):
            texts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" \
                        or not isinstance(part.get("text"), str):
                    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                    raise APIError(f"messages[{i}].content: only text parts are supported, got "
                                   f"{kind!r}", param=param)
                texts.append(part["text"])
            message["content"] = "".join(texts)
        elif content is None:
            if role != "assistant":
                raise APIError(f"messages[{i}].content is required for role {role!r}",
                               param=param)
            message["content"] = ""
        elif not isinstance(content, str):
            raise APIError(f"messages[{i}].content must be a string or a list of text parts",
                           param=param)
        out.append(message)
    return out


class TokenizeRequest(_Body):
    """``POST /tokenize``: either ``prompt`` or ``messages``."""

    model: str | None = None
    prompt: str | None = None
    messages: Any = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    tools: list[dict[str, Any]] | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(_Body):
    """``POST /detokenize``."""

    model: str | None = None
    tokens: list[int]


class AbortRequest(_Body):
    """``POST /abort_requests``: the listed ids, or every request when none are given."""

    request_ids: list[str] | None = None


def _schema_problem(schema: Any) -> str | None:
    """Why ``schema`` is not a JSON Schema object (the keys a tool's arguments rely on)."""
    if not isinstance(schema, dict):
        return f"expected an object, got {type(schema).__name__}"
    kind = schema.get("type")
    kinds = kind if isinstance(kind, list) else [kind] if kind is not None else []
    if not all(isinstance(k, str) and k in _JSON_TYPES for k in kinds):
        return f"type must be one of {', '.join(sorted(_JSON_TYPES))} (or a list of them)"
    properties = schema.get("properties")
    if properties is not None and not (isinstance(properties, dict) and all(
            isinstance(p, (dict, bool)) for p in properties.values())):
        return "properties must map names to schemas"
    required = schema.get("required")
    if required is not None and not (isinstance(required, list)
                                     and all(isinstance(r, str) for r in required)):
        return "required must be a list of property names"
    return None


def _is_token(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def parse_body(model_cls: type[_Body], data: Any) -> Any:
    """Validate a decoded JSON body; the first problem becomes a 400 naming the field."""
    if not isinstance(data, dict):
        raise APIError("the request body must be a JSON object")
    try:
        return model_cls.model_validate(data)
    except ValidationError as exc:
        error = exc.errors()[0]
        field = ".".join(str(p) for p in error["loc"]) or None
        if error["type"] == "extra_forbidden":
            raise APIError(f"{field}: this server does not support the request field "
                           f"{field!r}; leave it out", param=field) from None
        got = error.get("input")
        shown = repr(got) if not isinstance(got, (dict, list)) else type(got).__name__
        raise APIError(f"{field}: {error['msg']} (got {shown})", param=field) from None
