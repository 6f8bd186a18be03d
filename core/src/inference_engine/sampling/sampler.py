"""Batched token selection with per-row parameters.

Per step: ``batch = SamplingBatch.from_rows(...)`` then ``sampler(logits, batch)``.
Processing order follows vLLM and transformers: the masks (grammar bitmask,
allowed_token_ids, bad_words and min_tokens blocking), logit_bias, penalties,
temperature, top-k, top-p, min-p, then a draw. Greedy rows take the
argmax after penalties. Reported logprobs are the model's raw distribution
(log-softmax of the logits as given, before any processing), which is what
vLLM reports by default.

Draws use the exponential race: ``argmax(p / E)`` with ``E ~ Exp(1)`` per
token is an exact categorical draw from ``p``. A seeded row draws its ``E``
from a generator seeded with ``derive_seed(seed, num_sampled)``, so its tokens
depend only on its seed and how many tokens it has sampled, never on batch
size, row position or neighbours (and survive preemption and recompute).
Unseeded rows share one generator seeded once per sampler.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from inference_engine.layers.cpu_fused import fused_argmax
from inference_engine.sampling.batch import SamplingBatch
from inference_engine.sampling.logprobs import Logprob, TokenDecoder, logprobs_to_dicts
from inference_engine.sampling.processors import (
    NEG_INF,
    apply_penalties_,
    apply_temperature_,
    apply_token_bitmask_,
    apply_top_k_top_p_min_p,
)

__all__ = ["Sampler", "SamplerOutput"]


@dataclass(slots=True)
class SamplerOutput:
    """One step's picks."""

    # [B] int64, on the logits' device.
    sampled_token_ids: torch.Tensor
    # Per row {token_id: Logprob} (sampled token first, then the top-N), or None
    # for rows that did not ask; None overall when no row asked.
    logprobs: list[dict[int, Logprob] | None] | None = None


