// Every decoder layer of a decode step in one call (inference_engine.layers.cpu_decode_step).
//
// A batch-1 decode step of a small model spends more time getting from one kernel to the
// next in Python than in the kernels. This runs the layers' sequence of kernels (RMSNorm,
// QKV GEMV, q/k norm, rotary, cache write, paged decode attention, o_proj, add + RMSNorm,
// gate/up GEMV, SiLU-and-mul, down GEMV) in C++, through the plain-pointer entry points
// the kernels' own extensions export (their entry_points()), so every number is the one the
// layer-by-layer path computes, in the same order. Weights and caches are bound once
// (add_layer); a step passes only its activations and batch layout.
#include <torch/extension.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

namespace py = pybind11;

namespace {

using GemvFn = void (*)(const float*, int64_t, int64_t, int64_t, const at::BFloat16*, int64_t,
                        const float*, float*);
using RmsNormFn = void (*)(const float*, int64_t, int64_t, int64_t, int64_t, int64_t,
                           const float*, int64_t, const float*, int64_t, int64_t, float*, float*,
                           float);
using SiluFn = void (*)(const float*, int64_t, int64_t, int64_t, float*);
using RopeFn = void (*)(const float*, int64_t, int64_t, int64_t, int64_t, int64_t, const float*,
                        int64_t, int64_t, float*);
using DecodeFn = void (*)(const float*, int64_t, int64_t, int64_t, int64_t, int64_t, const void*,
                          const int64_t*, const void*, const int64_t*, int64_t, int,
                          const int64_t*, int64_t, const int64_t*, float, int64_t, float*);
using WriteKvFn = void (*)(void*, const int64_t*, void*, const int64_t*, int, const float*,
                           int64_t, int64_t, const float*, int64_t, int64_t, int64_t, int64_t,
                           int64_t, const int64_t*, const int64_t*);

using ArgmaxFn = void (*)(const float*, int64_t, int64_t, int64_t, int64_t*);

// A linear layer's product provided by another extension (a quantized format):
// y [M, N] = x [M, K] (row stride ldx) . W^T for the weights ctx stands for.
using LinearFn = void (*)(void* ctx, const float* x, int64_t ldx, int64_t M, float* y);

template <typename F>
F entry(const std::map<std::string, int64_t>& points, const char* name) {
  auto it = points.find(name);
  TORCH_CHECK(it != points.end() && it->second != 0, "no entry point named ", name);
  return reinterpret_cast<F>(it->second);
}

// A packed bf16 weight [N/16, K/2, 16, 2], or a provided product (fn, ctx, and the
// Python object that owns ctx), and an optional float32 bias.
struct Linear {
  torch::Tensor weight, bias;
  int64_t groups = 0, K = 0, N = 0;
  LinearFn fn = nullptr;
  void* ctx = nullptr;
  py::object owner;
  const float* bias_ptr() const { return bias.defined() ? bias.data_ptr<float>() : nullptr; }
};

// spec: a packed bf16 weight tensor, or a tuple (function address, context address, owner)
// from the layer's quantization method.
Linear make_linear(const py::object& spec, const c10::optional<torch::Tensor>& bias,
                   int64_t K, int64_t N, const char* what) {
  Linear lin;
  lin.K = K;
  lin.N = N;
  if (py::isinstance<py::tuple>(spec)) {
    auto t = spec.cast<py::tuple>();
    TORCH_CHECK(t.size() == 3, what, ": a provided product is (function, context, owner)");
    lin.fn = reinterpret_cast<LinearFn>(t[0].cast<int64_t>());
    lin.ctx = reinterpret_cast<void*>(t[1].cast<int64_t>());
    lin.owner = t[2];
    TORCH_CHECK(lin.fn != nullptr, what, ": null function");
  } else {
    const auto w = spec.cast<torch::Tensor>();
    TORCH_CHECK(w.dim() == 4 && w.scalar_type() == torch::kBFloat16 && w.is_contiguous(), what,
                ": expected a packed bfloat16 weight");
    TORCH_CHECK(w.size(0) * 16 == N && w.size(1) * 2 == K, what, ": packed weight is [",
                w.size(0) * 16, ", ", w.size(1) * 2, "], expected [", N, ", ", K, "]");
    lin.weight = w;
    lin.groups = w.size(0);
  }
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == torch::kFloat32 && bias->is_contiguous() &&
                bias->numel() == N, what, ": bias must be float32 [", N, "]");
    lin.bias = *bias;
  }
  return lin;
}

