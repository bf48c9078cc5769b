// Reduction strategies: how the Reducer turns each worker's VN gradients into the sum
// over all workers. The Reducer (csrc/reducer.h) decides *when* — which slots a VN
// wrote, when a bucket is complete, final, launched, in which order — and a strategy
// decides *what*: where a gradient is written, what zeroing a slot means, what
// communication a final bucket starts and how its result lands in the float buffer.
//
// Note [Reduction strategies]
// Three kinds exist, chosen per Executor (Python's `deterministic` argument):
//   * AllReduceSum  — float accumulation in the GradBuffer, one all-reduce (SUM) per
//                     bucket (the default; what DDP does), a small CPU bucket by one
//                     all-gather (Note [Small buckets by all-gather], all_reduce.cpp);
//   * OrderedSum    — float sums in one fixed tree over the VN indices, exchanged point
//                     to point (Note [Ordered sum], ordered.cpp);
//   * ExactSum      — exact integer accumulation, a MAX and a SUM all-reduce per bucket
//                     (Note [Exact buckets], exact_sum.cpp).
//
// Note [Statistics ride with bucket 0]
// Every collective costs a fixed latency (a backend thread woken, a round trip per
// peer) whatever its size: on 2 Gloo ranks on one machine about 0.3-0.5 ms, as much
// as the whole backward of a small model. The step's statistics (csrc/reducer.h,
// `start_stats`) are a few hundred float64 values, so when the caller says that each
// of them is nonzero on one worker at most (a sum over workers then only adds zeros:
// exact in any order and any dtype wide enough), a strategy whose first bucket is
// small sends them inside that bucket's collective instead of a collective of their
// own. They travel as 16-bit pieces of their bits, each a whole number in [0, 65535]
// in the bucket's float dtype (`encode_stats`): adding zeros to such a number is exact
// in float32 and float64, so the bits arrive unchanged (adding float64 values
// themselves would not keep -0.0 or a NaN's payload). Which strategies carry them:
//   * AllReduceSum: bucket 0 and the pieces are copied into one private tensor that is
//     all-reduced, and the bucket copied back when it is waited for, when bucket 0 is
//     at most kCarryBytes (the two copies then cost less than a collective); when
//     bucket 0 goes by all-gather, the pieces are appended to this worker's block;
//   * OrderedSum: when its bucket 0 is exchanged by one all-gather (Note [Gathered
//     buckets], ordered.cpp), the pieces are appended to this worker's block;
//   * ExactSum: not carried (its buckets need two collectives anyway).
// A bucket 0 larger than that leaves the statistics to their own all-reduce, whose
// latency its bucket's transfer time dwarfs.
// A strategy's state splits in two. Per-buffer state (exact accumulators, tree levels)
// is allocated once in `bind` and lives as long as the buffers. World-dependent state
// (the tree schedule, which depends on the plan and this worker's rank) is rebuilt by
// `set_world` whenever the Reducer gets a new group, so a worker set can change between
// steps without touching the buffers. Every method is called with the Reducer's mutex
// held, except the Python-facing setters, which refuse to run during a step.
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "../comm.h"
#include "../grad_buffer.h"

namespace vflow {

// Note [Statistics ride with bucket 0]: `stats` (float64, 1-D) as 4 * numel pieces of
// `dtype` written to `out`, and back from pieces summed over the workers.
constexpr int64_t kStatsPieces = 4;
void encode_stats(const at::Tensor& stats, const at::Tensor& out);
at::Tensor decode_stats(const at::Tensor& pieces);

// One bucket of Note [Buckets] as the strategies see it.
struct BucketInfo {
  int64_t buffer;
  int64_t first_slot;
  int64_t last_slot;
  int64_t offset;  // first element of `flat` in the flat buffer
  at::Tensor flat;  // the bucket's slice of the float buffer, inter-slot padding included
};

class Reduction {
 public:
  virtual ~Reduction() = default;
  // "all-reduce", "ordered" or "exact".
  virtual std::string kind() const = 0;

  // Attaches the strategy to a Reducer's buffers and buckets (once).
  virtual void bind(const std::vector<std::shared_ptr<GradBuffer>>& buffers,
                    const std::vector<BucketInfo>& buckets);
  bool bound() const {
    return !buffers_.empty();
  }
  // A new worker set: rebuild world-dependent state. Not during a step.
  virtual void set_world(const Comm& comm) {}
  // Raises unless everything a step needs under `comm` is set.
  virtual void check_ready(const Comm& comm) const {}

  virtual void begin_step();
  // After finalize or discard.
  virtual void end_step();
  bool in_step() const {
    return in_step_;
  }

