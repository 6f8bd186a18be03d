"""Incremental detokenization and stop-string matching across token boundaries.

``IncrementalDetokenizer`` follows vLLM's prefix/read offsets: each step
decodes a short window of recent tokens twice, without and with the new ones,
and emits the difference. Decoding a window (not single tokens) keeps merges,
added/stripped spaces (SentencePiece's leading space) and multi-byte characters
right; cost per token depends on the window, not on the output length. For a plain
transformers fast tokenizer the per-token call (``add_token``) runs that same window
through ``tokenizers.decoders.DecodeStream`` (one call into Rust instead of two decodes);
the window is still kept here, so ``flush`` and the fallbacks continue from the same state.

NOTE: like vLLM, this assumes decoding is local: text decoded from a window
is what the same tokens contribute inside the whole output. Tokenizers whose
``decode`` rewrites across tokens (``clean_up_tokenization_spaces=True``
turning " ." into ".") can differ from ``decode(all)`` at window edges.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "IncrementalDetokenizer",
    "NoTextDetokenizer",
    "StopChecker",
    "StopMatch",
    "find_stop",
    "find_stop_string",
    "stop_holdback",
    "window_decoder",
]

# Prompt tokens decoded ahead of the first output token (vLLM's initial offset).
PROMPT_CONTEXT = 5
# Tokens held back at most; past this the text is emitted even if it ends in
# U+FFFD (then genuinely invalid bytes: a UTF-8 character spans at most 4
# tokens), so the decoded window stays bounded.
MAX_PENDING = 32
REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Turns a growing list of output tokens into text, emitting only certain text.

    Text is held back while the decoded window ends with U+FFFD (a multi-byte
    character whose remaining bytes are in later tokens) or while new tokens add
    no text yet; :meth:`flush` releases it at the end.

    Args:
        tokenizer: anything with ``decode(ids, skip_special_tokens=...)``.
        prompt_token_ids: the prompt; its last few tokens give the first output
            tokens their left context (spaces, merges).
        skip_special_tokens: leave special tokens out of the text.
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int],
                 skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        # Windows are always lists here, so the Rust decode is called without a wrapper.
        self._decode = _list_decoder(tokenizer, skip_special_tokens)
        # Skipped special tokens add no text: keep them out of the window, so a
        # run of them does not grow it.
        self._skipped_ids = _skipped_special_ids(tokenizer) if skip_special_tokens else frozenset()
        context = self._kept(prompt_token_ids)
        # Window of recent ids: [0, read) is emitted context, [read, end) pending.
        self._ids: list[int] = context[-PROMPT_CONTEXT:] if context else []
        self._read = len(self._ids)
        # Grows by each emission (read every step by a stream or a stop-string check; a
        # final-only request emits once, at the end).
        self._text = ""
        self.num_output_tokens = 0
        # The Rust tokenizer's DecodeStream runs the same window algorithm for one token in
        # one call (see add_token); None: every token takes the Python path.
        self._stream, self._backend = _decode_stream(tokenizer, skip_special_tokens, self._ids,
                                                     self._decode)

    @property
    def text(self) -> str:
        """All text emitted so far."""
        return self._text

    @property
    def num_pending_tokens(self) -> int:
        """Output tokens whose text is still held back."""
        return len(self._ids) - self._read

    def _kept(self, token_ids: Sequence[int]) -> list[int]:
        if not self._skipped_ids:
            return list(token_ids)
        return [t for t in token_ids if t not in self._skipped_ids]

    def add_tokens(self, token_ids: Sequence[int]) -> str:
        """Add generated tokens; return the text that became certain (maybe "")."""
        self._stream = None  # the Python path from here on (its window is the one kept)
        self._ids.extend(self._kept(token_ids))
        self.num_output_tokens += len(token_ids)
        return self._emit(force=False)

    def add_token(self, token_id: int) -> str:
        """:meth:`add_tokens` of one token (the per-step call of a streaming request).

        With a DecodeStream, the window is still kept here (so :meth:`flush` and the
        fallbacks see the same state) but decoded by the stream: one call instead of two
        decodes through the binding.
        """
        ids = self._ids
        if token_id not in self._skipped_ids:
            ids.append(token_id)
        self.num_output_tokens += 1
        stream = self._stream
        if stream is None:
            return self._emit(force=False)
        try:
            delta = stream.step(self._backend, token_id)
        except Exception:  # the window's text did not extend its prefix's: Python from here
            self._stream = None
            return self._emit(force=False)
        if delta is None:
            if len(ids) - self._read >= MAX_PENDING:  # the Python path forces it out
                self._stream = None
                return self._emit(force=False)
            return ""
        del ids[: self._read]
        self._read = len(ids)
        if delta:
            self._text += delta
        return delta

    def flush(self) -> str:
        """End of output: emit whatever is held back, even an incomplete character."""
        return self._emit(force=True)

    def _emit(self, force: bool) -> str:
        ids, read = self._ids, self._read
        if read == len(ids):
            return ""
        # The window's left context starts at 0: each emission drops what came before it.
        prefix_text = self._decode(ids[:read])
        full_text = self._decode(ids)
        is_ready = len(full_text) > len(prefix_text) and not full_text.endswith(REPLACEMENT)
        if not (is_ready or force or len(ids) - read >= MAX_PENDING):
            return ""
        delta = full_text[len(prefix_text) :]
        # The new tokens become the next window's left context.
        del ids[:read]
        self._read = len(ids)
        if delta:
            self._text += delta
        return delta


def window_decoder(tokenizer: Any, skip_special_tokens: bool) -> Callable[[Sequence[int]], str]:
    """``ids -> tokenizer.decode(ids, skip_special_tokens=...)``, chosen once per request.

    For a transformers fast tokenizer that neither overrides decoding nor cleans up
    spaces, ``decode`` is the Rust tokenizer's ``decode`` behind a Python conversion
    that walks every id (``to_py_obj``); the window is decoded twice per step for every
    running request, so calling the Rust ``decode`` directly is what keeps detokenizing
    64 streams cheap. Any other tokenizer keeps its own ``decode``.
    """
    backend = _plain_rust_backend(tokenizer)
    if backend is not None:
        decode = backend.decode

        def fast(ids: Sequence[int]) -> str:
            return decode(ids if isinstance(ids, list) else list(ids),
                          skip_special_tokens=skip_special_tokens)

        return fast

    def general(ids: Sequence[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    return general


def _list_decoder(tokenizer: Any, skip_special_tokens: bool) -> Callable[[list[int]], str]:
    """:func:`window_decoder` for list windows: where that calls the Rust tokenizer's
    ``decode``, a closure calling it with positional arguments (the cheapest call through
    its binding: no keyword parsing, no list conversion)."""
    backend = _plain_rust_backend(tokenizer)
    if backend is None:
        return window_decoder(tokenizer, skip_special_tokens)
    decode = backend.decode

    def rust(ids: list[int]) -> str:
        return decode(ids, skip_special_tokens)

    return rust


def _decode_stream(tokenizer: Any, skip_special_tokens: bool, context: list[int],
                   decode: Callable[[list[int]], str]) -> tuple[Any, Any]:
    """``(tokenizers.decoders.DecodeStream primed with context, the Rust tokenizer)`` where
    :func:`window_decoder` would call the Rust ``decode``; ``(None, None)`` otherwise.

    The stream keeps the window as :class:`IncrementalDetokenizer` does (prefix = emitted
    text, emit when the decode grows and does not end in U+FFFD, then the new tokens become
    the prefix). Not used when the context itself ends inside a character: the stream
    would then take the whole context as output.
    """
    backend = _plain_rust_backend(tokenizer)
    if backend is None:
        return None, None
    try:
        from tokenizers.decoders import DecodeStream

        stream = DecodeStream(ids=list(context), skip_special_tokens=skip_special_tokens)
    except (ImportError, TypeError):  # an older tokenizers without a primed stream
        return None, None
    if context and decode(context).endswith(REPLACEMENT):
        return None, None
    return stream, backend


def _plain_rust_backend(tokenizer: Any) -> Any | None:
    """The Rust ``tokenizers.Tokenizer`` behind a plain transformers fast tokenizer (no own
    decoding, no space clean-up), whose ``decode`` equals the tokenizer's; else None."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is None or not _plain_fast_decode(type(tokenizer)) or getattr(
            tokenizer, "clean_up_tokenization_spaces", True):
        return None
    return backend


