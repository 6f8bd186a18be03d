"""Build C++ CPU kernels once per process, with one switch to turn them all off.

The engine's CPU kernels (decode attention in the core, GGML block matmuls in
the GGUF plugin, ...) are compiled on first use from their files in a ``csrc``
folder of their distribution with ``torch.utils.cpp_extension.load``
(:func:`load_cpu_extension_from_files`). A C++ compiler and ninja are needed
(ninja comes with the core's ``ninja`` dependency: its binary is put on
``PATH`` when no other is there, so an unactivated virtual environment or a
``pip install --target`` still builds), the first build takes about a minute
and torch caches it on disk
(``TORCH_EXTENSIONS_DIR``, else ``~/.cache/torch_extensions``). Wherever a
build is impossible the caller gets ``None`` (logged once) and uses its plain
torch path, which is also the reference every kernel is tested against. Set
``INFERENCE_ENGINE_CPU_KERNELS=0`` to never build any of them.

The name a kernel is built under ends in two short hashes: one of this CPU's
instruction-set flags (the kernels are built with ``-march=native``, so a
home folder shared by machines never loads an AVX-512 build on a CPU without
it) and one of the C++ itself, sources and the headers they include, and the
flags (torch's own check does not see headers, and a new hash means a new
build folder, so no version suffix is bumped by hand).

Each build is one compiler process on one core (most of it parsing torch's headers), so
:func:`build_cpu_extensions` builds a list of kernels side by side, one per core: the CPU
platform builds its kernels that way when an engine starts (:class:`CpuKernelBuild`), and
the test suite does the same for its kernel variants.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import re
import shutil
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "CPU_KERNELS_ENV", "CSRC_DIR", "DEFAULT_CFLAGS", "DEFAULT_LDFLAGS", "CpuKernelBuild",
    "build_cpu_extensions", "cpu_isa_flags", "cpu_kernels_enabled", "csrc_extension_name",
    "ensure_ninja_on_path",
    "extension_name", "isa_key", "load_cpu_extension_from_files", "load_cpu_kernel",
]

logger = logging.getLogger(__name__)

CPU_KERNELS_ENV = "INFERENCE_ENGINE_CPU_KERNELS"
# -fopenmp makes ``at::parallel_for`` in the kernel actually run on torch's
# threads (without it the OpenMP pragma in ATen's header is compiled out and
# the kernel runs on one thread); the ``libgomp.so.1`` it links is the one
# torch has already loaded.
DEFAULT_CFLAGS: tuple[str, ...] = ("-O3", "-march=native", "-fopenmp")
DEFAULT_LDFLAGS: tuple[str, ...] = ("-fopenmp",)

CSRC_DIR: Path = Path(__file__).resolve().parent / "csrc"
"""The core's kernel sources and shared headers (``ie_parallel_tasks.h``, ``ie_simd_helpers.h``):
pass it as an include path to build against them."""

# /proc/cpuinfo flags that decide what ``-march=native`` emits and which paths the kernels take.
_ISA_FLAGS = frozenset({
    # x86
    "sse4_1", "sse4_2", "avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "avx_vnni", "avx512f",
    "avx512dq", "avx512cd", "avx512bw", "avx512vl", "avx512ifma", "avx512vbmi", "avx512_vbmi2",
    "avx512_vnni", "avx512_bitalg", "avx512_vpopcntdq", "avx512_bf16", "avx512_fp16",
    "amx_tile", "amx_bf16", "amx_int8", "amx_fp16",
    # arm64 (the "Features" line)
    "asimd", "asimdhp", "asimddp", "fphp", "sve", "sve2", "bf16", "i8mm", "sme",
})
_INCLUDE = re.compile(r'^\s*#\s*include\s*"([^"]+)"', re.M)

_LOCK = threading.Lock()  # guards _BUILD_LOCKS
_BUILD_LOCKS: dict[str, threading.Lock] = {}  # one per built name: others build meanwhile
_MODULES: dict[str, Any] = {}
_NAMES: dict[tuple[Any, ...], str] = {}  # (stem, sources, cflags, dirs) -> built name
_MISSING: set[str] = set()  # stems whose files could not be read (logged once)


def cpu_kernels_enabled() -> bool:
    """False when the user turned the C++ kernels off."""
    return os.environ.get(CPU_KERNELS_ENV, "1") != "0"


def _short_hash(*parts: str | bytes) -> str:
    digest = hashlib.sha256()
    for part in parts:
        digest.update(part if isinstance(part, bytes) else part.encode())
        digest.update(b"\0")
    return digest.hexdigest()[:10]


@functools.lru_cache(maxsize=1)
def cpu_isa_flags() -> tuple[str, ...]:
    """This CPU's flags as ``/proc/cpuinfo`` spells them (empty where it cannot be read)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ()
    match = re.search(r"^(?:flags|Features)\s*:(.*)$", text, re.M)
    return tuple(match.group(1).split()) if match else ()


