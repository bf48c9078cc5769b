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
//            it straight into their GradBuffer (started in `wait_all`, bucket by
//            bucket as phase 1 completes).
// Each worker sends about (C(W-1) + (W-1)) / W times the bucket, C being its number of
// partial sums: with aligned plans (C = 1) that is what a ring all-reduce moves.
// The schedule depends on the plan and on this worker's rank, so it is world-dependent
// state: every new worker set clears it and the Python layer sets the new one.
//
// Note [Gathered buckets]
// Phases 1 and 2 are two rounds of messages, each paying the backend's latency; for a
// small bucket that latency is the whole cost. A bucket of which every worker would
// receive at most kGatherBytes in all is therefore exchanged in one round instead: one
// all-gather of each worker's block (its partial sums, padded to the largest cover of
// any worker, and for bucket 0 the statistics' pieces of Note [Statistics ride with
// bucket 0]), after which every worker pushes all partials of the whole bucket through
// the same stack in VN order (the same combine merges) and writes the root to its
// GradBuffer. Each element goes through the same float additions in the same order as
// in the sharded combine, so the bits do not depend on which way a bucket went; every
// worker decides the same way from the bucket's size and the tree.
#include "reduction.h"

#include "../ops.h"

#include <ATen/record_function.h>
#include <c10/util/irange.h>

#include <algorithm>
#include <limits>

