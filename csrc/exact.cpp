#include "exact.h"

#include "ops.h"

#include <c10/util/Exception.h>

namespace vflow {
namespace {

void check_slice(const at::Tensor& t, const char* name, at::ScalarType dtype, int64_t numel,
                 const at::Device& device) {
  TORCH_CHECK(t.defined(), name, " must be a defined tensor");
  TORCH_CHECK(t.scalar_type() == dtype, name, " must have dtype ", dtype, ", got ",
              t.scalar_type());
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
  TORCH_CHECK(t.numel() == numel, name, " has ", t.numel(), " elements, expected ", numel);
  TORCH_CHECK(t.device() == device, name, " is on ", t.device(), " but the first tensor is on ",
              device);
}

// The tensor the others of a call are checked against (numel and device).
void check_first(const at::Tensor& top, const char* name) {
  TORCH_CHECK(top.defined(), name, " must be a defined tensor");
  TORCH_CHECK(top.device().is_cpu() || top.device().is_cuda(), name,
              " must be on a CPU or CUDA device, got ", top.device());
  check_slice(top, name, at::kChar, top.numel(), top.device());
}

void check_limbs(const at::Tensor& top, const at::Tensor& l0, const at::Tensor& l1,
                 const at::Tensor& l2, const char* top_name) {
  check_first(top, top_name);
  check_slice(l0, "l0", at::kInt, top.numel(), top.device());
  check_slice(l1, "l1", at::kInt, top.numel(), top.device());
  check_slice(l2, "l2", at::kInt, top.numel(), top.device());
}

} // namespace

std::optional<at::Tensor> prepare_exact_accumulate(
    const at::Tensor& top, const at::Tensor& l0, const at::Tensor& l1, const at::Tensor& l2,
    const at::Tensor& grad) {
  check_limbs(top, l0, l1, l2, "top");
  TORCH_CHECK(grad.defined(), "grad must be a defined tensor");
  TORCH_CHECK(grad.scalar_type() == at::kFloat || grad.scalar_type() == at::kBFloat16 ||
                  grad.scalar_type() == at::kHalf,
              "grad must be float32, bfloat16 or float16 for exact accumulation, got ",
              grad.scalar_type());
  TORCH_CHECK(grad.numel() == top.numel(), "grad has ", grad.numel(),
              " elements but the accumulator has ", top.numel());
  TORCH_CHECK(grad.device() == top.device(), "grad is on ", grad.device(),
              " but the accumulator is on ", top.device());
  if (top.numel() == 0) {
    return std::nullopt;
  }
  // Rare (channels_last parameters): one contiguous copy keeps the kernels simple.
  return grad.contiguous();
}

bool prepare_exact_pack(
    const at::Tensor& local_top, const at::Tensor& global_top, const at::Tensor& l0,
    const at::Tensor& l1, const at::Tensor& l2, const at::Tensor& wire) {
  check_limbs(local_top, l0, l1, l2, "local_top");
  check_slice(global_top, "global_top", at::kChar, local_top.numel(), local_top.device());
  check_slice(wire, "wire", at::kLong, local_top.numel(), local_top.device());
  return local_top.numel() > 0;
}

bool prepare_exact_unpack(const at::Tensor& global_top, const at::Tensor& wire,
                          const at::Tensor& out) {
  check_first(global_top, "global_top");
  check_slice(wire, "wire", at::kLong, global_top.numel(), global_top.device());
  check_slice(out, "out", at::kFloat, global_top.numel(), global_top.device());
  return global_top.numel() > 0;
}

void exact_accumulate_(
    const at::Tensor& top,
    const at::Tensor& l0,
    const at::Tensor& l1,
    const at::Tensor& l2,
    const at::Tensor& grad,
    double weight,
    bool fresh) {
  static const auto op = find_op<void(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                      const at::Tensor&, const at::Tensor&, double, bool)>(
      "vflow::exact_accumulate_");
  op.call(top, l0, l1, l2, grad, weight, fresh);
}

void exact_pack_(
    const at::Tensor& local_top,
    const at::Tensor& global_top,
    const at::Tensor& l0,
    const at::Tensor& l1,
    const at::Tensor& l2,
    const at::Tensor& wire) {
  static const auto op = find_op<void(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                      const at::Tensor&, const at::Tensor&, const at::Tensor&)>(
      "vflow::exact_pack_");
  op.call(local_top, global_top, l0, l1, l2, wire);
}

void exact_unpack_(const at::Tensor& global_top, const at::Tensor& wire, const at::Tensor& out,
                   double factor) {
  static const auto op =
      find_op<void(const at::Tensor&, const at::Tensor&, const at::Tensor&, double)>(
          "vflow::exact_unpack_");
  op.call(global_top, wire, out, factor);
}

} // namespace vflow