struct Layer {
  torch::Tensor input_norm, post_norm, qk_norm;  // qk_norm [heads + kv_heads, D] or undefined
  Linear qkv, o, gate_up, down;
  torch::Tensor k_cache, v_cache;
  int64_t k_strides[3], v_strides[3];
  int cache_bf16;
  int64_t block_size, window;
  float eps, qk_eps, scale;
};

void check_cache(const torch::Tensor& c, int64_t kv_heads, int64_t head_dim) {
  TORCH_CHECK(c.dim() == 4 && c.size(2) == kv_heads && c.size(3) == head_dim && c.stride(3) == 1,
              "cache must be [blocks, block_size, kv_heads, head_dim] with dense rows");
  TORCH_CHECK(c.scalar_type() == torch::kFloat32 || c.scalar_type() == torch::kBFloat16,
              "cache must be float32 or bfloat16");
  TORCH_CHECK(c.size(1) <= 16, "block size at most 16");
}

void check_vector(const torch::Tensor& t, int64_t n, const char* what) {
  TORCH_CHECK(t.scalar_type() == torch::kFloat32 && t.is_contiguous() && t.numel() == n, what,
              ": expected float32 [", n, "]");
}

}  // namespace

class DecodeStep {
 public:
  DecodeStep(const std::map<std::string, int64_t>& points, int64_t heads, int64_t kv_heads,
             int64_t head_dim, int64_t hidden, int64_t intermediate)
      : gemv_(entry<GemvFn>(points, "gemv_packed")),
        rms_norm_(entry<RmsNormFn>(points, "rms_norm")),
        silu_(entry<SiluFn>(points, "silu_and_mul")),
        rope_(entry<RopeFn>(points, "rope_neox")),
        decode_(entry<DecodeFn>(points, "paged_decode")),
        write_kv_(entry<WriteKvFn>(points, "write_kv")),
        H_(heads), KVH_(kv_heads), D_(head_dim), hidden_(hidden), inter_(intermediate) {
    TORCH_CHECK(heads > 0 && kv_heads > 0 && heads % kv_heads == 0 && heads <= 256,
                "heads must be a multiple of kv_heads, at most 256");
  }

