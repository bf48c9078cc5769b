// Reducer: folds one worker's VN gradients into flat buffers, bucket by bucket, and
// all-reduces the buckets over a torch.distributed ProcessGroup while the backward of
// the worker's last VN is still running.
//
// Note [Buckets]
// Each GradBuffer's slots (reverse registration order: the order backward usually
// produces gradients) are cut into buckets of consecutive slots: the first bucket of
// a buffer at most `first_bucket_bytes`, the others at most `bucket_cap_bytes` (a
// single larger parameter makes a bucket of its own). A bucket is therefore one
// contiguous slice of its flat buffer, and that slice is what is all-reduced — no
// copy into or out of a communication buffer. A small first bucket gets the first
// collective going early in backward; large later buckets amortise per-collective
// latency. Buckets are numbered buffer by buffer, slot by slot, and every rank
// launches its collectives in that order (see Note [Launch order]).
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
// its final local value, so its asynchronous all-reduce (SUM) is started right away
// and runs while autograd computes the remaining gradients. Buckets with a parameter
// that received no gradient in the last VN become final only when backward returns;
// they are launched then. `finalize` waits for every collective and applies the
// global normalisation once. The VN weights already contain 1/B (mean losses), so a
// plain sum over workers is the global-batch gradient, whatever each worker's number
// or size of VNs.
//
// Note [Launch order]
// Collectives on one process group are matched by issue order, so every rank must
// start the same collectives in the same order even if autograd completes buckets in
// a different order on different ranks (data-dependent graphs, parameters unused on
// one rank). A completed bucket is launched only after all lower-numbered buckets
// were; the step's statistics all-reduce (`start_stats`) goes before all buckets.
//
// Note [Exact buckets]
// In exact mode (deterministic="exact" in Python) a bucket's gradients are folded into the
// integer accumulators of Note [Exact accumulation] (exact.h) instead of the float
// buffer, and a bucket is reduced in two collectives. When it becomes final in the
// last VN, an all-reduce (MAX) of its top bins runs at once and the thread that made
// the bucket final (autograd's) waits for it; the worker then packs its limbs against
// the global top bins and starts the all-reduce (SUM) of the packed int64s
// asynchronously, so the SUM overlaps the rest of backward as the float path's
// all-reduce does. Waiting inside backward costs little: the MAX carries one byte per
// element, and it only waits for the other workers to complete the same bucket.
// Every rank issues stats, MAX 0, SUM 0, MAX 1, SUM 1, ... in that order (Note
// [Launch order]). `finalize` waits for the SUMs and writes the float buffer by
// unpacking them together with its factor.
// One process (or a group of one) packs against its own top bins: the same integers
// as the reduced path, since the sum is exact either way.
//
// Note [Ordered sum]
// In ordered mode (deterministic=True in Python, the default kind) gradients are added
// in float, but always in one binary tree over the V VN indices that depends on V
// alone (vflow/tree.py): node [lo, hi) = node [lo, mid) + node [mid, hi). Two-operand
// float addition is correctly rounded and commutative, so every node has the same
// bits whoever computes it. Each worker keeps a stack of float buffers ("levels";
// level 0 is the GradBuffer itself). A VN's gradient is written (w * g, rounded once,
// as in Note [First fold overwrites]) to the level its schedule names, and once a
// bucket has every gradient of the VN, the schedule's merges run on that bucket's
// slice (level k-1 += level k, ...). After the last VN the levels hold the worker's
// partial sums (its cover of the tree). A bucket is then reduced without any
// all-reduce, whose summation order belongs to the backend: each bucket is cut into
// W shards, worker r owns shard r, and
//   phase 1: every worker sends each of its partial sums' shard r to worker r
//            (point-to-point; started as soon as the bucket is final in the last VN,
//            so it overlaps the rest of backward);
//   combine: worker r pushes all workers' partials of shard r through the same stack
//            in VN order (the schedule's combine merges) and gets the root;
//   phase 2: worker r sends its root shard to every other worker, which receive
//            it straight into their GradBuffer (started in `finalize`, bucket by
//            bucket as phase 1 completes).
// Each worker sends about (C(W-1) + (W-1)) / W times the bucket, C being its number of
// partial sums: with aligned plans (C = 1) that is what a ring all-reduce moves.
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <chrono>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "exact.h"
#include "grad_buffer.h"

namespace vflow {

// A collective of a step failed or did not finish within the timeout (a worker died,
// hung, or the group is broken). Python sees it as vflow.CollectiveError, a
// RuntimeError. The message names the step, the collective and the process group.
class CollectiveError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class Reducer {
 public:
  // See Note [Fold granularity].
  static constexpr int64_t kFoldBytes = 1024 * 1024;

