"""Hugging Face checkpoint folders: config.json plus single or sharded safetensors."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import torch
from safetensors import safe_open

from inference_engine.interfaces.weight_format import WeightFormat

__all__ = ["CheckpointError", "SafetensorsFormat"]

INDEX_NAME = "model.safetensors.index.json"


class CheckpointError(ValueError):
    """A checkpoint folder is missing files or is inconsistent."""


class SafetensorsFormat(WeightFormat):
    """Reads tensors lazily, one at a time, in file order."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        if not os.path.isdir(path):
            raise CheckpointError(f"model path {path!r} is not a directory")
        self._files = self._shard_files()

    def _shard_files(self) -> list[str]:
        index = os.path.join(self.path, INDEX_NAME)
        if os.path.exists(index):
            with open(index) as f:
                weight_map = json.load(f).get("weight_map", {})
            files = sorted(set(weight_map.values()))
            missing = [n for n in files if not os.path.exists(os.path.join(self.path, n))]
            if missing:
                raise CheckpointError(
                    f"{INDEX_NAME} in {self.path} names shard files that do not exist: {missing}"
                )
        else:
            files = sorted(n for n in os.listdir(self.path) if n.endswith(".safetensors"))
        if not files:
            raise CheckpointError(f"no .safetensors files in {self.path}")
        return [os.path.join(self.path, n) for n in files]

    def load_config(self) -> dict[str, Any]:
        config_path = os.path.join(self.path, "config.json")
        if not os.path.exists(config_path):
            raise CheckpointError(f"{self.path} has no config.json")
        with open(config_path) as f:
            try:
                return json.load(f)
            except json.JSONDecodeError as exc:
                raise CheckpointError(f"{config_path} is not valid JSON: {exc}") from exc

    def tensor_names(self) -> list[str]:
        names: list[str] = []
        for file in self._files:
            with safe_open(file, framework="pt") as f:
                names.extend(f.keys())
        return names

    def num_bytes(self) -> int:
        return sum(os.path.getsize(f) for f in self._files)

    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        for file in self._files:
            try:
                handle = safe_open(file, framework="pt")
            except Exception as exc:  # safetensors raises its own error types
                raise CheckpointError(f"cannot read {file}: {exc}") from exc
            with handle as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)

    def generation_config(self) -> dict[str, Any]:
        path = os.path.join(self.path, "generation_config.json")
        if not os.path.exists(path):
            return {}
        with open(path) as f:
            return json.load(f)
