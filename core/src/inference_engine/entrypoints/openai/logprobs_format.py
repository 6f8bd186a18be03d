"""Engine logprobs (``dict[token_id, Logprob]`` per token) in the two OpenAI shapes.

``as_ids`` writes tokens as ``token_id:N`` (vLLM's ``return_tokens_as_token_ids``),
for clients that need ids rather than text pieces that may not decode alone.
"""

from __future__ import annotations

from typing import Any

__all__ = ["chat_logprobs", "completion_logprobs", "prompt_logprobs_json"]


def _token_text(token_id: int, entry: Any, tokenizer: Any, as_ids: bool = False) -> str:
    if as_ids:
        return f"token_id:{token_id}"
    text = getattr(entry, "decoded_token", None)
    if text is None:
        text = tokenizer.decode([token_id])
    return text


def _ranked(position: dict[int, Any], top_n: int) -> list[tuple[int, Any]]:
    if top_n < 0:  # -1: every token the engine returned (the whole vocabulary)
        top_n = len(position)
    return sorted(((t, e) for t, e in position.items() if e.rank <= top_n),
                  key=lambda item: item[1].rank)[:top_n]


def completion_logprobs(token_ids: list[int], positions: list[dict[int, Any]], top_n: int,
                        tokenizer: Any, text_offset: int = 0,
                        as_ids: bool = False) -> dict[str, Any]:
    """The legacy completions shape: tokens, token_logprobs, top_logprobs, text_offset."""
    tokens, token_logprobs, tops, offsets = [], [], [], []
    offset = text_offset
    for token_id, position in zip(token_ids, positions, strict=False):
        entry = position[token_id]
        text = _token_text(token_id, entry, tokenizer, as_ids)
        tokens.append(text)
        token_logprobs.append(entry.logprob)
        offsets.append(offset)
        offset += len(text)
        if top_n:
            top = {_token_text(t, e, tokenizer, as_ids): e.logprob
                   for t, e in _ranked(position, top_n)}
            top.setdefault(text, entry.logprob)
            tops.append(top)
        else:
            tops.append(None)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops,
            "text_offset": offsets}


def chat_logprobs(token_ids: list[int], positions: list[dict[int, Any]], top_n: int,
                  tokenizer: Any, as_ids: bool = False) -> dict[str, Any]:
    """The chat shape: ``{"content": [{token, logprob, bytes, top_logprobs}]}``."""
    content = []
    for token_id, position in zip(token_ids, positions, strict=False):
        entry = position[token_id]
        text = _token_text(token_id, entry, tokenizer, as_ids)
        content.append({
            "token": text,
            "logprob": entry.logprob,
            "bytes": list(text.encode("utf-8")),
            "top_logprobs": [
                {"token": (s := _token_text(t, e, tokenizer, as_ids)), "logprob": e.logprob,
                 "bytes": list(s.encode("utf-8"))}
                for t, e in _ranked(position, top_n)
            ],
        })
    return {"content": content}


def prompt_logprobs_json(positions: list[dict[int, Any] | None] | None
                         ) -> list[dict[str, dict[str, Any]] | None] | None:
    """vLLM's ``prompt_logprobs``: per prompt token (None first) ``{token id: {logprob, rank,
    decoded_token}}``, the prompt's own token and the top-N."""
    if positions is None:
        return None
    return [None if position is None else {
        str(token_id): {"logprob": entry.logprob, "rank": entry.rank,
                        "decoded_token": entry.decoded_token}
        for token_id, entry in position.items()} for position in positions]
