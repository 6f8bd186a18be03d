"""Checkpoint weight formats: where config, tensors and tokenizer come from."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["WeightFormat"]


class WeightFormat(ABC):
    """Reads one checkpoint. Formats are chosen by ``ie_detect_weight_format``."""

    def __init__(self, path: str) -> None:
        self.path = path

    @abstractmethod
    def load_config(self) -> dict[str, Any]:
        """The model's Hugging Face style ``config.json`` dict."""

    @abstractmethod
    def tensor_names(self) -> list[str]:
        """Every tensor name in the checkpoint, in file order."""

    @abstractmethod
    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``(name, tensor)`` pairs, one tensor in memory at a time."""

    def load_tokenizer(self) -> Any | None:
        """A tokenizer built from the checkpoint itself, or None to use AutoTokenizer."""
        return None

    def generation_config(self) -> dict[str, Any]:
        """``generation_config.json`` contents (eos ids), or an empty dict."""
        return {}