  // Where the VN's gradients go (OrderedSum: a stack level and the merges after it;
  // the other kinds take level = merges = 0).
  virtual void begin_vn(int64_t level, int64_t merges);
  // Whether each VN writes its gradients afresh (so every VN zeroes the slots it left
  // empty), rather than adding to the previous VNs'.
  virtual bool fresh_each_vn() const {
    return false;
  }
  // Writes `weight * grads[k]` into slot `slots[k]` of the bucket: overwriting with
  // `first` (Note [First fold overwrites]), adding otherwise. May free the gradients.
  virtual void fold(const BucketInfo& bucket, const std::vector<int64_t>& slots,
                    std::vector<at::Tensor>& grads, double weight, bool first) = 0;
  // Zeroes elements [begin, begin + numel) of the bucket's buffer (a run of slots that
  // received nothing).
  virtual void zero(const BucketInfo& bucket, int64_t begin, int64_t numel) = 0;
  // The bucket holds the whole current VN (every slot written or zeroed).
  virtual void vn_complete(const BucketInfo& bucket) {}
  // After every bucket of the VN is complete.
  virtual void end_vn(bool last, const Comm& comm) {}

  // Bucket `index` holds this worker's final value for the step: start reducing it.
  virtual void start(size_t index, Comm& comm) = 0;
  // Blocks until every bucket's reduction is complete (the time the Reducer reports
  // as waiting). By default: waits for each bucket's collective in `works_`.
  virtual void wait_all(Comm& comm);
  // Writes the reduced sums into the float buffers, applying `factor` if it can;
  // returns the factor still to apply.
  virtual double write_result(double factor) {
    return factor;
  }
  // The collectives still in flight after a failure, which the strategy forgets. By
  // default: those in `works_`.
  virtual std::vector<c10::intrusive_ptr<c10d::Work>> take_in_flight();
  // Bytes of gradient this worker hands to the backend per step under `comm` (0 when
  // there is no one to reduce with).
  virtual int64_t bytes_per_step(const Comm& comm) const = 0;

  // Note [Statistics ride with bucket 0]: whether bucket 0's collective can carry
  // `numel` statistics under `comm`. Called at the step's start_stats, before bucket 0
  // starts.
  virtual bool carries_stats(const Comm& comm, int64_t numel) const {
    return false;
  }
  // The statistics (float64, 1-D, each value nonzero on one worker at most) that bucket
  // 0's collective carries in this step; only after carries_stats said yes.
  void attach_stats(at::Tensor stats) {
    stats_ = std::move(stats);
  }
  // Waits for bucket 0's collective (started already) and returns the attached
  // statistics summed over the workers, as a new tensor.
  virtual at::Tensor wait_stats(Comm& comm);

 protected:
  std::string bucket_name(size_t index) const;

  // The statistics attached for this step (undefined otherwise; cleared by end_step).
  at::Tensor stats_;

  std::vector<std::shared_ptr<GradBuffer>> buffers_;
  std::vector<BucketInfo> buckets_;
  // [bucket]: the collective that finishes the bucket's reduction, for strategies that
  // end a bucket with one (all-reduce, exact).
  std::vector<c10::intrusive_ptr<c10d::Work>> works_;

 private:
  bool in_step_ = false;
};

class AllReduceSum final : public Reduction {
 public:
  std::string kind() const override {
    return "all-reduce";
  }
  void fold(const BucketInfo& bucket, const std::vector<int64_t>& slots,
            std::vector<at::Tensor>& grads, double weight, bool first) override;
  void zero(const BucketInfo& bucket, int64_t begin, int64_t numel) override;
  void start(size_t index, Comm& comm) override;
  void wait_all(Comm& comm) override;
  std::vector<c10::intrusive_ptr<c10d::Work>> take_in_flight() override;
  int64_t bytes_per_step(const Comm& comm) const override;
  bool carries_stats(const Comm& comm, int64_t numel) const override;
  at::Tensor wait_stats(Comm& comm) override;

  // Note [Statistics ride with bucket 0]: the largest bucket 0 that carries them.
  static constexpr int64_t kCarryBytes = 256 * 1024;
  // Note [Small buckets by all-gather]: the most a worker receives for one bucket.
  static constexpr int64_t kGatherBytes = 256 * 1024;

 private:
  // One bucket's all-gather (Note [Small buckets by all-gather]).
  struct Gather {
    at::Tensor block;  // this worker's bucket, then (bucket 0) the statistics' pieces
    std::vector<at::Tensor> blocks;  // every worker's block, by rank
    int64_t pieces = 0;  // statistics' pieces at the end of each block
    bool in_flight = false;  // started and not yet added up
  };

  // Whether bucket `index`, with `pieces` statistics' pieces, goes by an all-gather.
  bool gathers(size_t index, const Comm& comm, int64_t pieces) const;
  void start_gathered(size_t index, Comm& comm);
  // Waits for bucket `index`'s all-gather and writes the sum of the blocks into the
  // bucket (and, for bucket 0, the statistics' sum into stats_sum_).
  void land_gathered(size_t index, Comm& comm);
  // Waits for bucket 0's collective with the statistics and copies bucket 0 back.
  void land_carrier(Comm& comm);

