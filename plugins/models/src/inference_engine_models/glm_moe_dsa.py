"""GLM-5 (GlmMoeDsaForCausalLM): DeepSeek-V3.2 sparse attention, selections shared by layers.

As :mod:`~inference_engine_models.deepseek_v32`, with two differences: the
indexer rotates its rope part as interleaved pairs, and ``indexer_types`` marks
each layer ``"full"`` (its own indexer, weights and cached keys) or
``"shared"`` (no indexer: it attends the positions the previous full layer
selected in the same step).
"""

from __future__ import annotations

from inference_engine_models.deepseek_v32 import DeepseekV32ForCausalLM

__all__ = ["GlmMoeDsaForCausalLM"]


class GlmMoeDsaForCausalLM(DeepseekV32ForCausalLM):
    """V3.2 with interleaved indexer rope and per-layer ``indexer_types``."""

    indexer_rope_interleaved = True

    def has_indexer(self, layer_idx: int) -> bool:
        types = getattr(self.ctx.hf_config, "indexer_types", None)
        if types is None:
            return True
        if types[0] != "full":
            raise ValueError(f"indexer_types[0] is {types[0]!r}: the first layer must be 'full', "
                             f"a 'shared' layer reuses an earlier layer's selection")
        return types[layer_idx] == "full"
