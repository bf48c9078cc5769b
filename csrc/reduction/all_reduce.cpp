// The default reduction: float accumulation in the GradBuffer and one asynchronous
// all-reduce (SUM) per bucket on its slice of the buffer, started as soon as the bucket
// is final (Note [Overlap with backward], csrc/reducer.h). The VN weights already hold
// 1/B for mean losses, so the plain sum over workers is the global-batch gradient
// whatever each worker's number or size of VNs.
#include "reduction.h"

#include <utility>

namespace vflow {

void AllReduceSum::fold(const BucketInfo& bucket, const std::vector<int64_t>& slots,
                        std::vector<at::Tensor>& grads, double weight, bool first) {
  buffers_[bucket.buffer]->accumulate_(slots, grads, weight, /*overwrite=*/first);
}

void AllReduceSum::zero(const BucketInfo& bucket, int64_t begin, int64_t numel) {
  buffers_[bucket.buffer]->data().narrow(0, begin, numel).zero_();
}

void AllReduceSum::start(size_t index, Comm& comm) {
  if (!comm.reduces()) {
    return;
  }
  const at::Tensor& flat = buckets_[index].flat;
  if (index != 0 || !stats_.defined()) {
    works_[index] = comm.all_reduce(flat, bucket_name(index));
    return;
  }
  // Note [Statistics ride with bucket 0].
  const int64_t n = flat.numel();
  const int64_t total = n + kStatsPieces * stats_.numel();
  if (!carrier_.defined() || carrier_.numel() != total) {
    carrier_ = at::empty({total}, flat.options());
  }
  carrier_.narrow(0, 0, n).copy_(flat);
  encode_stats(stats_, carrier_.narrow(0, n, total - n));
  works_[0] = comm.all_reduce(carrier_, bucket_name(0) + " and the step's statistics");
  carrying_ = true;
  stats_sum_ = at::Tensor();
}

bool AllReduceSum::carries_stats(const Comm& comm, int64_t numel) const {
  const at::Tensor& flat = buckets_[0].flat;
  return comm.reduces() &&
      flat.numel() * static_cast<int64_t>(flat.element_size()) <= kCarryBytes;
}

void AllReduceSum::land_carrier(Comm& comm) {
  if (!carrying_) {
    return;
  }
  carrying_ = false;
  auto work = std::move(works_[0]);
  if (work) {
    comm.wait(work, bucket_name(0) + " and the step's statistics");
  }
  const at::Tensor& flat = buckets_[0].flat;
  const int64_t n = flat.numel();
  flat.copy_(carrier_.narrow(0, 0, n));
  stats_sum_ = decode_stats(carrier_.narrow(0, n, carrier_.numel() - n));
}

at::Tensor AllReduceSum::wait_stats(Comm& comm) {
  land_carrier(comm);
  TORCH_CHECK(stats_sum_.defined(), "no statistics rode with bucket 0 in this step");
  // Handed over, not kept: a tensor Python holds is released by Python alone (Note
  // [Collectives on tensors Python cannot see], csrc/collectives.h).
  return std::move(stats_sum_);
}

void AllReduceSum::wait_all(Comm& comm) {
  land_carrier(comm);
  Reduction::wait_all(comm);
}

std::vector<c10::intrusive_ptr<c10d::Work>> AllReduceSum::take_in_flight() {
  carrying_ = false;
  return Reduction::take_in_flight();
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