  std::vector<Gather> gathers_;  // [bucket]
  at::Tensor carrier_;  // bucket 0, then the statistics' pieces
  at::Tensor stats_sum_;  // the statistics summed, once landed
  bool carrying_ = false;  // bucket 0's collective in flight carries the statistics
};

class OrderedSum final : public Reduction {
 public:
  std::string kind() const override {
    return "ordered";
  }
  void bind(const std::vector<std::shared_ptr<GradBuffer>>& buffers,
            const std::vector<BucketInfo>& buckets) override;
  void set_world(const Comm& comm) override;
  void check_ready(const Comm& comm) const override;
  // The tree schedule of the following steps (Note [Ordered sum]): `cover_counts[w]`
  // partial sums of worker w (one entry per rank of the current group, or one without a
  // group), and `combine_merges[k]` merges after pushing the k-th partial sum of all
  // workers in VN order. Not during a step; cleared by every new worker set.
  void set_tree(const std::vector<int64_t>& cover_counts,
                const std::vector<int64_t>& combine_merges);

  void begin_step() override;
  void begin_vn(int64_t level, int64_t merges) override;
  bool fresh_each_vn() const override {
    return true;
  }
  void fold(const BucketInfo& bucket, const std::vector<int64_t>& slots,
            std::vector<at::Tensor>& grads, double weight, bool first) override;
  void zero(const BucketInfo& bucket, int64_t begin, int64_t numel) override;
  void vn_complete(const BucketInfo& bucket) override;
  void end_vn(bool last, const Comm& comm) override;
  void start(size_t index, Comm& comm) override;
  void wait_all(Comm& comm) override;
  std::vector<c10::intrusive_ptr<c10d::Work>> take_in_flight() override;
  int64_t bytes_per_step(const Comm& comm) const override;
  bool carries_stats(const Comm& comm, int64_t numel) const override;
  at::Tensor wait_stats(Comm& comm) override;

  // Note [Gathered buckets]: the most bytes a worker receives for a bucket exchanged
  // by one all-gather.
  static constexpr int64_t kGatherBytes = 256 * 1024;

 private:
  struct Exchange {
    // Point-to-point transfers in flight, the partial sums received for this worker's
    // shard, and every worker's partial of that shard in VN order.
    std::vector<c10::intrusive_ptr<c10d::Work>> transfers;
    at::Tensor received;
    std::vector<at::Tensor> shard_partials;
    // Note [Gathered buckets]: this step's exchange is one all-gather of `block` (this
    // worker's partial sums, then the statistics' pieces for bucket 0) into `blocks`.
    bool gathered = false;
    bool waited = false;  // its all-gather was waited for by wait_stats
    int64_t stats_pieces = 0;  // statistics' pieces at the end of each block
    at::Tensor block;
    std::vector<at::Tensor> blocks;  // [rank]
  };

  int64_t max_cover() const;
  // Whether bucket `index` is exchanged by one all-gather under the current tree.
  bool gathers(size_t index) const;
  void start_gathered(size_t index, Comm& comm);
  void wait_gathered(size_t index, Comm& comm);
  void combine_gathered(size_t index, Comm& comm);

  at::Tensor level(int64_t buffer, int64_t index);
  at::Tensor level_slice(const BucketInfo& bucket, int64_t index);
  int64_t shard_begin(const BucketInfo& bucket, int64_t rank) const;
  void combine_and_share(size_t index, Comm& comm);

  // [buffer][level] stack of partial sums; levels_[b][0] is buffer b's data.
  std::vector<std::vector<at::Tensor>> levels_;
  std::vector<Exchange> exchanges_;  // [bucket]
  int64_t world_size_ = 1;
  std::vector<int64_t> cover_counts_;
  std::vector<int64_t> combine_merges_;
  int64_t depth_ = 0;  // stack depth after the VNs folded so far in this step
  int64_t vn_level_ = 0;
  int64_t vn_merges_ = 0;
};

class ExactSum final : public Reduction {
 public:
  std::string kind() const override {
    return "exact";
  }
  void bind(const std::vector<std::shared_ptr<GradBuffer>>& buffers,
            const std::vector<BucketInfo>& buckets) override;
  void fold(const BucketInfo& bucket, const std::vector<int64_t>& slots,
            std::vector<at::Tensor>& grads, double weight, bool first) override;
  void zero(const BucketInfo& bucket, int64_t begin, int64_t numel) override;
  void start(size_t index, Comm& comm) override;
  double write_result(double factor) override;
  int64_t bytes_per_step(const Comm& comm) const override;

 private:
  // Integer accumulators of one GradBuffer, one entry per element of the flat buffer
  // (padding included, which stays zero); see Note [Exact buckets].
  struct State {
    at::Tensor top;         // int8: this worker's top bins
    at::Tensor limbs;       // int32 [3, numel]: the carry-save limbs
    at::Tensor global_top;  // int8: top bins all-reduced with MAX
    at::Tensor wire;        // int64: packed sums, all-reduced with SUM
  };
  at::Tensor slice(const at::Tensor& plane, const BucketInfo& bucket) const;

  std::vector<State> states_;  // [buffer]
  bool reduced_ = false;  // the last step's sums came from a group (global top bins)
};

} // namespace vflow
