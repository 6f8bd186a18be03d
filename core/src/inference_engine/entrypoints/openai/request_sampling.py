"""Request fields that become :class:`SamplingParams` keywords beyond the basic ones.

Structured outputs come in three spellings, all honoured and mutually exclusive:
OpenAI's ``response_format`` (``json_schema``, ``json_object``, ``text``), vLLM's
``structured_outputs`` object and vLLM's older ``guided_json`` / ``guided_regex`` /
``guided_choice`` / ``guided_grammar`` / ``structural_tag`` fields. Forced tool
calls (``tool_choice``, ``strict`` tools) become a structural tag in the tool
parser's format. Token-level fields (``logit_bias``,
``allowed_token_ids``, ``bad_words``, ``spaces_between_special_tokens``) pass through;
the engine checks their values.
"""

from __future__ import annotations

import re
from typing import Any

from inference_engine.diffusion.settings import DIFFUSION_KEYS
from inference_engine.entrypoints.openai.errors import APIError
from inference_engine.structured_output import StructuredOutputsParams

__all__ = ["extra_sampling_kwargs", "structured_outputs_of", "tool_call_constraint",
           "truncate_prompt_ids"]

# vLLM's top-level constraint fields -> StructuredOutputsParams field.
_VLLM_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                "guided_grammar": "grammar", "structural_tag": "structural_tag"}
# The structured_outputs keys this server implements.
_STRUCTURED_KEYS = frozenset({"json", "json_object", "regex", "choice", "grammar",
                              "structural_tag", "disable_any_whitespace"})
# guided_decoding_backend values that mean this server's only backend.
_BACKENDS = ("xgrammar", "auto")


def structured_outputs_of(body: Any) -> StructuredOutputsParams | None:
    """The request's output constraint, from whichever spelling it used.

    Raises:
        APIError: two spellings at once, an unknown ``response_format`` type or
            ``structured_outputs`` key, or a malformed constraint (each names its field).
    """
    found: list[tuple[str, dict[str, Any]]] = []
    response_format = getattr(body, "response_format", None)
    if response_format is not None:
        spec = _from_response_format(response_format)
        if spec is not None:
            found.append(("response_format", spec))
    structured = getattr(body, "structured_outputs", None)
    if structured is not None:
        if not isinstance(structured, dict):
            raise APIError("structured_outputs must be an object", param="structured_outputs")
        unknown = sorted(set(structured) - _STRUCTURED_KEYS)
        if unknown:
            raise APIError(f"structured_outputs.{unknown[0]} is not supported (supported: "
                           f"{', '.join(sorted(_STRUCTURED_KEYS))})", param="structured_outputs")
        found.append(("structured_outputs",
                      {k: v for k, v in structured.items() if v is not None}))
    for field, key in _VLLM_FIELDS.items():
        value = getattr(body, field, None)
        if value is not None:
            found.append((field, {key: value}))
    backend = getattr(body, "guided_decoding_backend", None)
    if backend is not None and backend not in _BACKENDS:
        raise APIError(f"guided_decoding_backend {backend!r} is not available; this server "
                       "uses xgrammar", param="guided_decoding_backend")
    if not found:
        return None
    if len(found) > 1:
        names = " and ".join(name for name, _ in found)
        raise APIError(f"{names} both constrain the output; give one", param=found[1][0])
    field, spec = found[0]
    try:
        return StructuredOutputsParams(**spec)
    except (TypeError, ValueError) as exc:
        raise APIError(f"{field}: {exc}", param=field) from None


def _from_response_format(response_format: dict[str, Any]) -> dict[str, Any] | None:
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise APIError("response_format.json_schema.schema must be a JSON schema object",
                           param="response_format")
        return {"json": schema}
    raise APIError(f"response_format.type must be text, json_object or json_schema, got "
                   f"{kind!r}", param="response_format")


def extra_sampling_kwargs(body: Any) -> dict[str, Any]:
    """SamplingParams keywords of the request's token-level and structured-output fields."""
    kwargs: dict[str, Any] = {}
    for name in ("logit_bias", "allowed_token_ids", "bad_words"):
        value = getattr(body, name, None)
        if value is not None:
            kwargs[name] = value
    if not getattr(body, "spaces_between_special_tokens", True):
        kwargs["spaces_between_special_tokens"] = False
    structured = structured_outputs_of(body)
    if structured is not None:
        kwargs["structured_outputs"] = structured
    # Block-diffusion settings travel in extra_args under their own names.
    diffusion = {name: getattr(body, name) for name in DIFFUSION_KEYS
                 if getattr(body, name, None) is not None}
    if diffusion:
        kwargs["extra_args"] = diffusion
    return kwargs