  void add_layer(torch::Tensor input_norm, torch::Tensor post_norm, double eps,
                 py::object qkv_w, c10::optional<torch::Tensor> qkv_b,
                 c10::optional<torch::Tensor> qk_norm, double qk_eps, py::object o_w,
                 c10::optional<torch::Tensor> o_b, py::object gate_up_w,
                 c10::optional<torch::Tensor> gate_up_b, py::object down_w,
                 c10::optional<torch::Tensor> down_b, torch::Tensor k_cache,
                 torch::Tensor v_cache, double scale, int64_t window) {
    const int64_t q = H_ * D_, kv = KVH_ * D_;
    Layer l;
    check_vector(input_norm, hidden_, "input_norm");
    check_vector(post_norm, hidden_, "post_norm");
    l.input_norm = input_norm;
    l.post_norm = post_norm;
    l.qkv = make_linear(qkv_w, qkv_b, hidden_, q + 2 * kv, "qkv_proj");
    l.o = make_linear(o_w, o_b, q, hidden_, "o_proj");
    l.gate_up = make_linear(gate_up_w, gate_up_b, hidden_, 2 * inter_, "gate_up_proj");
    l.down = make_linear(down_w, down_b, inter_, hidden_, "down_proj");
    if (qk_norm.has_value() && qk_norm->defined()) {
      check_vector(*qk_norm, (H_ + KVH_) * D_, "qk_norm");
      l.qk_norm = *qk_norm;
    }
    check_cache(k_cache, KVH_, D_);
    check_cache(v_cache, KVH_, D_);
    TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type() &&
                k_cache.size(1) == v_cache.size(1), "k and v caches differ");
    l.k_cache = k_cache;
    l.v_cache = v_cache;
    for (int i = 0; i < 3; ++i) {
      l.k_strides[i] = k_cache.stride(i);
      l.v_strides[i] = v_cache.stride(i);
    }
    l.cache_bf16 = k_cache.scalar_type() == torch::kBFloat16;
    l.block_size = k_cache.size(1);
    l.window = window;
    l.eps = static_cast<float>(eps);
    l.qk_eps = static_cast<float>(qk_eps);
    l.scale = static_cast<float>(scale);
    layers_.push_back(std::move(l));
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  // hidden [M, hidden] float32 (the embedded tokens, one per sequence); rope [M, 2R] rows
  // [cos | -sin | sin]; tables [M, >= blocks] int64; lens [M] int64 (with the new token);
  // blocks/offsets [M] int64: each new token's cache slot. Returns {mlp output, residual}
  // of the last layer (their sum is its output), as the layer loop does.
  std::vector<torch::Tensor> run(torch::Tensor hidden, torch::Tensor rope, torch::Tensor tables,
                                 torch::Tensor lens, torch::Tensor blocks,
                                 torch::Tensor offsets) {
    TORCH_CHECK(!layers_.empty(), "no layers bound");
    TORCH_CHECK(hidden.dim() == 2 && hidden.scalar_type() == torch::kFloat32 &&
                hidden.is_contiguous() && hidden.size(1) == hidden_, "hidden must be float32 [M, ",
                hidden_, "] contiguous");
    const int64_t M = hidden.size(0);
    TORCH_CHECK(rope.dim() == 2 && rope.scalar_type() == torch::kFloat32 && rope.stride(1) == 1 &&
                rope.size(0) == M && rope.size(1) % 4 == 0 && rope.size(1) / 2 <= D_,
                "rope rows do not fit");
    TORCH_CHECK(tables.scalar_type() == torch::kInt64 && tables.dim() == 2 &&
                tables.stride(1) == 1 && tables.size(0) >= M, "bad block tables");
    for (const auto* t : {&lens, &blocks, &offsets})
      TORCH_CHECK(t->scalar_type() == torch::kInt64 && t->is_contiguous() && t->numel() >= M,
                  "lens, blocks and offsets must be int64 [M] contiguous");
    const int64_t* lp = lens.data_ptr<int64_t>();
    const int64_t* bp = blocks.data_ptr<int64_t>();
    const int64_t* op = offsets.data_ptr<int64_t>();
    const int64_t max_blocks = tables.size(1);
    for (int64_t i = 0; i < M; ++i) {
      const int64_t bs = layers_[0].block_size, nb = layers_[0].k_cache.size(0);
      TORCH_CHECK(lp[i] > 0 && (lp[i] + bs - 1) / bs <= max_blocks, "sequence length out of range");
      TORCH_CHECK(bp[i] >= 0 && bp[i] < nb && op[i] >= 0 && op[i] < bs, "slot out of range");
    }
    ensure_scratch(M);
    // Fresh each step: the caller keeps them.
    auto opts = hidden.options();
    auto out = torch::empty({M, hidden_}, opts);
    torch::Tensor res_buf[2] = {torch::empty({M, hidden_}, opts), torch::empty({M, hidden_}, opts)};
    int last = -1;
    {
      py::gil_scoped_release no_gil;
      last = layers(hidden.data_ptr<float>(), M, rope.data_ptr<float>(), rope.stride(0),
                    rope.size(1) / 2, tables.data_ptr<int64_t>(), tables.stride(0), lp, bp, op,
                    out.data_ptr<float>(), res_buf[0].data_ptr<float>(),
                    res_buf[1].data_ptr<float>());
    }
    return {out, last < 0 ? hidden : res_buf[last]};
  }

