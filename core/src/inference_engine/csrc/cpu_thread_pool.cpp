// The CPU kernels' spinning thread pool (inference_engine.cpu_thread_pool): kernels call
// ie_parallel_run through the address runner_address() returns.
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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("start", torch::wrap_pybind_function(start), "start");
  m.def("num_workers", torch::wrap_pybind_function(num_workers), "num_workers");
  m.def("runner_address", torch::wrap_pybind_function(runner_address), "runner_address");
  m.def("count_tasks", torch::wrap_pybind_function(count_tasks), "count_tasks");
}