def truncate_prompt_ids(token_ids: list[int], keep: int | None, max_model_len: int) -> list[int]:
    """vLLM's ``truncate_prompt_tokens``: the last ``keep`` ids (-1: as many as leave room
    for one output token); ``token_ids`` unchanged when ``keep`` is None.

    Raises:
        APIError: ``keep`` is 0 or below -1, or larger than the context.
    """
    if keep is None:
        return token_ids
    if keep == -1:
        keep = max_model_len - 1
    if not 1 <= keep < max_model_len:
        raise APIError(f"truncate_prompt_tokens must be -1 or between 1 and "
                       f"{max_model_len - 1}, got {keep}", param="truncate_prompt_tokens")
    return token_ids[-keep:]


# Characters that end a function name in the XML and special-token call formats.
_UNWRITABLE_NAME = re.compile(r"""[\s<>"'{}=]""")


def tool_call_constraint(parser_cls: Any, tools: list[dict[str, Any]] | None,
                         tool_choice: Any, parallel_tool_calls: bool | None
                         ) -> StructuredOutputsParams | None:
    """A structural tag that forces the tool calls the request asks for, in the tool
    parser's own call format (its ``call_tag``): ``tool_choice`` "required" (at least one
    call) or naming a function (exactly that call), and ``strict`` tools (their arguments
    follow their ``parameters`` schema wherever the model calls them). Text around the
    calls is free (so a reasoning section stays possible) except that a forced call comes
    first. None when nothing is forced.

    Raises:
        APIError: a ``strict`` tool with a parser whose format cannot be forced.
    """
    if not tools or tool_choice == "none":
        return None
    strict = [i for i, t in enumerate(tools) if t["function"].get("strict") is True]
    forced = tool_choice == "required" or isinstance(tool_choice, dict)
    if not strict and not forced:
        return None
    tag = getattr(parser_cls, "call_tag", None)
    if tag is None:
        if strict:
            raise APIError(f"tools[{strict[0]}].function.strict: the tool-call format of this "
                           "server's tool parser cannot be enforced by a grammar",
                           param="tools")
        return None  # the choice is checked after generation (docs/server.md)
    named = tool_choice["function"]["name"] if isinstance(tool_choice, dict) else None
    tags = []
    for index, tool in enumerate(tools):
        function = tool["function"]
        if named is not None and function["name"] != named:
            continue
        if not tag.name_in_json_string and _UNWRITABLE_NAME.search(function["name"]):
            raise APIError(f"tools[{index}].function.name {function['name']!r}: this server's "
                           "tool-call format cannot write a name with spaces, quotes, braces, "
                           "'<', '>' or '=', so the call cannot be forced", param="tools")
        schema = function.get("parameters") if (forced or function.get("strict") is True) \
            else None
        content = {"type": "json_schema", "style": tag.style,
                   "json_schema": schema or {"type": "object"}}
        if tag.whitespace is not None:
            content["max_whitespace_cnt"] = 1
        tags.append({"type": "tag", "begin": tag.begin_for(function["name"]),
                     "content": content, "end": tag.end})
    fmt = {"type": "triggered_tags", "triggers": [tag.trigger], "tags": tags,
           "at_least_one": forced,
           "stop_after_first": named is not None or parallel_tool_calls is False}
    structural_tag = {"type": "structural_tag", "format": fmt}
    if tag.whitespace is None:
        return StructuredOutputsParams(structural_tag=structural_tag)
    return StructuredOutputsParams(grammar=_narrow_whitespace(structural_tag, tag.whitespace))


def _narrow_whitespace(structural_tag: dict[str, Any], whitespace: str) -> str:
    """The EBNF of ``structural_tag`` with each optional whitespace character (xgrammar's
    ``[ \\n\\r\\t]``, at most one in a row here) replaced by ``whitespace``."""
    import json

    import xgrammar

    try:
        grammar = xgrammar.Grammar.from_structural_tag(json.dumps(structural_tag))
    except Exception as exc:  # xgrammar names what it could not convert
        raise APIError(f"tools: the forced tool call could not be made a grammar: {exc}",
                       param="tools") from None
    return str(grammar).replace("[ \\n\\r\\t]", json.dumps(whitespace))