def isa_key(flags: Sequence[str] | None = None) -> str:
    """A short hash of the machine's architecture and its instruction-set flags.

    Args:
        flags: CPU flags as ``/proc/cpuinfo`` spells them; None reads this CPU's. Only
            those that change what ``-march=native`` emits count (not ``hypervisor``...).
    """
    if flags is None:
        flags = cpu_isa_flags()
    return _short_hash(platform.machine(), " ".join(sorted(_ISA_FLAGS.intersection(flags))))


def torch_build_tag() -> str:
    """The torch version and Python ABI a C++ extension is built for (part of its name)."""
    import sys

    import torch

    abi = torch.compiled_with_cxx11_abi()
    return f"torch {torch.__version__} cxx11abi={abi} {sys.implementation.cache_tag}"


def _included_files(sources: Sequence[Path], include_dirs: Sequence[Path]) -> list[Path]:
    """The sources and every header they reach with ``#include "..."`` found in their own
    folder or ``include_dirs``, each once, in a stable order."""
    seen: dict[Path, None] = {}
    pending = list(sources)
    while pending:
        path = pending.pop(0).resolve()
        if path in seen:
            continue
        seen[path] = None
        for header in _INCLUDE.findall(path.read_text()):
            for folder in (path.parent, *include_dirs):
                candidate = Path(folder) / header
                if candidate.is_file():
                    pending.append(candidate)
                    break
    return list(seen)


def extension_name(
    stem: str,
    sources: Sequence[str | os.PathLike[str]],
    *,
    include_dirs: Sequence[str | os.PathLike[str]] = (),
    extra_cflags: Sequence[str] = (),
    flags: Sequence[str] | None = None,
) -> str:
    """``{stem}_{isa}_{content}``: the name the sources are built and cached under.

    Args:
        stem: the kernel's name (``inference_engine_cpu_decode``).
        sources: the ``.cpp`` files.
        include_dirs: folders searched for ``#include "..."`` headers (after each source's own).
        extra_cflags: flags beyond :data:`DEFAULT_CFLAGS`; part of the content hash.
        flags: CPU flags for :func:`isa_key` (None: this machine's).

    Returns:
        A name that changes when a source, a header it includes, the folder they are in,
        the flags, the torch version or the CPU's instruction set change.
    """
    files = _included_files([Path(s) for s in sources], [Path(d) for d in include_dirs])
    # The torch and Python it is built against: a build links one torch's C++ ABI, and a cache
    # folder shared by environments with different torches must not hand one's build to another.
    parts: list[str | bytes] = [torch_build_tag(), *DEFAULT_CFLAGS, *extra_cflags]
    for path in files:
        # The absolute path too: torch's build folder (named after the extension) holds a
        # build.ninja naming the sources by path, so two checkouts with the same bytes under
        # one name would each rewrite it and rebuild in turn (minutes each, seen with copies
        # of this tree in /tmp), and every other process waits on the build lock meanwhile.
        parts += [str(path), path.read_bytes()]
    return f"{stem}_{isa_key(flags)}_{_short_hash(*parts)}"


def csrc_extension_name(
    stem: str,
    sources: Sequence[str | os.PathLike[str]],
    *,
    extra_cflags: Sequence[str] = (),
    include_dirs: Sequence[str | os.PathLike[str]] = (),
) -> str:
    """:func:`extension_name` of sources in :data:`CSRC_DIR` (or paths), with headers found
    there and in ``include_dirs``; computed once per process for each set of arguments.

    Raises:
        OSError: a source or header cannot be read.
    """
    key = (stem, tuple(map(str, sources)), tuple(extra_cflags), tuple(map(str, include_dirs)))
    name = _NAMES.get(key)
    if name is None:
        name = extension_name(stem, [CSRC_DIR / s for s in sources],
                              include_dirs=[CSRC_DIR, *map(Path, include_dirs)],
                              extra_cflags=extra_cflags)
        _NAMES[key] = name
    return name


