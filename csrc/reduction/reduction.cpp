#include "reduction.h"

#include <c10/util/Exception.h>
#include <c10/util/irange.h>

#include <sstream>

namespace vflow {

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
