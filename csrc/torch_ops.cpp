// Defines the stateless kernels as PyTorch operators, torch.ops.vflow.* (Note [One op
// surface] in ops.h). The backends register their implementations next to their
// kernels: cpu/*.cpp for CPU, cuda/*.cu for CUDA.
#include <torch/library.h>

#include "ops.h"

namespace vflow {
namespace {

constexpr const char* kOpNames[] = {
    "multi_accumulate_", "scale_",      "scale_check_",
    "exact_accumulate_", "exact_pack_", "exact_unpack_",
};

#ifndef VFLOW_WITH_CUDA
void raise_no_cuda(const c10::OperatorHandle& op, torch::jit::Stack* /*stack*/) {
  no_cuda(op.schema().name().c_str());
}
#endif

} // namespace

TORCH_LIBRARY(vflow, m) {
  // The fake implementations live in Python: a fake-tensor trace that meets one of
  // these operators before vflow.ops was imported is told to import it.
  m.set_python_module("vflow.ops");
  m.def(
      "multi_accumulate_(Tensor(a!)[] accs, Tensor[] grads, float weight, "
      "bool overwrite=False) -> ()");
  m.def("scale_(Tensor(a!) buf, float factor) -> ()");
  m.def("scale_check_(Tensor(a!) buf, float factor, Tensor(b!) found_nonfinite) -> ()");
  m.def(
      "exact_accumulate_(Tensor(a!) top, Tensor(b!) l0, Tensor(c!) l1, Tensor(d!) l2, "
      "Tensor grad, float weight, bool fresh=False) -> ()");
  m.def(
      "exact_pack_(Tensor local_top, Tensor global_top, Tensor l0, Tensor l1, Tensor l2, "
      "Tensor(a!) wire) -> ()");
  m.def("exact_unpack_(Tensor global_top, Tensor wire, Tensor(a!) out, float factor=1.0) -> ()");
}

// No gradient formula: see Note [One op surface].
TORCH_LIBRARY_IMPL(vflow, Autograd, m) {
  for (const char* name : kOpNames) {
    m.impl(name, torch::CppFunction::makeFallthrough());
  }
}

#ifndef VFLOW_WITH_CUDA
// A CPU-only build still owns the CUDA key of its operators: a CUDA tensor gets the
// error that names the missing kernels, not the dispatcher's "could not run".
TORCH_LIBRARY_IMPL(vflow, CUDA, m) {
  for (const char* name : kOpNames) {
    m.impl(name, torch::CppFunction::makeFromBoxedFunction<&raise_no_cuda>());
  }
}
#endif

} // namespace vflow
