"""Builds each step's flattened batch and runs one forward over it.

The batch has no padding: token ids, positions and cache slots of every
scheduled request are laid end to end, decodes first. Inputs are written with
numpy into persistent packed buffers (:mod:`step_inputs`) and uploaded in one
copy, and the rows that sample are known before the forward, so nothing in a
step reads the device back until the sampled ids.

Where the platform can capture graphs, pure-decode steps replay a graph
captured at start-up for the smallest batch-size bucket that holds them:
forward and logits in one launch, the rows past the real batch padded (one
query, no context, slot -1, so they write nothing).
"""

from __future__ import annotations

import bisect
import itertools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from inference_engine.engine.kv_cache import KVCachePool
from inference_engine.engine.scheduler import SchedulerOutput
from inference_engine.engine.state_cache import StateCachePool, state_layers
from inference_engine.engine.step_inputs import StepInputBuffers
from inference_engine.interfaces.attention import AttentionMetadata, KVCacheSpec
from inference_engine.interfaces.encoder_decoder import EncoderDecoderLM
from inference_engine.interfaces.model import CausalLM
from inference_engine.interfaces.platform import Platform

__all__ = ["ModelRunner", "StepBatch", "StepLogits", "graph_batch_sizes"]

logger = logging.getLogger(__name__)


@dataclass
class StepLogits:
    """Float32 logits the sampler needs from one step."""

    # [num_sampling, vocab]: one row per request that samples, in scheduled order.
    sample_logits: torch.Tensor
    # Index into SchedulerOutput.scheduled of each sampling row.
    sample_rows: list[int]
    # Scheduled index -> [chunk_len, vocab] logits of every position (prompt_logprobs).
    prompt_logits: dict[int, torch.Tensor]


@dataclass
class StepBatch:
    """One step's work as plain data (what the scheduler's output boils down to)."""

    # Per sequence: the token ids known so far (prompt + outputs).
    token_ids: Sequence[Sequence[int]]
    # Per sequence: tokens already in the cache, and tokens computed this step.
    num_computed: list[int]
    query_lens: list[int]
    # Per sequence: physical block ids.
    block_lists: Sequence[Sequence[int]]
    # Sequences that sample a token after this step.
    sample_rows: list[int]
    # Sequences that want the logits of every position (prompt_logprobs).
    prompt_rows: list[int]
    # Async scheduling: (sequence, row of ``pending_ids``) of each decode whose input token
    # was sampled by the step before and is still only on the device.
    pending_rows: list[tuple[int, int]] = field(default_factory=list)
    # That step's sampled ids, ``[rows]`` int64 on the device.
    pending_ids: torch.Tensor | None = None
    # Speculative decoding: per sequence, the draft tokens at the end of its query; a
    # sampling sequence then samples at its last 1 + drafts positions. None: no drafts.
    num_spec_tokens: list[int] | None = None
    # Per sequence: its slot of the per-sequence state pool (hybrid models); None: the
    # sequences' own indices (a profiling step) or no state pool.
    state_slots: list[int] | None = None
    # Encoder-decoder models: per sequence, its encoder input where it has no computed
    # context (its state slot is written this step), else None; None when no sequence has one.
    encoder_inputs: list[Any] | None = None

    @classmethod
    def from_scheduler(cls, out: SchedulerOutput,
                       block_lists: Sequence[Sequence[int]] | None = None,
                       pending_source: dict[str, int] | None = None,
                       pending_ids: torch.Tensor | None = None) -> StepBatch:
        """The step of ``out``; ``pending_source`` maps a request id to its row of
        ``pending_ids`` (the previous step's sampled ids) for requests with a pending token."""
        scheduled = out.scheduled
        # One pass over the rows (this runs every step for every running request).
        token_ids: list[Sequence[int]] = []
        num_computed: list[int] = []
        query_lens: list[int] = []
        sample_rows: list[int] = []
        prompt_rows: list[int] = []
        pending_rows: list[tuple[int, int]] = []
        spec: list[int] = []
        encoder_inputs: list[Any] = []
        for i, s in enumerate(scheduled):
            request = s.request
            computed = request.num_computed_tokens
            token_ids.append(request.all_token_ids + request.spec_token_ids[: s.num_spec_tokens]
                             if s.num_spec_tokens else request.all_token_ids)
            num_computed.append(computed)
            query_lens.append(s.num_new_tokens)
            spec.append(s.num_spec_tokens)
            if s.samples:
                sample_rows.append(i)
            if (request.params.prompt_logprobs is not None
                    and computed < request.num_prompt_tokens):
                prompt_rows.append(i)
            if pending_source and request.num_pending_tokens:
                pending_rows.append((i, pending_source[request.request_id]))
            # Encoder inputs of sequences with no computed context (their first step, or
            # the first after a preemption): the encoder fills their state slots now.
            encoder_inputs.append(request.encoder_inputs if computed == 0 else None)
        return cls(
            token_ids=token_ids,
            num_computed=num_computed,
            query_lens=query_lens,
            block_lists=[s.block_ids for s in scheduled] if block_lists is None else block_lists,
            sample_rows=sample_rows,
            prompt_rows=prompt_rows,
            pending_rows=pending_rows,
            pending_ids=pending_ids if pending_rows else None,
            num_spec_tokens=spec if any(spec) else None,
            encoder_inputs=(encoder_inputs if any(x is not None for x in encoder_inputs)
                            else None),
        )

    @property
    def is_pure_decode(self) -> bool:
        return not self.prompt_rows and all(q == 1 for q in self.query_lens)


