"""Per-step sampling inputs, gathered once from the rows' params and histories.

``SamplingBatch.from_rows`` reads the params first and builds only the tensors
some row needs: a batch of plain greedy rows costs one pass over the params
and no tensors at all, and histories are read only when a row has penalties.
The tensors are built on the host and reach the device in one copy (pinned,
non-blocking); the sampler then needs no host value but the batch's own
(``max_top_k``, ``seeded_rows``).
"""

from __future__ import annotations

import itertools
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch

from inference_engine.sampling_params import GREEDY_EPS, SamplingParams

__all__ = ["SamplingBatch", "derive_seed"]

_MASK64 = (1 << 64) - 1


def derive_seed(seed: int, num_sampled: int) -> int:
    """The generator seed for a seeded request's draw number ``num_sampled``.

    A splitmix64 mix, so nearby seeds and steps give unrelated streams; the
    draw depends on nothing but these two numbers.
    """
    x = (seed * 0x9E3779B97F4A7C15 + num_sampled * 0xD1B54A32D192ED03 + 1) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (x ^ (x >> 31)) & ((1 << 63) - 1)


def _plain_greedy(p: SamplingParams) -> bool:
    """Whether a row of ``p`` is a bare argmax whatever its history: one test per row, so
    the common all-greedy step skips gathering each field separately."""
    return (p.temperature < GREEDY_EPS and p.repetition_penalty == 1.0
            and p.presence_penalty == 0.0 and p.frequency_penalty == 0.0 and not p.min_tokens
            and not p.bad_words_token_ids and p.allowed_token_ids is None and not p.logit_bias
            and p.logprobs is None)


