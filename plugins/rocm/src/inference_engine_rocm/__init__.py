"""AMD ROCm platform and gfx942/gfx950 kernel tunings for inference-engine."""

__version__ = "0.1.0"
