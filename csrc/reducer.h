// Reducer: folds one worker's VN gradients into the GradStore's flat buffers, bucket by
// bucket, and reduces the buckets over the current worker set while the backward of
// the worker's last VN is still running. What a reduction does with a bucket is its
// Reduction strategy's (csrc/reduction/reduction.h); the reducer keeps the bookkeeping
// every strategy shares and the replaceable process group (Note [Gradient store and
// reducer], csrc/grad_store.h).
//
// Note [Buckets]
// Each GradBuffer's slots (reverse registration order: the order backward usually
// produces gradients) are cut into buckets of consecutive slots. A bucket is therefore
// one contiguous slice of its flat buffer, and that slice is what is reduced — no copy
// into or out of a communication buffer. The cut is computed outside (Python's
// `vflow.grad_store.assign_buckets`: the first bucket of a buffer at most
// `first_bucket_bytes`, the others at most `bucket_cap_bytes`, a larger parameter a
// bucket of its own) and checked here: a small first bucket gets the first collective
// going early in backward; large later buckets amortise per-collective latency.
// Buckets are numbered buffer by buffer, slot by slot, and every rank launches its
// collectives in that order (see Note [Launch order]).
//
// Note [First fold overwrites]
// Buffers are not zeroed at the start of a step. The first gradient a slot receives
// in a step is written as acc = w * g (the kernel does not read the accumulator);
// later ones are added. Slots that received nothing during the whole step are zeroed
// (in contiguous runs) when their bucket becomes final, before it is reduced.
// Overwriting gives the same bits as adding to zero, so results do not depend on it.
//
// Note [Fold granularity]
// Gradients are folded into the buffer as soon as the ones waiting add up to
// kFoldBytes (or their bucket is complete), independently of the all-reduce bucket
// size. Holding a whole 25 MB bucket of gradients until it is complete and then
// freeing them at once makes glibc return that memory to the OS (its trim threshold
// adapts to about twice the largest allocation), so the next VN's gradients fault
// every page back in: on CPU, with the 48 MB MLP of benchmarks/distributed.py, 10-12k
// minor page faults per step of 2 VNs and ~19 ms per VN. Folding every ~1 MB keeps the freed memory below the trim threshold and the
// un-folded gradients at about 1 MB plus the one being folded. Small gradients are
// still batched, so one fused call covers many of them.
//
// Note [Overlap with backward]
// All VNs but a worker's last only fold: a bucket is folded (one fused kernel call)
// as soon as all of its gradients arrived, and partly filled buckets are folded after
// that VN's backward. During the last VN's backward a bucket that is complete holds
// its final local value, so its reduction (for the default strategy an asynchronous
// all-reduce) is started right away and runs while autograd computes the remaining
// gradients. Buckets with a parameter that received no gradient in the last VN become
// final only when backward returns; they are launched then. `finalize` waits for every
// reduction and applies the global normalisation once.
//
// Note [Launch order]
// Collectives on one process group are matched by issue order, so every rank must
// start the same collectives in the same order even if autograd completes buckets in
// a different order on different ranks (data-dependent graphs, parameters unused on
// one rank). A completed bucket is launched only after all lower-numbered buckets
// were; the step's statistics all-reduce (`start_stats`) goes before all buckets, or
// rides with bucket 0 (Note [Statistics ride with bucket 0], reduction/reduction.h).
//
// Note [Changing the worker set]
// `set_group` replaces the process group between steps (never during one) and has the
// strategy rebuild its world-dependent state; the buffers, the bucket cut and the
// per-buffer strategy state stay. It does not communicate: agreeing on the new group,
// and bringing new members up to date, is the Python layer's job (vflow/membership.py).
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "comm.h"
#include "grad_buffer.h"
#include "grad_store.h"
#include "reduction/reduction.h"

namespace vflow {

class Reducer final : public GradSink {
 public:
  // See Note [Fold granularity].
  static constexpr int64_t kFoldBytes = 1024 * 1024;

