"""``n > 1`` samples that share one computation of their prompt (vLLM's sequence-group fork).

With prefix caching on, the samples of one request share their prompt's full blocks
through the cache. With it off (always, for models with per-sequence state, whose
recurrent state a cached block cannot bring back) each sample would compute the whole
prompt itself. Instead only the group's first sample (the *parent*) is scheduled; its
siblings wait here. In the step whose forward reaches the end of the parent's prompt,
each sibling is forked: it takes shares of the parent's full KV blocks, a copy of its
partial last block and a copy of its state slot (``BlockManager.fork`` and
``ModelRunner.copy_caches``), samples its first token from the parent's last logits
row with its own seed, and joins the running requests. A sibling whose parent ends
before its prompt does (aborted, failed) is scheduled on its own and computes the
prompt itself; so is one for which no block or slot is free at the fork.
"""

from __future__ import annotations

from inference_engine.engine.output_state import SequenceState
from inference_engine.engine.request import Request

__all__ = ["PromptForks"]


class PromptForks:
    """Siblings waiting for their parent's prompt, by the parent's request id."""

    def __init__(self) -> None:
        self._waiting: dict[str, tuple[SequenceState, list[SequenceState]]] = {}

    @property
    def num_waiting(self) -> int:
        return sum(len(siblings) for _, siblings in self._waiting.values())

    def wait(self, parent: SequenceState, siblings: list[SequenceState]) -> None:
        """Hold ``siblings`` until ``parent`` has computed the prompt they share."""
        if siblings:
            self._waiting[parent.request.request_id] = (parent, list(siblings))

    @staticmethod
    def at_prompt_end(request: Request) -> bool:
        """Whether the step just run computed the last prompt token of ``request`` (its
        first token is about to be sampled): the moment its caches hold the prompt only."""
        return (request.num_computed_tokens == request.num_prompt_tokens
                and not request.output_token_ids and not request.num_pending_tokens)

    def take(self, parent_id: str) -> list[SequenceState]:
        """The siblings waiting on ``parent_id`` (none if it has none), forgotten here."""
        entry = self._waiting.pop(parent_id, None)
        return entry[1] if entry is not None else []

    def has_siblings(self, parent_id: str) -> bool:
        return parent_id in self._waiting

    def orphans(self) -> list[SequenceState]:
        """Siblings whose parent finished before its prompt did: they compute it themselves."""
        ready = []
        for parent_id, (parent, siblings) in list(self._waiting.items()):
            if parent.request.is_finished:
                del self._waiting[parent_id]
                ready.extend(siblings)
        return ready
