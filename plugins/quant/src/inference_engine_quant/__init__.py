"""Quantization methods for inference-engine (FP8, PTPC, MXFP4, MXFP8, NVFP4, ModelOpt)."""

__version__ = "0.1.0"
