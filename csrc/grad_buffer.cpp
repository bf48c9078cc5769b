#include "grad_buffer.h"

#include "ops.h"

#include <c10/util/irange.h>

namespace vflow {

GradBuffer::GradBuffer(const std::vector<at::Tensor>& params, at::ScalarType dtype) {
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kDouble,
              "dtype must be torch.float32 or torch.float64, got ", dtype);
  TORCH_CHECK(!params.empty(), "params must hold at least one tensor");
  const at::Device device = params.front().device();
  const int64_t align = kAlignBytes / static_cast<int64_t>(c10::elementSize(dtype));
  int64_t total = 0;
  offsets_.reserve(params.size());
  numels_.reserve(params.size());
  shapes_.reserve(params.size());
  for (const auto i : c10::irange(params.size())) {
    const at::Tensor& p = params[i];
    TORCH_CHECK(p.defined(), "params[", i, "] is undefined");
    TORCH_CHECK(p.is_floating_point(), "params[", i, "] must be floating point, got ",
                p.scalar_type());
    TORCH_CHECK(p.device() == device, "params[", i, "] is on ", p.device(),
                " but params[0] is on ", device, "; use one GradBuffer per device");
    offsets_.push_back(total);
    numels_.push_back(p.numel());
    shapes_.push_back(p.sizes().vec());
    total += (p.numel() + align - 1) / align * align;
  }
  data_ = at::zeros({total}, at::TensorOptions().dtype(dtype).device(device));
  views_ = views_of(data_);
}

std::vector<at::Tensor> GradBuffer::views_of(const at::Tensor& flat) const {
  TORCH_CHECK(flat.dim() == 1 && flat.is_contiguous(),
              "flat must be a contiguous 1-D tensor");
  TORCH_CHECK(!data_.defined() || flat.numel() == data_.numel(), "flat has ", flat.numel(),
              " elements but this buffer's layout needs ", data_.numel());
  std::vector<at::Tensor> out;
  out.reserve(offsets_.size());
  for (const auto i : c10::irange(offsets_.size())) {
    out.push_back(flat.narrow(0, offsets_[i], numels_[i]).view(shapes_[i]));
  }
  return out;
}

void GradBuffer::accumulate_(
    const std::vector<int64_t>& indices,
    const std::vector<at::Tensor>& grads,
    double weight,
    bool overwrite) {
  TORCH_CHECK(indices.size() == grads.size(), "indices and grads must have the same length, got ",
              indices.size(), " and ", grads.size());
  std::vector<at::Tensor> accs;
  accs.reserve(indices.size());
  // Two gradients for one slot would race in the parallel kernels.
  std::vector<bool> seen(views_.size(), false);
  for (const auto k : c10::irange(indices.size())) {
    const int64_t index = indices[k];
    TORCH_CHECK(index >= 0 && index < num_slots(), "indices[", k, "]=", index,
                " is out of range for a buffer of ", num_slots(), " slots");
    TORCH_CHECK(!seen[index], "indices[", k, "]=", index, " appears more than once");
    seen[index] = true;
    accs.push_back(views_[index]);
  }
  multi_accumulate_(accs, grads, weight, overwrite);
}

void GradBuffer::zero_() {
  data_.zero_();
}

void GradBuffer::zero_slots_(int64_t first, int64_t last) {
  TORCH_CHECK(0 <= first && first <= last && last < num_slots(), "slots [", first, ", ", last,
              "] are not a valid range of a buffer of ", num_slots(), " slots");
  const int64_t end = offsets_[last] + numels_[last];
  data_.narrow(0, offsets_[first], end - offsets_[first]).zero_();
}

void GradBuffer::scale_(double factor) {
  vflow::scale_(data_, factor);
}

void GradBuffer::scale_check_(double factor, const at::Tensor& found_nonfinite) {
  vflow::scale_check_(data_, factor, found_nonfinite);
}

} // namespace vflow