namespace vflow {

namespace {

// Point-to-point tags are (bucket * kTagLevels + level) * 2 + phase, so a worker
// contributes at most kTagLevels partial sums (a cover of [0, V) has fewer than
// 2 log2(V) nodes, i.e. < 32 for the largest V deterministic mode accepts).
constexpr int64_t kTagLevels = 64;

int tag_of(size_t bucket, int64_t level, int64_t phase) {
  const int64_t tag = (static_cast<int64_t>(bucket) * kTagLevels + level) * 2 + phase;
  TORCH_CHECK(tag <= std::numeric_limits<int>::max(), "too many buckets for point-to-point "
              "tags in ordered mode: raise bucket_cap_bytes");
  return static_cast<int>(tag);
}

} // namespace

void OrderedSum::bind(const std::vector<std::shared_ptr<GradBuffer>>& buffers,
                      const std::vector<BucketInfo>& buckets) {
  Reduction::bind(buffers, buckets);
  for (const auto& buffer : buffers) {
    levels_.push_back({buffer->data()});
  }
  exchanges_.assign(buckets.size(), {});
}

void OrderedSum::set_world(const Comm& comm) {
  TORCH_CHECK(!in_step(), "OrderedSum: the worker set cannot change during a step");
  world_size_ = comm.size();
  cover_counts_.clear();
  combine_merges_.clear();
  for (auto& exchange : exchanges_) {
    exchange.received = at::Tensor();
    exchange.block = at::Tensor();
    exchange.blocks.clear();
  }
}

void OrderedSum::check_ready(const Comm& comm) const {
  TORCH_CHECK(!cover_counts_.empty(), "the ordered reduction needs set_tree before the first "
              "step, and again after every new worker set");
  TORCH_CHECK(static_cast<int64_t>(cover_counts_.size()) == comm.size(),
              "the ordered reduction's tree is for ", cover_counts_.size(),
              " workers but the group has ", comm.size());
}

void OrderedSum::set_tree(const std::vector<int64_t>& cover_counts,
                          const std::vector<int64_t>& combine_merges) {
  TORCH_CHECK(!in_step(), "set_tree called during a step");
  TORCH_CHECK(static_cast<int64_t>(cover_counts.size()) == world_size_, "cover_counts has ",
              cover_counts.size(), " entries; give one per worker (", world_size_, ")");
  int64_t total = 0;
  for (const auto w : c10::irange(cover_counts.size())) {
    TORCH_CHECK(cover_counts[w] >= 1 && cover_counts[w] <= kTagLevels, "cover_counts[", w,
                "] must be in [1, ", kTagLevels, "], got ", cover_counts[w]);
    total += cover_counts[w];
  }
  TORCH_CHECK(static_cast<int64_t>(combine_merges.size()) == total, "combine_merges has ",
              combine_merges.size(), " entries but the workers have ", total,
              " partial sums in all");
  int64_t depth = 0;
  for (const auto k : c10::irange(combine_merges.size())) {
    TORCH_CHECK(combine_merges[k] >= 0 && combine_merges[k] <= depth, "combine_merges[", k,
                "]=", combine_merges[k], " merges more than the ", depth + 1,
                " entries on the stack can");
    depth += 1 - combine_merges[k];
  }
  TORCH_CHECK(depth == 1, "combine_merges leave ", depth, " sums on the stack, not one root");
  cover_counts_ = cover_counts;
  combine_merges_ = combine_merges;
}

void OrderedSum::begin_step() {
  Reduction::begin_step();
  depth_ = 0;
}

void OrderedSum::begin_vn(int64_t level, int64_t merges) {
  TORCH_CHECK(level == depth_, "level must be the stack depth after the previous VNs (",
              depth_, "), got ", level);
  TORCH_CHECK(merges >= 0 && merges <= level, "merges must be in [0, level=", level,
              "], got ", merges);
  for (const auto b : c10::irange(buffers_.size())) {
    this->level(static_cast<int64_t>(b), level);  // allocated here, not under backward
  }
  vn_level_ = level;
  vn_merges_ = merges;
}

at::Tensor OrderedSum::level(int64_t buffer, int64_t index) {
  auto& levels = levels_[buffer];
  while (static_cast<int64_t>(levels.size()) <= index) {
    // Zeros, not empty: the padding between slots is never written and must add up to 0.
    levels.push_back(at::zeros_like(levels[0]));
  }
  return levels[index];
}

at::Tensor OrderedSum::level_slice(const BucketInfo& bucket, int64_t index) {
  return level(bucket.buffer, index).narrow(0, bucket.offset, bucket.flat.numel());
}

void OrderedSum::fold(const BucketInfo& bucket, const std::vector<int64_t>& slots,
                      std::vector<at::Tensor>& grads, double weight, bool first) {
  // Every VN writes its own level: a slot cannot be written twice within one VN.
  TORCH_INTERNAL_ASSERT(first || slots.empty());
  if (slots.empty()) {
    return;
  }
  const GradBuffer& buffer = *buffers_[bucket.buffer];
  const at::Tensor target = level(bucket.buffer, vn_level_);
  std::vector<at::Tensor> accs;
  accs.reserve(slots.size());
  for (const auto k : c10::irange(slots.size())) {
    const int64_t slot = slots[k];
    TORCH_CHECK(grads[k].numel() == buffer.numels()[slot], "the gradient of slot ", slot,
                " has ", grads[k].numel(), " elements, expected ", buffer.numels()[slot]);
    accs.push_back(target.narrow(0, buffer.offsets()[slot], buffer.numels()[slot])
                       .view(grads[k].sizes()));
  }
  multi_accumulate_(accs, grads, weight, /*overwrite=*/true);
}

void OrderedSum::zero(const BucketInfo& bucket, int64_t begin, int64_t numel) {
  level(bucket.buffer, vn_level_).narrow(0, begin, numel).zero_();
}

void OrderedSum::vn_complete(const BucketInfo& bucket) {
  for (int64_t k = vn_level_; k > vn_level_ - vn_merges_; --k) {
    level_slice(bucket, k - 1).add_(level_slice(bucket, k));
  }
}

void OrderedSum::end_vn(bool last, const Comm& comm) {
  depth_ = vn_level_ + 1 - vn_merges_;
  if (last) {
    const int64_t rank = comm.rank();
    TORCH_CHECK(depth_ == cover_counts_[rank], "after its last VN this worker holds ", depth_,
                " partial sums but set_tree says ", cover_counts_[rank],
                ": the VN schedule and the tree disagree");
  }
}

int64_t OrderedSum::shard_begin(const BucketInfo& bucket, int64_t rank) const {
  return bucket.flat.numel() * rank / world_size_;
}

int64_t OrderedSum::max_cover() const {
  int64_t most = 1;
  for (const int64_t count : cover_counts_) {
    most = std::max(most, count);
  }
  return most;
}

bool OrderedSum::gathers(size_t index) const {
  const BucketInfo& bucket = buckets_[index];
  const int64_t received = world_size_ * max_cover() * bucket.flat.numel() *
      static_cast<int64_t>(bucket.flat.element_size());
  return world_size_ > 1 && received <= kGatherBytes;
}

bool OrderedSum::carries_stats(const Comm& comm, int64_t numel) const {
  return comm.reduces() && !cover_counts_.empty() && gathers(0);
}

// Note [Gathered buckets].
void OrderedSum::start_gathered(size_t index, Comm& comm) {
  const BucketInfo& bucket = buckets_[index];
  Exchange& exchange = exchanges_[index];
  const int64_t n = bucket.flat.numel();
  const int64_t covers = max_cover();
  const int64_t pieces = index == 0 && stats_.defined() ? kStatsPieces * stats_.numel() : 0;
  const int64_t size = covers * n + pieces;
  if (!exchange.block.defined() || exchange.block.numel() != size ||
      static_cast<int64_t>(exchange.blocks.size()) != comm.size()) {
    // Zeros: the padding of a smaller cover is sent but never read.
    exchange.block = at::zeros({size}, bucket.flat.options());
    exchange.blocks.clear();
    for (int64_t r = 0; r < comm.size(); ++r) {
      exchange.blocks.push_back(at::empty({size}, bucket.flat.options()));
    }
  }
  for (const auto j : c10::irange(cover_counts_[comm.rank()])) {
    exchange.block.narrow(0, j * n, n).copy_(level_slice(bucket, j));
  }
  if (pieces > 0) {
    encode_stats(stats_, exchange.block.narrow(0, covers * n, pieces));
  }
  exchange.gathered = true;
  exchange.waited = false;
  exchange.stats_pieces = pieces;
  exchange.transfers.push_back(comm.all_gather(
      exchange.block, exchange.blocks,
      "all-gather of the partial sums of " + bucket_name(index) +
          (pieces > 0 ? " and the step's statistics" : "")));
}

void OrderedSum::wait_gathered(size_t index, Comm& comm) {
  Exchange& exchange = exchanges_[index];
  if (exchange.waited) {
    return;
  }
  auto transfers = std::move(exchange.transfers);
  exchange.transfers.clear();
  for (const auto& transfer : transfers) {
    comm.wait(transfer, "all-gather of the partial sums of " + bucket_name(index));
  }
  exchange.waited = true;
}

void OrderedSum::combine_gathered(size_t index, Comm& comm) {
  wait_gathered(index, comm);
  RECORD_FUNCTION("vflow::combine", std::vector<c10::IValue>());
  const BucketInfo& bucket = buckets_[index];
  Exchange& exchange = exchanges_[index];
  const int64_t n = bucket.flat.numel();
  std::vector<at::Tensor> stack;
  size_t k = 0;
  for (const auto peer : c10::irange(comm.size())) {
    for (const auto j : c10::irange(cover_counts_[peer])) {
      TORCH_INTERNAL_ASSERT(k < combine_merges_.size());
      stack.push_back(exchange.blocks[peer].narrow(0, j * n, n));
      for (int64_t m = 0; m < combine_merges_[k]; ++m) {
        at::Tensor right = std::move(stack.back());
        stack.pop_back();
        stack.back().add_(right);
      }
      ++k;
    }
  }
  TORCH_INTERNAL_ASSERT(stack.size() == 1 && k == combine_merges_.size());
  bucket.flat.copy_(stack[0]);
  exchange.gathered = false;
}

at::Tensor OrderedSum::wait_stats(Comm& comm) {
  Exchange& exchange = exchanges_[0];
  TORCH_CHECK(exchange.gathered && exchange.stats_pieces > 0,
              "no statistics rode with bucket 0 in this step");
  wait_gathered(0, comm);
  const int64_t pieces = exchange.stats_pieces;
  const int64_t at = exchange.block.numel() - pieces;
  at::Tensor summed = exchange.blocks[0].narrow(0, at, pieces).clone();
  for (size_t r = 1; r < exchange.blocks.size(); ++r) {
    summed.add_(exchange.blocks[r].narrow(0, at, pieces));
  }
  return decode_stats(summed);
}

// Phase 1 of Note [Ordered sum].
void OrderedSum::start(size_t index, Comm& comm) {
  if (!comm.reduces()) {
    return;
  }
  if (gathers(index)) {
    start_gathered(index, comm);
    return;
  }
  const BucketInfo& bucket = buckets_[index];
  Exchange& exchange = exchanges_[index];
  const int64_t world = comm.size();
  const int64_t rank = comm.rank();
  const int64_t own_begin = shard_begin(bucket, rank);
  const int64_t own = shard_begin(bucket, rank + 1) - own_begin;
  int64_t total = 0;
  for (const int64_t count : cover_counts_) {
    total += count;
  }
  const int64_t incoming = (total - cover_counts_[rank]) * own;
  if (!exchange.received.defined() || exchange.received.numel() != incoming) {
    exchange.received = at::empty({incoming}, bucket.flat.options());
  }
  const std::string what = "exchange of partial sums of " + bucket_name(index);
  exchange.shard_partials.clear();
  int64_t next = 0;
  for (const auto peer : c10::irange(world)) {
    if (peer == rank) {
      for (const auto j : c10::irange(cover_counts_[rank])) {
        exchange.shard_partials.push_back(level_slice(bucket, j).narrow(0, own_begin, own));
      }
      continue;
    }
    const int64_t first_received = next;
    for (const auto j : c10::irange(cover_counts_[peer])) {
      exchange.shard_partials.push_back(exchange.received.narrow(0, (next + j) * own, own));
    }
    next += cover_counts_[peer];
    const int64_t begin = shard_begin(bucket, peer);
    const int64_t size = shard_begin(bucket, peer + 1) - begin;
    auto sends = [&] {
      for (const auto j : c10::irange(cover_counts_[rank])) {
        if (size > 0) {
          exchange.transfers.push_back(comm.send(level_slice(bucket, j).narrow(0, begin, size),
                                                 peer, tag_of(index, j, 0), what));
        }
      }
    };
    auto receives = [&] {
      for (const auto j : c10::irange(cover_counts_[peer])) {
        if (own > 0) {
          exchange.transfers.push_back(
              comm.recv(exchange.received.narrow(0, (first_received + j) * own, own), peer,
                        tag_of(index, j, 0), what));
        }
      }
    };
    in_pair_order(rank, peer, sends, receives);
  }
}

// Combine and phase 2 of Note [Ordered sum].
void OrderedSum::combine_and_share(size_t index, Comm& comm) {
  const BucketInfo& bucket = buckets_[index];
  Exchange& exchange = exchanges_[index];
  if (exchange.gathered) {
    combine_gathered(index, comm);
    return;
  }
  const std::string what = "exchange of partial sums of " + bucket_name(index);
  auto transfers = std::move(exchange.transfers);
  exchange.transfers.clear();
  for (const auto& transfer : transfers) {
    comm.wait(transfer, what);
  }
  RECORD_FUNCTION("vflow::combine", std::vector<c10::IValue>());
  std::vector<at::Tensor> stack;
  TORCH_INTERNAL_ASSERT(exchange.shard_partials.size() == combine_merges_.size());
  for (const auto k : c10::irange(combine_merges_.size())) {
    stack.push_back(exchange.shard_partials[k]);
    for (int64_t m = 0; m < combine_merges_[k]; ++m) {
      at::Tensor right = std::move(stack.back());
      stack.pop_back();
      stack.back().add_(right);
    }
  }
  TORCH_INTERNAL_ASSERT(stack.size() == 1);
  exchange.shard_partials.clear();
  const int64_t world = comm.size();
  const int64_t rank = comm.rank();
  const int64_t own_begin = shard_begin(bucket, rank);
  const int64_t own = shard_begin(bucket, rank + 1) - own_begin;
  const at::Tensor result = bucket.flat.narrow(0, own_begin, own);
  if (own > 0 && stack[0].data_ptr() != result.data_ptr()) {
    result.copy_(stack[0]);
  }
  const std::string sharing = "sharing the sums of " + bucket_name(index);
  for (const auto peer : c10::irange(world)) {
    if (peer == rank) {
      continue;
    }
    const int64_t begin = shard_begin(bucket, peer);
    const int64_t size = shard_begin(bucket, peer + 1) - begin;
    auto send = [&] {
      if (own > 0) {
        exchange.transfers.push_back(comm.send(result, peer, tag_of(index, 0, 1), sharing));
      }
    };
    auto receive = [&] {
      if (size > 0) {
        exchange.transfers.push_back(
            comm.recv(bucket.flat.narrow(0, begin, size), peer, tag_of(index, 0, 1), sharing));
      }
    };
    in_pair_order(rank, peer, send, receive);
  }
}

void OrderedSum::wait_all(Comm& comm) {
  if (!comm.reduces()) {
    return;
  }
  // Bucket by bucket, so one bucket's phase 2 overlaps the next one's phase 1.
  for (const auto b : c10::irange(buckets_.size())) {
    combine_and_share(b, comm);
  }
  for (const auto b : c10::irange(buckets_.size())) {
    auto transfers = std::move(exchanges_[b].transfers);
    exchanges_[b].transfers.clear();
    for (const auto& transfer : transfers) {
      comm.wait(transfer, "receiving the sums of " + bucket_name(b));
    }
  }
}

std::vector<c10::intrusive_ptr<c10d::Work>> OrderedSum::take_in_flight() {
  std::vector<c10::intrusive_ptr<c10d::Work>> out;
  for (auto& exchange : exchanges_) {
    for (auto& transfer : exchange.transfers) {
      out.push_back(std::move(transfer));
    }
    exchange.transfers.clear();
    exchange.shard_partials.clear();
    exchange.gathered = false;
  }
  return out;
}

int64_t OrderedSum::bytes_per_step(const Comm& comm) const {
  if (!comm.reduces()) {
    return 0;
  }
  const int64_t world = comm.size();
  const int64_t rank = comm.rank();
  const int64_t covers = cover_counts_.empty() ? 1 : cover_counts_[rank];
  int64_t bytes = 0;
  for (const auto b : c10::irange(buckets_.size())) {
    const BucketInfo& bucket = buckets_[b];
    const int64_t numel = bucket.flat.numel();
    if (!cover_counts_.empty() && gathers(b)) {
      // A ring all-gather: this worker's block passes on to each of the others.
      bytes += (world - 1) * max_cover() * numel *
          static_cast<int64_t>(bucket.flat.element_size());
      continue;
    }
    const int64_t own = shard_begin(bucket, rank + 1) - shard_begin(bucket, rank);
    bytes += (covers * (numel - own) + (world - 1) * own) *
        static_cast<int64_t>(bucket.flat.element_size());
  }
  return bytes;
}

} // namespace vflow
