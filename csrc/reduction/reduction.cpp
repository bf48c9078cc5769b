#include "reduction.h"

#include <c10/util/Exception.h>

#include <sstream>

namespace vflow {

void Reduction::bind(const std::vector<std::shared_ptr<GradBuffer>>& buffers,
                     const std::vector<BucketInfo>& buckets) {
  TORCH_CHECK(!bound(), "this ", kind(), " reduction is already used by a Reducer; make one "
              "per Reducer");
  TORCH_CHECK(!buffers.empty(), "a reduction needs at least one buffer");
  buffers_ = buffers;
  buckets_ = buckets;
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
