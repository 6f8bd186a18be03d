"""The kernels' spinning thread pool: every task runs exactly once, from any state."""

from __future__ import annotations

import os
import subprocess
import sys

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
