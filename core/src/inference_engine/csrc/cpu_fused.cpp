// Fused float32 RMSNorm, SiLU-and-mul, neox RoPE and argmax (inference_engine.layers.cpu_fused).
// Built with -ffast-math.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <map>
#include <string>
#include <vector>

#include "ie_parallel_tasks.h"

namespace {
// Rows per task: at least ~32K elements, so decode-sized inputs run on the calling thread.
int64_t grain_rows(int64_t width) {
  return std::max<int64_t>(1, 32768 / std::max<int64_t>(width, 1));
}

// body(begin, end) over [0, rows) in tasks of `grain` rows, on the spinning pool where
// it is on (under OMP_WAIT_POLICY=PASSIVE waking OpenMP's threads per call cost more).
template <class F>
void for_rows(int64_t rows, int64_t grain, const F& body) {
  if (rows <= grain) {
    body(0, rows);
    return;
  }
  parallel_tasks((rows + grain - 1) / grain, [&](int64_t task) {
    body(task * grain, std::min(rows, (task + 1) * grain));
  });
}
}

// The plain-pointer bodies of rms_norm, silu_and_mul and rope_neox, for kernels that chain
// them without Python (csrc/cpu_decode_step.cpp reaches them through entry_points()).

// Rows r = a * B + b of x (element (a, b, i) at x + a * xa + b * xb + i) normalised into
// out [A * B, D] (dense): weight [P, D] (row r uses row r % P) or null; with residual (same
// layout, strides ra, rb) x + residual is normalised and written to sum [A * B, D] as well.
extern "C" void ie_rms_norm_raw(const float* xp, int64_t A, int64_t B, int64_t D, int64_t xa,
                                int64_t xb, const float* wp, int64_t P, const float* rp,
                                int64_t ra, int64_t rb, float* op, float* sp, float eps) {
  const int64_t R = A * B;
  for_rows(R, grain_rows(D), [&](int64_t b, int64_t end) {
    for (int64_t r = b; r < end; ++r) {
      const float* src = xp + (r / B) * xa + (r % B) * xb;
      if (rp != nullptr) {
        const float* rr = rp + (r / B) * ra + (r % B) * rb;
        float* sr = sp + r * D;
#pragma omp simd
        for (int64_t i = 0; i < D; ++i) sr[i] = src[i] + rr[i];
        src = sr;
      }
      float ss = 0.f;
#pragma omp simd reduction(+ : ss)
      for (int64_t i = 0; i < D; ++i) ss += src[i] * src[i];
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(D) + eps);
      float* orow = op + r * D;
      if (wp != nullptr) {
        const float* wr = wp + (r % P) * D;
#pragma omp simd
        for (int64_t i = 0; i < D; ++i) orow[i] = (src[i] * inv) * wr[i];
      } else {
#pragma omp simd
        for (int64_t i = 0; i < D; ++i) orow[i] = src[i] * inv;
      }
    }
  });
}

// gate_up rows [T, 2I] (row stride gs) -> out [T, I] dense: silu(gate) * up.
extern "C" void ie_silu_and_mul_raw(const float* gp, int64_t T, int64_t I, int64_t gs,
                                    float* op) {
  for_rows(T, grain_rows(I), [&](int64_t b, int64_t end) {
    for (int64_t t = b; t < end; ++t) {
      const float* g = gp + t * gs;
      const float* u = g + I;
      float* o = op + t * I;
#pragma omp simd
      // exp's argument is capped so that -ffast-math never meets an infinity
      // (silu(g) for g < -80 is below 1e-33 either way).
      for (int64_t i = 0; i < I; ++i) o[i] = g[i] / (1.f + std::exp(std::min(-g[i], 80.f))) * u[i];
    }
  });
}

