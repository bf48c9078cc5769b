#include "ops.h"

#include <c10/util/irange.h>

#include <algorithm>
#include <cstdint>
#include <utility>

namespace vflow {
namespace {

bool allowed_grad_dtype(at::ScalarType acc, at::ScalarType grad) {
  const bool narrow = grad == at::kFloat || grad == at::kBFloat16 || grad == at::kHalf;
  if (acc == at::kFloat) {
    return narrow;
  }
  return acc == at::kDouble && (narrow || grad == at::kDouble);
}

void check_buffer(const at::Tensor& buf, const char* name) {
  TORCH_CHECK(buf.defined(), name, " must be a defined tensor");
  TORCH_CHECK(
      buf.scalar_type() == at::kFloat || buf.scalar_type() == at::kDouble,
      name, " must be float32 or float64, got ", buf.scalar_type());
  TORCH_CHECK(buf.is_contiguous(), name, " must be contiguous");
  TORCH_CHECK(buf.device().is_cpu() || buf.device().is_cuda(),
              name, " must be on a CPU or CUDA device, got ", buf.device());
}

// Two accumulators sharing memory would be updated by different threads (CPU) or
// blocks (CUDA) without ordering: a silent race. Rejecting overlap costs a sort of
// the list, nothing next to the pass over the data.
void check_no_overlap(const std::vector<at::Tensor>& accs) {
  std::vector<std::pair<uintptr_t, uintptr_t>> ranges;
  ranges.reserve(accs.size());
  for (const at::Tensor& acc : accs) {
    const auto begin = reinterpret_cast<uintptr_t>(acc.data_ptr());
    ranges.emplace_back(begin, begin + acc.numel() * acc.element_size());
  }
  std::sort(ranges.begin(), ranges.end());
  for (size_t i = 1; i < ranges.size(); ++i) {
    TORCH_CHECK(ranges[i].first >= ranges[i - 1].second,
                "accs must not overlap: two accumulators share memory");
  }
}

} // namespace

[[noreturn]] void no_cuda(const char* what) {
  TORCH_CHECK(false, what, ": this build of vflow has no CUDA kernels; rebuild with a CUDA "
              "build of torch and nvcc available (see README, 'CUDA build')");
}

FusedPairs prepare_multi_accumulate(
    at::TensorList accs,
    at::TensorList grads,
    double weight,
    bool overwrite) {
  TORCH_CHECK(accs.size() == grads.size(), "accs and grads must have the same length, got ",
              accs.size(), " and ", grads.size());
  // See Note [Kernel contracts]: only contiguous, non-empty pairs reach a kernel.
  FusedPairs fused;
  fused.accs.reserve(accs.size());
  fused.grads.reserve(grads.size());
  c10::optional<at::Device> device;
  for (const auto i : c10::irange(accs.size())) {
    const at::Tensor& acc = accs[i];
    const at::Tensor& grad = grads[i];
    TORCH_CHECK(acc.defined() && grad.defined(), "accs[", i, "] and grads[", i,
                "] must be defined tensors");
    TORCH_CHECK(acc.scalar_type() == at::kFloat || acc.scalar_type() == at::kDouble,
                "accs[", i, "] must be float32 or float64, got ", acc.scalar_type());
    TORCH_CHECK(allowed_grad_dtype(acc.scalar_type(), grad.scalar_type()), "grads[", i,
                "] has dtype ", grad.scalar_type(), ", which cannot be accumulated into a ",
                acc.scalar_type(), " accumulator (float32 takes float32/bfloat16/float16, "
                "float64 also takes float64)");
    TORCH_CHECK(acc.is_contiguous(), "accs[", i, "] must be contiguous");
    TORCH_CHECK(acc.sizes() == grad.sizes(), "grads[", i, "] has shape ", grad.sizes(),
                " but accs[", i, "] has shape ", acc.sizes());
    TORCH_CHECK(acc.device() == grad.device(), "grads[", i, "] is on ", grad.device(),
                " but accs[", i, "] is on ", acc.device());
    TORCH_CHECK(!grad.is_sparse(), "grads[", i, "] is sparse; only dense gradients are supported");
    if (!device) {
      device = acc.device();
    }
    TORCH_CHECK(acc.device() == *device, "all tensors must be on one device, accs[", i,
                "] is on ", acc.device(), " but accs[0] is on ", *device);
    if (acc.numel() == 0) {
      continue;
    }
    if (!grad.is_contiguous()) {
      // Rare (e.g. a channels_last parameter): the strided TensorIterator path is exact
      // and avoids materialising a contiguous copy of the gradient.
      if (overwrite) {
        // Widen first so the product is rounded in the accumulator dtype.
        acc.copy_(grad).mul_(weight);
      } else {
        acc.add_(grad, weight);
      }
      continue;
    }
    fused.accs.push_back(acc);
    fused.grads.push_back(grad);
  }
  if (!fused.accs.empty()) {
    check_no_overlap(fused.accs);
  }
  return fused;
}

bool prepare_scale(const at::Tensor& buf, double factor) {
  check_buffer(buf, "buf");
  return buf.numel() > 0 && factor != 1.0;
}

bool prepare_scale_check(const at::Tensor& buf, const at::Tensor& found_nonfinite) {
  check_buffer(buf, "buf");
  TORCH_CHECK(found_nonfinite.defined() && found_nonfinite.dim() == 0 &&
                  found_nonfinite.scalar_type() == at::kFloat,
              "found_nonfinite must be a 0-dim float32 tensor");
  TORCH_CHECK(found_nonfinite.device() == buf.device(), "found_nonfinite is on ",
              found_nonfinite.device(), " but buf is on ", buf.device());
  return buf.numel() > 0;
}

void multi_accumulate_(
    const std::vector<at::Tensor>& accs,
    const std::vector<at::Tensor>& grads,
    double weight,
    bool overwrite) {
  if (accs.empty() && grads.empty()) {
    // The dispatcher needs a tensor to pick a backend; there is no work anyway.
    return;
  }
  static const auto op =
      find_op<void(at::TensorList, at::TensorList, double, bool)>("vflow::multi_accumulate_");
  op.call(accs, grads, weight, overwrite);
}

void scale_(const at::Tensor& buf, double factor) {
  static const auto op = find_op<void(const at::Tensor&, double)>("vflow::scale_");
  op.call(buf, factor);
}

void scale_check_(const at::Tensor& buf, double factor, const at::Tensor& found_nonfinite) {
  static const auto op = find_op<void(const at::Tensor&, double, const at::Tensor&)>(
      "vflow::scale_check_");
  op.call(buf, factor, found_nonfinite);
}

bool built_with_cuda() {
#ifdef VFLOW_WITH_CUDA
  return true;
#else
  return false;
#endif
}

} // namespace vflow