  // One bucket of Note [Buckets], for introspection.
  struct BucketRange {
    int64_t buffer;
    int64_t first_slot;
    int64_t last_slot;
    int64_t offset;  // first element of the bucket's slice of the flat buffer
    int64_t numel;   // elements in that slice, inter-slot padding included
  };

  // Builds one GradBuffer per entry of `groups` (parameters in slot order, one device
  // each) with accumulator dtype `dtypes[i]`, and cuts them into buckets (Note
  // [Buckets]). `process_group` may be null (one worker: nothing is reduced); a group
  // of size 1 reduces nothing either. `timeout` bounds every wait for a collective;
  // `description` names the group in error messages. With `exact`, gradients are summed
  // exactly (Note [Exact buckets]); every dtype must then be float32. With `ordered`,
  // gradients are summed in a fixed tree (Note [Ordered sum]); at most one of the two.
  Reducer(
      const std::vector<std::vector<at::Tensor>>& groups,
      const std::vector<at::ScalarType>& dtypes,
      int64_t first_bucket_bytes,
      int64_t bucket_cap_bytes,
      c10::intrusive_ptr<c10d::ProcessGroup> process_group,
      std::chrono::milliseconds timeout,
      std::string description,
      bool exact = false,
      bool ordered = false);

  const std::vector<std::shared_ptr<GradBuffer>>& buffers() const {
    return buffers_;
  }
  int64_t num_buckets() const {
    return static_cast<int64_t>(buckets_.size());
  }
  // The bucket holding slot `slot` of buffer `buffer`.
  int64_t bucket_of(int64_t buffer, int64_t slot) const;
  std::vector<BucketRange> bucket_ranges() const;

  // Starts step number `step` (used in error messages): no slot has been written yet
  // (Note [First fold overwrites]) and nothing is in flight. Throws if the previous step
  // was neither finalized nor discarded.
  void begin_step(int64_t step);

  // Ordered mode: sets the tree schedule of the following steps (Note [Ordered sum]):
  // `cover_counts[w]` partial sums of worker w (one entry per rank of the group, or
  // one entry without a group), and `combine_merges[k]` merges after pushing the k-th
  // partial sum of all workers in VN order. Not during a step.
  void set_tree(const std::vector<int64_t>& cover_counts,
                const std::vector<int64_t>& combine_merges);

  // Starts a VN whose gradients are added with factor `weight`. With `last`, buckets
  // are all-reduced as they become final (Note [Overlap with backward]). In ordered
  // mode the gradients are written to stack level `level` (which must be the current
  // stack depth) and `merges` merges follow per bucket (Note [Ordered sum]).
  void begin_vn(double weight, bool last, int64_t level = 0, int64_t merges = 0);

  // Hands over the gradient of slot `slot` of bucket `bucket` produced by the current
  // VN's backward (at most once per slot and VN). Folds what is waiting per Note [Fold
  // granularity]; in the last VN, once the bucket is complete, launches every bucket
  // that may go (Note [Launch order]). Thread-safe: autograd may call it from one
  // thread per device.
  void add_grad(int64_t bucket, int64_t slot, const at::Tensor& grad);

  // Ends the current VN after its backward returned: folds what is waiting; after the
  // last VN zeroes the slots that never received a gradient and launches every
  // bucket not launched yet.
  void end_vn();

  // Drops gradients handed over by a VN whose backward failed.
  void abort_vn();

  // Starts an all-reduce (SUM) of a copy of `stats`, a small tensor of per-worker
  // totals on the buffers' communication device, ahead of every bucket of this step
  // (`stats` itself is not touched: Note [Collectives on tensors Python cannot see]).
  // Without a process group of size > 1 nothing is reduced.
  void start_stats(const at::Tensor& stats);

  // Waits for the all-reduce started by start_stats and returns the sums, as a new
  // tensor.
  at::Tensor wait_stats();

  // Waits for every bucket's all-reduce, then multiplies every buffer by `factor` in
  // one pass each; with `found_nonfinite` (0-dim float32 per device, see Note
  // [Non-finite flag]) also records inf/NaN results. Must follow the last VN.
  void finalize(double factor, const std::vector<at::Tensor>& found_nonfinite);

  // After a failed step: waits (each wait bounded by the timeout) for collectives
  // still in flight so that they no longer touch the buffers, ignoring their errors;
  // stops waiting after the first failure, which means the group is broken anyway.
  void discard();

  // Host seconds the last finalize spent blocked on collectives (the all-reduce time
  // that backward did not hide).
  double last_wait_seconds() const {
    return last_wait_seconds_;
  }
  // Buckets of the last step whose all-reduce was started (without a process group:
  // that were final) while the last VN's backward was still running (Note [Overlap
  // with backward]); the others started after backward returned.
  int64_t early_launches() const {
    return early_launches_;
  }
  int64_t world_size() const;
  bool exact() const {
    return exact_;
  }
  bool ordered() const {
    return ordered_;
  }
  // Bytes of gradient this worker hands to the backend in one step (the step's
  // statistics excluded), 0 without a group to reduce over. Default and exact mode:
  // the buckets in their all-reduce wire format (a ring all-reduce moves about
  // 2 (W - 1) / W times this over each link). Ordered mode: the bytes it sends point
  // to point in phases 1 and 2 of Note [Ordered sum] under the current tree.
  int64_t bytes_per_step() const;

