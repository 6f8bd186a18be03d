"""Shared tiny checkpoints, built once per session in a temp dir (no network)."""

from __future__ import annotations

import pytest
import torch

from inference_engine.testing import make_tiny_model, train_tiny_tokenizer

torch.set_flush_denormal(True)


@pytest.fixture(scope="session")
def tiny_tokenizer():
    return train_tiny_tokenizer()


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory, tiny_tokenizer):
    """arch -> folder of a random fp32 model with the tiny tokenizer."""
    out = {}
    for arch in ("llama", "qwen2", "qwen3"):
        out[arch] = make_tiny_model(tmp_path_factory.mktemp(arch), arch, tokenizer=tiny_tokenizer)
    return out
