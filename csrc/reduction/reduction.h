// Reduction strategies: how the Reducer turns each worker's VN gradients into the sum
// over all workers. The Reducer (csrc/reducer.h) decides *when* — which slots a VN
// wrote, when a bucket is complete, final, launched, in which order — and a strategy
// decides *what*: where a gradient is written, what zeroing a slot means, what
// communication a final bucket starts and how its result lands in the float buffer.
//
// Note [Reduction strategies]
// Three kinds exist, chosen per Executor (Python's `deterministic` argument):
//   * AllReduceSum  — float accumulation in the GradBuffer, one all-reduce (SUM) per
//                     bucket (the default; what DDP does);
//   * OrderedSum    — float sums in one fixed tree over the VN indices, exchanged point
//                     to point (Note [Ordered sum], ordered.cpp);
//   * ExactSum      — exact integer accumulation, a MAX and a SUM all-reduce per bucket
//                     (Note [Exact buckets], exact_sum.cpp).
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

 protected:
  std::string bucket_name(size_t index) const;

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
  int64_t bytes_per_step(const Comm& comm) const override;
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

 private:
  struct Exchange {
    // Point-to-point transfers in flight, the partial sums received for this worker's
    // shard, and every worker's partial of that shard in VN order.
    std::vector<c10::intrusive_ptr<c10d::Work>> transfers;
    at::Tensor received;
    std::vector<at::Tensor> shard_partials;
  };

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
