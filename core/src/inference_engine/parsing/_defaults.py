"""Default parser pair for a model when the user names none (``--enable-auto-tool-choice``)."""

from __future__ import annotations

__all__ = ["ARCHITECTURE_PARSERS", "default_parsers"]

# HF architecture -> (tool parser, reasoning parser). Where one architecture
# serves families with different output formats, the model name refines it
# below; these are the formats the first-party parsers document.
ARCHITECTURE_PARSERS: dict[str, tuple[str, str | None]] = {
    "Qwen2ForCausalLM": ("qwen3", None),
    "Qwen3ForCausalLM": ("qwen3", "qwen3"),
    "Qwen3MoeForCausalLM": ("qwen3", "qwen3"),
    "Qwen3NextForCausalLM": ("qwen3_coder", "qwen3"),
    "Qwen3_5ForConditionalGeneration": ("qwen3_coder", "qwen3"),
    "Qwen3_5MoeForConditionalGeneration": ("qwen3_coder", "qwen3"),
    "Glm4MoeForCausalLM": ("glm45", "glm45"),
    "GlmMoeDsaForCausalLM": ("glm47", "glm45"),
    "MiniMaxM2ForCausalLM": ("minimax_m2", "minimax_m2"),
    "NemotronHForCausalLM": ("nemotron_v3", "nemotron_v3"),
    "DeepseekV3ForCausalLM": ("deepseek_v31", "deepseek_v3"),
}

# (architecture, lower-case substring of the model name) -> pair, checked first.
_NAME_REFINEMENTS: list[tuple[str, str, tuple[str, str | None]]] = [
    ("Qwen3MoeForCausalLM", "coder", ("qwen3_coder", "qwen3")),
    ("Qwen3ForCausalLM", "coder", ("qwen3_coder", "qwen3")),
    ("Glm4MoeForCausalLM", "4.7", ("glm47", "glm45")),
    ("Glm4MoeForCausalLM", "glm-5", ("glm47", "glm45")),
    ("NemotronHForCausalLM", "nano-9b-v2", ("nemotron_v2", None)),
    ("NemotronHForCausalLM", "nano-12b-v2", ("nemotron_v2", None)),
    ("DeepseekV3ForCausalLM", "r1", ("deepseek_v31", "deepseek_r1")),
]


def default_parsers(architecture: str, model_name: str = "") -> tuple[str | None, str | None]:
    """(tool parser, reasoning parser) names for a model; (None, None) when unknown.

    Args:
        architecture: ``config.architectures[0]``.
        model_name: the model id or path, used to tell apart families that
            share an architecture (Qwen3 vs Qwen3-Coder, GLM-4.5 vs 4.7).
    """
    name = model_name.lower()
    for arch, needle, pair in _NAME_REFINEMENTS:
        if arch == architecture and needle in name:
            return pair
    return ARCHITECTURE_PARSERS.get(architecture, (None, None))
