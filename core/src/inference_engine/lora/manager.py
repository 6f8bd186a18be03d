"""The engine's LoRA state: adapters in host memory, device slots, each step's token groups.

Adapters are read and checked when a request (or the server) names them and
kept in host memory, the ``max_cpu_loras`` most recently used at most (a
running request keeps its own adapter alive). The device holds ``max_loras``
slots; before each step the adapters the step needs are put in slots, taking
the least recently used slot no scheduled request needs (the scheduler never
runs more distinct adapters at once than there are slots).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from inference_engine.config import LoRAConfig
from inference_engine.lora.adapter import LoRAAdapter, LoRATarget, load_adapter, lora_targets
from inference_engine.lora.grouped_matmul import make_segments
from inference_engine.lora.layer import LoRALayerSlots, LoRAStepMapping
from inference_engine.lora.request import LoRARequest

__all__ = ["LoRAManager"]


class LoRAManager:
    """Wraps the model's targetable linear layers with slots and fills them per step.

    Args:
        model: the loaded model (its q/k/v/o and gate/up/down layers get slots).
        config: ``max_loras``, ``max_lora_rank``, ``max_cpu_loras``.
        device, dtype: the model's.

    Raises:
        ValueError: the model has no layer an adapter can target.
    """

    def __init__(self, model: nn.Module, config: LoRAConfig, device: torch.device,
                 dtype: torch.dtype) -> None:
        self.config = config
        self.device = device
        self.dtype = dtype
        self.targets: dict[str, LoRATarget] = lora_targets(model)
        if not self.targets:
            raise ValueError(f"{type(model).__name__} has no q/k/v/o or gate/up/down projection "
                             f"a LoRA adapter can target")
        self.mapping = LoRAStepMapping()
        self.slots: dict[int, LoRALayerSlots] = {}  # id(layer) -> its slots
        for target in self.targets.values():
            layer = target.layer
            if id(layer) not in self.slots:
                slots = LoRALayerSlots(layer, config.max_loras, config.max_lora_rank,
                                       self.mapping, device, dtype)
                self.slots[id(layer)] = slots
                layer.lora = slots
        self._host: OrderedDict[int, LoRAAdapter] = OrderedDict()
        # adapter id -> slot, least recently used first.
        self._in_slot: OrderedDict[int, int] = OrderedDict()
        self._slot_adapter: list[LoRAAdapter | None] = [None] * config.max_loras

    # ---- adapters in host memory ------------------------------------------------
    def load(self, request: LoRARequest) -> LoRAAdapter:
        """The checked adapter of ``request`` (read now unless held in host memory).

        Raises:
            LoRAAdapterError: what is wrong with it (nothing else is affected).
        """
        held = self._host.get(request.lora_int_id)
        if held is not None and held.request == request:
            self._host.move_to_end(request.lora_int_id)
            return held
        adapter = load_adapter(request, self.targets, self.config.max_lora_rank, self.dtype)
        self.remove(request.lora_int_id)  # a new path for an id replaces the old adapter
        self._host[request.lora_int_id] = adapter
        while len(self._host) > self.config.max_cpu_loras:
            self._host.popitem(last=False)
        return adapter

    def remove(self, lora_int_id: int) -> bool:
        """Forget an adapter (host copy and slot); running requests keep their own copy."""
        found = self._host.pop(lora_int_id, None) is not None
        slot = self._in_slot.pop(lora_int_id, None)
        if slot is not None:
            self._slot_adapter[slot] = None
            found = True
        return found

    def loaded(self) -> list[LoRARequest]:
        """Adapters held in host memory, least recently used first."""
        return [adapter.request for adapter in self._host.values()]

    # ---- the step ------------------------------------------------------------------
    def prepare_step(self, adapters: Sequence[LoRAAdapter | None],
                     query_lens: Sequence[int]) -> None:
        """Put the step's adapters in slots and group its tokens by slot; ``adapters`` and
        ``query_lens`` run over the step's sequences in batch order.

        Raises:
            RuntimeError: more distinct adapters than slots (the scheduler prevents it).
        """
        slot_of_seq = [-1 if a is None else self._slot_for(a, adapters) for a in adapters]
        if all(s < 0 for s in slot_of_seq):
            self.mapping.segments = None
            return
        token_slots = np.repeat(np.asarray(slot_of_seq, dtype=np.int64),
                                np.asarray(query_lens, dtype=np.int64))
        self.mapping.segments = make_segments(token_slots.tolist(), self.device, self.dtype)

    def _slot_for(self, adapter: LoRAAdapter, step: Sequence[LoRAAdapter | None]) -> int:
        key = adapter.request.lora_int_id
        slot = self._in_slot.get(key)
        if slot is not None and self._slot_adapter[slot] is adapter:
            self._in_slot.move_to_end(key)
            return slot
        if slot is not None:  # the id was reloaded from another path
            self._in_slot.pop(key)
            self._slot_adapter[slot] = None
        if None in self._slot_adapter:
            slot = self._slot_adapter.index(None)
        else:
            needed = {id(a) for a in step if a is not None}
            victim = next((k for k, s in self._in_slot.items()
                           if id(self._slot_adapter[s]) not in needed), None)
            if victim is None:
                raise RuntimeError(f"the step needs more than max_loras "
                                   f"({self.config.max_loras}) adapters")
            slot = self._in_slot.pop(victim)
        self._fill_slot(slot, adapter)
        self._in_slot[key] = slot
        self._slot_adapter[slot] = adapter
        return slot

    def _fill_slot(self, slot: int, adapter: LoRAAdapter) -> None:
        per_layer: dict[int, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {
            key: {} for key in self.slots}
        for module, (a, b) in adapter.weights.items():
            target = self.targets[module]
            per_layer[id(target.layer)][target.part] = (a, b)
        for key, slots in self.slots.items():
            slots.load_slot(slot, per_layer[key])

    def slot_contents(self) -> list[LoRAAdapter | None]:
        """The adapter in each device slot (None: empty)."""
        return list(self._slot_adapter)