def greedy_pick(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(dim=-1)``, through the fused CPU kernel where it applies."""
    picked = fused_argmax(logits)
    return logits.argmax(dim=-1) if picked is None else picked


class Sampler:
    """Picks one token per row of float32 logits ``[B, V]``.

    Args:
        seed: seed of the generator shared by unseeded rows; None picks one from
            torch's global seed (so ``torch.manual_seed`` makes runs repeatable).
        tokenizer: fills ``Logprob.decoded_token`` when given.
    """

    def __init__(self, seed: int | None = None, tokenizer: Any = None) -> None:
        self.seed = int(seed) if seed is not None else int(torch.initial_seed())
        self.decoder = TokenDecoder(tokenizer)
        # Per device: the shared generator, and one re-seeded for each seeded row.
        self._shared: dict[torch.device, torch.Generator] = {}
        self._per_row: dict[torch.device, torch.Generator] = {}

    # ---- the step -------------------------------------------------------------
    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        return self.forward(logits, batch)

    def forward(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        """Sample ``[B]`` token ids from ``logits [B, V]`` under ``batch``.

        The input logits are not modified.
        """
        if batch.is_plain_greedy:
            return SamplerOutput(greedy_pick(logits))
        logits = logits.float()
        tokens = self.sample_tokens(logits, batch)
        if batch.num_logprobs is None:
            return SamplerOutput(tokens)
        return SamplerOutput(tokens, self.compute_logprobs(logits, tokens, batch.num_logprobs))

    def sample_ids(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """The ``[B]`` int64 device tensor of picks, without logprobs.

        Reads nothing back to the host (no ``.item()``, ``.tolist()``, data-dependent
        shapes), so the caller can read the ids once, after the step. ``logits`` is
        left untouched.
        """
        if batch.is_plain_greedy:
            return greedy_pick(logits)
        return self.sample_tokens(logits.float(), batch)

    def sample_tokens(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """``[B]`` int64 picks; ``logits`` is left untouched."""
        processed, is_copy = self._block_and_penalise(logits, batch)
        if batch.all_greedy:
            return greedy_pick(processed)
        greedy_tokens = None
        if batch.is_greedy is not None:
            # Greedy rows: argmax after penalties; their warpers are off anyway.
            greedy_tokens = processed.argmax(dim=-1)
        processed = self._warp(processed, batch, is_copy)
        drawn = self._draw(processed.softmax(dim=-1), batch)
        if greedy_tokens is None:
            return drawn
        return torch.where(batch.is_greedy, greedy_tokens, drawn)

    def process_logits(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """Logits after blocking, penalties, temperature, top-k, top-p, min-p.

        Returns a new ``[B, V]`` float32 tensor: the draw is ``softmax(result)``
        on random rows; greedy rows (left unwarped) take its argmax.
        """
        logits = logits.float()
        out, is_copy = self._block_and_penalise(logits, batch)
        out = self._warp(out, batch, is_copy)
        return out.clone() if out is logits else out

    @staticmethod
    def _block_and_penalise(logits: torch.Tensor, batch: SamplingBatch
                            ) -> tuple[torch.Tensor, bool]:
        """(logits after the masks, logit_bias and penalties, whether that is a copy)."""
        if not batch.has_masks and not batch.has_penalties:
            return logits, False
        out = logits.clone()
        if batch.token_bitmask is not None:
            apply_token_bitmask_(out, batch.token_bitmask)
        if batch.disallowed is not None:
            out.masked_fill_(batch.disallowed, NEG_INF)
        if batch.logit_bias is not None:
            rows, cols, bias = batch.logit_bias
            out.index_put_((rows, cols), bias, accumulate=True)
        if batch.blocked is not None:
            # NOTE: a device-side fill value; ``out[idx] = float`` would upload the scalar
            # from pageable host memory, a synchronous copy on CUDA.
            out.index_put_(batch.blocked, out.new_full((1,), NEG_INF))
        if batch.has_penalties:
            apply_penalties_(out, batch.seen_mask, batch.repetition_penalty,
                             batch.output_counts, batch.presence_penalty,
                             batch.frequency_penalty)
        return out, True

    @staticmethod
    def _warp(logits: torch.Tensor, batch: SamplingBatch, is_copy: bool) -> torch.Tensor:
        """Temperature, top-k, top-p, min-p; never writes into a tensor it does not own."""
        if batch.all_greedy:
            return logits if is_copy else logits.clone()
        if batch.temperature is not None:
            if is_copy:
                apply_temperature_(logits, batch.temperature)
            else:
                logits = logits / batch.temperature[:, None]
        return apply_top_k_top_p_min_p(logits, batch.top_k, batch.top_p, batch.min_p,
                                       batch.max_top_k)

    def _draw(self, probs: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """Exponential race over ``probs [B, V]``; greedy rows' picks are discarded."""
        device = probs.device
        if batch.has_unseeded:
            noise = torch.empty_like(probs).exponential_(generator=self._shared_generator(device))
        else:
            # Seeded rows are overwritten below; greedy rows just need finite values.
            noise = torch.ones_like(probs)
        if batch.seeded_rows:
            gen = self._row_generator(device)
            row_noise = torch.empty(probs.shape[1], dtype=probs.dtype, device=device)
            for row, seed in batch.seeded_rows:
                gen.manual_seed(seed)
                noise[row] = row_noise.exponential_(generator=gen)
        # NOTE: exponential_ may return exactly 0 on some backends; p / 0 would win wrongly.
        noise.clamp_min_(torch.finfo(noise.dtype).tiny)
        return probs.div_(noise).argmax(dim=-1)

    def _shared_generator(self, device: torch.device) -> torch.Generator:
        gen = self._shared.get(device)
        if gen is None:
            gen = torch.Generator(device=device)
            gen.manual_seed(self.seed)
            self._shared[device] = gen
        return gen

    def _row_generator(self, device: torch.device) -> torch.Generator:
        gen = self._per_row.get(device)
        if gen is None:
            gen = self._per_row[device] = torch.Generator(device=device)
        return gen

    # ---- logprobs -------------------------------------------------------------
    def compute_logprobs(
        self, logits: torch.Tensor, token_ids: torch.Tensor, num_logprobs: Sequence[int | None]
    ) -> list[dict[int, Logprob] | None]:
        """Raw logprobs of ``token_ids [B]`` under ``logits [B, V]`` plus each row's top-N."""
        rows = [i for i, n in enumerate(num_logprobs) if n is not None]
        result: list[dict[int, Logprob] | None] = [None] * len(num_logprobs)
        if not rows:
            return result
        index = torch.tensor(rows, dtype=torch.int64, device=logits.device)
        # lp: [R, V] log-softmax of the unprocessed logits.
        lp = torch.log_softmax(logits.index_select(0, index).float(), dim=-1)
        dicts = logprobs_to_dicts(lp, token_ids.index_select(0, index),
                                  [num_logprobs[i] for i in rows], self.decoder)
        for i, entry in zip(rows, dicts, strict=True):
            result[i] = entry
        return result

    # ---- compatibility --------------------------------------------------------
    def sample(self, logits: torch.Tensor, requests: Sequence[Any]
               ) -> tuple[list[int], list[dict[int, Logprob] | None] | None]:
        """Older entry point: build the batch from engine ``Request`` objects.

        Reads ``params``, ``prompt_token_ids``, ``output_token_ids`` and
        ``eos_token_ids`` of each request.

        Returns:
            (token ids, per-row logprob dicts or None).
        """
        batch = SamplingBatch.from_rows(
            [r.params for r in requests],
            [r.output_token_ids for r in requests],
            vocab_size=logits.shape[1],
            device=logits.device,
            prompt_token_ids=[r.prompt_token_ids for r in requests],
            eos_token_ids=[r.eos_token_ids for r in requests],
        )
        out = self.forward(logits, batch)
        return out.sampled_token_ids.tolist(), out.logprobs
