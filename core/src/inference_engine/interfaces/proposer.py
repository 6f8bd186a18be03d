"""The speculative-decoding drafter interface (a plugin kind: ``ie_register_proposers``).

Each step the target verifies ``[last token, d1..dk]`` for every running request;
afterwards the engine asks the proposer for the next drafts of each request that is
still running. A proposer only proposes: acceptance is the shared rejection sampler's
(:mod:`inference_engine.speculative.rejection_sampler`), so every drafter is lossless.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from inference_engine.config import EngineConfig, SpeculativeConfig
    from inference_engine.interfaces.attention import KVCacheSpec
    from inference_engine.interfaces.platform import Platform
    from inference_engine.sampling_params import SamplingParams

__all__ = ["DraftRequest", "Proposal", "Proposer", "ProposerContext"]


@dataclass(frozen=True, slots=True)
class ProposerContext:
    """What a proposer may need from the engine it drafts for."""

    config: EngineConfig
    platform: Platform
    # The target model (a CausalLM): drafters that share its embedding or LM head.
    target_model: Any
    # The target's compute dtype and vocabulary width.
    dtype: torch.dtype
    vocab_size: int
    max_model_len: int
    block_size: int


@dataclass(slots=True)
class DraftRequest:
    """One running request to draft for, after its verified tokens were appended."""

    request_id: str
    # Prompt + verified outputs (the last one not yet in the target's cache).
    token_ids: Sequence[int]
    # Its KV block ids in the paged pool (lookahead slots included): a drafter with its
    # own pool of the same geometry writes its K/V at the same block ids.
    block_ids: Sequence[int]
    # Times the request was preempted: a change means its cache was recomputed from zero.
    num_preemptions: int
    # Most drafts worth proposing (k, fewer near max_tokens or the context limit).
    max_drafts: int
    # The request's sampling parameters (drafters with ``draft_sample_method:
    # probabilistic`` draw with them); None: draft greedily.
    params: SamplingParams | None = None
    # How many of ``token_ids`` are the prompt (the rest are outputs: the draw number).
    num_prompt_tokens: int = 0


@dataclass(slots=True)
class Proposal:
    """Drafts for each request asked, in order (possibly empty lists)."""

    token_ids: list[list[int]]
    # Per request ``[len(drafts), vocab]`` float32 draft probabilities q, or None where
    # the drafter is a point mass (n-gram, greedy drafting): the rejection sampler then
    # accepts a draft with the target's probability of it.
    probs: list[torch.Tensor | None] | None = None


class Proposer(ABC):
    """Drafts up to k tokens per request.

    Args:
        spec: the ``speculative_config`` (k, method-specific keys).
        context: the target engine's facts.
    """

    # Drafters fed with the target's hidden states (recorded by hooks on its layers): the
    # engine then never replays decode graphs, which would skip the hooks.
    reads_target_hidden_states: bool = False
    # Drafters that can draw their drafts from their own distribution and pass it on
    # (``draft_sample_method: probabilistic``); others refuse that setting.
    supports_probabilistic_drafts: bool = False

    def __init__(self, spec: SpeculativeConfig, context: ProposerContext) -> None:
        self.spec = spec
        self.context = context
        self.num_speculative_tokens = spec.num_speculative_tokens
        if (getattr(spec, "draft_sample_method", "greedy") == "probabilistic"
                and not self.supports_probabilistic_drafts):
            raise ValueError(f"speculative_config 'draft_sample_method': 'probabilistic' is not "
                             f"supported by method {spec.method!r} (its drafts have no "
                             f"distribution); use 'greedy'")

    @property
    def num_lookahead_slots(self) -> int:
        """KV slots past the verified tokens a request must hold for the drafter to write
        its drafts' K/V (model drafters: k; drafters without a cache: 0)."""
        return 0

    def kv_cache_specs(self) -> list[KVCacheSpec]:
        """Per-block cache layers the drafter keeps in a pool of the target's geometry
        (counted when the pool is sized); none by default."""
        return []

    def bind_kv_cache(self, num_blocks: int) -> None:  # noqa: B027 - optional
        """Allocate the drafter's cache: ``num_blocks`` blocks, the target's block ids."""

    @abstractmethod
    def propose(self, requests: Sequence[DraftRequest]) -> Proposal:
        """Draft for each request (at most ``max_drafts`` tokens each).

        Called once per step, after the verified tokens were appended, for the requests
        that keep running.
        """

    def on_target_step(  # noqa: B027 - optional
            self, request_ids: Sequence[str], num_computed: Sequence[int],
            query_lens: Sequence[int]) -> None:
        """After each target forward: which requests it ran, from which position, over how
        many tokens (in the forward's row order); drafters that read the target's hidden
        states take them here."""

    def remove(self, request_id: str) -> None:  # noqa: B027 - optional
        """Forget a request (finished, aborted or preempted)."""
