"""Intel XPU platform for inference-engine."""

__version__ = "0.1.0"
