"""Triton kernels of the quantization methods; each has a plain-PyTorch reference."""
