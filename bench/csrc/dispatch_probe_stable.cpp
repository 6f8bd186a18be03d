// One trivial op and one allocating op registered as torch.library custom ops through torch's
// stable ABI (torch/csrc/stable): bench/op_dispatch_overhead.py times a call through the
// dispatcher against the same ops bound with pybind11 (dispatch_probe_pybind.cpp).
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/csrc/stable/ops.h>
using torch::stable::Tensor;
Tensor ident_stable(Tensor x, Tensor w, double eps) {
  float* p = reinterpret_cast<float*>(x.data_ptr());
  // Touch the data, a size and the scalar argument, as a kernel would.
  p[0] += static_cast<float>(eps) * 0.0f * static_cast<float>(w.size(0));
  return x;
}
Tensor alloc_stable(Tensor x) {
  return torch::stable::empty_like(x);
}
STABLE_TORCH_LIBRARY(ie_abi_test, m) {
  m.def("ident(Tensor(a!) x, Tensor w, float eps) -> Tensor(a!)");
  m.def("alloc(Tensor x) -> Tensor");
}
STABLE_TORCH_LIBRARY_IMPL(ie_abi_test, CPU, m) {
  m.impl("ident", TORCH_BOX(&ident_stable));
  m.impl("alloc", TORCH_BOX(&alloc_stable));
}
