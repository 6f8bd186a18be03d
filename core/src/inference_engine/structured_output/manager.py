"""Per-sequence grammar state for the engine: compile, admit, mask, advance.

The engine's hooks, in step order:

* ``add(seq_id, params)`` when a request arrives: its grammar starts compiling; the
  engine keeps the sequence out of the scheduler until :meth:`take_ready` returns it,
  so a slow compile never stalls a step.
* ``fill_bitmask(seq_ids)`` before sampling: one packed row per sampling row (xgrammar's
  ``int32 [rows, ceil(vocab / 32)]``, bit set = allowed); rows without a grammar, and
  grammars already complete, allow everything (as vLLM). The sampler applies it to the
  logits in one batched op.
* ``accept(seq_id, token)`` for each token read back: the matcher advances.

Preemption needs nothing: it recomputes the KV cache but keeps the sampled tokens, so
the matcher state stays right. ``rollback`` is there for tokens that are dropped
after being accepted (speculative decoding).
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import Any

import torch

from inference_engine.structured_output.compiler import CompiledConstraint, GrammarCompilerPool
from inference_engine.structured_output.params import StructuredOutputsParams

__all__ = ["StructuredOutputManager"]

logger = logging.getLogger(__name__)


class StructuredOutputManager:
    """Grammar matchers of the sequences that have a constraint (keyed by sequence id).

    xgrammar is imported when the first constrained request arrives.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Collection[int]) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._stop_token_ids = frozenset(stop_token_ids)
        self._pool: GrammarCompilerPool | None = None
        # seq id -> (the caller's handle, compile future), until compiled.
        self._waiting: dict[str, tuple[Any, Future[CompiledConstraint]]] = {}
        self._matchers: dict[str, Any] = {}

    @property
    def pool(self) -> GrammarCompilerPool:
        if self._pool is None:
            self._pool = GrammarCompilerPool(self._tokenizer, self.vocab_size,
                                             self._stop_token_ids)
        return self._pool

    # ---- admission ----------------------------------------------------------------
    def add(self, seq_id: str, params: StructuredOutputsParams, handle: Any) -> None:
        """Start compiling ``params``; ``handle`` comes back from :meth:`take_ready`."""
        self._waiting[seq_id] = (handle, self.pool.submit(params))

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def is_waiting(self, seq_id: str) -> bool:
        """Whether ``seq_id``'s grammar is still compiling (it is not scheduled yet)."""
        return seq_id in self._waiting

    def take_ready(self) -> tuple[list[Any], list[tuple[Any, str]]]:
        """Handles whose grammar compiled (each now has a matcher), and those that failed
        with the reason."""
        ready: list[Any] = []
        failed: list[tuple[Any, str]] = []
        for seq_id, (handle, future) in list(self._waiting.items()):
            if not future.done():
                continue
            del self._waiting[seq_id]
            try:
                compiled = future.result()
            except Exception as exc:
                failed.append((handle, str(exc)))
                continue
            import xgrammar

            self._matchers[seq_id] = xgrammar.GrammarMatcher(compiled.grammar)
            ready.append(handle)
        return ready, failed

    def wait(self, timeout: float) -> None:
        """Block until some waiting grammar is compiled, or ``timeout`` seconds."""
        if self._waiting:
            wait([f for _, f in self._waiting.values()], timeout=timeout,
                 return_when=FIRST_COMPLETED)

    # ---- per step ---------------------------------------------------------------------
    @property
    def num_active(self) -> int:
        """Sequences with a matcher (a compiled grammar): 0 lets a step skip per-token calls."""
        return len(self._matchers)

    def has_matcher(self, seq_id: str) -> bool:
        return seq_id in self._matchers

    def fill_bitmask(self, seq_ids: Sequence[str]) -> torch.Tensor | None:
        """Host ``int32 [rows, ceil(vocab / 32)]`` allowed-token bits; None when no row
        has an unfinished grammar."""
        if not self._matchers:
            return None
        rows = [(i, self._matchers.get(s)) for i, s in enumerate(seq_ids)]
        rows = [(i, m) for i, m in rows if m is not None and not m.is_terminated()]
        if not rows:
            return None
        import xgrammar

        bitmask = xgrammar.allocate_token_bitmask(len(seq_ids), self.vocab_size)
        for i, matcher in rows:
            matcher.fill_next_token_bitmask(bitmask, i)
        return bitmask

    def draft_bitmask(self, seq_id: str, drafts: Sequence[int]) -> torch.Tensor | None:
        """Host ``int32 [len(drafts) + 1, ceil(vocab / 32)]`` bits for verifying ``drafts``:
        row ``j`` allows what the grammar allows after the drafts before ``j``. Rows after
        a draft the grammar refuses allow everything: verification rejects at that draft
        (the target's masked draw cannot equal it), so they are never read. The matcher
        is left as it was. None without an unfinished grammar."""
        matcher = self._matchers.get(seq_id)
        if matcher is None or matcher.is_terminated():
            return None
        import xgrammar

        bitmask = xgrammar.allocate_token_bitmask(len(drafts) + 1, self.vocab_size)
        advanced = 0
        for j in range(len(drafts) + 1):
            matcher.fill_next_token_bitmask(bitmask, j)
            if j == len(drafts) or matcher.is_terminated() \
                    or not matcher.accept_token(int(drafts[j])):
                break
            advanced += 1
        if advanced:
            matcher.rollback(advanced)
        return bitmask

    def accept(self, seq_id: str, token_id: int) -> None:
        """Advance ``seq_id``'s matcher by a sampled token (no-op without one, or once the
        grammar is complete)."""
        matcher = self._matchers.get(seq_id)
        if matcher is None or matcher.is_terminated():
            return
        if not matcher.accept_token(token_id):
            # The mask allowed only accepted tokens: this is a bug, not a user error.
            logger.error("grammar of %s rejected sampled token %d", seq_id, token_id)

    def rollback(self, seq_id: str, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens of ``seq_id``."""
        matcher = self._matchers.get(seq_id)
        if matcher is not None and num_tokens:
            matcher.rollback(num_tokens)

    def remove(self, seq_id: str) -> None:
        self._waiting.pop(seq_id, None)
        self._matchers.pop(seq_id, None)
