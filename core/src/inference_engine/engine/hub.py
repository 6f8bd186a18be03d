"""A Hugging Face model id (``org/name``) as a local folder, through ``huggingface_hub``.

As vLLM: ``serve Qwen/Qwen3-0.6B`` downloads the checkpoint into the Hub cache (or, with
``HF_HUB_OFFLINE=1``, finds it there) and loads that folder.
"""

from __future__ import annotations

import os

__all__ = ["resolve_model_path"]

# The files a checkpoint folder needs: config, weights, tokenizer, chat template, and the
# code a trusted config may ship (never the duplicate *.bin / *.pt weights).
_CHECKPOINT_FILES = ["*.json", "*.safetensors", "*.jinja", "*.model", "*.txt", "*.tiktoken",
                     "*.py"]


def looks_like_hub_id(model: str) -> bool:
    """``org/name`` that is no local path (a missing relative path may look like one)."""
    if os.path.exists(model) or model.startswith(("/", ".", "~")) or model.count("/") != 1:
        return False
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(model)
    except HFValidationError:
        return False
    return True


def resolve_model_path(model: str) -> str:
    """``model`` itself when it is not a Hub id, else the local snapshot folder of that id.

    Raises:
        ValueError: the id is not in the cache (offline) or cannot be fetched; the message
            names the id and the cause.
    """
    if not looks_like_hub_id(model):
        return model
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(model, allow_patterns=_CHECKPOINT_FILES)
    except Exception as exc:  # offline cache miss, unknown repo, network, gated repo
        raise ValueError(f"{model!r} is no local path, and fetching it as a Hugging Face model "
                         f"id failed ({type(exc).__name__}: {exc}); with HF_HUB_OFFLINE=1 it "
                         f"must already be in the Hub cache (HF_HUB_CACHE / HF_HOME)") from None
