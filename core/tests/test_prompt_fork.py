"""``n > 1`` samples forked from their first sample at its prompt's end (engine/prompt_fork.py).

The pieces: the block manager's fork (shared full blocks, a copied partial block, a slot
of its own, refusal leaving nothing taken), the pools' device copies, the waiting list;
then the whole engine on an attention-only model with prefix caching off, against
transformers' greedy continuation (the hybrid-model cases are in the models plugin's
Nemotron-H tests).
"""

from __future__ import annotations

import pytest
import torch
import transformers
from inference_engine import SamplingParams
from inference_engine.engine.kv_cache import BlockManager, KVCachePool
from inference_engine.engine.output_state import RequestGroup, SequenceState
from inference_engine.engine.prompt_fork import PromptForks
from inference_engine.engine.request import Request, RequestStatus
from inference_engine.engine.state_cache import StateCachePool, StateSlotManager
from inference_engine.interfaces.attention import KVCacheSpec
from inference_engine.interfaces.state_cache import StateCacheSpec, StateTensorSpec
from inference_engine.testing import cpu_llm, make_tiny_model
from inference_engine.testing_parity import assert_greedy_matches, hf_greedy

CPU = torch.device("cpu")


def manager(num_blocks: int = 10, num_slots: int = 3) -> BlockManager:
    blocks = BlockManager(num_blocks, block_size=4, enable_prefix_caching=False)
    blocks.state_slots = StateSlotManager(num_slots)
    return blocks


def test_fork_shares_full_blocks_copies_the_partial_one_and_takes_a_slot():
    blocks = manager()
    assert blocks.allocate("parent", 11)  # blocks for 4 + 4 + 3 tokens
    parent = list(blocks.req_blocks["parent"])
    free = blocks.num_free_blocks
    copies = blocks.fork("parent", "child", 11)
    child = blocks.req_blocks["child"]
    assert child[:2] == parent[:2] and child[2] not in parent
    assert copies == [(parent[2], child[2])]
    assert blocks.num_free_blocks == free - 1
    assert blocks.state_slots.slot("child") != blocks.state_slots.slot("parent")
    blocks.free("parent")  # the shared blocks stay with the child
    assert blocks.num_free_blocks == free  # only the parent's partial block came back
    assert blocks.allocate("child", 16)  # it grows on its own table
    blocks.free("child")
    assert blocks.num_free_blocks == 9 and blocks.state_slots.num_free_slots == 3


def test_fork_of_a_block_aligned_prompt_copies_nothing():
    blocks = manager()
    assert blocks.allocate("parent", 8)
    assert blocks.fork("parent", "child", 8) == []
    assert blocks.req_blocks["child"] == blocks.req_blocks["parent"]


def test_fork_is_refused_with_nothing_taken_when_no_block_or_slot_is_free():
    blocks = manager(num_blocks=4, num_slots=3)
    assert blocks.allocate("parent", 11)  # every block
    assert blocks.fork("parent", "a", 11) is None
    assert "a" not in blocks.req_blocks and not blocks.state_slots.has_slot("a")
    blocks = manager(num_blocks=10, num_slots=1)
    assert blocks.allocate("parent", 11)
    free = blocks.num_free_blocks
    assert blocks.fork("parent", "a", 11) is None
    assert "a" not in blocks.req_blocks and blocks.num_free_blocks == free
    with pytest.raises(ValueError, match="holds 0 blocks of 4"):
        manager().fork("parent", "a", 11)  # parent unknown: no blocks


