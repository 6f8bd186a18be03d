"""GGUF weight format, GGML quant types and GGUF tokenizer for inference-engine."""

__version__ = "0.1.0"
