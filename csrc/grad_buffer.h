// GradBuffer: one flat, contiguous accumulation buffer for a group of parameters.
//
// Note [Flat buffer layout]
// Parameters of one device and one accumulation dtype share a single 1-D tensor.
// Slot i holds parameter i's gradient, shaped like the parameter and contiguous,
// and starts at an offset aligned to kAlignBytes so that every slot can use the
// widest vector loads (AVX-512 / 16-byte CUDA accesses) without a scalar prologue.
// The padding between slots is zero at construction and is never written by
// accumulate (only by whole-buffer passes, which keep zero as zero), so whole-buffer
// operations — zero, scale, non-finite checks, casts, and the all-reduce of later
// issues — are one pass over one tensor instead of one per parameter.
// `param.grad` is set to the slot views by the Python layer, so optimizers read the
// buffer directly: no copy between "accumulated gradient" and "gradient".
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

namespace vflow {

class GradBuffer {
 public:
  static constexpr int64_t kAlignBytes = 64;

  // Lays out slots for `params` (one device; floating point; any dtype) in a new
  // zero-filled buffer of `dtype` (float32 or float64) on the parameters' device.
  // Only shapes, device and count are read from `params`; nothing is retained.
  GradBuffer(const std::vector<at::Tensor>& params, at::ScalarType dtype);

  // The flat buffer, padding included.
  const at::Tensor& data() const {
    return data_;
  }

  // Views of slot i (shaped like parameter i) into the buffer.
  const std::vector<at::Tensor>& views() const {
    return views_;
  }

  // Views with this buffer's layout into another flat tensor of the same numel
  // (any dtype, any device), e.g. a low-precision copy handed to an optimizer.
  std::vector<at::Tensor> views_of(const at::Tensor& flat) const;

  // slot[indices[k]] += weight * grads[k] for every k in one fused kernel call
  // (= instead of += with `overwrite`). grads[k] must match parameter indices[k]'s
  // shape and the buffer's device; see multi_accumulate_ for the allowed dtypes.
  // Indices must be distinct.
  void accumulate_(
      const std::vector<int64_t>& indices,
      const std::vector<at::Tensor>& grads,
      double weight,
      bool overwrite = false);

  // Sets slots [first, last] and the padding between them to zero in one pass.
  void zero_slots_(int64_t first, int64_t last);

  // Sets the whole buffer (padding included) to zero in one pass.
  void zero_();

  // Multiplies the whole buffer by `factor` in one pass.
  void scale_(double factor);

  // Multiplies the whole buffer by `factor` and reports non-finite results in the
  // same pass through `found_nonfinite`; see Note [Non-finite flag] in ops.h.
  void scale_check_(double factor, const at::Tensor& found_nonfinite);

  int64_t num_slots() const {
    return static_cast<int64_t>(views_.size());
  }
  const std::vector<int64_t>& offsets() const {
    return offsets_;
  }
  const std::vector<int64_t>& numels() const {
    return numels_;
  }

 private:
  at::Tensor data_;
  std::vector<at::Tensor> views_;
  std::vector<int64_t> offsets_;
  std::vector<int64_t> numels_;
  std::vector<std::vector<int64_t>> shapes_;
};

} // namespace vflow