  // The greedy window's model ends: the float32 embedding table [V, hidden], the final
  // norm, the LM head (a packed bf16 weight or a provided product) and the rotary table
  // [positions, 2R] indexed by position.
  void bind_greedy(torch::Tensor embed, torch::Tensor final_norm, double eps, py::object head,
                   c10::optional<torch::Tensor> head_bias, int64_t vocab, torch::Tensor rope,
                   const std::map<std::string, int64_t>& points) {
    TORCH_CHECK(embed.dim() == 2 && embed.scalar_type() == torch::kFloat32 &&
                embed.is_contiguous() && embed.size(1) == hidden_ && embed.size(0) >= vocab,
                "embedding must be float32 [vocab, ", hidden_, "] contiguous");
    check_vector(final_norm, hidden_, "final_norm");
    TORCH_CHECK(rope.dim() == 2 && rope.scalar_type() == torch::kFloat32 && rope.stride(1) == 1 &&
                rope.size(1) % 4 == 0 && rope.size(1) / 2 <= D_, "rope table does not fit");
    embed_ = embed;
    final_norm_ = final_norm;
    final_eps_ = static_cast<float>(eps);
    head_ = make_linear(head, head_bias, hidden_, vocab, "lm_head");
    vocab_ = vocab;
    rope_table_ = rope;
    argmax_ = entry<ArgmaxFn>(points, "argmax");
    logits_ = torch::empty({1, vocab}, embed.options());
  }

  // Up to out.numel() greedy decode steps of one sequence in one call: the step's layers,
  // the final norm, the LM head and argmax, then the picked token's embedding and the next
  // position, slot and length. token: the last known token (not yet in the cache), at
  // `position`; table [>= blocks] int64: the sequence's block table, holding a slot for
  // every position computed here. Stops after a token in stop_ids. Returns the number of
  // tokens written to out (int64); their K/V (all but the last's) are in the cache.
  int64_t greedy_window(int64_t token, int64_t position, torch::Tensor table,
                        torch::Tensor stop_ids, torch::Tensor out) {
    TORCH_CHECK(embed_.defined(), "bind_greedy first");
    TORCH_CHECK(table.scalar_type() == torch::kInt64 && table.dim() == 1 &&
                table.is_contiguous(), "table must be int64 [blocks] contiguous");
    TORCH_CHECK(stop_ids.scalar_type() == torch::kInt64 && stop_ids.is_contiguous(),
                "stop_ids must be int64 contiguous");
    TORCH_CHECK(out.scalar_type() == torch::kInt64 && out.is_contiguous(),
                "out must be int64 contiguous");
    const int64_t K = out.numel(), bs = layers_[0].block_size, nb = layers_[0].k_cache.size(0);
    TORCH_CHECK(position >= 0 && position + K <= rope_table_.size(0),
                "positions past the rotary table");
    TORCH_CHECK(position + K <= table.numel() * bs, "the block table holds no slot for step ",
                (table.numel() * bs) - position);
    const int64_t* tp = table.data_ptr<int64_t>();
    for (int64_t b = position / bs; b < (position + K + bs - 1) / bs; ++b)
      TORCH_CHECK(tp[b] >= 0 && tp[b] < nb, "block id out of range");
    TORCH_CHECK(token >= 0 && token < vocab_, "token id out of range");
    ensure_scratch(1);
    if (!window_hidden_.defined()) {
      auto opts = embed_.options();
      window_hidden_ = torch::empty({1, hidden_}, opts);
      window_out_ = torch::empty({1, hidden_}, opts);
      window_res_[0] = torch::empty({1, hidden_}, opts);
      window_res_[1] = torch::empty({1, hidden_}, opts);
      window_sum_ = torch::empty({1, hidden_}, opts);
    }
    const int64_t* stops = stop_ids.data_ptr<int64_t>();
    const int64_t num_stops = stop_ids.numel();
    int64_t* op = out.data_ptr<int64_t>();
    float* h = window_hidden_.data_ptr<float>();
    float* mlp_out = window_out_.data_ptr<float>();
    float* res0 = window_res_[0].data_ptr<float>();
    float* res1 = window_res_[1].data_ptr<float>();
    float* normed = normed_.data_ptr<float>();
    float* sum = window_sum_.data_ptr<float>();
    float* logits = logits_.data_ptr<float>();
    const float* embed = embed_.data_ptr<float>();
    const float* rope = rope_table_.data_ptr<float>();
    const int64_t rope_stride = rope_table_.stride(0), R = rope_table_.size(1) / 2;
    int64_t n = 0;
    py::gil_scoped_release no_gil;
    while (n < K) {
      const int64_t pos = position + n;
      std::copy(embed + token * hidden_, embed + (token + 1) * hidden_, h);
      const int64_t len = pos + 1, block = tp[pos / bs], offset = pos % bs;
      const int last = layers(h, 1, rope + pos * rope_stride, rope_stride, R, tp, 0, &len,
                              &block, &offset, mlp_out, res0, res1);
      const float* res = last < 0 ? h : (last == 0 ? res0 : res1);
      rms_norm_(mlp_out, 1, 1, hidden_, hidden_, 0, final_norm_.data_ptr<float>(), 1, res,
                hidden_, 0, normed, sum, final_eps_);
      linear(head_, normed, 1, logits);
      argmax_(logits, 1, vocab_, vocab_, &token);
      op[n++] = token;
      bool stop = false;
      for (int64_t i = 0; i < num_stops; ++i) stop |= stops[i] == token;
      if (stop) break;
    }
    return n;
  }

