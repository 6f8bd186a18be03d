"""One denoising step of a block: temperature schedule, entropy-bounded acceptance,
renoising and the stable-and-confident stop (transformers' ``EntropyBoundSampler`` and
``StableAndConfidentStoppingCriteria``, arXiv 2505.24857).

Each request draws from its own generator, so its result does not depend on what else
is in the batch; the draws are made in transformers' order (candidates, then renoise),
so a seeded request repeats ``generate`` after ``torch.manual_seed`` of the same seed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from inference_engine.diffusion.state import DiffusionState

__all__ = ["DenoiseResult", "denoise_step"]


@dataclass(frozen=True, slots=True)
class DenoiseResult:
    # [C, vocab] float32 temperature-scaled logits (the next step's self-conditioning).
    processed_logits: torch.Tensor
    # Whether the block is done (stable and confident, or out of steps).
    finished: bool


def _entropy(logits: torch.Tensor) -> torch.Tensor:
    """Per-row entropy of softmax(logits), as ``torch.distributions.Categorical`` computes it."""
    return torch.distributions.Categorical(logits=logits).entropy()


def denoise_step(state: DiffusionState, logits: torch.Tensor, vocab_size: int) -> DenoiseResult:
    """Apply one decoder pass's ``logits [C, vocab]`` (float32) to ``state``.

    Updates ``state.canvas`` (accepted candidates, the rest renoised), ``state.argmax``,
    the stability history and ``state.step``.
    """
    settings = state.settings
    assert state.canvas is not None
    processed = logits / settings.temperature(state.step)
    probs = torch.softmax(processed, dim=-1, dtype=torch.float32)
    candidates = torch.multinomial(probs, num_samples=1, generator=state.generator).squeeze(-1)
    argmax = torch.argmax(processed, dim=-1)
    entropy = _entropy(processed)
    # Entropy-bounded acceptance: the longest lowest-entropy prefix whose
    # sum(H) - max(H) stays within the bound.
    sorted_entropy, order = torch.sort(entropy, dim=-1)
    selected = torch.cumsum(sorted_entropy, dim=-1) - sorted_entropy <= settings.entropy_bound
    accepted_mask = torch.zeros_like(selected).scatter(-1, order, selected)
    accepted = torch.where(accepted_mask, candidates, state.canvas)
    noise = torch.randint(0, vocab_size, accepted.shape, generator=state.generator,
                          device=accepted.device)
    state.canvas = torch.where(accepted_mask, accepted, noise)
    # Stable: the argmax canvas equals each of the last stability_threshold ones.
    threshold = settings.stability_threshold
    if threshold == 0:
        stable = True
    else:
        stable = (len(state.history) == threshold
                  and all(bool(torch.equal(h, argmax)) for h in state.history))
        state.history = (state.history + [argmax])[-threshold:]
    confident = float(entropy.mean()) < settings.confidence_threshold
    state.argmax = argmax
    state.step -= 1
    state.num_passes += 1
    return DenoiseResult(processed, (stable and confident) or state.step == 0)