// x [T, H, D] (strides xt, xh; elements contiguous) -> out [T, H, D] dense, the first R
// dims of every head rotated as neox halves from table rows (stride ts)
// [cos (R, both halves) | -sin (R/2) | sin (R/2)].
extern "C" void ie_rope_neox_raw(const float* xp, int64_t T, int64_t H, int64_t D, int64_t xt,
                                 int64_t xh, const float* tp, int64_t ts, int64_t R, float* op) {
  const int64_t h = R / 2;
  for_rows(T * H, grain_rows(D), [&](int64_t b, int64_t end) {
    for (int64_t r = b; r < end; ++r) {
      const int64_t t = r / H;
      const float* src = xp + t * xt + (r % H) * xh;
      const float* cs = tp + t * ts;
      const float* ns = cs + R;
      const float* sn = ns + h;
      float* dst = op + r * D;
#pragma omp simd
      for (int64_t i = 0; i < h; ++i) dst[i] = src[i] * cs[i] + src[i + h] * ns[i];
#pragma omp simd
      for (int64_t i = 0; i < h; ++i) dst[i + h] = src[i + h] * cs[i + h] + src[i] * sn[i];
      for (int64_t i = R; i < D; ++i) dst[i] = src[i];
    }
  });
}

// x [A, B, D] (any strides for A and B, elements contiguous), rows r = a * B + b;
// weight [P, D] float32 or empty (row r uses weight row r % P); residual [A, B, D] or
// empty: then x + residual is what is normalised, and returned too.
// Returns {normalised rows [A, B, D], sum [A, B, D] (or an empty tensor)}.
std::vector<torch::Tensor> rms_norm(torch::Tensor x, torch::Tensor weight, torch::Tensor residual,
                                    double eps) {
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == torch::kFloat32 && x.stride(2) == 1);
  const int64_t B = x.size(1), D = x.size(2);
  const bool has_w = weight.numel() > 0, has_r = residual.numel() > 0;
  if (has_w) TORCH_CHECK(weight.scalar_type() == torch::kFloat32 && weight.is_contiguous() &&
                         weight.size(-1) == D && weight.numel() % D == 0);
  if (has_r) TORCH_CHECK(residual.scalar_type() == torch::kFloat32 && residual.dim() == 3 &&
                         residual.stride(2) == 1 && residual.sizes() == x.sizes());
  auto out = torch::empty(x.sizes(), x.options());
  auto sum = has_r ? torch::empty(x.sizes(), x.options()) : torch::empty({0}, x.options());
  ie_rms_norm_raw(x.data_ptr<float>(), x.size(0), B, D, x.stride(0), x.stride(1),
                  has_w ? weight.data_ptr<float>() : nullptr, has_w ? weight.numel() / D : 1,
                  has_r ? residual.data_ptr<float>() : nullptr, has_r ? residual.stride(0) : 0,
                  has_r ? residual.stride(1) : 0, out.data_ptr<float>(),
                  has_r ? sum.data_ptr<float>() : nullptr, static_cast<float>(eps));
  return {out, sum};
}

// gate_up [T, 2I] (rows may be strided) -> silu(gate) * up [T, I].
torch::Tensor silu_and_mul(torch::Tensor gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.scalar_type() == torch::kFloat32 &&
              gate_up.stride(1) == 1 && gate_up.size(1) % 2 == 0);
  const int64_t T = gate_up.size(0), I = gate_up.size(1) / 2;
  auto out = torch::empty({T, I}, gate_up.options());
  ie_silu_and_mul_raw(gate_up.data_ptr<float>(), T, I, gate_up.stride(0), out.data_ptr<float>());
  return out;
}

// x [T, H, D] (any strides for T and H, elements contiguous); table [T, 2R] float32 rows
// [cos (R, both halves) | -sin (R/2) | sin (R/2)]. Returns x with its first R dims of
// every head rotated as neox halves, contiguous [T, H, D].
torch::Tensor rope_neox(torch::Tensor x, torch::Tensor table) {
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == torch::kFloat32 && x.stride(2) == 1);
  TORCH_CHECK(table.dim() == 2 && table.scalar_type() == torch::kFloat32 && table.stride(1) == 1);
  const int64_t T = x.size(0), H = x.size(1), D = x.size(2), R = table.size(1) / 2;
  TORCH_CHECK(table.size(0) == T && R % 2 == 0 && R <= D, "table does not fit x");
  auto out = torch::empty({T, H, D}, x.options());
  ie_rope_neox_raw(x.data_ptr<float>(), T, H, D, x.stride(0), x.stride(1),
                   table.data_ptr<float>(), table.stride(0), R, out.data_ptr<float>());
  return out;
}

