"""The DENOISE phase of block-diffusion requests: one decoder pass per request per step.

The scheduler gives a diffusion request whose tokens are all cached a denoise slot
(``ScheduledRequest.is_denoise``, ``canvas_length`` budget tokens); the engine runs
its causal chunks (ENCODE) through the ordinary forward and hands the denoise slots
here. Every slot of the step goes through one batched :meth:`BlockDiffusionLM.denoise`
over the cached prefixes (read-only) plus the canvases, then each request's sampler
step runs with its own generator. A finished block is returned for COMMIT: the
engine appends its ids (EOS and length checks as for any token), after which the
request has uncached tokens again and the scheduler runs ENCODE for them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from inference_engine.diffusion import DiffusionSettings, DiffusionState, denoise_step
from inference_engine.interfaces.attention import AttentionMetadata
from inference_engine.interfaces.block_diffusion import BlockDiffusionLM

if TYPE_CHECKING:
    from inference_engine.engine.request import Request
    from inference_engine.engine.scheduler import ScheduledRequest
    from inference_engine.sampling_params import SamplingParams

__all__ = ["DiffusionStepper"]


class DiffusionStepper:
    """Runs the denoise slots of a step and reports the blocks they finish."""

    def __init__(self, model: BlockDiffusionLM, device: torch.device, block_size: int,
                 defaults: DiffusionSettings) -> None:
        self.model = model
        self.device = device
        self.block_size = block_size
        self.defaults = defaults
        self.canvas_length = model.canvas_length
        self.vocab_size = model.ctx.hf_config.vocab_size
        # Totals for the bench and stats: decoder passes, blocks committed.
        self.num_passes = 0
        self.num_blocks = 0

    def new_state(self, params: SamplingParams) -> DiffusionState:
        """A request's state: the checkpoint's settings with its ``extra_args`` applied, and
        a generator seeded from ``params.seed`` (a fresh random seed when unset).

        Raises:
            ValueError: an unknown ``extra_args`` key or a bad value, by name.
        """
        settings = self.defaults.with_overrides(params.extra_args)
        generator = torch.Generator(device=self.device)
        if params.seed is not None:
            generator.manual_seed(params.seed)
        else:
            generator.seed()
        return DiffusionState(settings, self.canvas_length, generator)

    def _metadata(self, scheduled: list[ScheduledRequest]) -> AttentionMetadata:
        c = self.canvas_length
        n = len(scheduled)
        prefix_lens = [s.request.num_computed_tokens for s in scheduled]
        width = max(1, max(len(s.block_ids) for s in scheduled))
        tables = torch.zeros(n, width, dtype=torch.int64)
        for i, s in enumerate(scheduled):
            tables[i, : len(s.block_ids)] = torch.tensor(s.block_ids, dtype=torch.int64)
        starts = torch.arange(0, (n + 1) * c, c, dtype=torch.int64)
        return AttentionMetadata(
            num_tokens=n * c, num_decodes=0,
            query_start_loc=starts.to(self.device),
            seq_lens=torch.tensor(prefix_lens, dtype=torch.int64, device=self.device),
            # The canvas is never written: no slots.
            slot_mapping=torch.full((n * c,), -1, dtype=torch.int64, device=self.device),
            block_tables=tables.to(self.device), block_size=self.block_size,
            query_lens_list=[c] * n, seq_lens_list=prefix_lens,
            max_query_len=c, max_seq_len=max(prefix_lens) + c,
        )

    @torch.inference_mode()
    def run(self, scheduled: list[ScheduledRequest]) -> list[tuple[Request, list[int]]]:
        """One decoder pass over every slot's canvas; returns (request, block ids) of the
        blocks that finished denoising, in slot order."""
        c = self.canvas_length
        states: list[DiffusionState] = []
        for s in scheduled:
            state = s.request.diffusion
            if not state.in_block:
                state.start_block(self.vocab_size, self.model.pad_token_id, self.device)
            states.append(state)
        canvas = torch.stack([state.canvas for state in states])
        soft = None
        if any(state.soft is not None for state in states):
            hidden = self.model.hidden_size
            soft = torch.stack([
                state.soft if state.soft is not None else
                torch.zeros(c, hidden, dtype=self.model.ctx.dtype, device=self.device)
                for state in states])
        positions = torch.cat([
            torch.arange(s.request.num_computed_tokens, s.request.num_computed_tokens + c)
            for s in scheduled]).to(self.device)
        logits = self.model.denoise(canvas, soft, positions, self._metadata(scheduled))
        self.num_passes += len(scheduled)
        committed = []
        for s, state, row in zip(scheduled, states, logits, strict=True):
            result = denoise_step(state, row, self.vocab_size)
            if result.finished:
                committed.append((s.request, state.end_block()))
                self.num_blocks += 1
            else:
                state.soft = self.model.soft_embeddings(result.processed_logits)
        return committed