 private:
  void ensure_scratch(int64_t M) {
    if (scratch_rows_ == M) return;
    const int64_t q = H_ * D_, kv = KVH_ * D_, qkv_n = q + 2 * kv, qk_heads = H_ + KVH_;
    auto opts = torch::dtype(torch::kFloat32);
    normed_ = torch::empty({M, hidden_}, opts);
    qkv_ = torch::empty({M, qkv_n}, opts);
    qkn_ = torch::empty({M, qk_heads, D_}, opts);
    rot_ = torch::empty({M, qk_heads, D_}, opts);
    attn_ = torch::empty({M, q}, opts);
    o_ = torch::empty({M, hidden_}, opts);
    gu_ = torch::empty({M, 2 * inter_}, opts);
    act_ = torch::empty({M, inter_}, opts);
    scratch_rows_ = M;
  }

  // Every layer over hidden [M, hidden] (scratch sized for M): the last layer's mlp output
  // into outp, the residual stream alternating between res_a and res_b. Returns which of
  // them holds the last residual (0: res_a, 1: res_b; -1 would be hidden itself). Runs
  // without the GIL.
  int layers(const float* hidden, int64_t M, const float* rp, int64_t rope_stride, int64_t R,
             const int64_t* tp, int64_t table_stride, const int64_t* lp, const int64_t* bp,
             const int64_t* op, float* outp, float* res_a, float* res_b) {
    const int64_t q = H_ * D_, kv = KVH_ * D_, qkv_n = q + 2 * kv, qk_heads = H_ + KVH_;
    float* res_buf[2] = {res_a, res_b};
    float* normed = normed_.data_ptr<float>();
    float* qkv = qkv_.data_ptr<float>();
    float* qkn = qkn_.data_ptr<float>();
    float* rot = rot_.data_ptr<float>();
    float* attn = attn_.data_ptr<float>();
    float* o = o_.data_ptr<float>();
    float* gu = gu_.data_ptr<float>();
    float* act = act_.data_ptr<float>();
    const float* cur = hidden;
    const float* res = nullptr;
    int last = -1;
    int next = 0;
    for (const Layer& l : layers_) {
      // input norm (+ the residual add after the first layer)
      if (res == nullptr) {
        rms_norm_(cur, M, 1, hidden_, hidden_, 0, l.input_norm.data_ptr<float>(), 1, nullptr,
                  0, 0, normed, nullptr, l.eps);
        res = cur;
      } else {
        float* sum = res_buf[next];
        rms_norm_(cur, M, 1, hidden_, hidden_, 0, l.input_norm.data_ptr<float>(), 1, res,
                  hidden_, 0, normed, sum, l.eps);
        res = sum;
        last = next;
        next ^= 1;
      }
      linear(l.qkv, normed, M, qkv);
      // q and k heads: per-head norm (Qwen3), then rotary, into rot [M, heads + kv_heads, D]
      const float* qk_src = qkv;
      int64_t qk_row = qkv_n;
      if (l.qk_norm.defined()) {
        rms_norm_(qkv, M, qk_heads, D_, qkv_n, D_, l.qk_norm.data_ptr<float>(), qk_heads,
                  nullptr, 0, 0, qkn, nullptr, l.qk_eps);
        qk_src = qkn;
        qk_row = qk_heads * D_;
      }
      rope_(qk_src, M, qk_heads, D_, qk_row, D_, rp, rope_stride, R, rot);
      write_kv_(l.k_cache.data_ptr(), l.k_strides, l.v_cache.data_ptr(), l.v_strides,
                l.cache_bf16, rot + q, qk_heads * D_, D_, qkv + q + kv, qkv_n, D_, M, KVH_, D_,
                bp, op);
      decode_(rot, qk_heads * D_, M, KVH_, H_ / KVH_, D_, l.k_cache.data_ptr(), l.k_strides,
              l.v_cache.data_ptr(), l.v_strides, l.block_size, l.cache_bf16, tp,
              table_stride, lp, l.scale, l.window, attn);
      linear(l.o, attn, M, o);
      // post-attention norm with the residual add
      float* sum = res_buf[next];
      rms_norm_(o, M, 1, hidden_, hidden_, 0, l.post_norm.data_ptr<float>(), 1, res, hidden_,
                0, normed, sum, l.eps);
      res = sum;
      last = next;
      next ^= 1;
      linear(l.gate_up, normed, M, gu);
      silu_(gu, M, inter_, 2 * inter_, act);
      linear(l.down, act, M, outp);
      cur = outp;
    }
    return last;
  }