@dataclass(slots=True)
class SamplingBatch:
    """What the sampler needs for one step, one row per sequence that samples.

    Tensor fields are None when no row uses them; ``[B]`` tensors hold the
    "off" value on rows that do not (top_k 0, top_p 1, min_p 0, penalties
    neutral, temperature 1 on greedy rows). Build it with :meth:`from_rows`.
    """

    num_rows: int
    vocab_size: int
    # Every row greedy, no penalties, nothing blocked, no logprobs: sampling is argmax.
    is_plain_greedy: bool
    # Every row greedy (penalties and blocking may still apply).
    all_greedy: bool
    # [B] bool, True on greedy rows; None when all rows or no rows are greedy.
    is_greedy: torch.Tensor | None = None
    # [B] float32; None when every random row has temperature 1 (or all greedy).
    temperature: torch.Tensor | None = None
    # [B] int64, 0 = off.
    top_k: torch.Tensor | None = None
    # Host bound on the active top_k values (the ``topk`` width); None with top_k.
    max_top_k: int | None = None
    # [B] float32, 1 = off.
    top_p: torch.Tensor | None = None
    # [B] float32, 0 = off.
    min_p: torch.Tensor | None = None
    # [B] float32 and [B, V] bool of tokens in prompt + output (transformers' rule).
    repetition_penalty: torch.Tensor | None = None
    seen_mask: torch.Tensor | None = None
    # [B] float32 each and [B, V] float32 occurrence counts in the output (OpenAI's rule).
    presence_penalty: torch.Tensor | None = None
    frequency_penalty: torch.Tensor | None = None
    output_counts: torch.Tensor | None = None
    # (rows [N], token ids [N]) int64 set to -inf: stop ids of rows still under min_tokens
    # and the banned last tokens of bad_words.
    blocked: tuple[torch.Tensor, torch.Tensor] | None = None
    # [B, ceil(V / 32)] int32 packed allowed-token bits of the grammar rows (bit set =
    # allowed; xgrammar's layout); every bit set on rows without a grammar.
    token_bitmask: torch.Tensor | None = None
    # [B, V] bool, True where a row with allowed_token_ids may not sample.
    disallowed: torch.Tensor | None = None
    # (rows [N], token ids [N], bias [N]) added to the logits (logit_bias).
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    # (row, generator seed) of each seeded random row; see derive_seed.
    seeded_rows: tuple[tuple[int, int], ...] = ()
    # True when some random row has no seed and draws from the shared generator.
    has_unseeded: bool = False
    # Per row: top-N logprobs wanted, or None; None overall when no row wants them.
    num_logprobs: tuple[int | None, ...] | None = None

    @property
    def has_penalties(self) -> bool:
        return self.seen_mask is not None or self.output_counts is not None

    @property
    def has_masks(self) -> bool:
        """Whether some row has tokens masked out or biased before the penalties."""
        return (self.blocked is not None or self.token_bitmask is not None
                or self.disallowed is not None or self.logit_bias is not None)

    @classmethod
    def from_rows(
        cls,
        params: Sequence[SamplingParams],
        output_token_ids: Sequence[Sequence[int]],
        vocab_size: int,
        device: torch.device | str = "cpu",
        prompt_token_ids: Sequence[Sequence[int] | torch.Tensor] | None = None,
        eos_token_ids: Sequence[Collection[int]] | None = None,
        token_bitmask: torch.Tensor | None = None,
    ) -> SamplingBatch:
        """Gather one step's sampling inputs.

        Args:
            params: per row, the sequence's params (a forked child's, for n > 1).
            output_token_ids: per row, the tokens generated so far; its length
                is the seeded draw number and the min_tokens count.
            vocab_size: width of the logits the batch will be applied to.
            device: where the logits live.
            prompt_token_ids: per row, the prompt (a list or a 1-D int64 tensor,
                which the caller may cache per request); read only for rows with
                a repetition penalty, required if any row has one.
            eos_token_ids: per row, the ids that would end the sequence (EOS
                unless ignore_eos, plus stop_token_ids); masked out while the row
                has fewer than ``min_tokens`` outputs. None: ``stop_token_ids``.
            token_bitmask: host ``int32 [rows, ceil(vocab_size / 32)]`` grammar bits (see
                :meth:`StructuredOutputManager.fill_bitmask`), or None.

        Returns:
            The batch.
        """
        num_rows = len(params)
        if token_bitmask is None and all(_plain_greedy(p) for p in params):
            return cls(num_rows, vocab_size, is_plain_greedy=True, all_greedy=True)
        greedy = [p.temperature < GREEDY_EPS for p in params]
        all_greedy = all(greedy)
        rep_rows = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
        pf_rows = [
            i for i, p in enumerate(params)
            if p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
        ]
        blocked_rows = [
            i for i, p in enumerate(params)
            if p.min_tokens and len(output_token_ids[i]) < p.min_tokens
        ]
        bad_word_rows = [i for i, p in enumerate(params) if p.bad_words_token_ids]
        allowed_rows = [i for i, p in enumerate(params) if p.allowed_token_ids is not None]
        bias_rows = [i for i, p in enumerate(params) if p.logit_bias]
        has_logprobs = any(p.logprobs is not None for p in params)
        if all_greedy and not (rep_rows or pf_rows or blocked_rows or has_logprobs
                               or bad_word_rows or allowed_rows or bias_rows
                               or token_bitmask is not None):
            return cls(num_rows, vocab_size, is_plain_greedy=True, all_greedy=True)

        batch = cls(num_rows, vocab_size, is_plain_greedy=False, all_greedy=all_greedy)
        # Everything is built on the host and uploaded in one copy (see _Staging).
        staged = _Staging()
        if has_logprobs:
            batch.num_logprobs = tuple(
                vocab_size if p.logprobs == -1 else p.logprobs for p in params)
        if blocked_rows or bad_word_rows:
            _stage_blocked(staged, blocked_rows, params, eos_token_ids, vocab_size,
                           _banned_bad_words(bad_word_rows, params, output_token_ids))
        if token_bitmask is not None:
            staged.add("token_bitmask", token_bitmask)
        if allowed_rows:
            staged.add("restricted", torch.tensor([p.allowed_token_ids is not None
                                                   for p in params], dtype=torch.bool))
            rows, cols = _scatter_index(allowed_rows,
                                        [params[i].allowed_token_ids for i in allowed_rows],
                                        vocab_size)
            staged.add("allowed_rows", rows)
            staged.add("allowed_cols", cols)
        if bias_rows:
            pairs = [(i, t, b) for i in bias_rows for t, b in params[i].logit_bias.items()
                     if t < vocab_size]
            staged.add("bias_rows", torch.tensor([r for r, _, _ in pairs], dtype=torch.int64))
            staged.add("bias_cols", torch.tensor([t for _, t, _ in pairs], dtype=torch.int64))
            staged.add("bias_values", torch.tensor([b for _, _, b in pairs],
                                                   dtype=torch.float32))
        if rep_rows:
            if prompt_token_ids is None:
                raise ValueError("prompt_token_ids are needed for a repetition penalty")
            staged.add("repetition_penalty", _per_row(params, "repetition_penalty", 1.0, rep_rows))
            r_p, c_p = _scatter_index(rep_rows, [prompt_token_ids[i] for i in rep_rows],
                                      vocab_size)
            r_o, c_o = _scatter_index(rep_rows, [output_token_ids[i] for i in rep_rows],
                                      vocab_size)
            staged.add("seen_rows", torch.cat([r_p, r_o]))
            staged.add("seen_cols", torch.cat([c_p, c_o]))
        if pf_rows:
            if any(params[i].presence_penalty != 0.0 for i in pf_rows):
                staged.add("presence_penalty", _per_row(params, "presence_penalty", 0.0, pf_rows))
            if any(params[i].frequency_penalty != 0.0 for i in pf_rows):
                staged.add("frequency_penalty",
                           _per_row(params, "frequency_penalty", 0.0, pf_rows))
            rows, cols = _scatter_index(pf_rows, [output_token_ids[i] for i in pf_rows],
                                        vocab_size)
            staged.add("count_rows", rows)
            staged.add("count_cols", cols)
        if not all_greedy:
            random_rows = [i for i, g in enumerate(greedy) if not g]
            if len(random_rows) < num_rows:
                staged.add("is_greedy", torch.tensor(greedy, dtype=torch.bool))
            if any(params[i].temperature != 1.0 for i in random_rows):
                staged.add("temperature", _per_row(params, "temperature", 1.0, random_rows))
            active_k = [params[i].top_k for i in random_rows if 0 < params[i].top_k < vocab_size]
            if active_k:
                staged.add("top_k", _per_row(params, "top_k", 0, random_rows, torch.int64))
                batch.max_top_k = max(active_k)
            if any(params[i].top_p < 1.0 for i in random_rows):
                staged.add("top_p", _per_row(params, "top_p", 1.0, random_rows))
            if any(params[i].min_p > 0.0 for i in random_rows):
                staged.add("min_p", _per_row(params, "min_p", 0.0, random_rows))
            batch.seeded_rows = tuple(
                (i, derive_seed(params[i].seed, len(output_token_ids[i])))
                for i in random_rows if params[i].seed is not None
            )
            batch.has_unseeded = len(batch.seeded_rows) < len(random_rows)

        on_device = staged.upload(device)
        for name in ("is_greedy", "temperature", "top_k", "top_p", "min_p",
                     "repetition_penalty", "presence_penalty", "frequency_penalty"):
            if name in on_device:
                setattr(batch, name, on_device[name])
        if "blocked_rows" in on_device:
            batch.blocked = (on_device["blocked_rows"], on_device["blocked_cols"])
        if "token_bitmask" in on_device:
            batch.token_bitmask = on_device["token_bitmask"].view(token_bitmask.shape)
        if "allowed_rows" in on_device:
            # One spare column absorbs out-of-vocabulary ids.
            keep = torch.zeros(num_rows, vocab_size + 1, dtype=torch.bool, device=device)
            keep[on_device["allowed_rows"], on_device["allowed_cols"]] = True
            batch.disallowed = on_device["restricted"][:, None] & ~keep[:, :vocab_size]
        if "bias_rows" in on_device:
            batch.logit_bias = (on_device["bias_rows"], on_device["bias_cols"],
                                on_device["bias_values"])
        if "seen_rows" in on_device:
            # One spare column absorbs out-of-vocabulary ids.
            mask = torch.zeros(num_rows, vocab_size + 1, dtype=torch.bool, device=device)
            mask[on_device["seen_rows"], on_device["seen_cols"]] = True
            batch.seen_mask = mask[:, :vocab_size]
        if "count_rows" in on_device:
            rows = on_device["count_rows"]
            counts = torch.zeros(num_rows, vocab_size + 1, dtype=torch.float32, device=device)
            counts.index_put_((rows, on_device["count_cols"]),
                              torch.ones(rows.shape, dtype=torch.float32, device=device),
                              accumulate=True)
            batch.output_counts = counts[:, :vocab_size]
        return batch


