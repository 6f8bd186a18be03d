"""The model runner's step inputs against a hand-built expectation (no attention layers).

One step, block size 4, ordered as the scheduler hands it over (decodes first):

====  ===========================  ========  =====  ============  =======
row   sequence                     computed  query  blocks        samples
====  ===========================  ========  =====  ============  =======
0     decode, 6 tokens known       5         1      [3, 7]        yes
1     decode, 9 tokens known       8         1      [2, 5, 9]     yes
2     prefill chunk after context  8         4      [4, 6, 8]     no
3     fresh prompt of 5            0         5      [1, 10]       yes
====  ===========================  ========  =====  ============  =======
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from inference_engine.builtin.platforms.cpu import CpuPlatform
from inference_engine.engine.model_runner import ModelRunner, StepBatch
from inference_engine.engine.request import Request
from inference_engine.engine.scheduler import ScheduledRequest, SchedulerOutput
from inference_engine.sampling_params import SamplingParams

BLOCK_SIZE = 4
MAX_MODEL_LEN = 32  # 8 blocks per sequence


class EchoModel(nn.Module):
    """Hidden state = [input id, position]; logits = hidden: the runner's gathers show."""

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata) -> torch.Tensor:
        self.metadata = metadata
        return torch.stack([input_ids, positions], dim=1).float()

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden


def make_runner() -> ModelRunner:
    return ModelRunner(EchoModel(), CpuPlatform(), block_size=BLOCK_SIZE,
                       max_model_len=MAX_MODEL_LEN, max_num_seqs=8, max_num_batched_tokens=32)


def _request(request_id: str, token_ids: list[int], num_computed: int) -> Request:
    request = Request(request_id, token_ids, SamplingParams(max_tokens=8))
    request.num_computed_tokens = num_computed
    return request


def make_step() -> SchedulerOutput:
    rows = [
        # (tokens, computed, query, blocks, samples)
        (list(range(10, 16)), 5, 1, [3, 7], True),
        (list(range(20, 29)), 8, 1, [2, 5, 9], True),
        (list(range(30, 44)), 8, 4, [4, 6, 8], False),
        (list(range(50, 55)), 0, 5, [1, 10], True),
    ]
    return SchedulerOutput(scheduled=[
        ScheduledRequest(_request(f"r{i}", tokens, computed), query, samples, blocks)
        for i, (tokens, computed, query, blocks, samples) in enumerate(rows)
    ])


EXPECTED_IDS = [15, 28, 38, 39, 40, 41, 50, 51, 52, 53, 54]
EXPECTED_POSITIONS = [5, 8, 8, 9, 10, 11, 0, 1, 2, 3, 4]
# slot = block * block_size + offset, block = the sequence's block at position // 4.
EXPECTED_BLOCKS = [7, 9, 8, 8, 8, 8, 1, 1, 1, 1, 10]
EXPECTED_OFFSETS = [1, 0, 0, 1, 2, 3, 0, 1, 2, 3, 0]
EXPECTED_SLOTS = [29, 36, 32, 33, 34, 35, 4, 5, 6, 7, 40]
EXPECTED_QUERY_START = [0, 1, 2, 6, 11]
EXPECTED_SEQ_LENS = [6, 9, 12, 5]
EXPECTED_TABLES = [
    [3, 7, 0, 0, 0, 0, 0, 0],
    [2, 5, 9, 0, 0, 0, 0, 0],
    [4, 6, 8, 0, 0, 0, 0, 0],
    [1, 10, 0, 0, 0, 0, 0, 0],
]


def test_step_batch_from_scheduler_output():
    batch = StepBatch.from_scheduler(make_step())
    assert batch.num_computed == [5, 8, 8, 0]
    assert batch.query_lens == [1, 1, 4, 5]
    assert [list(b) for b in batch.block_lists] == [[3, 7], [2, 5, 9], [4, 6, 8], [1, 10]]
    assert batch.sample_rows == [0, 1, 3]
    assert batch.prompt_rows == [] and batch.pending_rows == []
    assert not batch.is_pure_decode


def test_expected_slots_follow_block_times_size_plus_offset():
    # The table above, checked against its own definition.
    assert EXPECTED_SLOTS == [b * BLOCK_SIZE + o for b, o in zip(EXPECTED_BLOCKS, EXPECTED_OFFSETS)]
    assert EXPECTED_OFFSETS == [p % BLOCK_SIZE for p in EXPECTED_POSITIONS]


