// The default reduction: float accumulation in the GradBuffer and one asynchronous
// collective per bucket on its slice of the buffer, started as soon as the bucket is
// final (Note [Overlap with backward], csrc/reducer.h): an all-reduce (SUM), or for a
// small CPU bucket an all-gather (Note [Small buckets by all-gather]). The VN weights
// already hold 1/B for mean losses, so the plain sum over workers is the global-batch
// gradient whatever each worker's number or size of VNs.
//
// Note [Small buckets by all-gather]
// Gloo's all-reduce is a ring of 2(W-1) rounds of messages (a reduce-scatter, then an
// all-gather of the reduced chunks); an all-gather alone takes W-1. For a small bucket
// the rounds' latency is the whole cost: on this 2-core machine a synchronous
// all-reduce of 531 floats took 0.40 ms on 2 Gloo ranks and an all-gather of them
// 0.30 ms; on 3 ranks 1.31 against 0.82 ms (benchmarks/README.md, "The ranks2 row").
// So a CPU bucket of which every worker would receive at most kGatherBytes in all goes
// by one all-gather of the workers' buckets, and every worker then adds the W blocks in
// rank order, (b0 + b1) + b2 + ..., into its buffer. All workers add the same blocks in
// the same order, so they stay equal. With two workers the bits are the all-reduce's
// (one addition, which commutes); with more, the order of the additions is the ranks'
// where it was the ring's, which the default kind leaves open (deterministic mode fixes
// its own, Note [Ordered sum]). Bucket 0's statistics ride at the end of its block
// (Note [Statistics ride with bucket 0]). Every worker decides alike, from the bucket's
// size, the statistics' size and W. A bucket on a GPU keeps the all-reduce: NCCL
// reduces small messages over a tree in about log W rounds, which a ring all-gather of
// W-1 rounds would not beat at scale (not measured here: no GPU).
#include "reduction.h"

#include <ATen/record_function.h>
#include <c10/util/irange.h>

#include <utility>

namespace vflow {

void AllReduceSum::fold(const BucketInfo& bucket, const std::vector<int64_t>& slots,
                        std::vector<at::Tensor>& grads, double weight, bool first) {
  buffers_[bucket.buffer]->accumulate_(slots, grads, weight, /*overwrite=*/first);
}

void AllReduceSum::zero(const BucketInfo& bucket, int64_t begin, int64_t numel) {
  buffers_[bucket.buffer]->data().narrow(0, begin, numel).zero_();
}

bool AllReduceSum::gathers(size_t index, const Comm& comm, int64_t pieces) const {
  const at::Tensor& flat = buckets_[index].flat;
  const int64_t received =
      comm.size() * (flat.numel() + pieces) * static_cast<int64_t>(flat.element_size());
  return comm.size() > 1 && flat.is_cpu() && received <= kGatherBytes;
}

void AllReduceSum::start(size_t index, Comm& comm) {
  if (!comm.reduces()) {
    return;
  }
  const at::Tensor& flat = buckets_[index].flat;
  const bool with_stats = index == 0 && stats_.defined();
  if (gathers(index, comm, with_stats ? kStatsPieces * stats_.numel() : 0)) {
    start_gathered(index, comm);
    return;
  }
  if (!with_stats) {
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

// Note [Small buckets by all-gather].
void AllReduceSum::start_gathered(size_t index, Comm& comm) {
  if (gathers_.size() != buckets_.size()) {
    gathers_.resize(buckets_.size());
  }
  Gather& gather = gathers_[index];
  const at::Tensor& flat = buckets_[index].flat;
  const int64_t n = flat.numel();
  const int64_t pieces = index == 0 && stats_.defined() ? kStatsPieces * stats_.numel() : 0;
  const int64_t size = n + pieces;
  if (!gather.block.defined() || gather.block.numel() != size ||
      static_cast<int64_t>(gather.blocks.size()) != comm.size()) {
    gather.block = at::empty({size}, flat.options());
    gather.blocks.clear();
    for (int64_t r = 0; r < comm.size(); ++r) {
      gather.blocks.push_back(at::empty({size}, flat.options()));
    }
  }
  gather.block.narrow(0, 0, n).copy_(flat);
  if (pieces > 0) {
    encode_stats(stats_, gather.block.narrow(0, n, pieces));
    stats_sum_ = at::Tensor();
  }
  gather.pieces = pieces;
  works_[index] = comm.all_gather(
      gather.block, gather.blocks,
      "all-gather of " + bucket_name(index) + (pieces > 0 ? " and the step's statistics" : ""));
  gather.in_flight = true;
}

void AllReduceSum::land_gathered(size_t index, Comm& comm) {
  if (index >= gathers_.size() || !gathers_[index].in_flight) {
    return;
  }
  Gather& gather = gathers_[index];
  gather.in_flight = false;
  auto work = std::move(works_[index]);
  if (work) {
    comm.wait(work, "all-gather of " + bucket_name(index));
  }
  RECORD_FUNCTION("vflow::combine", std::vector<c10::IValue>());
  at::Tensor& flat = buckets_[index].flat;
  const int64_t n = flat.numel();
  const std::vector<at::Tensor>& blocks = gather.blocks;
  at::add_out(flat, blocks[0].narrow(0, 0, n), blocks[1].narrow(0, 0, n));
  for (size_t r = 2; r < blocks.size(); ++r) {
    flat.add_(blocks[r].narrow(0, 0, n));
  }
  if (gather.pieces > 0) {
    at::Tensor summed = blocks[0].narrow(0, n, gather.pieces).clone();
    for (size_t r = 1; r < blocks.size(); ++r) {
      summed.add_(blocks[r].narrow(0, n, gather.pieces));
    }
    stats_sum_ = decode_stats(summed);
  }
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
  land_gathered(0, comm);
  land_carrier(comm);
  TORCH_CHECK(stats_sum_.defined(), "no statistics rode with bucket 0 in this step");
  // Handed over, not kept: a tensor Python holds is released by Python alone (Note
  // [Collectives on tensors Python cannot see], csrc/collectives.h).
  return std::move(stats_sum_);
}

void AllReduceSum::wait_all(Comm& comm) {
  land_carrier(comm);
  for (const auto b : c10::irange(gathers_.size())) {
    land_gathered(b, comm);
  }
  Reduction::wait_all(comm);
}

std::vector<c10::intrusive_ptr<c10d::Work>> AllReduceSum::take_in_flight() {
  carrying_ = false;
  // A collective still in flight holds its own references to the blocks; the next step
  // gathers into new ones.
  gathers_.clear();
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
