"""Example third-party plugin for inference-engine."""

__version__ = "0.1.0"
