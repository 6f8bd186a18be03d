"""Grammar compilation with xgrammar: once per distinct constraint, off the engine thread.

A slow compile (a large JSON schema) must not stall the requests already running, so
:meth:`GrammarCompilerPool.submit` returns a future at once; the engine admits the
request to the scheduler when it is done. Futures are cached by the constraint's
:meth:`~.params.StructuredOutputsParams.cache_key`, so a schema is compiled once however
many requests use it (a failed compile is cached too: the same bad schema fails fast).
The cache keeps the most recently used ``max_cached`` constraints.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Collection
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from inference_engine.structured_output.params import StructuredOutputsParams

__all__ = ["CompiledConstraint", "GrammarCompilerPool", "json_schema_ebnf"]

# xgrammar (0.2.9) writes the characters of a length-bounded JSON string as this class,
# which admits raw control characters (U+0000-U+001F): not JSON, json.loads refuses it.
# Its unbounded strings use the right class; the bounded ones are tightened to it.
_LOOSE_STRING_CHAR = r'[^\"\\\r\n]'
_JSON_STRING_CHAR = r'[^\0-\x1f\"\\]'


def json_schema_ebnf(schema: dict[str, Any], any_whitespace: bool = True) -> str:
    """xgrammar's EBNF for ``schema``, with JSON's string characters (see above)."""
    import json

    import xgrammar

    grammar = xgrammar.Grammar.from_json_schema(json.dumps(schema),
                                                any_whitespace=any_whitespace)
    return str(grammar).replace(_LOOSE_STRING_CHAR, _JSON_STRING_CHAR)


@dataclass(frozen=True)
class CompiledConstraint:
    """An xgrammar ``CompiledGrammar`` and how long compiling it took."""

    grammar: Any
    compile_seconds: float


class GrammarCompilerPool:
    """Compiles constraints for one tokenizer in a background thread, with a cache.

    Args:
        tokenizer: the Hugging Face tokenizer (xgrammar reads its vocabulary and decoder).
        vocab_size: width of the model's logits (may exceed the tokenizer's vocabulary;
            ids past it are never allowed).
        stop_token_ids: ids that end a sequence (the engine's EOS set): allowed once the
            grammar is complete.
        max_workers: compile threads.
        max_cached: compiled constraints kept (least recently used dropped first).
    """

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Collection[int],
                 max_workers: int = 1, max_cached: int = 1024) -> None:
        import xgrammar

        self.tokenizer_info = xgrammar.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(stop_token_ids) or None)
        self.vocab_size = vocab_size
        # Our cache (below) is the only one: xgrammar's would hold every grammar again.
        self._compiler = xgrammar.GrammarCompiler(self.tokenizer_info, max_threads=max_workers,
                                                  cache_enabled=False)
        self._executor = ThreadPoolExecutor(max_workers=max_workers,
                                            thread_name_prefix="grammar-compile")
        self._cache: OrderedDict[tuple[str, str, bool], Future[CompiledConstraint]] = \
            OrderedDict()
        self._max_cached = max_cached
        self._lock = threading.Lock()

    def submit(self, params: StructuredOutputsParams) -> Future[CompiledConstraint]:
        """The (possibly shared, possibly finished) future of ``params``' grammar."""
        key = params.cache_key()
        with self._lock:
            future = self._cache.get(key)
            if future is None:
                future = self._cache[key] = self._executor.submit(self._compile, params)
                while len(self._cache) > self._max_cached:
                    self._cache.popitem(last=False)  # requests holding it keep their future
            else:
                self._cache.move_to_end(key)
        return future

    def compile(self, params: StructuredOutputsParams) -> CompiledConstraint:
        """Compile now, on this thread (through the cache)."""
        return self.submit(params).result()

    def _compile(self, params: StructuredOutputsParams) -> CompiledConstraint:
        start = time.perf_counter()
        compiler = self._compiler
        any_whitespace = not params.disable_any_whitespace
        try:
            if params.json is not None:
                schema = params.json
                if schema is True:  # the schema that allows any JSON value
                    grammar = compiler.compile_builtin_json_grammar()
                else:
                    grammar = compiler.compile_grammar(json_schema_ebnf(schema, any_whitespace))
            elif params.json_object:
                # A JSON object (OpenAI's json_object), not any JSON value.
                grammar = compiler.compile_grammar(json_schema_ebnf({"type": "object"},
                                                                    any_whitespace))
            elif params.regex is not None:
                grammar = compiler.compile_regex(params.regex)
            elif params.structural_tag is not None:
                import json

                grammar = compiler.compile_structural_tag(json.dumps(params.structural_tag))
            elif params.choice is not None:
                grammar = compiler.compile_grammar(params.choice_grammar())
            else:
                grammar = compiler.compile_grammar(params.grammar)
        except Exception as exc:  # xgrammar raises RuntimeError/ValueError with its reason
            raise ValueError(f"structured_outputs.{params.kind} could not be compiled: "
                             f"{exc}") from None
        return CompiledConstraint(grammar, time.perf_counter() - start)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
