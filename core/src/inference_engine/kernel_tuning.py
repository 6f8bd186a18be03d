"""Launch configurations for tunable kernels: plugin hook, then platform, then the kernel's default.

Kernels (fused MoE, FP8 GEMM, ...) call :func:`tuning_config` once per distinct
problem shape. The answer comes from the first plugin answering
``ie_kernel_tuning_config`` (e.g. the ROCm plugin's shipped gfx942/gfx950
tables), else the platform's ``kernel_tuning_default``, else the kernel's own
``default``. Partial answers are laid over ``default`` so a kernel always gets
every key it asked for. Answers are cached per (op, platform, shape).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from inference_engine.interfaces.platform import Platform

__all__ = ["clear_tuning_cache", "tuning_config"]

logger = logging.getLogger(__name__)

_CacheKey = tuple[str, str, str, tuple[tuple[str, int], ...]]
_CACHE: dict[_CacheKey, dict[str, Any]] = {}


def _frozen(shape: dict[str, int]) -> tuple[tuple[str, int], ...]:
    return tuple(sorted((str(k), int(v)) for k, v in shape.items()))


def tuning_config(
    op_name: str,
    shape: dict[str, int],
    default: dict[str, Any],
    platform: Platform | None = None,
) -> dict[str, Any]:
    """The launch parameters for ``op_name`` on ``shape``.

    Args:
        op_name: ``"fused_moe"``, ``"fp8_gemm"``, ``"fp8_block_gemm"``, ...
        shape: problem size; keys per op are listed in the hook's docs
            (``{"M", "N", "K"}``, plus ``"E"`` and ``"topk"`` for fused MoE).
        default: the kernel's own configuration; also fills keys an answer omits.
        platform: the platform to tune for; None: the process's current one.

    Returns:
        A fresh dict (callers may modify it) with every key of ``default``.
    """
    if platform is None:
        from inference_engine.platforms.selection import current_platform

        platform = current_platform()
    key = (op_name, platform.name, platform.arch_name(), _frozen(shape))
    cached = _CACHE.get(key)
    if cached is None:
        cached = {**default, **_answer(op_name, shape, platform)}
        _CACHE[key] = cached
    return dict(cached)


def _answer(op_name: str, shape: dict[str, int], platform: Platform) -> dict[str, Any]:
    from inference_engine.plugins import get_plugins

    try:
        answer = get_plugins().hook.ie_kernel_tuning_config(
            op_name=op_name, platform=platform, shape=dict(shape)
        )
    except Exception as exc:  # noqa: BLE001 - a broken tuning plugin must not stop a kernel
        logger.warning("ie_kernel_tuning_config failed for %s %s: %s", op_name, shape, exc)
        answer = None
    if answer is None:
        answer = platform.kernel_tuning_default(op_name, dict(shape))
    return dict(answer or {})


def clear_tuning_cache() -> None:
    """Forget cached answers (tests; after plugins or platform change)."""
    _CACHE.clear()
