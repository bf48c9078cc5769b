// The default reduction: float accumulation in the GradBuffer and one asynchronous
// all-reduce (SUM) per bucket on its slice of the buffer, started as soon as the bucket
// is final (Note [Overlap with backward], csrc/reducer.h). The VN weights already hold
// 1/B for mean losses, so the plain sum over workers is the global-batch gradient
// whatever each worker's number or size of VNs.
#include "reduction.h"

namespace vflow {

void AllReduceSum::fold(const BucketInfo& bucket, const std::vector<int64_t>& slots,
                        std::vector<at::Tensor>& grads, double weight, bool first) {
  buffers_[bucket.buffer]->accumulate_(slots, grads, weight, /*overwrite=*/first);
}

void AllReduceSum::zero(const BucketInfo& bucket, int64_t begin, int64_t numel) {
  buffers_[bucket.buffer]->data().narrow(0, begin, numel).zero_();
}

void AllReduceSum::start(size_t index, Comm& comm) {
  if (comm.reduces()) {
    works_[index] = comm.all_reduce(buckets_[index].flat, bucket_name(index));
  }
}

int64_t AllReduceSum::bytes_per_step(const Comm& comm) const {
  if (!comm.reduces()) {
    return 0;
  }
  int64_t bytes = 0;
  for (const auto& bucket : buckets_) {
    bytes += bucket.flat.numel() * static_cast<int64_t>(bucket.flat.element_size());
  }
  return bytes;
}

} // namespace vflow
