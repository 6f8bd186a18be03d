"""Worker threads that spin between kernel calls, shared by the C++ CPU kernels.

A decode step calls a C++ kernel dozens of times with a few microseconds of
Python in between. With ``OMP_WAIT_POLICY=PASSIVE`` (the setting to share a
machine politely) torch's OpenMP threads go to sleep after every parallel
region, and waking them costs tens of microseconds per call, more in a
virtual machine: measured on the 2-core development VM, the batch-1 decode
ran at 69 tok/s on two threads against 76 on one, and 121 with OpenMP's
spinning default. Under that policy (:func:`pool_wanted`) these workers spin for a short while
(``INFERENCE_ENGINE_CPU_SPIN_US``, default 200 microseconds) after each job
before they sleep, so back-to-back kernel calls find them awake; when the
engine is idle they sleep and cost nothing.

The calling thread always takes tasks too: a worker that is asleep or
descheduled delays nothing, and a process with no workers (after ``fork``)
still finishes every job, on one thread. Kernels receive the pool as the
address of a C function (:func:`parallel_runner_address`), since each kernel
is its own shared library.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from inference_engine import cpu_extensions
from inference_engine.cpu_extensions import load_cpu_extension

__all__ = ["PARALLEL_TASKS_CPP", "SPIN_ENV", "kernel_runner", "load_pooled_extension",
           "parallel_runner_address", "pool_wanted", "thread_pool"]

SPIN_ENV = "INFERENCE_ENGINE_CPU_SPIN_US"

PARALLEL_TASKS_CPP = r"""
// Run f(task) for every task in [0, ntasks): on inference_engine's spinning pool once
// set_parallel_runner() gave its address, else on ATen's threads.
typedef void (*ie_parallel_run_t)(void (*)(void*, int64_t), void*, int64_t);
static ie_parallel_run_t ie_runner = nullptr;
void set_parallel_runner(int64_t address) {
  ie_runner = reinterpret_cast<ie_parallel_run_t>(address);
}
template <class F>
void parallel_tasks(int64_t ntasks, const F& f) {
  if (ntasks <= 0) return;
  if (ie_runner != nullptr) {
    ie_runner([](void* c, int64_t t) { (*static_cast<const F*>(c))(t); },
              const_cast<void*>(static_cast<const void*>(&f)), ntasks);
  } else {
    at::parallel_for(0, ntasks, 1, [&](int64_t a, int64_t b) {
      for (int64_t t = a; t < b; ++t) f(t);
    });
  }
}
"""
"""C++ for a kernel's source (after ``#include <ATen/Parallel.h>``): ``parallel_tasks``
and the ``set_parallel_runner`` function to export and call with
:func:`parallel_runner_address`."""

_SOURCE = r"""
#include <torch/extension.h>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>
#include <unistd.h>
#ifdef __x86_64__
#include <immintrin.h>
#endif

namespace {
inline void relax() {
#ifdef __x86_64__
  _mm_pause();
#else
  std::this_thread::yield();
#endif
}

constexpr uint64_t CLOSED = 0xffffffffu;

// state = generation << 32 | next task index; index CLOSED while main rewrites the job.
struct Pool {
  std::atomic<uint64_t> state{CLOSED};
  std::atomic<void (*)(void*, int64_t)> fn{nullptr};
  std::atomic<void*> ctx{nullptr};
  std::atomic<int64_t> ntasks{0};
  std::atomic<int64_t> done{0};
  std::atomic<int> sleepers{0};
  std::atomic<bool> stop{false};
  std::mutex mutex;
  std::condition_variable wake;
  std::mutex run_mutex;  // one job at a time
  std::vector<std::thread> workers;
  int64_t spin_ns = 200000;
  pid_t owner = 0;
};

Pool* pool = nullptr;
thread_local bool in_job = false;  // a task that calls the pool again runs it inline

// Claim and run tasks of the job whose state was `seen`; false once it is over.
bool work(Pool& p, uint64_t seen) {
  const uint64_t gen = seen >> 32;
  for (;;) {
    const uint64_t index = seen & 0xffffffffu;
    if (index == CLOSED) return false;
    void (*fn)(void*, int64_t) = p.fn.load(std::memory_order_acquire);
    void* ctx = p.ctx.load(std::memory_order_acquire);
    const int64_t n = p.ntasks.load(std::memory_order_acquire);
    if ((int64_t)index >= n) return false;
    if (!p.state.compare_exchange_weak(seen, seen + 1, std::memory_order_acq_rel)) {
      if ((seen >> 32) != gen) return false;  // a newer job: the caller picks it up
      continue;  // `seen` now holds the current state; re-check it
    }
    in_job = true;
    fn(ctx, (int64_t)index);
    in_job = false;
    p.done.fetch_add(1, std::memory_order_acq_rel);
    seen = p.state.load(std::memory_order_acquire);
  }
}

void worker_loop(Pool* p) {
  uint64_t last_gen = p->state.load() >> 32;
  while (!p->stop.load(std::memory_order_relaxed)) {
    uint64_t s = p->state.load(std::memory_order_acquire);
    if ((s >> 32) != last_gen && (s & 0xffffffffu) != CLOSED) {
      last_gen = s >> 32;
      work(*p, s);
      continue;
    }
    // Spin a while for the next job, then sleep until one is published.
    const auto until = std::chrono::steady_clock::now() + std::chrono::nanoseconds(p->spin_ns);
    bool found = false;
    while (!found && !p->stop.load(std::memory_order_relaxed)) {
      for (int i = 0; i < 64; ++i) relax();
      s = p->state.load(std::memory_order_acquire);
      found = (s >> 32) != last_gen && (s & 0xffffffffu) != CLOSED;
      if (!found && std::chrono::steady_clock::now() > until) break;
    }
    if (found) continue;
    std::unique_lock<std::mutex> lock(p->mutex);
    p->sleepers.fetch_add(1);
    p->wake.wait(lock, [&] {
      const uint64_t t = p->state.load(std::memory_order_acquire);
      return p->stop.load() || ((t >> 32) != last_gen && (t & 0xffffffffu) != CLOSED);
    });
    p->sleepers.fetch_sub(1);
  }
}
}  // namespace