  // One bucket of Note [Buckets]: slots [first_slot, last_slot] of buffer `buffer`.
  struct BucketSpec {
    int64_t buffer;
    int64_t first_slot;
    int64_t last_slot;
  };
  // One bucket of Note [Buckets], for introspection.
  struct BucketRange {
    int64_t buffer;
    int64_t first_slot;
    int64_t last_slot;
    int64_t offset;  // first element of the bucket's slice of the flat buffer
    int64_t numel;   // elements in that slice, inter-slot padding included
  };

  // Reduces `buffers` (a GradStore's) cut into `buckets` (buffer by buffer, each
  // buffer's slots covered in order, none twice) with `reduction`, which must not be
  // used by another Reducer. `process_group` may be null (one worker: nothing is
  // reduced); a group of size 1 reduces nothing either. `timeout` bounds every wait for
  // a collective; `description` names the group in error messages.
  Reducer(const std::vector<std::shared_ptr<GradBuffer>>& buffers,
          const std::vector<BucketSpec>& buckets,
          std::shared_ptr<Reduction> reduction,
          c10::intrusive_ptr<c10d::ProcessGroup> process_group,
          std::chrono::milliseconds timeout,
          std::string description);

  // Note [Changing the worker set]: reduces over `process_group` (null: nothing) from
  // the next step on, waiting at most `timeout` for each collective.
  void set_group(c10::intrusive_ptr<c10d::ProcessGroup> process_group,
                 std::chrono::milliseconds timeout, std::string description);

  const std::vector<std::shared_ptr<GradBuffer>>& buffers() const {
    return buffers_;
  }
  const std::shared_ptr<Reduction>& reduction() const {
    return reduction_;
  }
  int64_t num_buckets() const {
    return static_cast<int64_t>(buckets_.size());
  }
  // The bucket holding slot `slot` of buffer `buffer`.
  int64_t bucket_of(int64_t buffer, int64_t slot) const;
  std::vector<BucketRange> bucket_ranges() const;

  // Starts step number `step` (used in error messages): no slot has been written yet
  // (Note [First fold overwrites]) and nothing is in flight. Throws if the previous step
  // was neither finalized nor discarded, or the strategy is not ready for the group.
  void begin_step(int64_t step);

  // Starts a VN whose gradients are added with factor `weight`. With `last`, buckets
  // are reduced as they become final (Note [Overlap with backward]). `level` and
  // `merges` place the VN on the ordered strategy's stack (0 for the other kinds).
  void begin_vn(double weight, bool last, int64_t level = 0, int64_t merges = 0);

  // Hands over the gradient of slot `slot` of bucket `bucket` produced by the current
  // VN's backward (at most once per slot and VN). Folds what is waiting per Note [Fold
  // granularity]; in the last VN, once the bucket is complete, launches every bucket
  // that may go (Note [Launch order]). Thread-safe: autograd may call it from one
  // thread per device.
  void add_grad(int64_t bucket, int64_t slot, const at::Tensor& grad);
  // GradSink: gradients are taken between begin_vn and end_vn (or abort_vn); each is
  // the gradient of slot `slot` of buffer `buffer`, from the GradStore's hooks.
  bool accepts() const override {
    return in_vn_.load(std::memory_order_acquire);
  }
  void receive_grad(int64_t buffer, int64_t slot, const at::Tensor& grad) override;

  // Ends the current VN after its backward returned: folds what is waiting; after the
  // last VN zeroes the slots that never received a gradient and launches every
  // bucket not launched yet.
  void end_vn();

  // Drops gradients handed over by a VN whose backward failed.
  void abort_vn();

  // Starts an all-reduce (SUM) of a copy of `stats`, a small tensor of per-worker
  // totals on the group's communication device, ahead of every bucket of this step
  // (`stats` itself is not touched: Note [Collectives on tensors Python cannot see]).
  // Without a group of size > 1 nothing is reduced. With `with_buckets` the caller
  // promises that `stats` is 1-D float64, that each of its values is nonzero on one
  // worker at most, and that it calls wait_stats only after the last VN ended: the
  // strategy may then carry it in bucket 0's collective (Note [Statistics ride with
  // bucket 0], csrc/reduction/reduction.h) rather than in a collective of its own.
  void start_stats(const at::Tensor& stats, bool with_buckets = false);