 private:
  // Integer accumulators of one GradBuffer in exact mode, one entry per element of
  // the flat buffer (padding included, which stays zero); see Note [Exact buckets].
  struct ExactState {
    at::Tensor top;         // int8: this worker's top bins
    at::Tensor limbs;       // int32 [3, numel]: the carry-save limbs
    at::Tensor global_top;  // int8: top bins all-reduced with MAX
    at::Tensor wire;        // int64: packed sums, all-reduced with SUM
  };

  struct Bucket {
    int64_t buffer;
    int64_t first_slot;
    int64_t last_slot;
    int64_t offset;  // first element of `flat` in the flat buffer
    at::Tensor flat;  // the bucket's slice of the flat buffer
    std::vector<int64_t> pending_slots;  // arrived, not folded yet
    std::vector<at::Tensor> pending_grads;
    int64_t pending_bytes = 0;
    int64_t arrived = 0;  // slots that received a gradient in the current VN
    bool final = false;  // holds its final local value for this step
    bool vn_done = false;  // ordered mode: the current VN's merges ran on it
    c10::intrusive_ptr<c10d::Work> work;
    // Ordered mode: point-to-point transfers in flight, the partial sums received for
    // this worker's shard, and every worker's partial of that shard in VN order.
    std::vector<c10::intrusive_ptr<c10d::Work>> transfers;
    at::Tensor received;
    std::vector<at::Tensor> shard_partials;

    int64_t num_slots() const {
      return last_slot - first_slot + 1;
    }
  };

  bool reduces() const;
  void fold(Bucket& bucket);
  void fold_exact(Bucket& bucket, const std::vector<int64_t>& slots,
                  std::vector<at::Tensor>& grads, bool fresh);
  void zero_run(int64_t buffer, int64_t first, int64_t last);
  void make_final(Bucket& bucket);
  void start_exact_sum(size_t index);
  at::Tensor level(int64_t buffer, int64_t index);
  void finish_vn(Bucket& bucket);
  int64_t shard_begin(const Bucket& bucket, int64_t rank) const;
  void start_partials_exchange(size_t index);
  void combine_and_share(size_t index);
  c10::intrusive_ptr<c10d::Work> transfer(at::Tensor tensor, int64_t peer, int64_t tag,
                                          bool send, const std::string& what);
  at::Tensor exact_slice(const at::Tensor& plane, const Bucket& bucket) const;
  void launch_ready();
  c10::intrusive_ptr<c10d::Work> launch(at::Tensor tensor, const std::string& what,
                                        c10d::ReduceOp::RedOpType op = c10d::ReduceOp::SUM);
  [[noreturn]] void fail(const std::string& what, const std::string& cause) const;
  void wait_for(const c10::intrusive_ptr<c10d::Work>& work, const std::string& what);
  std::string bucket_name(size_t index) const;

  std::vector<std::shared_ptr<GradBuffer>> buffers_;
  std::vector<ExactState> exact_states_;  // [buffer], exact mode only
  bool exact_ = false;
  bool ordered_ = false;
  // Ordered mode: [buffer][level] stack of partial sums; levels[b][0] is buffer b's data.
  std::vector<std::vector<at::Tensor>> levels_;
  std::vector<int64_t> cover_counts_;
  std::vector<int64_t> combine_merges_;
  int64_t depth_ = 0;  // stack depth after the VNs folded so far in this step
  int64_t vn_level_ = 0;
  int64_t vn_merges_ = 0;
  std::vector<Bucket> buckets_;
  std::vector<std::vector<int64_t>> bucket_of_slot_;  // [buffer][slot]
  // [buffer][slot]: written in this step (Note [First fold overwrites]).
  std::vector<std::vector<uint8_t>> written_;
  c10::intrusive_ptr<c10d::ProcessGroup> process_group_;
  std::chrono::milliseconds timeout_;
  std::string description_;

  std::mutex mutex_;
  double weight_ = 1.0;
  bool last_vn_ = false;
  bool in_step_ = false;
  int64_t step_ = 0;
  size_t next_launch_ = 0;
  c10::intrusive_ptr<c10d::Work> stats_work_;
  at::Tensor stats_sum_;  // what stats_work_ reduces; never handed to Python
  double last_wait_seconds_ = 0.0;
  int64_t early_launches_ = 0;
};

} // namespace vflow