class _Staging:
    """Host tensors gathered for one upload: packed into one byte buffer (pinned when the
    device is not the CPU), copied with one ``non_blocking`` transfer, then viewed back."""

    # Each part starts at a multiple of this many bytes, so every dtype can view it.
    ALIGN = 8

    def __init__(self) -> None:
        self.parts: dict[str, torch.Tensor] = {}

    def add(self, name: str, tensor: torch.Tensor) -> None:
        self.parts[name] = tensor.reshape(-1)

    def upload(self, device: torch.device | str) -> dict[str, torch.Tensor]:
        """The parts on ``device`` (on the CPU: views of one host buffer)."""
        if not self.parts:
            return {}
        offsets, size = [], 0
        for t in self.parts.values():
            offsets.append(size)
            size += -(-t.numel() * t.element_size() // self.ALIGN) * self.ALIGN
        host = torch.empty(size, dtype=torch.uint8)
        for (_, t), start in zip(self.parts.items(), offsets, strict=True):
            nbytes = t.numel() * t.element_size()
            host[start:start + nbytes].view(t.dtype).copy_(t)
        device = torch.device(device)
        if device.type != "cpu":
            host = host.pin_memory()
        buffer = host.to(device, non_blocking=True)
        out = {}
        for (name, t), start in zip(self.parts.items(), offsets, strict=True):
            nbytes = t.numel() * t.element_size()
            out[name] = buffer[start:start + nbytes].view(t.dtype)
        return out


def _per_row(
    params: Sequence[SamplingParams],
    name: str,
    off: float,
    rows: Sequence[int],
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Host ``[B]`` of ``params[i].name`` on ``rows`` and ``off`` elsewhere."""
    values = [off] * len(params)
    for i in rows:
        values[i] = getattr(params[i], name)
    return torch.tensor(values, dtype=dtype)


def _scatter_index(
    rows: Sequence[int], ids_per_row: Sequence[Sequence[int] | torch.Tensor], vocab_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat (row, token id) int64 CPU index of the rows' ids; ids >= vocab map to vocab."""
    lengths = torch.tensor([len(ids) for ids in ids_per_row], dtype=torch.int64)
    if ids_per_row and all(isinstance(ids, torch.Tensor) for ids in ids_per_row):
        cols = torch.cat([ids.reshape(-1).to("cpu", torch.int64) for ids in ids_per_row])
    else:
        flat = itertools.chain.from_iterable(
            ids.tolist() if isinstance(ids, torch.Tensor) else ids for ids in ids_per_row
        )
        cols = torch.tensor(list(flat), dtype=torch.int64)
    row_index = torch.repeat_interleave(torch.tensor(list(rows), dtype=torch.int64), lengths)
    return row_index, cols.clamp_(0, vocab_size)


def _stage_blocked(
    staged: _Staging,
    rows: Sequence[int],
    params: Sequence[SamplingParams],
    eos_token_ids: Sequence[Collection[int]] | None,
    vocab_size: int,
    banned: Sequence[tuple[int, int]] = (),
) -> None:
    """Stage (row, token id) of the stop ids masked on rows still under min_tokens, and
    the ``banned`` pairs."""
    pairs = [(i, t) for i, t in banned if 0 <= t < vocab_size]
    for i in rows:
        ids = eos_token_ids[i] if eos_token_ids is not None else params[i].stop_token_ids or ()
        pairs.extend((i, t) for t in ids if 0 <= t < vocab_size)
    if pairs:
        index = torch.tensor(pairs, dtype=torch.int64)
        staged.add("blocked_rows", index[:, 0])
        staged.add("blocked_cols", index[:, 1])


def _banned_bad_words(rows: Sequence[int], params: Sequence[SamplingParams],
                      output_token_ids: Sequence[Sequence[int]]) -> list[tuple[int, int]]:
    """(row, token id) pairs bad_words ban now: a word's last token where the row's output
    ends with the word's other tokens (always, for one-token words)."""
    pairs = []
    for i in rows:
        output = output_token_ids[i]
        for ids in params[i].bad_words_token_ids or ():
            prefix = ids[:-1]
            if not prefix or (len(output) >= len(prefix)
                              and list(output[len(output) - len(prefix):]) == prefix):
                pairs.append((i, ids[-1]))
    return pairs
