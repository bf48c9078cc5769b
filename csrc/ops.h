// Stateless fused kernels behind vflow's gradient-accumulation buffers.
//
// Note [Kernel contracts]
// The public entry points (`multi_accumulate_`, `scale_`, `scale_check_`) validate
// their arguments with TORCH_CHECK and then call exactly one backend (`_cpu` or
// `_cuda`). Backends may assume everything the entry points check:
//   * every accumulator is a contiguous float32 or float64 tensor,
//   * every gradient is contiguous, has the accumulator's numel and device, and a
//     dtype allowed for that accumulator (float32/bfloat16/float16 into float32;
//     any of those or float64 into float64),
//   * all tensors of one call live on one device, none has zero elements,
//   * accumulators never alias gradients, and never overlap each other (checked:
//     overlapping accumulators would race between threads or blocks).
// Backends never allocate temporaries proportional to the data: the point of the
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

#include <string>
#include <vector>

namespace vflow {

// acc[i] += weight * grad[i] for every pair, elementwise, in the accumulator dtype;
// with `overwrite`, acc[i] = weight * grad[i] instead (the accumulator is not read,
// which saves both a zeroing pass and a read stream for the first contribution).
// Gradients that are not contiguous (e.g. channels_last parameters) are handled
// with a strided fallback; everything else goes through one fused backend call.
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

// ---- Backends: preconditions in Note [Kernel contracts]. ----

void multi_accumulate_cpu(
    const std::vector<at::Tensor>& accs,
    const std::vector<at::Tensor>& grads,
    double weight,
    bool overwrite);
void scale_cpu(const at::Tensor& buf, double factor);
void scale_check_cpu(const at::Tensor& buf, double factor, const at::Tensor& found_nonfinite);

#ifdef VFLOW_WITH_CUDA
void multi_accumulate_cuda(
    const std::vector<at::Tensor>& accs,
    const std::vector<at::Tensor>& grads,
    double weight,
    bool overwrite);
void scale_cuda(const at::Tensor& buf, double factor);
void scale_check_cuda(const at::Tensor& buf, double factor, const at::Tensor& found_nonfinite);
#endif

// Selects the CPU kernels' vector path: "avx2" (AVX2+FMA+F16C, the default where the
// CPU has them) or "portable"; see Note [CPU vector paths]. For tests and benchmarks.
void set_cpu_vector_path(const std::string& name);
std::string cpu_vector_path();

// True when this build of the extension contains the CUDA kernels.
bool built_with_cuda();

// Raises the error a CUDA tensor gets from a build without the CUDA kernels; `what`
// names the operation.
[[noreturn]] void no_cuda(const char* what);

} // namespace vflow
