// Registers the stateless kernels as PyTorch operators (torch.ops.vflow.*), so they
// can be called from TorchScript-free graph code and show up under their own names
// in the profiler. The pybind11 functions in bindings.cpp and these operators call
// the same entry points in ops.cpp.
#include <torch/library.h>

#include "ops.h"

namespace vflow {
namespace {

void multi_accumulate_op(
    at::TensorList accs,
    at::TensorList grads,
    double weight,
    bool overwrite) {
  multi_accumulate_(accs.vec(), grads.vec(), weight, overwrite);
}

} // namespace

TORCH_LIBRARY(vflow, m) {
  m.def(
      "multi_accumulate_(Tensor(a!)[] accs, Tensor[] grads, float weight, "
      "bool overwrite=False) -> ()");
  m.def("scale_(Tensor(a!) buf, float factor) -> ()");
  m.def("scale_check_(Tensor(a!) buf, float factor, Tensor(b!) found_nonfinite) -> ()");
}

TORCH_LIBRARY_IMPL(vflow, CPU, m) {
  m.impl("multi_accumulate_", &multi_accumulate_op);
  m.impl("scale_", &scale_);
  m.impl("scale_check_", &scale_check_);
}

#ifdef VFLOW_WITH_CUDA
TORCH_LIBRARY_IMPL(vflow, CUDA, m) {
  m.impl("multi_accumulate_", &multi_accumulate_op);
  m.impl("scale_", &scale_);
  m.impl("scale_check_", &scale_check_);
}
#endif

} // namespace vflow