  // y [M, N] = x [M, K] (dense rows) . W^T + bias: the bf16 GEMV, or the provided product
  // followed by the bias add the layer's apply() does.
  void linear(const Linear& l, const float* x, int64_t M, float* y) const {
    if (l.fn == nullptr) {
      gemv_(x, l.K, M, l.K, l.weight.data_ptr<at::BFloat16>(), l.groups, l.bias_ptr(), y);
      return;
    }
    l.fn(l.ctx, x, l.K, M, y);
    if (const float* b = l.bias_ptr()) {
      for (int64_t m = 0; m < M; ++m)
        for (int64_t n = 0; n < l.N; ++n) y[m * l.N + n] += b[n];
    }
  }

  GemvFn gemv_;
  RmsNormFn rms_norm_;
  SiluFn silu_;
  RopeFn rope_;
  DecodeFn decode_;
  WriteKvFn write_kv_;
  int64_t H_, KVH_, D_, hidden_, inter_;
  std::vector<Layer> layers_;
  int64_t scratch_rows_ = -1;
  torch::Tensor normed_, qkv_, qkn_, rot_, attn_, o_, gu_, act_;
  // The greedy window (bind_greedy).
  torch::Tensor embed_, final_norm_, rope_table_, logits_;
  Linear head_;
  float final_eps_ = 0.f;
  int64_t vocab_ = 0;
  ArgmaxFn argmax_ = nullptr;
  torch::Tensor window_hidden_, window_out_, window_res_[2], window_sum_;
};

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<DecodeStep>(m, "DecodeStep")
      .def(py::init<const std::map<std::string, int64_t>&, int64_t, int64_t, int64_t, int64_t,
                    int64_t>())
      .def("add_layer", &DecodeStep::add_layer)
      .def("num_layers", &DecodeStep::num_layers)
      .def("run", &DecodeStep::run)
      .def("bind_greedy", &DecodeStep::bind_greedy)
      .def("greedy_window", &DecodeStep::greedy_window);
}