def attention_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Modules that keep a KV cache, in model order."""
    return [m for m in model.modules() if callable(getattr(m, "kv_cache_spec", None))]


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """Decode batch sizes to capture: 1, 2, 4, 8, then every 8 up to ``max_num_seqs``
    (vLLM's buckets), always including ``max_num_seqs`` itself."""
    sizes = [s for s in (1, 2, 4) if s < max_num_seqs]
    sizes += list(range(8, max_num_seqs, 8))
    sizes.append(max_num_seqs)
    return sorted(set(sizes))


def _graph_unsafe_name(layer: torch.nn.Module) -> str | None:
    """None when the cache layer's step can be captured: its attention backend says so
    (``graph_safe``), or a layer without a backend (MLA) declares ``graph_safe = True``."""
    backend = getattr(layer, "backend", None)
    if backend is not None:
        return None if backend.graph_safe else f"attention backend {type(backend).__name__}"
    return None if getattr(layer, "graph_safe", False) else f"layer {type(layer).__name__}"


@dataclass
class _DecodeGraph:
    graph: Any
    # [bucket, vocab] logits the replay writes.
    logits: torch.Tensor


class ModelRunner:
    """Prepares inputs, runs the forward (eagerly or by graph replay), returns logits."""

    def __init__(
        self,
        model: CausalLM,
        platform: Platform,
        block_size: int,
        max_model_len: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        enforce_eager: bool = False,
        num_speculative_tokens: int = 0,
    ) -> None:
        self.model = model
        self.platform = platform
        self.device = platform.device()
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        self.layers = attention_layers(model)
        # Layers with per-sequence state (Mamba-2) and their pool, once allocated.
        self.state_layers = state_layers(model)
        self.state_pool: StateCachePool | None = None
        self.pool: KVCachePool | None = None
        self.enforce_eager = enforce_eager
        self.buffers = StepInputBuffers(max_num_batched_tokens + max_num_seqs, max_num_seqs,
                                        self.max_blocks_per_seq, self.device,
                                        platform.pinned_memory(),
                                        sample_width=1 + num_speculative_tokens,
                                        record_event=platform.record_event)
        self._graphs: dict[int, _DecodeGraph] = {}
        self._graph_sizes: list[int] = []
        # An encoder-decoder model is told each step's requests before its forward.
        self.encoder_decoder = model if isinstance(model, EncoderDecoderLM) else None

    # ---- set-up ---------------------------------------------------------------
    def kv_cache_specs(self) -> list[KVCacheSpec]:
        return [layer.kv_cache_spec() for layer in self.layers]

    def allocate_kv_cache(self, num_blocks: int) -> KVCachePool:
        self.pool = KVCachePool(self.kv_cache_specs(), self.block_size, num_blocks, self.device)
        for i, layer in enumerate(self.layers):
            layer.kv_cache = self.pool.layer_views(i)
            backend = getattr(layer, "backend", None)
            if backend is not None:
                backend.prepare(self.device, self.pool.specs[i].dtype)
        self.model.kv_cache_bound()
        return self.pool

    def release_kv_cache(self) -> None:
        """Drop the pool (after a profiling run); layers hold no cache until the next one."""
        for layer in self.layers:
            layer.kv_cache = None
        self.pool = None
        self.model.kv_cache_bound()

    def allocate_state_cache(self, num_slots: int) -> StateCachePool | None:
        """Allocate the per-sequence state pool and bind each state layer's tensors; None (and
        nothing allocated) for a model without state layers."""
        if not self.state_layers:
            return None
        specs = [layer.state_cache_spec() for layer in self.state_layers]
        self.state_pool = StateCachePool(specs, num_slots, self.device)
        for layer, tensors in zip(self.state_layers, self.state_pool.layer_tensors, strict=True):
            layer.state_cache = tensors
        return self.state_pool

    def copy_caches(self, block_pairs: Sequence[tuple[int, int]],
                    slot_pairs: Sequence[tuple[int, int]]) -> None:
        """Give forked samples their parent's caches: copy KV blocks and state slots
        ``source -> destination`` on the device, in stream order after the step that
        computed them and before any later step (``n > 1``, docs/engine.md)."""
        if block_pairs:
            self.pool.copy_blocks(block_pairs)
        if slot_pairs:
            self.state_pool.copy_slots(slot_pairs)

    def _fill_state_slots(self, batch: StepBatch) -> None:
        """Write the step's per-sequence state slots into the host buffers (with a state pool)."""
        if self.state_pool is None:
            return
        n = len(batch.query_lens)
        view = self.buffers.host_view("state_slots", n)
        if batch.state_slots is not None:
            view[:] = batch.state_slots
        else:  # a dummy (profiling) step may hold more sequences than slots: they share them
            np.remainder(np.arange(n), self.state_pool.num_slots, out=view)

    def _state_slots(self, batch: StepBatch) -> torch.Tensor | None:
        """The step's ``[num_seqs]`` state slots on the device (None without a state pool),
        uploaded with the step's other inputs."""
        if self.state_pool is None:
            return None
        return self.buffers.device_view("state_slots", len(batch.query_lens))

    def graphs_possible(self) -> tuple[bool, str]:
        """Whether decode steps can be captured here, and if not why."""
        if self.enforce_eager:
            return False, "enforce_eager is set"
        if not self.platform.supports_graph_capture():
            return False, f"the {self.platform.name} platform cannot capture graphs"
        unsafe = sorted({_graph_unsafe_name(layer)
                         for layer in [*self.layers, *self.state_layers]} - {None})
        if not getattr(self.model, "graph_safe", True):
            unsafe.append(f"model {type(self.model).__name__}")
        if unsafe:
            return False, f"{', '.join(unsafe)} not graph-safe"
        return True, ""

    @torch.inference_mode()
    def capture_decode_graphs(self) -> str:
        """Capture forward + logits of a decode step at every batch-size bucket.

        Returns the start-up line (how many graphs, how long); a bucket whose capture
        fails (a model that synchronises inside its forward) leaves every step eager.
        """
        possible, why = self.graphs_possible()
        if not possible:
            return f"CUDA graphs: off ({why})"
        sizes = graph_batch_sizes(self.max_num_seqs)
        start = time.perf_counter()
        pool = None
        try:
            # Eager warm-up under the platform's sync check: a model that reads the device
            # inside its forward is found here, before anything is captured.
            self._fill_padding_step(sizes[-1])
            with self.platform.forbid_host_sync():
                self._decode_forward(sizes[-1])
            self.platform.synchronize()
            for size in reversed(sizes):
                self._fill_padding_step(size)
                self._decode_forward(size)  # warm-up: kernels compiled outside capture
                graph, logits, pool = self.platform.capture_graph(
                    lambda s=size: self._decode_forward(s), pool)
                self._graphs[size] = _DecodeGraph(graph, logits)
        except Exception as exc:  # noqa: BLE001 - any capture failure means: run eagerly
            self._graphs.clear()
            message = f"CUDA graphs: off (capture failed: {type(exc).__name__}: {exc})"
            logger.warning(message)
            return message
        self.platform.synchronize()
        self._graph_sizes = sizes
        message = (f"CUDA graphs: captured {len(sizes)} decode batch sizes (1..{sizes[-1]}) in "
                   f"{time.perf_counter() - start:.1f} s")
        logger.info(message)
        return message

    @property
    def graph_sizes(self) -> list[int]:
        return list(self._graph_sizes)

    # ---- inputs ---------------------------------------------------------------
    def _fill(self, batch: StepBatch) -> tuple[int, np.ndarray]:
        """Write the step's inputs into the host buffers; returns (tokens, query offsets)."""
        buf = self.buffers
        buf.begin_step()
        n = len(batch.query_lens)
        bs = self.block_size
        q = np.asarray(batch.query_lens, dtype=np.int64)
        c = np.asarray(batch.num_computed, dtype=np.int64)
        cu = buf.host_view("query_start_loc", n + 1)
        cu[0] = 0
        np.cumsum(q, out=cu[1:])
        total = int(cu[-1])
        # Gathered into one list and written at once (a numpy store per row costs more).
        values: list[int] = []
        for tokens, nc, ql in zip(batch.token_ids, batch.num_computed, batch.query_lens,
                                  strict=True):
            if ql > 1:
                values += tokens[nc : nc + ql]
            else:  # a pending token (not on the host yet) is filled in on the device
                values.append(tokens[nc] if nc < len(tokens) else 0)
        buf.host_view("input_ids", total)[:] = values
        if batch.pending_rows:
            pending = np.asarray(batch.pending_rows, dtype=np.int64)
            buf.host_view("pending_index", len(pending))[:] = cu[pending[:, 0]]
            buf.host_view("pending_source", len(pending))[:] = pending[:, 1]
        req_index = np.repeat(np.arange(n), q)
        positions = buf.host_view("positions", total)
        np.subtract(np.arange(total), cu[:-1][req_index], out=positions)
        positions += c[req_index]
        # Every row's blocks in one scatter: row i's j-th block goes to tables[i, j].
        lens = np.fromiter(map(len, batch.block_lists), dtype=np.int64, count=n)
        num_entries = int(lens.sum())
        tables = buf.host_tables(n)
        tables[:, : int(lens.max())] = 0
        table_rows = np.repeat(np.arange(n), lens)
        table_cols = np.arange(num_entries) - np.repeat(np.cumsum(lens) - lens, lens)
        tables[table_rows, table_cols] = np.fromiter(
            itertools.chain.from_iterable(batch.block_lists), dtype=tables.dtype,
            count=num_entries)
        slot_blocks = buf.host_view("slot_blocks", total)
        slot_offsets = buf.host_view("slot_offsets", total)
        np.floor_divide(positions, bs, out=slot_offsets)
        slot_blocks[:] = tables[req_index, slot_offsets]
        np.remainder(positions, bs, out=slot_offsets)
        np.add(slot_blocks * bs, slot_offsets, out=buf.host_view("slot_mapping", total))
        np.add(c, q, out=buf.host_view("seq_lens", n))
        self._fill_state_slots(batch)
        rows = batch.sample_rows
        if batch.num_spec_tokens is None:
            buf.host_view("sample_index", len(rows))[:] = cu[1:][rows] - 1
        else:  # every verified position of a row samples: its last 1 + drafts tokens
            widths = np.asarray(batch.num_spec_tokens, dtype=np.int64)[rows] + 1
            ends = np.repeat(cu[1:][rows], widths)
            back = np.arange(int(widths.sum())) - np.repeat(np.cumsum(widths) - widths, widths)
            buf.host_view("sample_index", len(ends))[:] = ends - widths.repeat(widths) + back
        return total, cu.copy()

    def _metadata(self, batch: StepBatch, total: int) -> AttentionMetadata:
        buf = self.buffers
        n = len(batch.query_lens)
        seq_lens = [c + q for c, q in zip(batch.num_computed, batch.query_lens, strict=True)]
        num_decodes = 0
        for ql in batch.query_lens:
            if ql != 1:
                break
            num_decodes += 1
        return AttentionMetadata(
            num_tokens=total,
            num_decodes=num_decodes,
            query_start_loc=buf.device_view("query_start_loc", n + 1),
            seq_lens=buf.device_view("seq_lens", n),
            slot_mapping=buf.device_view("slot_mapping", total),
            block_tables=buf.device_tables(n),
            block_size=self.block_size,
            query_lens_list=list(batch.query_lens),
            seq_lens_list=seq_lens,
            slot_blocks=buf.device_view("slot_blocks", total),
            slot_offsets=buf.device_view("slot_offsets", total),
            max_decode_seq_len=max(seq_lens[:num_decodes], default=0),
            max_query_len=max(batch.query_lens),
            max_seq_len=max(seq_lens),
            state_slots=self._state_slots(batch),
        )

    def _pad_rows(self, start: int, size: int) -> None:
        """Make decode rows ``start..size`` padding in the host buffers: one query each, no
        context, slot -1 (they read and write nothing)."""
        buf = self.buffers
        buf.host_view("input_ids", size)[start:] = 0
        buf.host_view("positions", size)[start:] = 0
        buf.host_view("slot_mapping", size)[start:] = -1
        buf.host_view("query_start_loc", size + 1)[start + 1 :] = np.arange(start + 1, size + 1)
        buf.host_view("seq_lens", size)[start:] = 0

    def _fill_padding_step(self, size: int) -> None:
        """Host and device buffers of a decode step whose ``size`` rows are all padding."""
        self.buffers.begin_step()
        self.buffers.host_view("query_start_loc", 1)[0] = 0
        self._pad_rows(0, size)
        self.buffers.host_tables(size)[:] = 0
        self.buffers.upload(size)

    def _graph_metadata(self, size: int) -> AttentionMetadata:
        buf = self.buffers
        return AttentionMetadata(
            num_tokens=size,
            num_decodes=size,
            query_start_loc=buf.device_view("query_start_loc", size + 1),
            seq_lens=buf.device_view("seq_lens", size),
            slot_mapping=buf.device_view("slot_mapping", size),
            block_tables=buf.device_tables(size),
            block_size=self.block_size,
            query_lens_list=[1] * size,
            seq_lens_list=[self.max_model_len] * size,
            max_decode_seq_len=self.max_model_len,
            max_query_len=1,
            max_seq_len=self.max_model_len,
            is_graph_step=True,
        )

    def _decode_forward(self, size: int) -> torch.Tensor:
        """Forward + logits of a ``size``-row decode step from the device buffers."""
        buf = self.buffers
        hidden = self.model(buf.device_view("input_ids", size), buf.device_view("positions", size),
                            self._graph_metadata(size))
        return self.model.compute_logits(hidden)

    # ---- the step -------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, out: SchedulerOutput,
                block_lists: list[list[int]] | None = None) -> StepLogits:
        """Run the step's forward and return the logits the sampler needs."""
        return self.execute_batch(StepBatch.from_scheduler(out, block_lists))

    @torch.inference_mode()
    def execute_batch(self, batch: StepBatch) -> StepLogits:
        n = len(batch.query_lens)
        if self._graph_sizes and batch.is_pure_decode and n <= self._graph_sizes[-1]:
            return self._replay(batch)
        total, cu = self._fill(batch)
        self.buffers.upload(n)
        self._fill_pending(batch)
        metadata = self._metadata(batch, total)
        if self.encoder_decoder is not None:
            self.encoder_decoder.prepare_encoder(batch.encoder_inputs, metadata)
        hidden = self.model(self.buffers.device_view("input_ids", total),
                            self.buffers.device_view("positions", total), metadata)
        prompt_logits = {i: self.model.compute_logits(hidden[int(cu[i]) : int(cu[i + 1])])
                         for i in batch.prompt_rows}
        rows = batch.sample_rows
        num_sample = len(rows)
        if batch.num_spec_tokens is not None:
            num_sample += sum(batch.num_spec_tokens[i] for i in rows)
        if num_sample == total:  # every token samples (pure decode): no gather
            sample_hidden = hidden
        else:
            sample_hidden = hidden.index_select(
                0, self.buffers.device_view("sample_index", num_sample))
        sample_logits = self.model.compute_logits(sample_hidden)
        return StepLogits(sample_logits, rows, prompt_logits)

    def _fill_pending(self, batch: StepBatch) -> None:
        """Write the previous step's sampled ids into the device input ids of the decodes
        still waiting for them (async scheduling); nothing is read back."""
        if not batch.pending_rows:
            return
        count = len(batch.pending_rows)
        buf = self.buffers
        index = buf.device_view("pending_index", count)
        source = buf.device_view("pending_source", count)
        ids = buf.device_view("input_ids", buf.max_tokens)
        ids.index_copy_(0, index, batch.pending_ids.index_select(0, source))

    def _replay(self, batch: StepBatch) -> StepLogits:
        n = len(batch.query_lens)
        size = self._graph_sizes[bisect.bisect_left(self._graph_sizes, n)]
        self._fill(batch)
        buf = self.buffers
        self._pad_rows(n, size)
        buf.upload(size)
        self._fill_pending(batch)
        entry = self._graphs[size]
        entry.graph.replay()
        return StepLogits(entry.logits[:n], batch.sample_rows, {})

    # ---- profiling ------------------------------------------------------------
    @torch.inference_mode()
    def profile_run(self, num_tokens: int) -> None:
        """A forward + logits at the step's token budget, over dummy sequences, with a
        temporary pool just big enough: the activation peak the KV pool must leave room for.
        """
        per_seq = max(1, min(num_tokens, self.max_model_len - 1))
        lens = [per_seq] * (num_tokens // per_seq)
        if num_tokens % per_seq:
            lens.append(num_tokens % per_seq)
        lens = lens[: self.max_num_seqs]
        blocks_per = [-(-n // self.block_size) for n in lens]
        self.allocate_kv_cache(sum(blocks_per) + 1)
        try:
            block_lists, next_block = [], 1
            for count in blocks_per:
                block_lists.append(list(range(next_block, next_block + count)))
                next_block += count
            batch = StepBatch(
                token_ids=[[0] * n for n in lens], num_computed=[0] * len(lens),
                query_lens=lens, block_lists=block_lists,
                sample_rows=list(range(len(lens))), prompt_rows=[],
            )
            self.execute_batch(batch)
            self.platform.synchronize()
        finally:
            self.release_kv_cache()
