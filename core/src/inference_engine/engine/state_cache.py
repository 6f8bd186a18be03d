"""The per-sequence state pool and its slot manager (the second cache kind).

Beside the paged KV pool, layers that declare a
:class:`~inference_engine.interfaces.state_cache.StateCacheSpec` get one tensor
per declared entry, ``[num_slots, *shape]``, and every running request owns one
slot across all of them. The block manager takes a slot when it first allocates
for a request and gives it back when it frees the request (finish, abort,
preemption), so the scheduler needs no changes to respect the pool; the engine
sizes it at start-up to ``max_num_seqs`` slots (every request that can run at
once; fewer where the default would take over half the budget, see
``LLMEngine._num_state_slots``) and takes its bytes out of the KV budget.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
from torch import nn

from inference_engine.interfaces.state_cache import StateCacheSpec

__all__ = ["NoFreeStateSlotsError", "StateCachePool", "StateSlotManager", "state_layers",
           "state_capacity_message"]

logger = logging.getLogger(__name__)


class NoFreeStateSlotsError(RuntimeError):
    """Every state slot is owned by a running request."""


def state_layers(model: nn.Module) -> list[nn.Module]:
    """Modules that declare per-sequence state (``state_cache_spec()``), in model order."""
    return [m for m in model.modules() if callable(getattr(m, "state_cache_spec", None))]


class StateCachePool:
    """One zeroed ``[num_slots, *shape]`` tensor per declared state tensor of every layer."""

    def __init__(self, specs: Sequence[StateCacheSpec], num_slots: int,
                 device: torch.device) -> None:
        if num_slots < 1:
            raise ValueError(f"the state cache needs at least 1 slot, got {num_slots}")
        self.specs = list(specs)
        self.num_slots = num_slots
        self.layer_tensors: list[tuple[torch.Tensor, ...]] = [
            tuple(torch.zeros((num_slots, *t.shape), dtype=t.dtype, device=device)
                  for t in spec.tensors)
            for spec in self.specs
        ]

    def copy_slots(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy every layer's state of each ``source`` slot into its ``destination`` slot.

        A forked sample's copy of its parent's prompt-end state: one indexed copy per state
        tensor for all of a step's forks, on the device, before either sequence runs again.
        """
        if not pairs:
            return
        device = self.layer_tensors[0][0].device
        src = torch.tensor([s for s, _ in pairs], dtype=torch.int64).to(device)
        dst = torch.tensor([d for _, d in pairs], dtype=torch.int64).to(device)
        for tensors in self.layer_tensors:
            for tensor in tensors:
                tensor.index_copy_(0, dst, tensor.index_select(0, src))

    @staticmethod
    def bytes_per_slot_for(specs: Sequence[StateCacheSpec]) -> int:
        return sum(spec.bytes_per_seq() for spec in specs)

    @property
    def bytes_per_slot(self) -> int:
        return self.bytes_per_slot_for(self.specs)

    @property
    def num_bytes(self) -> int:
        return self.bytes_per_slot * self.num_slots


class StateSlotManager:
    """Hands out state slots to request ids, one each, and takes them back."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._free: list[int] = list(range(num_slots - 1, -1, -1))  # pop() gives low ids first
        self._slot_of: dict[str, int] = {}

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    def has_slot(self, request_id: str) -> bool:
        return request_id in self._slot_of

    def can_allocate(self, request_id: str) -> bool:
        """Whether ``request_id`` has a slot or one is free for it."""
        return request_id in self._slot_of or bool(self._free)

    def allocate(self, request_id: str) -> int:
        """The request's slot, taking a free one on its first call.

        Raises:
            NoFreeStateSlotsError: every slot is owned by another request.
        """
        slot = self._slot_of.get(request_id)
        if slot is None:
            if not self._free:
                raise NoFreeStateSlotsError(f"no free state slot for request {request_id!r}")
            slot = self._free.pop()
            self._slot_of[request_id] = slot
        return slot

    def slot(self, request_id: str) -> int:
        """The slot ``request_id`` owns.

        Raises:
            KeyError: the request holds no slot.
        """
        return self._slot_of[request_id]

    def free(self, request_id: str) -> None:
        """Give the request's slot back (nothing if it has none)."""
        slot = self._slot_of.pop(request_id, None)
        if slot is not None:
            self._free.append(slot)


def state_capacity_message(pool: StateCachePool) -> str:
    """The start-up line's state-cache part: slots, bytes per sequence, total, layers."""
    kinds = "/".join(sorted({str(t.dtype).removeprefix("torch.")
                             for spec in pool.specs for t in spec.tensors}))
    message = (f"state cache: {pool.num_slots} sequence slots x "
               f"{pool.bytes_per_slot / 2**10:.1f} KiB ({pool.num_bytes / 2**20:.1f} MiB, "
               f"{kinds}) for {len(pool.specs)} layers")
    logger.info(message)
    return message
