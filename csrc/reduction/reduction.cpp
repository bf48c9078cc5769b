#include "reduction.h"

#include <c10/util/Exception.h>
#include <c10/util/irange.h>

#include <ATen/Dispatch.h>

#include <cstring>
#include <sstream>

namespace vflow {

// Note [Statistics ride with bucket 0]: piece k of value i is bits 16k..16k+15 of its
// float64, stored at out[k * numel + i].
void encode_stats(const at::Tensor& stats, const at::Tensor& out) {
  const int64_t n = stats.numel();
  TORCH_CHECK(stats.scalar_type() == at::kDouble && stats.dim() == 1,
              "the statistics must be a 1-D float64 tensor");
  TORCH_CHECK(out.numel() == kStatsPieces * n && out.is_contiguous(),
              "the statistics' pieces need ", kStatsPieces * n, " contiguous elements");
  if (stats.is_cpu() && out.is_cpu()) {
    const at::Tensor values = stats.contiguous();
    const double* src = values.data_ptr<double>();
    AT_DISPATCH_FLOATING_TYPES(out.scalar_type(), "vflow_encode_stats", [&] {
      scalar_t* dst = out.data_ptr<scalar_t>();
      for (int64_t i = 0; i < n; ++i) {
        uint64_t bits = 0;
        std::memcpy(&bits, &src[i], sizeof(bits));
        for (int64_t k = 0; k < kStatsPieces; ++k) {
          dst[k * n + i] = static_cast<scalar_t>((bits >> (16 * k)) & 0xFFFFu);
        }
      }
    });
    return;
  }
  const at::Tensor bits = stats.contiguous().view(at::kLong);
  std::vector<at::Tensor> pieces;
  for (int64_t k = 0; k < kStatsPieces; ++k) {
    pieces.push_back(at::bitwise_and(at::bitwise_right_shift(bits, 16 * k), 0xFFFF));
  }
  out.view({kStatsPieces, n}).copy_(at::stack(pieces));
}

at::Tensor decode_stats(const at::Tensor& pieces) {
  TORCH_CHECK(pieces.dim() == 1 && pieces.numel() % kStatsPieces == 0,
              "the statistics' pieces must be a 1-D tensor of a multiple of ", kStatsPieces,
              " elements");
  const int64_t n = pieces.numel() / kStatsPieces;
  if (pieces.is_cpu()) {
    const at::Tensor summed = pieces.contiguous();
    at::Tensor out = at::empty({n}, summed.options().dtype(at::kDouble));
    double* dst = out.data_ptr<double>();
    AT_DISPATCH_FLOATING_TYPES(summed.scalar_type(), "vflow_decode_stats", [&] {
      const scalar_t* src = summed.data_ptr<scalar_t>();
      for (int64_t i = 0; i < n; ++i) {
        uint64_t bits = 0;
        for (int64_t k = 0; k < kStatsPieces; ++k) {
          bits |= static_cast<uint64_t>(src[k * n + i]) << (16 * k);
        }
        std::memcpy(&dst[i], &bits, sizeof(bits));
      }
    });
    return out;
  }
  const at::Tensor parts = pieces.view({kStatsPieces, n}).to(at::kLong);
  at::Tensor bits = parts[0].clone();
  for (int64_t k = 1; k < kStatsPieces; ++k) {
    bits = at::bitwise_or(bits, at::bitwise_left_shift(parts[k], 16 * k));
  }
  return bits.view(at::kDouble);
}

void Reduction::bind(const std::vector<std::shared_ptr<GradBuffer>>& buffers,
                     const std::vector<BucketInfo>& buckets) {
  TORCH_CHECK(!bound(), "this ", kind(), " reduction is already used by a Reducer; make one "
              "per Reducer");
  TORCH_CHECK(!buffers.empty(), "a reduction needs at least one buffer");
  buffers_ = buffers;
  buckets_ = buckets;
  works_.assign(buckets.size(), {});
}

void Reduction::wait_all(Comm& comm) {
  for (const auto b : c10::irange(works_.size())) {
    auto work = std::move(works_[b]);
    if (work) {
      comm.wait(work, bucket_name(b));
    }
  }
}

std::vector<c10::intrusive_ptr<c10d::Work>> Reduction::take_in_flight() {
  std::vector<c10::intrusive_ptr<c10d::Work>> out;
  for (auto& work : works_) {
    if (work) {
      out.push_back(std::move(work));
    }
  }
  return out;
}

void Reduction::begin_step() {
  in_step_ = true;
}

void Reduction::end_step() {
  in_step_ = false;
  stats_ = at::Tensor();
}

at::Tensor Reduction::wait_stats(Comm& comm) {
  TORCH_CHECK(false, "the ", kind(), " reduction does not carry the step's statistics");
}

void Reduction::begin_vn(int64_t level, int64_t merges) {
  TORCH_CHECK(level == 0 && merges == 0, "level and merges are for the ordered reduction only");
}

std::string Reduction::bucket_name(size_t index) const {
  const auto& bucket = buckets_[index];
  const double megabytes = static_cast<double>(bucket.flat.numel()) *
      static_cast<double>(bucket.flat.element_size()) / (1024.0 * 1024.0);
  std::ostringstream out;
  out << "all-reduce of gradient bucket " << index << " of " << buckets_.size() << " ("
      << megabytes << " MB)";
  return out.str();
}

} // namespace vflow
