"""Model architectures for inference-engine (Llama, Qwen2/3, MoE, MLA)."""

__version__ = "0.1.0"
