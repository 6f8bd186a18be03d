"""Token selection: logits processing, seeded sampling and logprobs.

Per engine step::

    batch = SamplingBatch.from_rows(params, output_token_ids, vocab_size, device,
                                    prompt_token_ids=..., eos_token_ids=...)
    out = sampler(logits, batch)        # SamplerOutput
    ids = sampler.sample_ids(logits, batch)  # [B] device tensor, no host sync

``from_rows`` runs before the step and uploads its tensors in one copy; the
sampling itself (``sample_ids``) reads nothing back to the host, so the engine
reads the ids once, after it. Logprobs are turned into Python dicts, which reads
them back (a sync) when asked for.
"""

from __future__ import annotations

from inference_engine.sampling.batch import SamplingBatch, derive_seed
from inference_engine.sampling.logprobs import Logprob, compute_prompt_logprobs
from inference_engine.sampling.sampler import Sampler, SamplerOutput

__all__ = [
    "Logprob",
    "Sampler",
    "SamplerOutput",
    "SamplingBatch",
    "compute_prompt_logprobs",
    "derive_seed",
]
