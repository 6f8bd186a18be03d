"""Which checkpoint modules stand behind one of our layers, and ignore-list matching.

Quantized checkpoints name modules as the checkpoint has them (``q_proj``) while our
layers may fuse several (``qkv_proj``); every quant method matches its ignore lists
(``ignore``, ``modules_to_not_convert``, ``exclude_modules``) through these.
"""

from __future__ import annotations

import fnmatch

from inference_engine.layers.weights import STACKED_PARAMS

__all__ = ["checkpoint_module_names", "is_ignored"]


def checkpoint_module_names(prefix: str) -> list[str]:
    """Checkpoint module names behind one of our layers (``qkv_proj`` -> q/k/v_proj)."""
    parent, _, leaf = prefix.rpartition(".")
    parts = [ckpt for ckpt, (fused, _) in STACKED_PARAMS.items() if fused == leaf]
    if not parts:
        return [prefix]
    return [f"{parent}.{p}" if parent else p for p in parts]


def is_ignored(prefix: str, patterns: list[str]) -> bool:
    """Whether any checkpoint module of ``prefix`` matches an ignore pattern."""
    for name in checkpoint_module_names(prefix) + [prefix]:
        for pattern in patterns:
            if pattern.startswith("re:"):
                import re

                if re.match(pattern[3:], name):
                    return True
            elif name == pattern or fnmatch.fnmatchcase(name, pattern) or pattern in name:
                return True
    return False