def test_fill_writes_the_flattened_step():
    runner = make_runner()
    batch = StepBatch.from_scheduler(make_step())
    total, query_start = runner._fill(batch)
    buf = runner.buffers
    assert total == 11
    assert query_start.tolist() == EXPECTED_QUERY_START
    assert buf.host_view("input_ids", total).tolist() == EXPECTED_IDS
    assert buf.host_view("positions", total).tolist() == EXPECTED_POSITIONS
    assert buf.host_view("slot_mapping", total).tolist() == EXPECTED_SLOTS
    assert buf.host_view("slot_blocks", total).tolist() == EXPECTED_BLOCKS
    assert buf.host_view("slot_offsets", total).tolist() == EXPECTED_OFFSETS
    assert buf.host_view("query_start_loc", 5).tolist() == EXPECTED_QUERY_START
    assert buf.host_view("seq_lens", 4).tolist() == EXPECTED_SEQ_LENS
    # The last token of each sampling sequence.
    assert buf.host_view("sample_index", 3).tolist() == [0, 1, 10]
    assert buf.host_tables(4).tolist() == EXPECTED_TABLES


def test_metadata_describes_the_step():
    runner = make_runner()
    batch = StepBatch.from_scheduler(make_step())
    total, _ = runner._fill(batch)
    meta = runner._metadata(batch, total)
    assert meta.num_tokens == 11 and meta.num_decodes == 2
    assert meta.block_size == BLOCK_SIZE
    assert meta.query_start_loc.tolist() == EXPECTED_QUERY_START
    assert meta.seq_lens.tolist() == EXPECTED_SEQ_LENS
    assert meta.slot_mapping.tolist() == EXPECTED_SLOTS
    assert meta.slot_blocks.tolist() == EXPECTED_BLOCKS
    assert meta.slot_offsets.tolist() == EXPECTED_OFFSETS
    assert meta.block_tables.shape == (4, runner.max_blocks_per_seq) == (4, 8)
    assert meta.block_tables.tolist() == EXPECTED_TABLES
    assert meta.query_lens_list == [1, 1, 4, 5]
    assert meta.seq_lens_list == EXPECTED_SEQ_LENS
    assert meta.max_query_len == 5 and meta.max_seq_len == 12
    assert meta.max_decode_seq_len == 9
    assert all(t.dtype == torch.int64 for t in (meta.query_start_loc, meta.seq_lens,
                                                 meta.slot_mapping, meta.block_tables))


def test_block_tables_are_padded_with_the_null_block_after_a_wider_step():
    runner = make_runner()
    wide = StepBatch(token_ids=[list(range(20))], num_computed=[0], query_lens=[20],
                     block_lists=[[11, 12, 13, 14, 15]], sample_rows=[0], prompt_rows=[])
    runner._fill(wide)
    batch = StepBatch.from_scheduler(make_step())
    runner._fill(batch)
    tables = runner.buffers.host_tables(4)
    width = max(len(b) for b in batch.block_lists)
    # Every entry a sequence of this step can reach is its block or the padding block 0.
    np.testing.assert_array_equal(tables[:, :width], np.asarray(EXPECTED_TABLES)[:, :width])


def test_execute_gathers_the_last_token_of_each_sampling_sequence():
    runner = make_runner()
    logits = runner.execute(make_step())
    assert logits.sample_rows == [0, 1, 3]
    # EchoModel: a row is (input id, position) of the token the logits came from.
    assert logits.sample_logits.tolist() == [[15.0, 5.0], [28.0, 8.0], [54.0, 4.0]]
    assert logits.prompt_logits == {}
    assert runner.model.metadata.num_decodes == 2


def test_prompt_logprobs_rows_get_every_position():
    step = make_step()
    fresh = step.scheduled[3].request
    fresh.params = SamplingParams(max_tokens=8, prompt_logprobs=1)
    runner = make_runner()
    batch = StepBatch.from_scheduler(step)
    assert batch.prompt_rows == [3]
    logits = runner.execute_batch(batch)
    assert logits.prompt_logits[3][:, 0].tolist() == [50.0, 51.0, 52.0, 53.0, 54.0]


def test_pure_decode_step_needs_no_gather():
    runner = make_runner()
    step = make_step()
    step.scheduled = step.scheduled[:2]
    batch = StepBatch.from_scheduler(step)
    assert batch.is_pure_decode
    logits = runner.execute_batch(batch)
    assert logits.sample_logits[:, 0].tolist() == [15.0, 28.0]