_PLAIN_DECODE: dict[type, bool] = {}


def _plain_fast_decode(cls: type) -> bool:
    """Whether ``cls`` decodes as transformers' ``TokenizersBackend`` does, unchanged."""
    if cls not in _PLAIN_DECODE:
        try:
            from transformers.tokenization_utils_base import PreTrainedTokenizerBase
            from transformers.tokenization_utils_tokenizers import TokenizersBackend
        except ImportError:  # another transformers layout: keep the tokenizer's decode
            _PLAIN_DECODE[cls] = False
        else:
            _PLAIN_DECODE[cls] = (issubclass(cls, TokenizersBackend)
                                  and cls.decode is PreTrainedTokenizerBase.decode
                                  and cls._decode is TokenizersBackend._decode)
    return _PLAIN_DECODE[cls]


_SKIPPED_CACHE: weakref.WeakKeyDictionary[Any, frozenset[int]] = weakref.WeakKeyDictionary()


def _skipped_special_ids(tokenizer: Any) -> frozenset[int]:
    """Special ids that ``decode(..., skip_special_tokens=True)`` drops, once per tokenizer."""
    try:
        return _SKIPPED_CACHE[tokenizer]
    except (KeyError, TypeError):
        pass
    candidates = getattr(tokenizer, "all_special_ids", None) or ()
    skipped = frozenset(
        t for t in candidates if tokenizer.decode([t], skip_special_tokens=True) == ""
    )
    try:
        _SKIPPED_CACHE[tokenizer] = skipped
    except TypeError:
        pass
    return skipped


