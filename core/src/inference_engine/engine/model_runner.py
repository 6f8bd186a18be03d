"""Builds each step's flattened batch and runs one forward over it.

The batch has no padding: token ids, positions and cache slots of every
scheduled request are laid end to end, decodes first. Inputs are prepared
with numpy into persistent buffers, so per-step Python work grows with the
number of requests, not the number of tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from inference_engine.engine.kv_cache import KVCachePool
from inference_engine.engine.scheduler import SchedulerOutput
from inference_engine.interfaces.attention import AttentionMetadata, KVCacheSpec
from inference_engine.interfaces.model import CausalLM

__all__ = ["ModelRunner", "StepLogits"]


@dataclass
class StepLogits:
    """Float32 logits the sampler needs from one step."""

    # [num_sampling, vocab]: one row per request that samples, in scheduled order.
    sample_logits: torch.Tensor
    # Index into SchedulerOutput.scheduled of each sampling row.
    sample_rows: list[int]
    # Scheduled index -> [chunk_len, vocab] logits of every position (prompt_logprobs).
    prompt_logits: dict[int, torch.Tensor]


def attention_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Modules that keep a KV cache, in model order."""
    return [m for m in model.modules() if callable(getattr(m, "kv_cache_spec", None))]


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        device: torch.device,
        block_size: int,
        max_model_len: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
    ) -> None:
        self.model = model
        self.device = device
        self.block_size = block_size
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        self.layers = attention_layers(model)
        self.pool: KVCachePool | None = None
        max_tokens = max_num_batched_tokens + max_num_seqs
        self._input_ids = np.zeros(max_tokens, dtype=np.int64)
        self._positions = np.zeros(max_tokens, dtype=np.int64)
        self._block_tables = np.zeros((max_num_seqs, self.max_blocks_per_seq), dtype=np.int64)

    def kv_cache_specs(self) -> list[KVCacheSpec]:
        return [layer.kv_cache_spec() for layer in self.layers]

    def allocate_kv_cache(self, num_blocks: int) -> KVCachePool:
        self.pool = KVCachePool(self.kv_cache_specs(), self.block_size, num_blocks, self.device)
        for i, layer in enumerate(self.layers):
            layer.kv_cache = self.pool.layer_views(i)
            backend = getattr(layer, "backend", None)
            if backend is not None:
                backend.prepare(self.device, self.pool.specs[i].dtype)
        return self.pool

    def _prepare(self, out: SchedulerOutput, block_lists: list[list[int]]) -> tuple[
        torch.Tensor, torch.Tensor, AttentionMetadata, np.ndarray
    ]:
        scheduled = out.scheduled
        n = len(scheduled)
        bs = self.block_size
        query_lens = [s.num_new_tokens for s in scheduled]
        computed = [s.request.num_computed_tokens for s in scheduled]
        q = np.asarray(query_lens, dtype=np.int64)
        c = np.asarray(computed, dtype=np.int64)
        cu = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(q, out=cu[1:])
        total = int(cu[-1])

        ids = self._input_ids[:total]
        pos = 0
        for s, nc, ql in zip(scheduled, computed, query_lens, strict=True):
            tokens = s.request.all_token_ids
            ids[pos : pos + ql] = tokens[nc : nc + ql] if ql > 1 else tokens[nc]
            pos += ql
        req_index = np.repeat(np.arange(n), q)
        positions = self._positions[:total]
        np.subtract(np.arange(total), cu[:-1][req_index], out=positions)
        positions += c[req_index]

        width = max(len(b) for b in block_lists)
        tables = self._block_tables[:n, :width]
        tables.fill(0)
        for i, blocks in enumerate(block_lists):
            tables[i, : len(blocks)] = blocks
        slot_blocks = tables[req_index, positions // bs]
        slot_offsets = positions % bs
        seq_lens = c + q
        num_decodes = 0
        for ql in query_lens:
            if ql != 1:
                break
            num_decodes += 1
        seq_lens_list = seq_lens.tolist()
        to = self._to_device
        metadata = AttentionMetadata(
            num_tokens=total,
            num_decodes=num_decodes,
            query_start_loc=to(cu),
            seq_lens=to(seq_lens),
            slot_mapping=to(slot_blocks * bs + slot_offsets),
            block_tables=to(tables),
            block_size=bs,
            query_lens_list=query_lens,
            seq_lens_list=seq_lens_list,
            slot_blocks=to(slot_blocks),
            slot_offsets=to(slot_offsets),
            max_decode_seq_len=max(seq_lens_list[:num_decodes], default=0),
        )
        return to(ids), to(positions), metadata, cu

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        tensor = torch.from_numpy(array)
        if self.device.type != "cpu":
            tensor = tensor.to(self.device, non_blocking=True)
        return tensor

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, block_lists: list[list[int]]) -> StepLogits:
        """Run the step's forward and return the logits the sampler needs."""
        input_ids, positions, metadata, cu = self._prepare(out, block_lists)
        hidden = self.model(input_ids, positions, metadata)
        sample_rows = [i for i, s in enumerate(out.scheduled) if s.samples]
        prompt_rows = [
            i for i, s in enumerate(out.scheduled)
            if s.request.params.prompt_logprobs is not None
            and s.request.num_computed_tokens < s.request.num_prompt_tokens
        ]
        prompt_logits: dict[int, torch.Tensor] = {}
        if prompt_rows:
            for i in prompt_rows:
                prompt_logits[i] = self.model.compute_logits(hidden[int(cu[i]) : int(cu[i + 1])])
        last = torch.from_numpy(cu[1:][sample_rows] - 1).to(hidden.device)
        sample_logits = self.model.compute_logits(hidden.index_select(0, last))
        return StepLogits(sample_logits, sample_rows, prompt_logits)