extern "C" void ie_parallel_run(void (*fn)(void*, int64_t), void* ctx, int64_t ntasks) {
  Pool* p = pool;
  if (p == nullptr || p->workers.empty() || ntasks <= 1 || in_job || p->owner != getpid()) {
    for (int64_t t = 0; t < ntasks; ++t) fn(ctx, t);
    return;
  }
  std::lock_guard<std::mutex> guard(p->run_mutex);
  const uint64_t gen = (p->state.load() >> 32) + 1;
  p->state.store((gen << 32) | CLOSED, std::memory_order_release);
  p->fn.store(fn, std::memory_order_release);
  p->ctx.store(ctx, std::memory_order_release);
  p->ntasks.store(ntasks, std::memory_order_release);
  p->done.store(0, std::memory_order_release);
  p->state.store(gen << 32, std::memory_order_release);
  if (p->sleepers.load() > 0) {
    { std::lock_guard<std::mutex> lock(p->mutex); }
    p->wake.notify_all();
  }
  work(*p, p->state.load(std::memory_order_acquire));
  while (p->done.load(std::memory_order_acquire) < ntasks) relax();
}

void start(int64_t workers, int64_t spin_us) {
  TORCH_CHECK(pool == nullptr, "the thread pool is already started");
  pool = new Pool();  // never freed: workers may outlive module teardown
  pool->spin_ns = spin_us * 1000;
  pool->owner = getpid();
  for (int64_t i = 0; i < workers; ++i) pool->workers.emplace_back(worker_loop, pool);
  for (auto& t : pool->workers) t.detach();
}

// Test hook: counts[t] += 1 for every task t, on the pool; returns the threads that took part.
int64_t count_tasks(torch::Tensor counts) {
  TORCH_CHECK(counts.dtype() == torch::kInt64 && counts.is_contiguous());
  int64_t* c = counts.data_ptr<int64_t>();
  std::mutex seen_mutex;
  std::vector<std::thread::id> seen;
  auto task = [&](int64_t t) {
    c[t] += 1;
    for (volatile int i = 0; i < 2000; ++i) {}  // long enough for a worker to join in
    std::lock_guard<std::mutex> lock(seen_mutex);
    const auto me = std::this_thread::get_id();
    for (auto& s : seen) if (s == me) return;
    seen.push_back(me);
  };
  ie_parallel_run([](void* f, int64_t t) { (*static_cast<decltype(task)*>(f))(t); }, &task,
                  counts.numel());
  return (int64_t)seen.size();
}

int64_t num_workers() { return pool == nullptr ? 0 : (int64_t)pool->workers.size(); }

int64_t runner_address() { return reinterpret_cast<int64_t>(&ie_parallel_run); }
"""

_STARTED: dict[str, Any] = {}


def thread_pool() -> Any | None:
    """The started pool module (``torch.get_num_threads() - 1`` workers), or None."""
    if "module" in _STARTED:
        return _STARTED["module"]
    module = load_cpu_extension(
        "inference_engine_cpu_pool_v1", _SOURCE,
        ["start", "num_workers", "runner_address", "count_tasks"],
        description="the CPU kernels' thread pool",
    )
    if module is not None and module.num_workers() == 0:
        spin_us = int(os.environ.get(SPIN_ENV, "200"))
        module.start(max(torch.get_num_threads() - 1, 0), spin_us)
    _STARTED["module"] = module
    return module


def pool_wanted() -> bool:
    """Whether the kernels should use this pool rather than torch's OpenMP threads.

    Only when OpenMP's threads sleep between regions (``OMP_WAIT_POLICY=PASSIVE``):
    with OpenMP's default or active waiting its threads already spin, and a
    second set of spinning threads would compete with them for the cores
    (measured: 107 against 121 tok/s at batch 1 on the development VM).
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


_POOLED: dict[str, Any] = {}  # name -> built module, already pointed at the pool


def load_pooled_extension(name: str, source: str, functions: list[str], *, description: str,
                          extra_cflags: tuple[str, ...] = ()) -> Any | None:
    """:func:`~inference_engine.cpu_extensions.load_cpu_extension` for a kernel that runs
    ``parallel_tasks``: its source's ``PARALLEL_TASKS`` line becomes
    :data:`PARALLEL_TASKS_CPP`, and the built module is pointed at the pool (or at ATen's
    threads) once. Called on every kernel call: a built module is found with two dict lookups."""
    module = _POOLED.get(name)
    if module is not None and cpu_extensions._MODULES.get(name) is module:
        return module
    module = load_cpu_extension(
        name, source.replace("PARALLEL_TASKS", PARALLEL_TASKS_CPP),
        [*functions, "set_parallel_runner"], description=description, extra_cflags=extra_cflags)
    if module is not None:
        module.set_parallel_runner(parallel_runner_address())
    _POOLED[name] = module
    return module


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
