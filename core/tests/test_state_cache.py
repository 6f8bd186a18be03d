"""The per-sequence state cache: pool layout, slot hand-out, and slots following a request's
blocks through the block manager (allocation, refusal when every slot is owned, freeing)."""

from __future__ import annotations

import pytest
import torch
from inference_engine.engine.kv_cache import BlockManager
from inference_engine.engine.state_cache import (
    NoFreeStateSlotsError,
    StateCachePool,
    StateSlotManager,
    state_capacity_message,
    state_layers,
)
from inference_engine.interfaces.state_cache import StateCacheSpec, StateTensorSpec
from torch import nn

CONV = StateTensorSpec((6, 3), torch.bfloat16)
SSM = StateTensorSpec((2, 4, 8), torch.float32)


class _Recurrent(nn.Module):
    def state_cache_spec(self) -> StateCacheSpec:
        return StateCacheSpec((CONV, SSM))


def test_pool_has_one_zeroed_tensor_per_declared_entry_with_a_slot_dimension():
    spec = StateCacheSpec((CONV, SSM))
    pool = StateCachePool([spec, spec], num_slots=3, device=torch.device("cpu"))
    assert len(pool.layer_tensors) == 2
    conv, ssm = pool.layer_tensors[1]
    assert conv.shape == (3, 6, 3) and conv.dtype == torch.bfloat16
    assert ssm.shape == (3, 2, 4, 8) and ssm.dtype == torch.float32
    assert not ssm.any()
    assert spec.bytes_per_seq() == 6 * 3 * 2 + 2 * 4 * 8 * 4
    assert pool.num_bytes == 2 * 3 * spec.bytes_per_seq()
    assert "3 sequence slots" in state_capacity_message(pool)


def test_state_layers_are_the_modules_that_declare_state():
    model = nn.Sequential(nn.Linear(2, 2), _Recurrent(), nn.Sequential(_Recurrent()))
    assert len(state_layers(model)) == 2
    assert state_layers(nn.Linear(2, 2)) == []


def test_slot_manager_hands_out_each_slot_once_and_takes_it_back():
    slots = StateSlotManager(2)
    a, b = slots.allocate("a"), slots.allocate("b")
    assert {a, b} == {0, 1} and slots.allocate("a") == a  # idempotent per request
    assert not slots.can_allocate("c")
    with pytest.raises(NoFreeStateSlotsError, match="'c'"):
        slots.allocate("c")
    slots.free("a")
    assert slots.can_allocate("c") and slots.allocate("c") == a
    slots.free("unknown")  # nothing held: nothing to do
    assert slots.num_free_slots == 0


def test_block_manager_allocates_and_frees_slots_with_blocks():
    blocks = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=False)
    blocks.state_slots = StateSlotManager(2)
    assert blocks.allocate("a", 5) and blocks.allocate("b", 3)
    assert blocks.state_slots.has_slot("a") and blocks.state_slots.has_slot("b")
    free_before = blocks.num_free_blocks
    # Blocks are free but no slot is: refused, and nothing taken.
    assert not blocks.allocate("c", 4)
    assert blocks.num_free_blocks == free_before and "c" not in blocks.req_blocks
    assert blocks.allocate("a", 12)  # growing keeps its slot
    blocks.free("b")
    assert not blocks.state_slots.has_slot("b")
    assert blocks.allocate("c", 4)
