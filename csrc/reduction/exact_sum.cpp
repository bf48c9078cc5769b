// Note [Exact buckets]
// In exact mode (deterministic="exact" in Python) a bucket's gradients are folded into
// the integer accumulators of Note [Exact accumulation] (csrc/exact.h) instead of the
// float buffer, and a bucket is reduced in two collectives. When it becomes final in
// the last VN, an all-reduce (MAX) of its top bins runs at once and the thread that
// made the bucket final (autograd's) waits for it; the worker then packs its limbs
// against the global top bins and starts the all-reduce (SUM) of the packed int64s
// asynchronously, so the SUM overlaps the rest of backward as the float path's
// all-reduce does. Waiting inside backward costs little: the MAX carries one byte per
// element, and it only waits for the other workers to complete the same bucket.
// Every rank issues stats, MAX 0, SUM 0, MAX 1, SUM 1, ... in that order (Note
// [Launch order], csrc/reducer.h). `write_result` writes the float buffer by unpacking
// the sums together with the step's factor.
// One process (or a group of one) packs against its own top bins: the same integers
// as the reduced path, since the sum is exact either way. Nothing here depends on the
// worker set: a new one needs no rebuilt state.
#include "reduction.h"

#include "../exact.h"

#include <c10/util/irange.h>

namespace vflow {

namespace {

// The bytes of one element of a bucket on the wire: an int8 top bin (MAX) and an int64
// packed sum (SUM).
constexpr int64_t kWireBytes = 1 + 8;

} // namespace

void ExactSum::bind(const std::vector<std::shared_ptr<GradBuffer>>& buffers,
                    const std::vector<BucketInfo>& buckets) {
  for (const auto b : c10::irange(buffers.size())) {
    TORCH_CHECK(buffers[b]->data().scalar_type() == at::kFloat, "exact accumulation needs "
                "float32 accumulators, but buffer ", b, " is ", buffers[b]->data().scalar_type());
  }
  Reduction::bind(buffers, buckets);
  for (const auto& buffer : buffers) {
    const auto numel = buffer->data().numel();
    const auto options = buffer->data().options();
    states_.push_back({at::zeros({numel}, options.dtype(at::kChar)),
                       at::zeros({exact::kLimbs, numel}, options.dtype(at::kInt)),
                       at::zeros({numel}, options.dtype(at::kChar)),
                       at::zeros({numel}, options.dtype(at::kLong))});
  }
}

at::Tensor ExactSum::slice(const at::Tensor& plane, const BucketInfo& bucket) const {
  return plane.narrow(0, bucket.offset, bucket.flat.numel());
}

// One kernel call per gradient: these passes are long next to a call's overhead.
void ExactSum::fold(const BucketInfo& bucket, const std::vector<int64_t>& slots,
                    std::vector<at::Tensor>& grads, double weight, bool first) {
  const GradBuffer& buffer = *buffers_[bucket.buffer];
  const State& state = states_[bucket.buffer];
  for (const auto k : c10::irange(slots.size())) {
    const int64_t offset = buffer.offsets()[slots[k]];
    const int64_t numel = buffer.numels()[slots[k]];
    TORCH_CHECK(grads[k].numel() == numel, "the gradient of slot ", slots[k], " has ",
                grads[k].numel(), " elements, expected ", numel);
    exact_accumulate_(state.top.narrow(0, offset, numel), state.limbs[0].narrow(0, offset, numel),
                      state.limbs[1].narrow(0, offset, numel),
                      state.limbs[2].narrow(0, offset, numel), grads[k], weight, first);
    grads[k] = at::Tensor();  // freed now: see Note [Fold granularity]
  }
}

void ExactSum::zero(const BucketInfo& bucket, int64_t begin, int64_t numel) {
  const State& state = states_[bucket.buffer];
  state.top.narrow(0, begin, numel).zero_();
  state.limbs.narrow(1, begin, numel).zero_();
}

void ExactSum::start(size_t index, Comm& comm) {
  const BucketInfo& bucket = buckets_[index];
  const State& state = states_[bucket.buffer];
  const at::Tensor top = slice(state.top, bucket);
  at::Tensor global_top = top;
  reduced_ = comm.reduces();
  if (reduced_) {
    global_top = slice(state.global_top, bucket);
    global_top.copy_(top);
    const std::string what = "all-reduce (MAX) of the exponents of " + bucket_name(index);
    comm.wait(comm.all_reduce(global_top, what, c10d::ReduceOp::MAX), what);
  }
  const at::Tensor wire = slice(state.wire, bucket);
  exact_pack_(top, global_top, slice(state.limbs[0], bucket), slice(state.limbs[1], bucket),
              slice(state.limbs[2], bucket), wire);
  if (reduced_) {
    works_[index] = comm.all_reduce(wire, bucket_name(index));
  }
}

double ExactSum::write_result(double factor) {
  for (const auto& bucket : buckets_) {
    const State& state = states_[bucket.buffer];
    exact_unpack_(slice(reduced_ ? state.global_top : state.top, bucket),
                  slice(state.wire, bucket), bucket.flat, factor);
  }
  return 1.0;  // applied by the unpacking
}

int64_t ExactSum::bytes_per_step(const Comm& comm) const {
  if (!comm.reduces()) {
    return 0;
  }
  int64_t bytes = 0;
  for (const auto& bucket : buckets_) {
    bytes += bucket.flat.numel() * kWireBytes;
  }
  return bytes;
}

} // namespace vflow
