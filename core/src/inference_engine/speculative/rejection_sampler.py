"""The one rejection sampler every proposer's drafts go through (Leviathan et al. 2211.17192).

A request that verified drafts ``d1..dk`` has k + 1 rows of target logits: row j
scores the token after ``d1..dj``. Each row is processed exactly as the plain
sampler would process it at that point (its history is the outputs plus the drafts
before it: penalties, min_tokens, logit_bias, temperature, top-k/top-p/min-p), so
the target distribution p_j is the one sampling without speculation would use.

* **Point-mass drafts** (n-gram, greedy drafting; no ``q``): draw y_j ~ p_j exactly
  as the plain sampler would (same exponential race, same per-request seed for draw
  number ``len(outputs) + j``), accept while ``y_j == d_j``, emit the first
  mismatching y_j as the correction, or y_k as the bonus token. The emitted token at
  every position is a true draw from p_j, so this is lossless; ``P(accept) = p_j(d_j)``
  and a rejection draws from p_j with d_j removed, which is exactly the standard rule
  ``min(1, p/q)`` / ``norm(max(p - q, 0))`` for a point mass q. Greedy rows are the
  case where p_j is the argmax; seeded rows give the very tokens they would without
  speculation.
* **Drafts with probabilities** q_j: accept d_j when ``u * q_j(d_j) <= p_j(d_j)``
  (``u ~ U(0, 1)``), else emit a draw from ``norm(max(p_j - q_j, 0))`` (exponential
  race, no normalisation) and stop; if all k pass, the bonus is y_k ~ p_k.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from inference_engine.sampling.batch import SamplingBatch, derive_seed
from inference_engine.sampling.sampler import Sampler, greedy_pick
from inference_engine.sampling_params import SamplingParams

__all__ = ["RejectionSampler", "VerifyOutput", "VerifyRow"]

# Keeps the acceptance uniforms and residual draws of a seeded row apart from its
# target draw (derive_seed(seed, n) seeds that one).
_RESIDUAL_SALT = 0x5EC0DE


@dataclass(slots=True)
class VerifyRow:
    """One request being verified: what the plain sampler would read, plus its drafts."""

    params: SamplingParams
    output_token_ids: Sequence[int]
    prompt_token_ids: Sequence[int]
    eos_token_ids: Collection[int]
    draft_token_ids: Sequence[int]
    # [len(drafts), vocab] float32 draft probabilities; None: a point mass on each draft.
    draft_probs: torch.Tensor | None = None
    # Host int32 [len(drafts) + 1, ceil(vocab / 32)] grammar bits per verified position
    # (StructuredOutputManager.draft_bitmask); None: no grammar.
    token_bitmask: torch.Tensor | None = None


@dataclass(slots=True)
class VerifyOutput:
    """Per request: the tokens to append (1 .. k + 1) and, if asked, their logprobs."""

    token_ids: list[list[int]]
    # Per request, one {token_id: Logprob} per emitted token, or None where not asked.
    logprobs: list[list[Any] | None] = field(default_factory=list)
    # Per request, how many drafts were accepted.
    num_accepted: list[int] = field(default_factory=list)


class RejectionSampler:
    """Verifies drafts against the target's logits; draws through ``sampler``."""

    def __init__(self, sampler: Sampler) -> None:
        self.sampler = sampler
        self._generators: dict[torch.device, torch.Generator] = {}

    def __call__(self, logits: torch.Tensor, rows: Sequence[VerifyRow]) -> VerifyOutput:
        """Verify ``rows`` against ``logits [sum(1 + k_i), V]`` (request-major)."""
        device = logits.device
        params: list[SamplingParams] = []
        histories: list[list[int]] = []
        prompts: list[Sequence[int]] = []
        eos: list[Collection[int]] = []
        offsets: list[int] = []
        for row in rows:
            offsets.append(len(params))
            out = list(row.output_token_ids)
            drafts = list(row.draft_token_ids)
            for j in range(len(drafts) + 1):
                params.append(row.params)
                histories.append(out + drafts[:j])
                prompts.append(row.prompt_token_ids)
                eos.append(row.eos_token_ids)
        if len(params) != logits.shape[0]:
            raise ValueError(f"{logits.shape[0]} logit rows for {len(params)} verified positions")
        batch = SamplingBatch.from_rows(params, histories, vocab_size=logits.shape[1],
                                        device=device, prompt_token_ids=prompts,
                                        eos_token_ids=eos,
                                        token_bitmask=self._bitmask(rows, len(params)))
        if batch.is_plain_greedy:
            target = greedy_pick(logits)
        else:
            target = self.sampler.sample_tokens(logits.float(), batch)
        probs = None
        if any(r.draft_probs is not None and not r.params.is_greedy for r in rows):
            probs = self.sampler.process_logits(logits, batch).softmax(dim=-1)
        target_ids = target.tolist()

        token_ids: list[list[int]] = []
        num_accepted: list[int] = []
        for row, start in zip(rows, offsets, strict=True):
            drafts = list(row.draft_token_ids)
            if row.draft_probs is None or row.params.is_greedy:
                emitted = self._point_mass(drafts, target_ids[start : start + len(drafts) + 1])
            else:
                emitted = self._with_probs(row, probs[start : start + len(drafts) + 1],
                                           target_ids[start + len(drafts)])
            token_ids.append(emitted)
            num_accepted.append(len(emitted) - 1)
        logprobs = self._logprobs(logits, rows, offsets, token_ids, batch)
        return VerifyOutput(token_ids, logprobs, num_accepted)

    @staticmethod
    def _bitmask(rows: Sequence[VerifyRow], num_positions: int) -> torch.Tensor | None:
        """Every verified position's grammar bits (all allowed for rows without a grammar),
        so each position is masked as the plain sampler masks a constrained step; None when
        no row has a grammar."""
        masks = [row.token_bitmask for row in rows]
        present = [m for m in masks if m is not None]
        if not present:
            return None
        out = torch.full((num_positions, present[0].shape[1]), -1, dtype=torch.int32)
        start = 0
        for row, mask in zip(rows, masks, strict=True):
            n = len(row.draft_token_ids) + 1
            if mask is not None:
                out[start : start + n] = mask
            start += n
        return out

    @staticmethod
    def _point_mass(drafts: list[int], targets: list[int]) -> list[int]:
        """Accept while the target's own draw equals the draft; its draw corrects or adds."""
        emitted = []
        for draft, y in zip(drafts, targets, strict=False):
            emitted.append(y)
            if y != draft:
                return emitted
        emitted.append(targets[len(drafts)])
        return emitted

    def _with_probs(self, row: VerifyRow, p: torch.Tensor, bonus: int) -> list[int]:
        """The standard rule with a draft distribution; ``p [k + 1, V]`` target probs."""
        q = row.draft_probs.to(device=p.device, dtype=torch.float32)
        drafts = list(row.draft_token_ids)
        k = len(drafts)
        gen = self._generator(p.device, row, len(row.output_token_ids))
        u = torch.rand(k, generator=gen, device=p.device, dtype=torch.float32)
        index = torch.arange(k, device=p.device)
        draft_t = torch.tensor(drafts, dtype=torch.int64, device=p.device)
        # accept_j: u_j * q_j(d_j) <= p_j(d_j)
        accept = (u * q[index, draft_t] <= p[:k][index, draft_t]).tolist()
        emitted: list[int] = []
        for j in range(k):
            if accept[j]:
                emitted.append(drafts[j])
                continue
            residual = (p[j] - q[j]).clamp_min_(0.0)
            noise = torch.empty_like(residual).exponential_(generator=gen)
            noise.clamp_min_(torch.finfo(noise.dtype).tiny)
            emitted.append(int((residual / noise).argmax()))
            return emitted
        emitted.append(bonus)
        return emitted

    def _generator(self, device: torch.device, row: VerifyRow, num_sampled: int
                   ) -> torch.Generator:
        """Seeded rows: a stream fixed by their seed and draw number; others: a shared one."""
        if row.params.seed is not None:
            gen = torch.Generator(device=device)
            gen.manual_seed(derive_seed(row.params.seed ^ _RESIDUAL_SALT, num_sampled))
            return gen
        gen = self._generators.get(device)
        if gen is None:
            gen = self._generators[device] = torch.Generator(device=device)
            gen.manual_seed(self.sampler.seed ^ _RESIDUAL_SALT)
        return gen

    def _logprobs(self, logits: torch.Tensor, rows: Sequence[VerifyRow], offsets: list[int],
                  token_ids: list[list[int]], batch: SamplingBatch) -> list[list[Any] | None]:
        """Raw logprobs (as the plain sampler reports) of each emitted token at its row."""
        result: list[list[Any] | None] = [None] * len(rows)
        if batch.num_logprobs is None:
            return result
        positions, tokens, wanted, owners = [], [], [], []
        for i, (row, start) in enumerate(zip(rows, offsets, strict=True)):
            if row.params.logprobs is None:
                continue
            for j, token in enumerate(token_ids[i]):
                positions.append(start + j)
                tokens.append(token)
                wanted.append(batch.num_logprobs[start + j])
                owners.append(i)
        if not positions:
            return result
        index = torch.tensor(positions, dtype=torch.int64, device=logits.device)
        dicts = self.sampler.compute_logprobs(
            logits.index_select(0, index),
            torch.tensor(tokens, dtype=torch.int64, device=logits.device), wanted)
        for owner, entry in zip(owners, dicts, strict=True):
            if result[owner] is None:
                result[owner] = []
            result[owner].append(entry)
        return result
