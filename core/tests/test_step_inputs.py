"""The step-input buffers against a device that runs its queued copies late.

A ``non_blocking`` copy from page-locked memory reads its source when the device gets
to it. Here the "device" is a queue: a copy records which host buffer it reads and
reads it only when it runs, so a host buffer refilled too early shows up as a step
that received the next step's inputs.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from inference_engine.engine.step_inputs import StepInputBuffers


class QueuedCopies(StepInputBuffers):
    """Step inputs whose uploads run when the test says the device reached them."""

    def __init__(self) -> None:
        self.queue: list[tuple[torch.Tensor, int]] = []
        self.received: list[list[int]] = []
        super().__init__(8, 2, 2, torch.device("meta"), pinned=False,
                         record_event=self._record_event)

    def _copy_to_device(self, end: int) -> None:
        self.queue.append((self.host, end))  # the buffer itself: read when the copy runs

    def run_copies(self, count: int) -> None:
        """The device carries out the first ``count`` queued copies."""
        while len(self.received) < min(count, len(self.queue)):
            host, end = self.queue[len(self.received)]
            self.received.append(host[:end].tolist())

    def _record_event(self) -> SimpleNamespace:
        queued = len(self.queue)
        return SimpleNamespace(synchronize=lambda: self.run_copies(queued))


def _fill_step(buffers: StepInputBuffers, value: int) -> None:
    buffers.begin_step()
    buffers.host_view("input_ids", 4)[:] = value
    buffers.host_view("seq_lens", 2)[:] = value + 100
    buffers.upload(2)


def _received_ids(buffers: QueuedCopies, step: int) -> tuple[list[int], list[int]]:
    span_ids, span_lens = buffers.spans["input_ids"], buffers.spans["seq_lens"]
    row = buffers.received[step]
    return (row[span_ids.start : span_ids.start + 4],
            row[span_lens.start : span_lens.start + 2])


def test_a_copy_the_device_runs_a_step_late_reads_its_own_step():
    buffers = QueuedCopies()
    for step in range(6):
        _fill_step(buffers, step)
        buffers.run_copies(step)  # step - 1's copy runs only now, after this step's fill
    buffers.run_copies(6)
    for step in range(6):
        assert _received_ids(buffers, step) == ([step] * 4, [step + 100] * 2)


def test_the_host_waits_for_a_copy_still_queued_before_refilling_its_buffer():
    buffers = QueuedCopies()
    for step in range(6):  # the device runs nothing unless the host waits for it
        _fill_step(buffers, step)
        assert len(buffers.received) == max(0, step - 1)  # the wait forced step - 2's copy
    buffers.run_copies(6)
    for step in range(6):
        assert _received_ids(buffers, step) == ([step] * 4, [step + 100] * 2)


def test_device_views_keep_their_addresses_across_steps():
    buffers = QueuedCopies()
    before = buffers.device_view("input_ids", 4).data_ptr()
    _fill_step(buffers, 1)
    _fill_step(buffers, 2)
    assert buffers.device_view("input_ids", 4).data_ptr() == before


def test_on_the_host_the_one_buffer_is_the_device_buffer():
    buffers = StepInputBuffers(8, 2, 2, torch.device("cpu"), pinned=False)
    for step in range(3):
        buffers.begin_step()
        buffers.host_view("input_ids", 4)[:] = step
        buffers.upload(2)
        assert buffers.device_view("input_ids", 4).tolist() == [step] * 4
