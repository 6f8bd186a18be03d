"""Build C++ CPU kernels once per process, with one switch to turn them all off.

The engine's CPU kernels (decode attention in the core, GGML block matmuls in
the GGUF plugin, ...) are compiled on first use with
``torch.utils.cpp_extension.load_inline``: a C++ compiler and ninja are needed,
the first build takes about a minute and torch caches it on disk. Wherever a
build is impossible the caller gets ``None`` (logged once) and uses its plain
torch path, which is also the reference every kernel is tested against. Set
``INFERENCE_ENGINE_CPU_KERNELS=0`` to never build any of them.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

__all__ = [
    "CPU_KERNELS_ENV", "DEFAULT_CFLAGS", "DEFAULT_LDFLAGS", "cpu_kernels_enabled",
    "load_cpu_extension",
]

logger = logging.getLogger(__name__)

CPU_KERNELS_ENV = "INFERENCE_ENGINE_CPU_KERNELS"
# -fopenmp makes ``at::parallel_for`` in the kernel actually run on torch's
# threads (without it the OpenMP pragma in ATen's header is compiled out and
# the kernel runs on one thread); the ``libgomp.so.1`` it links is the one
# torch has already loaded.
DEFAULT_CFLAGS: tuple[str, ...] = ("-O3", "-march=native", "-fopenmp")
DEFAULT_LDFLAGS: tuple[str, ...] = ("-fopenmp",)

_LOCK = threading.Lock()
_MODULES: dict[str, Any] = {}


def cpu_kernels_enabled() -> bool:
    """False when the user turned the C++ kernels off."""
    return os.environ.get(CPU_KERNELS_ENV, "1") != "0"


def load_cpu_extension(
    name: str,
    source: str,
    functions: list[str],
    *,
    description: str,
    extra_cflags: tuple[str, ...] = (),
) -> Any | None:
    """The compiled module ``name`` (bump its version suffix when ``source`` changes), or None.

    ``description`` names the kernel in the log lines ("the CPU paged-decode
    attention kernel"). Thread-safe; each name is built at most once per process.
    """
    if name in _MODULES:
        return _MODULES[name]
    with _LOCK:
        if name in _MODULES:
            return _MODULES[name]
        module = None
        if cpu_kernels_enabled():
            try:
                from torch.utils.cpp_extension import load_inline

                logger.info("building %s (first use only)", description)
                module = load_inline(
                    name=name,
                    cpp_sources=[source],
                    functions=functions,
                    extra_cflags=[*DEFAULT_CFLAGS, *extra_cflags],
                    extra_ldflags=list(DEFAULT_LDFLAGS),
                    verbose=False,
                )
            except Exception as exc:  # no compiler, no ninja, no headers: the torch path
                logger.warning("%s unavailable, using the torch path: %s", description, exc)
        _MODULES[name] = module
        return module
