"""Worker threads that spin between kernel calls, shared by the C++ CPU kernels.

A decode step calls a C++ kernel dozens of times with a few microseconds of
Python in between. With ``OMP_WAIT_POLICY=PASSIVE`` (the setting to share a
machine politely) torch's OpenMP threads go to sleep after every parallel
region, and waking them costs tens of microseconds per call, more in a
virtual machine (timings in ``docs/benchmarks.md``, "CPU kernel timings").
Under that policy (:func:`pool_wanted`) these workers spin for a short while
(``INFERENCE_ENGINE_CPU_SPIN_US``, default 200 microseconds) after each job
before they sleep, so back-to-back kernel calls find them awake; when the
engine is idle they sleep and cost nothing.

The calling thread always takes tasks too: a worker that is asleep or
descheduled delays nothing, and a process with no workers (after ``fork``)
still finishes every job, on one thread. Kernels receive the pool as the
address of a C function (:func:`parallel_runner_address`), since each kernel
is its own shared library. The pool is ``csrc/cpu_thread_pool.cpp``; kernels
reach it through ``csrc/ie_parallel_tasks.h``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from inference_engine import cpu_extensions
from inference_engine.cpu_extensions import (
    CpuKernelBuild,
    csrc_extension_name,
    load_cpu_extension_from_files,
    load_cpu_kernel,
)

__all__ = ["POOL_BUILD", "SPIN_ENV", "kernel_runner", "load_pooled_build", "load_pooled_sources",
           "parallel_runner_address", "pool_wanted", "thread_pool"]

SPIN_ENV = "INFERENCE_ENGINE_CPU_SPIN_US"

_STARTED: dict[str, Any] = {}

POOL_BUILD = CpuKernelBuild("inference_engine_cpu_pool", ("cpu_thread_pool.cpp",),
                            "the CPU kernels' thread pool")


def thread_pool() -> Any | None:
    """The started pool module (``torch.get_num_threads() - 1`` workers), or None."""
    if "module" in _STARTED:
        return _STARTED["module"]
    module = load_cpu_kernel(POOL_BUILD)
    if module is not None and module.num_workers() == 0:
        spin_us = int(os.environ.get(SPIN_ENV, "200"))
        module.start(max(torch.get_num_threads() - 1, 0), spin_us)
    _STARTED["module"] = module
    return module


def pool_wanted() -> bool:
    """Whether the kernels should use this pool rather than torch's OpenMP threads.

    Only when OpenMP's threads sleep between regions (``OMP_WAIT_POLICY=PASSIVE``):
    with OpenMP's default or active waiting its threads already spin, and a
    second set of spinning threads would compete with them for the cores (slower
    at batch 1 on the development VM, see ``docs/benchmarks.md``).
    ``INFERENCE_ENGINE_CPU_SPIN_US=0`` turns the pool off.
    """
    if os.environ.get(SPIN_ENV, "") == "0":
        return False
    return os.environ.get("OMP_WAIT_POLICY", "").strip().upper() == "PASSIVE"


def parallel_runner_address() -> int:
    """Address of ``ie_parallel_run`` for kernels to call, or 0 (then they use ATen's)."""
    if not pool_wanted():
        return 0
    module = thread_pool()
    return 0 if module is None else int(module.runner_address())


_POOLED_FILES: dict[str, tuple[str, Any]] = {}  # stem -> (built name, module pointed at the pool)


def load_pooled_sources(stem: str, sources: list[str], *, description: str,
                        extra_cflags: tuple[str, ...] = ()) -> Any | None:
    """:func:`~inference_engine.cpu_extensions.load_cpu_extension_from_files` for a kernel whose
    sources include ``ie_parallel_tasks.h`` and export ``set_parallel_runner``: the built module
    is pointed at the pool (or at ATen's threads) once. Called on every kernel call: a built
    module is found with a few dict lookups."""
    entry = _POOLED_FILES.get(stem)
    if entry is not None and cpu_extensions._MODULES.get(entry[0]) is entry[1]:
        return entry[1]
    module = load_cpu_extension_from_files(stem, sources, description=description,
                                           extra_cflags=extra_cflags)
    if module is not None:
        module.set_parallel_runner(parallel_runner_address())
        _POOLED_FILES[stem] = (csrc_extension_name(stem, sources, extra_cflags=extra_cflags),
                               module)
    return module


def load_pooled_build(build: CpuKernelBuild) -> Any | None:
    """:func:`load_pooled_sources` of a :class:`~inference_engine.cpu_extensions.CpuKernelBuild`."""
    return load_pooled_sources(build.stem, list(build.sources), description=build.description,
                               extra_cflags=build.extra_cflags)


@contextmanager
def kernel_runner(module: Any, use_pool: bool) -> Iterator[None]:
    """Run ``module``'s tasks on this pool (or on ATen's threads) inside the block, whatever
    the environment chose, then restore that choice (tests and benchmarks compare both)."""
    pool = thread_pool() if use_pool else None
    if use_pool and pool is None:
        raise RuntimeError("the CPU kernels' thread pool is not available (see the log)")
    module.set_parallel_runner(int(pool.runner_address()) if pool is not None else 0)
    try:
        yield
    finally:
        module.set_parallel_runner(parallel_runner_address())
