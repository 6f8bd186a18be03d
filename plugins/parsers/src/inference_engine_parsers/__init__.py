"""Streaming tool-call and reasoning parsers for inference-engine."""

__version__ = "0.1.0"