// x [T, V] float32 (rows may be strided) -> int64 [T]: torch.argmax(x, -1), the first
// maximum of each row, or its first NaN (torch ranks NaN above everything). Compared as
// order-preserving integer keys of the float bits (-0 taken as +0), so -ffast-math's
// assumptions (no NaN, no infinity) cannot touch it.
inline int32_t order_key(uint32_t bits) {
  if (bits == 0x80000000u) bits = 0;
  const int32_t i = static_cast<int32_t>(bits);
  return i ^ ((i >> 31) & 0x7fffffff);
}

// The plain-pointer body: rows t of x (stride xs) -> out[t].
extern "C" void ie_argmax_raw(const float* x, int64_t T, int64_t V, int64_t xs, int64_t* op) {
  const uint32_t* xp = reinterpret_cast<const uint32_t*>(x);
  constexpr int64_t kChunk = 64;
  for_rows(T, grain_rows(V), [&](int64_t b, int64_t end) {
    for (int64_t t = b; t < end; ++t) {
      const uint32_t* bits = xp + t * xs;
      int32_t best = INT32_MIN;
      int nan = 0;
#pragma omp simd reduction(max:best) reduction(|:nan)
      for (int64_t i = 0; i < V; ++i) {
        best = std::max(best, order_key(bits[i]));
        nan |= (bits[i] & 0x7fffffffu) > 0x7f800000u;
      }
      // The first index that matches, a chunk at a time.
      int64_t pick = 0;
      for (int64_t c = 0; c < V; c += kChunk) {
        const int64_t stop = std::min(V, c + kChunk);
        int hit = 0;
#pragma omp simd reduction(|:hit)
        for (int64_t i = c; i < stop; ++i)
          hit |= nan ? (bits[i] & 0x7fffffffu) > 0x7f800000u : order_key(bits[i]) == best;
        if (!hit) continue;
        pick = c;
        while (nan ? (bits[pick] & 0x7fffffffu) <= 0x7f800000u : order_key(bits[pick]) != best)
          ++pick;
        break;
      }
      op[t] = pick;
    }
  });
}

torch::Tensor argmax_rows(torch::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.stride(1) == 1 &&
              x.size(1) > 0);
  auto out = torch::empty({x.size(0)}, torch::dtype(torch::kInt64));
  ie_argmax_raw(x.data_ptr<float>(), x.size(0), x.size(1), x.stride(0),
                out.data_ptr<int64_t>());
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", torch::wrap_pybind_function(rms_norm), "rms_norm");
  m.def("silu_and_mul", torch::wrap_pybind_function(silu_and_mul), "silu_and_mul");
  m.def("rope_neox", torch::wrap_pybind_function(rope_neox), "rope_neox");
  m.def("argmax_rows", torch::wrap_pybind_function(argmax_rows), "argmax_rows");
  m.def("entry_points", []() {
    return std::map<std::string, int64_t>{
        {"rms_norm", reinterpret_cast<int64_t>(&ie_rms_norm_raw)},
        {"silu_and_mul", reinterpret_cast<int64_t>(&ie_silu_and_mul_raw)},
        {"rope_neox", reinterpret_cast<int64_t>(&ie_rope_neox_raw)},
        {"argmax", reinterpret_cast<int64_t>(&ie_argmax_raw)}};
  }, "addresses of the plain-pointer kernels");
  m.def("set_parallel_runner", torch::wrap_pybind_function(set_parallel_runner),
        "set_parallel_runner");
}
