"""Persistent host and device buffers for a step's integer inputs, uploaded in one copy.

Every step needs the same handful of int64 arrays (token ids, positions, cache
slots, query offsets, context lengths, sample rows, block tables). They live
at fixed offsets of one host buffer (page-locked where the platform wants it)
mirrored by one device buffer, so a step fills numpy views and issues a single
asynchronous copy, and the device views keep their addresses from step to
step, which is what a captured CUDA graph needs. Where the device is the host
the two buffers are one.

The host side is a ring of two buffers. A ``non_blocking`` copy from page-locked
memory reads its source when the device reaches it, not when it is issued, and the
engine runs ahead of the device (async scheduling; steps that sample nothing, such
as the chunks of a long prompt, are never waited for): refilling the buffer a
queued copy still has to read would hand that step the next step's inputs. Each
step fills the other buffer, after waiting for the event of the last copy made
from it (two steps back; almost always done already).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

__all__ = ["StepInputBuffers"]

# Field order in the packed buffer; the block tables come last so a step uploads
# up to the end of the rows it uses.
FIELDS = ("input_ids", "positions", "slot_mapping", "slot_blocks", "slot_offsets",
          "query_start_loc", "seq_lens", "sample_index", "pending_index", "pending_source",
          "state_slots", "block_tables")


@dataclass(frozen=True, slots=True)
class _Span:
    start: int
    size: int


class StepInputBuffers:
    """Host (numpy) and device (torch) views of the packed int64 step inputs.

    Args:
        max_tokens: most tokens in one step (token budget plus one per sequence).
        max_seqs: most sequences in one step.
        max_blocks_per_seq: block-table width (blocks of the longest sequence).
        device: where the model runs.
        pinned: page-lock the host buffer (asynchronous uploads).
        sample_width: positions that sample per sequence (1 + k with speculative decoding).
        record_event: the platform's ``record_event`` (a marker of the work queued so
            far, with ``synchronize()``); None: a copy counts as done once issued, and a
            host buffer is refilled without waiting.
    """

    # Host buffers in the ring where the device is not the host.
    NUM_HOST_BUFFERS = 2

    def __init__(self, max_tokens: int, max_seqs: int, max_blocks_per_seq: int,
                 device: torch.device, pinned: bool, sample_width: int = 1,
                 record_event: Callable[[], Any] | None = None) -> None:
        self.max_tokens = max_tokens
        self.max_seqs = max_seqs
        self.width = max_blocks_per_seq
        sizes = {
            "input_ids": max_tokens, "positions": max_tokens, "slot_mapping": max_tokens,
            "slot_blocks": max_tokens, "slot_offsets": max_tokens,
            "query_start_loc": max_seqs + 1, "seq_lens": max_seqs,
            "sample_index": max_seqs * sample_width,
            "pending_index": max_seqs, "pending_source": max_seqs, "state_slots": max_seqs,
            "block_tables": max_seqs * max_blocks_per_seq,
        }
        self.spans: dict[str, _Span] = {}
        offset = 0
        for name in FIELDS:
            self.spans[name] = _Span(offset, sizes[name])
            offset += sizes[name]
        self.on_host = device == torch.device("cpu")
        count = 1 if self.on_host else self.NUM_HOST_BUFFERS
        self._hosts = [torch.zeros(offset, dtype=torch.int64, pin_memory=pinned)
                       for _ in range(count)]
        self._host_arrays = [host.numpy() for host in self._hosts]
        # Per host buffer: the event recorded after the last copy made from it, or None.
        self._copied: list[Any] = [None] * count
        self._current = 0
        self._record_event = record_event
        self.device_buffer = (self._hosts[0] if self.on_host
                              else torch.zeros(offset, dtype=torch.int64, device=device))

    @property
    def host(self) -> torch.Tensor:
        """The host buffer this step fills."""
        return self._hosts[self._current]

    @property
    def host_np(self) -> np.ndarray:
        return self._host_arrays[self._current]

    def begin_step(self) -> None:
        """Move to the next host buffer of the ring, once the copy last made from it has been
        carried out (a wait on its event; nothing where the device is the host). Call before
        writing a step's inputs."""
        if len(self._hosts) == 1:
            return
        self._current = (self._current + 1) % len(self._hosts)
        event, self._copied[self._current] = self._copied[self._current], None
        if event is not None:
            event.synchronize()

    def host_view(self, name: str, length: int | None = None) -> np.ndarray:
        """The writable numpy view of field ``name`` (its first ``length`` entries)."""
        span = self.spans[name]
        return self.host_np[span.start : span.start + (span.size if length is None else length)]

    def host_tables(self, rows: int) -> np.ndarray:
        """``[rows, width]`` view of the host block tables."""
        return self.host_view("block_tables", rows * self.width).reshape(rows, self.width)

    def device_view(self, name: str, length: int) -> torch.Tensor:
        span = self.spans[name]
        return self.device_buffer[span.start : span.start + length]

    def device_tables(self, rows: int) -> torch.Tensor:
        """``[rows, width]`` device block tables."""
        return self.device_view("block_tables", rows * self.width).view(rows, self.width)

    def upload(self, rows: int) -> None:
        """Copy every field, up to the block tables of the first ``rows`` sequences, in one
        asynchronous copy (nothing to do where the device is the host)."""
        if self.on_host:
            return
        end = self.spans["block_tables"].start + rows * self.width
        self._copy_to_device(end)
        if self._record_event is not None:
            self._copied[self._current] = self._record_event()

    def _copy_to_device(self, end: int) -> None:
        """Queue the copy of the current host buffer's first ``end`` entries."""
        self.device_buffer[:end].copy_(self.host[:end], non_blocking=True)
