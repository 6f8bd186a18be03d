// parallel_tasks(): run f(task) for every task of a kernel on inference_engine's spinning
// pool (csrc/cpu_thread_pool.cpp) once set_parallel_runner() gave its address
// (inference_engine.cpu_thread_pool.parallel_runner_address), else on ATen's threads.
// Include it once per extension and export set_parallel_runner from its module.
#ifndef IE_PARALLEL_TASKS_H
#define IE_PARALLEL_TASKS_H

#include <ATen/Parallel.h>
#include <cstdint>

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

#endif  // IE_PARALLEL_TASKS_H