def ensure_ninja_on_path() -> str | None:
    """The ``ninja`` torch's builder will run, putting the ``ninja`` package's binary on ``PATH``
    when none is there.

    torch looks for ninja on ``PATH`` only; the ``ninja`` wheel installs its binary inside the
    package and a launcher in the environment's ``bin``, which is not on ``PATH`` when the
    environment's Python is run without activating it (``.venv/bin/python``, ``pip install
    --target``). Returns the path found, or None (then the build fails and says so).
    """
    found = shutil.which("ninja")
    if found is not None:
        return found
    try:
        import ninja  # the PyPI package: a binary under ninja.BIN_DIR
    except ImportError:
        return None
    bin_dir = getattr(ninja, "BIN_DIR", None)
    if not bin_dir or not (Path(bin_dir) / "ninja").is_file():
        return None
    os.environ["PATH"] = os.pathsep.join([bin_dir, os.environ.get("PATH", "")])
    return shutil.which("ninja")


def _build(name: str, description: str, build: Any) -> Any | None:
    """``_MODULES[name]``, built with ``build()`` the first time (None when off or failing)."""
    if name in _MODULES:
        return _MODULES[name]
    with _LOCK:
        lock = _BUILD_LOCKS.setdefault(name, threading.Lock())
    with lock:
        if name in _MODULES:
            return _MODULES[name]
        module = None
        if cpu_kernels_enabled():
            try:
                logger.info("building %s (first use only)", description)
                if ensure_ninja_on_path() is None:
                    raise RuntimeError("ninja was not found on PATH nor as the 'ninja' package "
                                       "(pip install ninja)")
                module = build()
            except Exception as exc:  # no compiler, no ninja, no headers: the torch path
                logger.warning("%s unavailable, using the torch path: %s", description, exc)
        _MODULES[name] = module
        return module


def load_cpu_extension_from_files(
    stem: str,
    sources: Sequence[str | os.PathLike[str]],
    *,
    description: str,
    extra_cflags: tuple[str, ...] = (),
    include_dirs: Sequence[str | os.PathLike[str]] = (),
) -> Any | None:
    """The module built from ``.cpp`` files (each with its own ``PYBIND11_MODULE``), or None.

    Args:
        stem: the kernel's name; it is built as :func:`extension_name`.
        sources: file names in :data:`CSRC_DIR`, or paths.
        description: names the kernel in the log lines.
        extra_cflags: flags beyond :data:`DEFAULT_CFLAGS`.
        include_dirs: header folders besides :data:`CSRC_DIR`.

    Thread-safe; each name is built at most once per process, and the sources are
    hashed once per process (:func:`csrc_extension_name`).
    """
    try:
        name = csrc_extension_name(stem, sources, extra_cflags=extra_cflags,
                                   include_dirs=include_dirs)
    except OSError as exc:  # an install without the .cpp files
        if stem not in _MISSING:
            _MISSING.add(stem)
            logger.warning("%s unavailable, using the torch path: %s", description, exc)
        return None
    if name in _MODULES:
        return _MODULES[name]

    def build() -> Any:
        from torch.utils.cpp_extension import load

        return load(
            name=name,
            sources=[str(CSRC_DIR / s) for s in sources],
            extra_cflags=[*DEFAULT_CFLAGS, *extra_cflags],
            extra_ldflags=list(DEFAULT_LDFLAGS),
            extra_include_paths=[str(CSRC_DIR), *map(str, include_dirs)],
            verbose=False,
        )

    return _build(name, description, build)


@dataclass(frozen=True)
class CpuKernelBuild:
    """One kernel's build: the arguments of :func:`load_cpu_extension_from_files`."""

    stem: str
    sources: tuple[str, ...]
    description: str
    extra_cflags: tuple[str, ...] = ()


def load_cpu_kernel(build: CpuKernelBuild) -> Any | None:
    """:func:`load_cpu_extension_from_files` of one :class:`CpuKernelBuild`."""
    return load_cpu_extension_from_files(build.stem, list(build.sources),
                                         description=build.description,
                                         extra_cflags=build.extra_cflags)


def build_cpu_extensions(builds: Sequence[CpuKernelBuild], jobs: int | None = None) -> float:
    """Build (or load from the cache) every kernel of ``builds``, ``jobs`` at a time.

    A compiler process uses one core, so building one kernel after another leaves the
    others idle (the core's six kernels took 205 s one after another on a 2-core machine,
    109 s side by side). Afterwards each loader finds its module built: the same name is
    never built twice, and a loader that asks while its kernel is being built waits for
    that build.

    Args:
        builds: the kernels.
        jobs: builds at a time; None: one per core this process may use.

    Returns:
        The seconds it took (0.0 when the kernels are turned off).
    """
    if not cpu_kernels_enabled() or not builds:
        return 0.0
    if jobs is None:
        jobs = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (
            os.cpu_count() or 1)
    start = time.perf_counter()

    with ThreadPoolExecutor(max_workers=max(1, min(jobs, len(builds))),
                            thread_name_prefix="ie-kernel-build") as pool:
        list(pool.map(load_cpu_kernel, builds))
    return time.perf_counter() - start
