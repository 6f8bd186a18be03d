"""Admission of ``n > 1`` requests by their worst case: samples run only as many at a time
as can all reach ``max_tokens`` within the KV pool.

Without it, n=16 x 2000 tokens on a pool of 5,400 tokens admits all 16 samples,
which then grow until they preempt one another over and over (recomputing
their text each time), and a request that arrives meanwhile waits behind the
preempted samples until the whole group is done (a 69 s wait for an 8-token
request on the CPU demo model). Held back, the group runs a few samples at a
time without preempting itself, and the samples it has not started yet queue
behind requests that came later, which keep the rest of the pool.
"""

from __future__ import annotations

from collections import deque

from inference_engine.engine.output_state import RequestGroup, SequenceState

__all__ = ["HeldSamples"]


class HeldSamples:
    """Samples of ``n > 1`` requests waiting outside the scheduler for their group's turn.

    Args:
        num_blocks: blocks in the KV pool.
        block_size: tokens per block.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        # Group id -> (the group, how many of its samples may run at once, those held).
        self._groups: dict[str, tuple[RequestGroup, int, deque[SequenceState]]] = {}

    @property
    def num_held(self) -> int:
        return sum(len(held) for _, _, held in self._groups.values())

    def concurrency(self, group: RequestGroup) -> int:
        """How many of the group's samples fit the pool at their longest (at least 1)."""
        request = group.children[0].request
        worst = min(request.num_prompt_tokens + request.max_new_tokens(), request.max_model_len)
        return max(1, self.num_blocks // max(-(-worst // self.block_size), 1))

    def admit(self, group: RequestGroup) -> list[SequenceState]:
        """The samples to schedule now; the rest wait here."""
        limit = self.concurrency(group)
        if len(group.children) <= limit:
            return list(group.children)
        self._groups[group.request_id] = (group, limit, deque(group.children[limit:]))
        return group.children[:limit]

    def release(self) -> list[SequenceState]:
        """Held samples whose turn came: their group has fewer than its limit unfinished."""
        ready = []
        for group_id, (group, limit, held) in list(self._groups.items()):
            started = len(group.children) - len(held)
            active = sum(1 for c in group.children[:started] if not c.request.is_finished)
            while held and active < limit:
                ready.append(held.popleft())
                active += 1
            if not held:
                del self._groups[group_id]
        return ready

    def drop(self, group_id: str) -> list[SequenceState]:
        """Forget a group (aborted or done); returns the samples it still held."""
        entry = self._groups.pop(group_id, None)
        return list(entry[2]) if entry is not None else []