  // Waits for the statistics started by start_stats and returns the sums, as a new
  // tensor.
  at::Tensor wait_stats();

  // Whether this step's statistics ride with bucket 0 (false before start_stats).
  bool stats_with_buckets() const;

  // Waits for every bucket's reduction, then multiplies every buffer by `factor` in
  // one pass each; with `found_nonfinite` (0-dim float32 per buffer's device, see Note
  // [Non-finite flag]) also records inf/NaN results. Must follow the last VN.
  void finalize(double factor, const std::vector<at::Tensor>& found_nonfinite);

  // After a failed step: waits (each wait bounded by the timeout) for collectives
  // still in flight so that they no longer touch the buffers, ignoring their errors;
  // stops waiting after the first failure, which means the group is broken anyway.
  void discard();

  // Runs one step's reduction on the buffers as they are, without folding or zeroing
  // anything: what benchmarks time as "communication alone". The buffers then hold
  // the sums of whatever they held. Not during a step.
  void reduce_as_is(int64_t step);

  // The message of the step's collective failure, empty if none: a failure raised in
  // an autograd hook reaches Python as a RuntimeError, which the caller turns back
  // into CollectiveError with this.
  std::string comm_failure() const {
    return comm_.last_failure();
  }

  // Host seconds the last step spent blocked on the buckets' collectives after its
  // backward (the reduction time that backward did not hide): finalize's waits, and
  // wait_stats' when the statistics rode with bucket 0.
  double last_wait_seconds() const {
    return last_wait_seconds_;
  }
  // Buckets of the last step whose reduction was started (without a process group:
  // that were final) while the last VN's backward was still running (Note [Overlap
  // with backward]); the others started after backward returned.
  int64_t early_launches() const {
    return early_launches_;
  }
  int64_t world_size() const;
  int64_t rank() const;
  bool in_step() const;
  // Bytes of gradient this worker hands to the backend in one step (the step's
  // statistics excluded), 0 without a group to reduce over. Default and exact kinds:
  // the buckets in their all-reduce wire format (a ring all-reduce moves about
  // 2 (W - 1) / W times this over each link). Ordered kind: the bytes it sends point to
  // point under the current tree.
  int64_t bytes_per_step() const;

 private:
  struct Bucket {
    BucketInfo info;
    std::vector<int64_t> pending_slots;  // arrived, not folded yet
    std::vector<at::Tensor> pending_grads;
    int64_t pending_bytes = 0;
    int64_t arrived = 0;  // slots that received a gradient in the current VN
    bool final = false;  // holds its final local value for this step
    bool vn_done = false;  // the current VN is complete on it

    int64_t num_slots() const {
      return info.last_slot - info.first_slot + 1;
    }
  };

  void fold(Bucket& bucket);
  void complete_vn(Bucket& bucket);
  void launch_ready();
  void clear_pending();
  void end_step();

  std::vector<std::shared_ptr<GradBuffer>> buffers_;
  std::shared_ptr<Reduction> reduction_;
  std::vector<Bucket> buckets_;
  std::vector<std::vector<int64_t>> bucket_of_slot_;  // [buffer][slot]
  // [buffer][slot]: written in this step (or VN, for strategies that write each VN
  // afresh): Note [First fold overwrites].
  std::vector<std::vector<uint8_t>> written_;
  Comm comm_;

  mutable std::mutex mutex_;
  double weight_ = 1.0;
  bool last_vn_ = false;
  bool in_step_ = false;
  std::atomic<bool> in_vn_{false};
  size_t next_launch_ = 0;
  c10::intrusive_ptr<c10d::Work> stats_work_;
  at::Tensor stats_sum_;  // what stats_work_ reduces; never handed to Python
  bool stats_carried_ = false;  // the statistics ride with bucket 0's collective
  double last_wait_seconds_ = 0.0;
  double stats_wait_seconds_ = 0.0;  // blocked in wait_stats on bucket 0 (carried stats)
  int64_t early_launches_ = 0;
};

} // namespace vflow