class NoTextDetokenizer:
    """What a request with ``detokenize=False`` gets instead of an
    :class:`IncrementalDetokenizer`: it counts tokens and never decodes (text stays "")."""

    text = ""
    num_pending_tokens = 0

    def __init__(self) -> None:
        self.num_output_tokens = 0

    def add_tokens(self, token_ids: Sequence[int]) -> str:
        self.num_output_tokens += len(token_ids)
        return ""

    def add_token(self, token_id: int) -> str:
        self.num_output_tokens += 1
        return ""

    def flush(self) -> str:
        return ""


# ---- stop strings ---------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class StopMatch:
    """Where generation stops on a stop string."""

    # The output text cut at the stop string (kept only with include_stop_str_in_output).
    text: str
    # The stop string that matched.
    stop: str
    # Index in the output text where the stop string starts.
    start: int


def find_stop_string(
    text: str,
    num_new_chars: int,
    stop_strings: Sequence[str],
    include_stop_str_in_output: bool = False,
) -> StopMatch | None:
    """Earliest stop string that ends inside the last ``num_new_chars`` of ``text``.

    Only the tail a new match can touch is searched (``num_new_chars +
    len(stop) - 1`` characters per stop string), so a match that straddles
    earlier text and the new text is found, and the cost does not grow with
    the output. The earliest start wins; at equal starts, the shorter string.

    Args:
        text: the whole output text so far.
        num_new_chars: how many of its trailing characters are new since the
            last check (everything before was already checked).
        stop_strings: non-empty strings.
        include_stop_str_in_output: keep the stop string in the returned text.

    Returns:
        The match, or None.
    """
    num_new_chars = min(num_new_chars, len(text))
    if num_new_chars <= 0:
        return None
    new_start = len(text) - num_new_chars
    best: tuple[int, str] | None = None
    for stop in stop_strings:
        at = text.find(stop, max(0, new_start - len(stop) + 1))
        if at == -1:
            continue
        if best is None or at < best[0] or (at == best[0] and len(stop) < len(best[1])):
            best = (at, stop)
    if best is None:
        return None
    at, stop = best
    end = at + len(stop) if include_stop_str_in_output else at
    return StopMatch(text[:end], stop, at)


def stop_holdback(text: str, stop_strings: Sequence[str]) -> int:
    """How many trailing characters of ``text`` to keep out of a stream.

    The longest tail that is a proper prefix of some stop string: it could
    still grow into that stop string, and a streamed delta must never show
    part of a stop string that is then cut away.
    """
    hold = 0
    for stop in stop_strings:
        for k in range(min(len(stop) - 1, len(text)), hold, -1):
            if text.endswith(stop[:k]):
                hold = k
                break
    return hold


def find_stop(text: str, checked_len: int, stops: Sequence[str],
              include: bool = False) -> tuple[str, str] | None:
    """Older form of :func:`find_stop_string`: ``text[:checked_len]`` was already checked.

    Returns:
        (text cut at the stop, the stop string), or None.
    """
    match = find_stop_string(text, len(text) - checked_len, stops, include)
    return None if match is None else (match.text, match.stop)


class StopChecker:
    """A request's stop strings, checked as its text grows.

    Args:
        stop_strings: non-empty strings (SamplingParams.stop).
        include_stop_str_in_output: keep the matched string in the text.
    """

    def __init__(self, stop_strings: Sequence[str],
                 include_stop_str_in_output: bool = False) -> None:
        if any(not s for s in stop_strings):
            raise ValueError("stop strings must be non-empty")
        self.stop_strings = tuple(stop_strings)
        self.include_stop_str_in_output = include_stop_str_in_output
        self.max_stop_len = max((len(s) for s in self.stop_strings), default=0)

    def check(self, text: str, num_new_chars: int) -> StopMatch | None:
        """See :func:`find_stop_string`."""
        if not self.stop_strings:
            return None
        return find_stop_string(text, num_new_chars, self.stop_strings,
                                self.include_stop_str_in_output)

    def holdback(self, text: str) -> int:
        """See :func:`stop_holdback`."""
        return stop_holdback(text, self.stop_strings) if self.stop_strings else 0

    def streamable_len(self, text: str) -> int:
        """Length of the prefix of ``text`` that is safe to stream now."""
        return len(text) - self.holdback(text)
