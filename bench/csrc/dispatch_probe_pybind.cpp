// The ops of dispatch_probe_stable.cpp bound with pybind11, as the engine's CPU kernels are.
#include <torch/extension.h>
torch::Tensor ident(torch::Tensor x, torch::Tensor w, double eps) {
  float* p = x.data_ptr<float>();
  p[0] += static_cast<float>(eps) * 0.0f * static_cast<float>(w.size(0));
  return x;
}
torch::Tensor alloc(torch::Tensor x) { return torch::empty_like(x); }
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("ident", torch::wrap_pybind_function(ident));
  m.def("alloc", torch::wrap_pybind_function(alloc));
}