def test_pools_copy_blocks_and_slots_on_the_device_leaving_the_rest():
    pool = KVCachePool([KVCacheSpec(2, 2, 4, torch.float32)], block_size=4, num_blocks=5,
                       device=CPU)
    pool.storage.copy_(torch.randint(0, 255, pool.storage.shape, dtype=torch.uint8))
    before = pool.storage.clone()
    pool.copy_blocks([(1, 3), (2, 4)])
    assert torch.equal(pool.storage[3], before[1]) and torch.equal(pool.storage[4], before[2])
    assert torch.equal(pool.storage[:3], before[:3])
    spec = StateCacheSpec((StateTensorSpec((3, 2), torch.bfloat16),
                           StateTensorSpec((2, 4), torch.float32)))
    states = StateCachePool([spec, spec], num_slots=4, device=CPU)
    for tensors in states.layer_tensors:
        for tensor in tensors:
            tensor.copy_(torch.randn(tensor.shape))
    before = [[t.clone() for t in tensors] for tensors in states.layer_tensors]
    states.copy_slots([(0, 2)])
    for tensors, old in zip(states.layer_tensors, before, strict=True):
        for tensor, was in zip(tensors, old, strict=True):
            assert torch.equal(tensor[2], was[0])
            assert torch.equal(tensor[[0, 1, 3]], was[[0, 1, 3]])


def _state(request_id: str, group: RequestGroup) -> SequenceState:
    request = Request(request_id, [1, 2, 3], SamplingParams())
    return SequenceState(request, group, 0, None)


def test_waiting_siblings_are_taken_at_the_prompt_end_or_orphaned_by_a_finished_parent():
    group = RequestGroup("g", None, [1, 2, 3])
    parent, a, b = (_state(rid, group) for rid in ("g#0", "g#1", "g#2"))
    forks = PromptForks()
    forks.wait(parent, [a, b])
    assert forks.num_waiting == 2 and forks.has_siblings("g#0")
    assert not forks.at_prompt_end(parent.request)
    parent.request.num_computed_tokens = 3
    assert forks.at_prompt_end(parent.request)
    parent.request.num_pending_tokens = 1  # its first token sampled already
    assert not forks.at_prompt_end(parent.request)
    assert forks.orphans() == []  # the parent still runs
    parent.request.status = RequestStatus.FINISHED
    assert forks.orphans() == [a, b] and forks.num_waiting == 0
    assert forks.take("g#0") == []


# --------------------------------------------------------------------------- #
# The engine, attention only.
# --------------------------------------------------------------------------- #

PROMPT = "Paged attention stores keys and values in blocks."
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(folder, transformers model, prompt ids, its greedy continuation)."""
    path = make_tiny_model(tmp_path_factory.mktemp("fork"), arch="llama")
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    hf.generation_config.eos_token_id = None
    ids = transformers.AutoTokenizer.from_pretrained(path).encode(PROMPT)
    return path, hf, ids, hf_greedy(hf, [ids], NEW_TOKENS)[0]


def test_attention_only_model_without_prefix_cache_computes_the_prompt_once(saved):
    path, hf, ids, ref = saved
    assert len(ids) % 4, "the prompt should end in a partial block"
    llm = cpu_llm(path, dtype="float32", block_size=4, enable_prefix_caching=False)
    computed = []
    execute = llm.engine.runner.execute_batch

    def execute_and_count(batch):
        computed.append(sum(max(0, min(c + q, len(ids)) - c)
                            for c, q in zip(batch.num_computed, batch.query_lens, strict=True)))
        return execute(batch)

    llm.engine.runner.execute_batch = execute_and_count
    params = SamplingParams(n=3, temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    (out,) = llm.generate([PROMPT], params)
    assert sum(computed) == len(ids)
    assert llm.engine.stats()["num_forked_samples"] == 2
    for sample in out.outputs:
        assert_greedy_matches(hf, ids, sample.token_ids, ref)
    assert llm.engine.blocks.num_free_blocks == llm.engine.blocks.num_blocks - 1


def test_with_the_prefix_cache_on_nothing_is_forked(saved):
    path, hf, ids, ref = saved
    llm = cpu_llm(path, dtype="float32", block_size=4)
    params = SamplingParams(n=2, temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    (out,) = llm.generate([PROMPT], params)
    assert llm.engine.stats()["num_forked_samples"] == 0
    for sample in out.outputs:
        assert_greedy_matches(hf, ids, sample.token_ids, ref)
