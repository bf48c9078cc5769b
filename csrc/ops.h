// Stateless fused kernels behind vflow's gradient-accumulation buffers.
//
// Note [One op surface]
// Every stateless kernel (these three, and the exact ones of exact.h) is a PyTorch
// operator, torch.ops.vflow.*, and has no other binding:
//   * torch_ops.cpp defines the schemas (TORCH_LIBRARY), with a mutation annotation on
//     every tensor an operator writes;
//   * each backend registers its implementations next to its kernels: CPU in cpu/
//     (TORCH_LIBRARY_IMPL(vflow, CPU, m)), CUDA in the .cu files of cuda/. A build
//     without the CUDA kernels registers, for the CUDA key, a kernel that raises
//     no_cuda()'s error, so a CUDA tensor gets that message rather than the
//     dispatcher's generic one;
//   * the dispatcher picks the backend from the tensors' devices; an implementation
//     never dispatches on the device by hand;
//   * every implementation starts with the operator's prepare_* function below (or in
//     exact.h), shared by all backends: it raises the errors users see, with the same
//     messages on every backend, and says what work is left for the kernel;
//   * the C++ entry points (multi_accumulate_, scale_, ... : GradBuffer and Reducer
//     call them) call the operators through the dispatcher with cached typed handles
//     (find_op), so C++ and Python callers alike reach the backend the same way and
//     torch.profiler records every call under the operator's name.
// The operators need no gradient formula: they write buffers that autograd never
// sees. Their Autograd kernel is a fallthrough (torch_ops.cpp), so a call goes
// straight to the backend, unboxed; torch's default for operators without one is a
// boxed kernel that would copy every argument list on each call.
//
// Note [Kernel contracts]
// The prepare_* functions validate the arguments with TORCH_CHECK; the kernels after
// them may assume everything those check:
//   * every accumulator is a contiguous float32 or float64 tensor,
//   * every gradient is contiguous, has the accumulator's numel and device, and a
//     dtype allowed for that accumulator (float32/bfloat16/float16 into float32;
//     any of those or float64 into float64),
//   * all tensors of one call live on one device, none has zero elements,
//   * accumulators never alias gradients, and never overlap each other (checked:
//     overlapping accumulators would race between threads or blocks).
// Kernels never allocate temporaries proportional to the data: the point of the
// fused kernels is one read of each gradient and one read-modify-write of each
// accumulator, in as few launches (CUDA) or parallel regions (CPU) as possible.
//
// Note [Non-finite flag]
// `scale_check_` reports non-finite values through a caller-owned 0-dim float32
// tensor on the buffer's device. Kernels only ever write 1.0f into it, never 0, so
// one flag can be OR-ed over several buffers and the caller decides when to read it
// (on CUDA, reading it is the only host synchronisation the check needs).
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <string>
#include <vector>

namespace vflow {

// acc[i] += weight * grad[i] for every pair, elementwise, in the accumulator dtype;
// with `overwrite`, acc[i] = weight * grad[i] instead (the accumulator is not read,
// which saves both a zeroing pass and a read stream for the first contribution).
// Gradients that are not contiguous (e.g. channels_last parameters) are handled
// with a strided fallback; everything else goes through one fused backend call.
// An empty call does nothing. These three entry points call the operators
// torch.ops.vflow.* through the dispatcher (Note [One op surface]).
void multi_accumulate_(
    const std::vector<at::Tensor>& accs,
    const std::vector<at::Tensor>& grads,
    double weight,
    bool overwrite = false);

// buf *= factor, in place, for a contiguous float32/float64 tensor.
void scale_(const at::Tensor& buf, double factor);

// buf *= factor (skipped when factor == 1) and, in the same pass, sets
// `found_nonfinite` to 1 if any resulting element is inf or NaN.
// See Note [Non-finite flag].
void scale_check_(const at::Tensor& buf, double factor, const at::Tensor& found_nonfinite);

// ---- Shared first step of every backend's implementation (Note [One op surface]) ----

// The pairs of a multi_accumulate_ call left for a fused kernel.
struct FusedPairs {
  std::vector<at::Tensor> accs;
  std::vector<at::Tensor> grads;
};

// Checks multi_accumulate_'s arguments, accumulates the pairs whose gradient is not
// contiguous with a strided pass, and returns the others (empty: nothing left); those
// meet Note [Kernel contracts].
FusedPairs prepare_multi_accumulate(
    at::TensorList accs,
    at::TensorList grads,
    double weight,
    bool overwrite);

// Check scale_'s / scale_check_'s arguments; false when the kernel has nothing to do.
bool prepare_scale(const at::Tensor& buf, double factor);
bool prepare_scale_check(const at::Tensor& buf, const at::Tensor& found_nonfinite);

// The typed dispatcher handle of operator `name` ("vflow::..."). Callers keep it in a
// function-local static: the lookup runs once, after the library has registered.
template <typename Signature>
c10::TypedOperatorHandle<Signature> find_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

// Selects the CPU kernels' vector path: "avx2" (AVX2+FMA+F16C, the default where the
// CPU has them) or "portable"; see Note [CPU vector paths]. For tests and benchmarks.
void set_cpu_vector_path(const std::string& name);
std::string cpu_vector_path();
// The vector paths this CPU and build offer, best first.
std::vector<std::string> cpu_vector_paths();

// True when this build of the extension contains the CUDA kernels.
bool built_with_cuda();

// Raises the error a CUDA tensor gets from a build without the CUDA kernels; `what`
// names the operator.
[[noreturn]] void no_cuda(const char* what);

} // namespace vflow
