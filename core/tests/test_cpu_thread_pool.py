"""The kernels' spinning thread pool: every task runs exactly once, from any state."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from inference_engine import cpu_thread_pool


@pytest.fixture(scope="module")
def pool():
    module = cpu_thread_pool.thread_pool()
    if module is None:
        pytest.skip("no C++ compiler: the kernels use ATen's threads")
    return module


def test_every_task_runs_once_across_many_jobs(pool):
    gen = torch.Generator().manual_seed(0)
    for _ in range(300):
        n = int(torch.randint(0, 300, (1,), generator=gen))
        counts = torch.zeros(n, dtype=torch.int64)
        pool.count_tasks(counts)
        assert torch.equal(counts, torch.ones(n, dtype=torch.int64))


def test_workers_take_part(pool):
    if torch.get_num_threads() < 2:
        pytest.skip("one thread: no workers")
    assert pool.num_workers() == torch.get_num_threads() - 1
    threads = max(pool.count_tasks(torch.zeros(4000, dtype=torch.int64)) for _ in range(20))
    assert threads >= 2


def test_sleeping_workers_wake_for_the_next_job(pool):
    import time

    time.sleep(0.05)  # far past the spin time: the workers are asleep
    counts = torch.zeros(500, dtype=torch.int64)
    pool.count_tasks(counts)
    assert torch.equal(counts, torch.ones(500, dtype=torch.int64))


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_runs_every_task_itself(pool):
    """The workers do not survive fork; the child's caller runs the jobs alone."""
    code = (
        "import os, torch\n"
        "from inference_engine import cpu_thread_pool\n"
        "pool = cpu_thread_pool.thread_pool()\n"
        "pool.count_tasks(torch.zeros(10, dtype=torch.int64))\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    c = torch.zeros(1000, dtype=torch.int64)\n"
        "    threads = pool.count_tasks(c)\n"
        "    os._exit(0 if bool((c == 1).all()) and threads == 1 else 3)\n"
        "_, status = os.waitpid(pid, 0)\n"
        "raise SystemExit(os.waitstatus_to_exitcode(status))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_pool_only_under_passive_openmp(monkeypatch):
    monkeypatch.setenv("OMP_WAIT_POLICY", "passive")
    monkeypatch.delenv(cpu_thread_pool.SPIN_ENV, raising=False)
    assert cpu_thread_pool.pool_wanted()
    monkeypatch.setenv(cpu_thread_pool.SPIN_ENV, "0")
    assert not cpu_thread_pool.pool_wanted()
    monkeypatch.delenv(cpu_thread_pool.SPIN_ENV)
    monkeypatch.delenv("OMP_WAIT_POLICY")
    assert not cpu_thread_pool.pool_wanted()
    assert cpu_thread_pool.parallel_runner_address() == 0


# ---- How the kernels are named and built (inference_engine.cpu_extensions).


def _kernel_files(tmp_path):
    (tmp_path / "inner.h").write_text("inline int inner() { return 1; }\n")
    (tmp_path / "outer.h").write_text(
        '#include "inner.h"\ninline int outer() { return inner(); }\n')
    source = tmp_path / "kernel.cpp"
    source.write_text('#include <vector>\n#include "outer.h"\nint f() { return outer(); }\n')
    return source


def test_extension_name_changes_when_an_included_header_changes(tmp_path):
    from inference_engine.cpu_extensions import extension_name

    source = _kernel_files(tmp_path)
    first = extension_name("ie_test", [source])
    assert extension_name("ie_test", [source]) == first
    (tmp_path / "inner.h").write_text("inline int inner() { return 2; }\n")  # two includes deep
    second = extension_name("ie_test", [source])
    assert second != first
    (tmp_path / "outer.h").write_text('#include "inner.h"\ninline int outer() { return 3; }\n')
    assert extension_name("ie_test", [source]) not in (first, second)


def test_extension_name_changes_with_the_torch_it_is_built_against(tmp_path, monkeypatch):
    """Environments with different torches sharing a cache folder build apart."""
    from inference_engine import cpu_extensions

    source = tmp_path / "k.cpp"
    source.write_text("int f() { return 1; }\n")
    first = cpu_extensions.extension_name("ie_test", [source])
    monkeypatch.setattr(torch, "__version__", "2.11.0+cu130")
    assert cpu_extensions.extension_name("ie_test", [source]) != first


def test_extension_name_differs_between_checkouts_of_the_same_sources(tmp_path):
    """Copies of one tree build under their own names: torch's build folder is named after
    the extension and its build.ninja names the sources by path, so sharing a name made two
    checkouts rebuild in turn."""
    from inference_engine.cpu_extensions import extension_name

    names = []
    for checkout in ("a", "b"):
        (tmp_path / checkout).mkdir()
        source = _kernel_files(tmp_path / checkout)
        names.append(extension_name("ie_test", [source]))
    assert names[0] != names[1]


def test_extension_name_finds_headers_on_the_include_path(tmp_path):
    from inference_engine.cpu_extensions import extension_name

    (tmp_path / "src").mkdir()
    (tmp_path / "inc").mkdir()
    source = tmp_path / "src" / "kernel.cpp"
    source.write_text('#include "shared.h"\n')
    (tmp_path / "inc" / "shared.h").write_text("// one\n")
    first = extension_name("ie_test", [source], include_dirs=[tmp_path / "inc"])
    (tmp_path / "inc" / "shared.h").write_text("// two\n")
    assert extension_name("ie_test", [source], include_dirs=[tmp_path / "inc"]) != first


def test_extension_name_carries_the_isa_key_and_the_flags(tmp_path):
    from inference_engine.cpu_extensions import extension_name, isa_key

    source = _kernel_files(tmp_path)
    name = extension_name("ie_test", [source])
    assert name.startswith("ie_test_") and isa_key() in name
    avx2 = extension_name("ie_test", [source], flags=["avx2", "fma"])
    avx512 = extension_name("ie_test", [source], flags=["avx2", "fma", "avx512f"])
    assert isa_key(["avx2", "fma"]) in avx2 and isa_key(["avx2", "fma", "avx512f"]) in avx512
    assert avx2 != avx512
    assert avx2.split("_")[-1] == avx512.split("_")[-1]  # same C++: same content hash
    assert isa_key(["fma", "avx2"]) == isa_key(["avx2", "fma"])
    assert extension_name("ie_test", [source], extra_cflags=("-ffast-math",)) != name


def test_isa_key_ignores_flags_that_do_not_change_the_code(monkeypatch):
    from inference_engine import cpu_extensions

    assert cpu_extensions.isa_key(["avx2", "hypervisor", "constant_tsc"]) == (
        cpu_extensions.isa_key(["avx2"]))
    assert cpu_extensions.isa_key(["avx2", "avx512_bf16"]) != cpu_extensions.isa_key(["avx2"])
    assert cpu_extensions.isa_key(["avx2", "amx_tile"]) != cpu_extensions.isa_key(["avx2"])
    monkeypatch.setattr(cpu_extensions, "cpu_isa_flags", lambda: ("avx2", "hypervisor"))
    assert cpu_extensions.isa_key() == cpu_extensions.isa_key(["avx2"])


def test_core_kernel_sources_ship_with_the_package():
    from inference_engine.cpu_extensions import CSRC_DIR, csrc_extension_name

    for source in ("cpu_thread_pool.cpp", "cpu_decode_attention.cpp", "cpu_prefill_attention.cpp",
                   "cpu_gemv.cpp", "cpu_fused.cpp"):
        assert (CSRC_DIR / source).is_file()
        assert csrc_extension_name("ie_test", [source])
    # Shared helpers are headers the sources include, not text spliced into them.
    assert "online_softmax_step" in (CSRC_DIR / "ie_simd_helpers.h").read_text()
    assert "parallel_tasks" in (CSRC_DIR / "ie_parallel_tasks.h").read_text()
    assert '#include "ie_simd_helpers.h"' in (CSRC_DIR / "cpu_decode_attention.cpp").read_text()


def test_ninja_from_the_package_is_put_on_path(monkeypatch):
    """Without ninja on PATH (an unactivated venv, pip --target), the builder still finds the
    binary the ``ninja`` package ships (the GPU machine's image has no ninja of its own)."""
    ninja = pytest.importorskip("ninja")
    from inference_engine import cpu_extensions

    monkeypatch.setenv("PATH", "/nonexistent")
    found = cpu_extensions.ensure_ninja_on_path()
    assert found is not None and Path(found).parent == Path(ninja.BIN_DIR)
    assert os.environ["PATH"].split(os.pathsep)[0] == ninja.BIN_DIR
    assert subprocess.run([found, "--version"], capture_output=True).returncode == 0


def test_switched_off_kernels_are_never_built(monkeypatch):
    from inference_engine import cpu_extensions
    from inference_engine.builtin.attention import cpu_decode_kernel

    monkeypatch.setenv(cpu_extensions.CPU_KERNELS_ENV, "0")
    monkeypatch.setattr(cpu_extensions, "_MODULES", {})
    assert cpu_decode_kernel.decode_kernel() is None
    assert cpu_extensions.load_cpu_extension_from_files(
        "ie_test", ["cpu_fused.cpp"], description="a test kernel") is None


def test_importing_the_kernel_modules_builds_nothing():
    code = (
        "import inference_engine\n"
        "from inference_engine import cpu_extensions, cpu_thread_pool\n"
        "from inference_engine.builtin.attention import cpu_decode_kernel, cpu_prefill_kernel\n"
        "from inference_engine.layers import cpu_fused, cpu_gemv\n"
        "assert not cpu_extensions._MODULES and not cpu_extensions._NAMES\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_kernels_build_side_by_side_and_each_name_once(monkeypatch):
    """build_cpu_extensions runs one compiler per job at once (torch's ``load`` stands in
    for the compiler here: it sleeps), and a loader asking for a kernel being built waits
    for that build instead of starting another."""
    import threading
    import time

    import torch.utils.cpp_extension
    from inference_engine import cpu_extensions
    from inference_engine.cpu_extensions import CpuKernelBuild, build_cpu_extensions

    monkeypatch.setattr(cpu_extensions, "_MODULES", {})
    monkeypatch.setattr(cpu_extensions, "_BUILD_LOCKS", {})
    monkeypatch.setattr(cpu_extensions, "ensure_ninja_on_path", lambda: "ninja")
    lock, running, peak, built = threading.Lock(), [0], [0], []

    def compile_slowly(name, **kwargs):
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        time.sleep(0.3)
        with lock:
            running[0] -= 1
            built.append(name)
        return object()

    monkeypatch.setattr(torch.utils.cpp_extension, "load", compile_slowly)
    builds = [CpuKernelBuild(f"ie_side_by_side_{i}", ("cpu_fused.cpp",), f"kernel {i}",
                             (f"-DIE_TEST_VARIANT={i}",)) for i in range(4)]
    waiter = threading.Thread(target=lambda: time.sleep(0.1) or build_cpu_extensions(builds[:1]))
    waiter.start()
    assert build_cpu_extensions(builds, jobs=2) > 0.5  # 4 builds of 0.3 s, 2 at a time
    waiter.join()
    assert peak[0] == 2
    assert sorted(built) == sorted(
        cpu_extensions.csrc_extension_name(b.stem, b.sources, extra_cflags=b.extra_cflags)
        for b in builds)  # each once, the waiter's included
    module = cpu_extensions.load_cpu_extension_from_files(
        builds[0].stem, list(builds[0].sources), description="again",
        extra_cflags=builds[0].extra_cflags)
    assert module is not None and len(built) == 4


def test_the_cpu_platform_lists_every_core_kernel(pool):
    from inference_engine import cpu_extensions
    from inference_engine.builtin.platforms.cpu import CpuPlatform, cpu_kernel_builds
    from inference_engine.cpu_extensions import CSRC_DIR, csrc_extension_name

    builds = cpu_kernel_builds()
    assert {s for b in builds for s in b.sources} == {p.name for p in CSRC_DIR.glob("*.cpp")}
    CpuPlatform().build_kernels()  # built, or loaded from the cache
    names = [csrc_extension_name(b.stem, list(b.sources), extra_cflags=b.extra_cflags)
             for b in builds]
    missing = [n for n in names if cpu_extensions._MODULES.get(n) is None]
    assert not missing, f"build_kernels() left these unbuilt: {missing}"
