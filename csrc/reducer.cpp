#include "reducer.h"

#include "collectives.h"
#include "ops.h"

#include <c10/util/Exception.h>
#include <c10/util/irange.h>

#include <limits>
#include <sstream>
#include <utility>

namespace vflow {

namespace {

const std::string kStatsName = "all-reduce of the step's loss and item totals";

// The bytes of one element of a bucket on the wire in exact mode: an int8 top bin
// (MAX) and an int64 packed sum (SUM).
constexpr int64_t kExactWireBytes = 1 + 8;

// Ordered mode: point-to-point tags are (bucket * kTagLevels + level) * 2 + phase, so a
// worker contributes at most kTagLevels partial sums (a cover of [0, V) has fewer than
// 2 log2(V) nodes, i.e. < 32 for the largest V deterministic mode accepts).
constexpr int64_t kTagLevels = 64;

// Issues one pair of ranks' transfers in an order both sides agree on: backends that
// run a pair's transfers in issue order (NCCL) would deadlock if both sides received
// first, so the lower rank sends first.
template <typename Send, typename Receive>
void in_pair_order(int64_t rank, int64_t peer, Send send, Receive receive) {
  if (rank < peer) {
    send();
    receive();
  } else {
    receive();
    send();
  }
}

int tag_of(size_t bucket, int64_t level, int64_t phase) {
  const int64_t tag = (static_cast<int64_t>(bucket) * kTagLevels + level) * 2 + phase;
  TORCH_CHECK(tag <= std::numeric_limits<int>::max(), "too many buckets for point-to-point "
              "tags in ordered mode: raise bucket_cap_bytes");
  return static_cast<int>(tag);
}

} // namespace

Reducer::Reducer(
    const std::vector<std::vector<at::Tensor>>& groups,
    const std::vector<at::ScalarType>& dtypes,
    int64_t first_bucket_bytes,
    int64_t bucket_cap_bytes,
    c10::intrusive_ptr<c10d::ProcessGroup> process_group,
    std::chrono::milliseconds timeout,
    std::string description,
    bool exact,
    bool ordered)
    : exact_(exact),
      ordered_(ordered),
      process_group_(std::move(process_group)),
      timeout_(timeout),
      description_(std::move(description)) {
  TORCH_CHECK(!groups.empty(), "groups must hold at least one parameter group");
  TORCH_CHECK(groups.size() == dtypes.size(), "dtypes has ", dtypes.size(),
              " entries but groups has ", groups.size(), "; give one dtype per group");
  TORCH_CHECK(first_bucket_bytes > 0, "first_bucket_bytes must be > 0, got ",
              first_bucket_bytes);
  TORCH_CHECK(bucket_cap_bytes > 0, "bucket_cap_bytes must be > 0, got ", bucket_cap_bytes);
  TORCH_CHECK(timeout.count() > 0, "timeout must be > 0 ms, got ", timeout.count());
  TORCH_CHECK(!(exact && ordered), "exact and ordered are two ways of summing "
              "deterministically: choose at most one");
  for (const auto g : c10::irange(groups.size())) {
    TORCH_CHECK(!exact || dtypes[g] == at::kFloat, "exact accumulation needs float32 "
                "accumulators, but dtypes[", g, "] is ", dtypes[g]);
    auto buffer = std::make_shared<GradBuffer>(groups[g], dtypes[g]);
    if (exact) {
      const auto numel = buffer->data().numel();
      const auto options = buffer->data().options();
      exact_states_.push_back({at::zeros({numel}, options.dtype(at::kChar)),
                               at::zeros({exact::kLimbs, numel}, options.dtype(at::kInt)),
                               at::zeros({numel}, options.dtype(at::kChar)),
                               at::zeros({numel}, options.dtype(at::kLong))});
    }
    if (ordered) {
      levels_.push_back({buffer->data()});
    }
    const int64_t element_size = static_cast<int64_t>(buffer->data().element_size());
    const auto& numels = buffer->numels();
    const auto& offsets = buffer->offsets();
    std::vector<int64_t> owner(numels.size());
    int64_t first = 0;
    int64_t bytes = 0;
    int64_t cap = first_bucket_bytes;
    auto close_bucket = [&](int64_t last) {
      Bucket bucket;
      bucket.buffer = static_cast<int64_t>(g);
      bucket.first_slot = first;
      bucket.last_slot = last;
      bucket.offset = offsets[first];
      const int64_t end = offsets[last] + numels[last];
      bucket.flat = buffer->data().narrow(0, offsets[first], end - offsets[first]);
      for (int64_t s = first; s <= last; ++s) {
        owner[s] = static_cast<int64_t>(buckets_.size());
      }
      buckets_.push_back(std::move(bucket));
    };
    for (const auto s : c10::irange(static_cast<int64_t>(numels.size()))) {
      const int64_t slot_bytes = numels[s] * element_size;
      if (s > first && bytes + slot_bytes > cap) {
        close_bucket(s - 1);
        first = s;
        bytes = 0;
        cap = bucket_cap_bytes;
      }
      bytes += slot_bytes;
    }
    close_bucket(static_cast<int64_t>(numels.size()) - 1);
    bucket_of_slot_.push_back(std::move(owner));
    written_.emplace_back(numels.size(), 0);
    buffers_.push_back(std::move(buffer));
  }
}

int64_t Reducer::bucket_of(int64_t buffer, int64_t slot) const {
  TORCH_CHECK(buffer >= 0 && buffer < static_cast<int64_t>(buffers_.size()),
              "buffer must be in [0, ", buffers_.size(), "), got ", buffer);
  const auto& owners = bucket_of_slot_[buffer];
  TORCH_CHECK(slot >= 0 && slot < static_cast<int64_t>(owners.size()),
              "slot must be in [0, ", owners.size(), "), got ", slot);
  return owners[slot];
}

std::vector<Reducer::BucketRange> Reducer::bucket_ranges() const {
  std::vector<BucketRange> out;
  out.reserve(buckets_.size());
  for (const auto& bucket : buckets_) {
    const int64_t offset = buffers_[bucket.buffer]->offsets()[bucket.first_slot];
    out.push_back({bucket.buffer, bucket.first_slot, bucket.last_slot, offset,
                   bucket.flat.numel()});
  }
  return out;
}

int64_t Reducer::world_size() const {
  return process_group_ ? process_group_->getSize() : 1;
}

int64_t Reducer::bytes_per_step() const {
  if (!reduces()) {
    return 0;
  }
  int64_t bytes = 0;
  const int64_t world = world_size();
  const int64_t rank = process_group_->getRank();
  const int64_t covers = cover_counts_.empty() ? 1 : cover_counts_[rank];
  for (const auto& bucket : buckets_) {
    const int64_t numel = bucket.flat.numel();
    const int64_t element_size = static_cast<int64_t>(bucket.flat.element_size());
    if (ordered_) {
      const int64_t own = shard_begin(bucket, rank + 1) - shard_begin(bucket, rank);
      bytes += (covers * (numel - own) + (world - 1) * own) * element_size;
    } else {
      bytes += numel * (exact_ ? kExactWireBytes : element_size);
    }
  }
  return bytes;
}

bool Reducer::reduces() const {
  return process_group_ && process_group_->getSize() > 1;
}

std::string Reducer::bucket_name(size_t index) const {
  const auto& bucket = buckets_[index];
  const double megabytes = static_cast<double>(bucket.flat.numel()) *
      static_cast<double>(bucket.flat.element_size()) / (1024.0 * 1024.0);
  std::ostringstream out;
  out << "all-reduce of gradient bucket " << index << " of " << buckets_.size() << " ("
      << megabytes << " MB)";
  return out.str();
}

void Reducer::begin_step(int64_t step) {
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_CHECK(!in_step_, "Reducer::begin_step: the previous step was neither finalized nor "
              "discarded");
  TORCH_CHECK(!ordered_ || !cover_counts_.empty(), "Reducer::begin_step: ordered mode needs "
              "set_tree before the first step");
  for (auto& bucket : buckets_) {
    TORCH_INTERNAL_ASSERT(!bucket.work && bucket.pending_grads.empty() &&
                          bucket.transfers.empty());
    bucket.final = false;
  }
  depth_ = 0;
  for (auto& flags : written_) {
    std::fill(flags.begin(), flags.end(), 0);
  }
  next_launch_ = 0;
  early_launches_ = 0;
  stats_work_.reset();
  stats_sum_ = at::Tensor();
  in_step_ = true;
  last_vn_ = false;
  step_ = step;
}

void Reducer::set_tree(const std::vector<int64_t>& cover_counts,
                       const std::vector<int64_t>& combine_merges) {
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_CHECK(ordered_, "Reducer::set_tree needs a Reducer made with ordered=True");
  TORCH_CHECK(!in_step_, "Reducer::set_tree called during a step");
  TORCH_CHECK(static_cast<int64_t>(cover_counts.size()) == world_size(), "cover_counts has ",
              cover_counts.size(), " entries; give one per worker (", world_size(), ")");
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

void Reducer::begin_vn(double weight, bool last, int64_t level, int64_t merges) {
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_CHECK(in_step_, "Reducer::begin_vn called outside a step");
  TORCH_CHECK(!last_vn_, "Reducer::begin_vn called after the step's last VN");
  if (ordered_) {
    TORCH_CHECK(level == depth_, "level must be the stack depth after the previous VNs (",
                depth_, "), got ", level);
    TORCH_CHECK(merges >= 0 && merges <= level, "merges must be in [0, level=", level,
                "], got ", merges);
    for (const auto b : c10::irange(buffers_.size())) {
      this->level(static_cast<int64_t>(b), level);  // allocated here, not under backward
    }
    for (auto& flags : written_) {
      std::fill(flags.begin(), flags.end(), 0);
    }
    vn_level_ = level;
    vn_merges_ = merges;
  } else {
    TORCH_CHECK(level == 0 && merges == 0, "level and merges are for ordered mode only");
  }
  weight_ = weight;
  last_vn_ = last;
  for (auto& bucket : buckets_) {
    bucket.arrived = 0;
    bucket.vn_done = false;
  }
}

at::Tensor Reducer::level(int64_t buffer, int64_t index) {
  auto& levels = levels_[buffer];
  while (static_cast<int64_t>(levels.size()) <= index) {
    // Zeros, not empty: the padding between slots is never written and must add up to 0.
    levels.push_back(at::zeros_like(levels[0]));
  }
  return levels[index];
}

// See Note [First fold overwrites]: slots seen for the first time in this step are
// overwritten, the others added to, in at most two fused calls.
void Reducer::fold(Bucket& bucket) {
  if (bucket.pending_slots.empty()) {
    return;
  }
  GradBuffer& buffer = *buffers_[bucket.buffer];
  auto& written = written_[bucket.buffer];
  std::vector<int64_t> first_slots;
  std::vector<at::Tensor> first_grads;
  std::vector<int64_t> later_slots;
  std::vector<at::Tensor> later_grads;
  for (const auto k : c10::irange(bucket.pending_slots.size())) {
    const int64_t slot = bucket.pending_slots[k];
    if (written[slot]) {
      later_slots.push_back(slot);
      later_grads.push_back(std::move(bucket.pending_grads[k]));
    } else {
      first_slots.push_back(slot);
      first_grads.push_back(std::move(bucket.pending_grads[k]));
      written[slot] = 1;
    }
  }
  bucket.pending_slots.clear();
  bucket.pending_grads.clear();
  bucket.pending_bytes = 0;
  if (ordered_) {
    // Every VN writes its own level: "later" slots cannot occur within one VN.
    TORCH_INTERNAL_ASSERT(later_slots.empty());
    if (!first_slots.empty()) {
      const at::Tensor target = level(bucket.buffer, vn_level_);
      std::vector<at::Tensor> accs;
      accs.reserve(first_slots.size());
      for (const auto k : c10::irange(first_slots.size())) {
        const int64_t slot = first_slots[k];
        TORCH_CHECK(first_grads[k].numel() == buffer.numels()[slot], "the gradient of slot ",
                    slot, " has ", first_grads[k].numel(), " elements, expected ",
                    buffer.numels()[slot]);
        accs.push_back(target.narrow(0, buffer.offsets()[slot], buffer.numels()[slot])
                           .view(first_grads[k].sizes()));
      }
      multi_accumulate_(accs, first_grads, weight_, /*overwrite=*/true);
    }
    return;
  }
  if (exact_) {
    fold_exact(bucket, first_slots, first_grads, /*fresh=*/true);
    fold_exact(bucket, later_slots, later_grads, /*fresh=*/false);
    return;
  }
  if (!first_slots.empty()) {
    buffer.accumulate_(first_slots, first_grads, weight_, /*overwrite=*/true);
  }
  if (!later_slots.empty()) {
    buffer.accumulate_(later_slots, later_grads, weight_, /*overwrite=*/false);
  }
}

// One kernel call per gradient: these passes are long next to a call's overhead.
void Reducer::fold_exact(Bucket& bucket, const std::vector<int64_t>& slots,
                         std::vector<at::Tensor>& grads, bool fresh) {
  const GradBuffer& buffer = *buffers_[bucket.buffer];
  const ExactState& state = exact_states_[bucket.buffer];
  for (const auto k : c10::irange(slots.size())) {
    const int64_t offset = buffer.offsets()[slots[k]];
    const int64_t numel = buffer.numels()[slots[k]];
    TORCH_CHECK(grads[k].numel() == numel, "the gradient of slot ", slots[k], " has ",
                grads[k].numel(), " elements, expected ", numel);
    exact_accumulate_(state.top.narrow(0, offset, numel),
                      state.limbs[0].narrow(0, offset, numel),
                      state.limbs[1].narrow(0, offset, numel),
                      state.limbs[2].narrow(0, offset, numel), grads[k], weight_, fresh);
    grads[k] = at::Tensor();  // freed now: see Note [Fold granularity]
  }
}

at::Tensor Reducer::exact_slice(const at::Tensor& plane, const Bucket& bucket) const {
  return plane.narrow(0, bucket.offset, bucket.flat.numel());
}

void Reducer::zero_run(int64_t buffer, int64_t first, int64_t last) {
  if (!exact_ && !ordered_) {
    buffers_[buffer]->zero_slots_(first, last);
    return;
  }
  const auto& offsets = buffers_[buffer]->offsets();
  const int64_t begin = offsets[first];
  const int64_t numel = offsets[last] + buffers_[buffer]->numels()[last] - begin;
  if (ordered_) {
    level(buffer, vn_level_).narrow(0, begin, numel).zero_();
    return;
  }
  const ExactState& state = exact_states_[buffer];
  state.top.narrow(0, begin, numel).zero_();
  state.limbs.narrow(1, begin, numel).zero_();
}

// Zeroes the runs of slots that received nothing in this step, so the bucket holds
// this worker's final sum.
void Reducer::make_final(Bucket& bucket) {
  auto& written = written_[bucket.buffer];
  int64_t slot = bucket.first_slot;
  while (slot <= bucket.last_slot) {
    if (written[slot]) {
      ++slot;
      continue;
    }
    const int64_t run_start = slot;
    while (slot <= bucket.last_slot && !written[slot]) {
      written[slot] = 1;
      ++slot;
    }
    zero_run(bucket.buffer, run_start, slot - 1);
  }
  if (ordered_) {
    // See Note [Ordered sum]: the VN's leaf is complete on this bucket; merge it upwards.
    for (int64_t k = vn_level_; k > vn_level_ - vn_merges_; --k) {
      level(bucket.buffer, k - 1)
          .narrow(0, bucket.offset, bucket.flat.numel())
          .add_(level(bucket.buffer, k).narrow(0, bucket.offset, bucket.flat.numel()));
    }
    bucket.vn_done = true;
    bucket.final = last_vn_;
    return;
  }
  bucket.final = true;
}

void Reducer::add_grad(int64_t bucket_index, int64_t slot, const at::Tensor& grad) {
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_CHECK(in_step_, "Reducer::add_grad called outside a step");
  TORCH_CHECK(bucket_index >= 0 && bucket_index < num_buckets(), "bucket must be in [0, ",
              num_buckets(), "), got ", bucket_index);
  Bucket& bucket = buckets_[bucket_index];
  TORCH_CHECK(slot >= bucket.first_slot && slot <= bucket.last_slot, "slot ", slot,
              " is not in bucket ", bucket_index, " (slots ", bucket.first_slot, "..",
              bucket.last_slot, ")");
  TORCH_INTERNAL_ASSERT(!bucket.final, "gradient for bucket ", bucket_index,
                        " arrived after the bucket was final");
  bucket.pending_slots.push_back(slot);
  bucket.pending_grads.push_back(grad);
  bucket.pending_bytes += static_cast<int64_t>(grad.nbytes());
  const bool complete = ++bucket.arrived == bucket.num_slots();
  if (complete || bucket.pending_bytes >= kFoldBytes) {
    fold(bucket);
  }
  if (complete && ordered_) {
    make_final(bucket);  // the VN's merges; final only in the last VN
  }
  if (complete && last_vn_) {
    if (!ordered_) {
      make_final(bucket);
    }
    launch_ready();
  }
}

void Reducer::end_vn() {
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_CHECK(in_step_, "Reducer::end_vn called outside a step");
  for (auto& bucket : buckets_) {
    fold(bucket);
  }
  if (ordered_) {
    for (auto& bucket : buckets_) {
      if (!bucket.vn_done) {
        make_final(bucket);
      }
    }
    depth_ = vn_level_ + 1 - vn_merges_;
    if (last_vn_) {
      const int64_t rank = reduces() ? process_group_->getRank() : 0;
      TORCH_CHECK(depth_ == cover_counts_[rank], "after its last VN this worker holds ",
                  depth_, " partial sums but set_tree says ", cover_counts_[rank],
                  ": the VN schedule and the tree disagree");
    }
  }
  if (last_vn_) {
    early_launches_ = static_cast<int64_t>(next_launch_);
    for (auto& bucket : buckets_) {
      if (!bucket.final) {
        make_final(bucket);
      }
    }
    launch_ready();
    TORCH_INTERNAL_ASSERT(next_launch_ == buckets_.size());
  }
}

void Reducer::abort_vn() {
  std::lock_guard<std::mutex> lock(mutex_);
  for (auto& bucket : buckets_) {
    bucket.pending_slots.clear();
    bucket.pending_grads.clear();
    bucket.pending_bytes = 0;
  }
}

// See Note [Launch order]. Called with mutex_ held.
void Reducer::launch_ready() {
  while (next_launch_ < buckets_.size() && buckets_[next_launch_].final) {
    Bucket& bucket = buckets_[next_launch_];
    if (exact_) {
      start_exact_sum(next_launch_);
    } else if (ordered_) {
      if (reduces()) {
        start_partials_exchange(next_launch_);
      }
    } else if (reduces()) {
      bucket.work = launch(bucket.flat, bucket_name(next_launch_));
    }
    ++next_launch_;
  }
}

void Reducer::start_stats(const at::Tensor& stats) {
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_CHECK(in_step_, "Reducer::start_stats called outside a step");
  TORCH_CHECK(next_launch_ == 0 && !stats_work_,
              "Reducer::start_stats must precede every bucket's all-reduce and run once");
  stats_sum_ = stats.clone(at::MemoryFormat::Contiguous);
  if (reduces()) {
    stats_work_ = launch(stats_sum_, kStatsName);
  }
}

c10::intrusive_ptr<c10d::Work> Reducer::launch(at::Tensor tensor, const std::string& what,
                                              c10d::ReduceOp::RedOpType op) {
  std::vector<at::Tensor> tensors{std::move(tensor)};
  c10d::AllreduceOptions options;
  options.reduceOp = c10d::ReduceOp(op);
  options.timeout = timeout_;
  try {
    return process_group_->allreduce(tensors, options);
  } catch (const std::exception& e) {
    fail("starting the " + what, error_text(e));
  }
}

void Reducer::fail(const std::string& what, const std::string& cause) const {
  std::ostringstream out;
  out << "vflow step " << step_ << ": " << what << " on " << description_
      << " failed or timed out (timeout " << static_cast<double>(timeout_.count()) / 1000.0
      << " s): " << cause;
  throw CollectiveError(out.str());
}

void Reducer::wait_for(const c10::intrusive_ptr<c10d::Work>& work, const std::string& what) {
  try {
    work->wait(timeout_);
  } catch (const std::exception& e) {
    fail(what, error_text(e));
  }
}

at::Tensor Reducer::wait_stats() {
  c10::intrusive_ptr<c10d::Work> work;
  at::Tensor sums;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    TORCH_CHECK(stats_sum_.defined(), "Reducer::wait_stats must follow start_stats");
    work = stats_work_;
    sums = stats_sum_;
  }
  if (work) {
    wait_for(work, kStatsName);
    std::lock_guard<std::mutex> lock(mutex_);
    stats_work_.reset();
  }
  // A copy: stats_sum_ may still be held by the finished Work (Note [Collectives on
  // tensors Python cannot see]).
  return sums.clone();
}

void Reducer::finalize(double factor, const std::vector<at::Tensor>& found_nonfinite) {
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_CHECK(in_step_ && last_vn_ && next_launch_ == buckets_.size(),
              "Reducer::finalize must follow the end of the step's last VN");
  TORCH_CHECK(found_nonfinite.empty() || found_nonfinite.size() == buffers_.size(),
              "found_nonfinite must be empty or hold one flag per buffer");
  const auto start = std::chrono::steady_clock::now();
  if (ordered_ && reduces()) {
    // Bucket by bucket, so one bucket's phase 2 overlaps the next one's phase 1.
    for (const auto b : c10::irange(buckets_.size())) {
      combine_and_share(b);
    }
  }
  for (const auto b : c10::irange(buckets_.size())) {
    auto work = std::move(buckets_[b].work);
    if (work) {
      wait_for(work, bucket_name(b));
    }
    auto transfers = std::move(buckets_[b].transfers);
    buckets_[b].transfers.clear();
    for (const auto& transfer : transfers) {
      wait_for(transfer, "receiving the sums of " + bucket_name(b));
    }
  }
  if (stats_work_) {
    auto work = std::move(stats_work_);
    wait_for(work, kStatsName);
  }
  last_wait_seconds_ =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (exact_) {
    for (const auto& bucket : buckets_) {
      const ExactState& state = exact_states_[bucket.buffer];
      exact_unpack_(exact_slice(reduces() ? state.global_top : state.top, bucket),
                    exact_slice(state.wire, bucket), bucket.flat, factor);
    }
    factor = 1.0;  // applied by the unpacking; what is left below is the check
  }
  for (const auto b : c10::irange(buffers_.size())) {
    if (found_nonfinite.empty()) {
      buffers_[b]->scale_(factor);
    } else {
      buffers_[b]->scale_check_(factor, found_nonfinite[b]);
    }
  }
  in_step_ = false;
  last_vn_ = false;
}

// See Note [Exact buckets]. Called with mutex_ held when bucket `index` is final.
void Reducer::start_exact_sum(size_t index) {
  Bucket& bucket = buckets_[index];
  const ExactState& state = exact_states_[bucket.buffer];
  const at::Tensor top = exact_slice(state.top, bucket);
  at::Tensor global_top = top;
  if (reduces()) {
    global_top = exact_slice(state.global_top, bucket);
    global_top.copy_(top);
    const std::string what = "all-reduce (MAX) of the exponents of " + bucket_name(index);
    wait_for(launch(global_top, what, c10d::ReduceOp::MAX), what);
  }
  const at::Tensor wire = exact_slice(state.wire, bucket);
  exact_pack_(top, global_top, exact_slice(state.limbs[0], bucket),
              exact_slice(state.limbs[1], bucket), exact_slice(state.limbs[2], bucket), wire);
  if (reduces()) {
    bucket.work = launch(wire, bucket_name(index));
  }
}

int64_t Reducer::shard_begin(const Bucket& bucket, int64_t rank) const {
  return bucket.flat.numel() * rank / world_size();
}

c10::intrusive_ptr<c10d::Work> Reducer::transfer(at::Tensor tensor, int64_t peer, int64_t tag,
                                                bool send, const std::string& what) {
  std::vector<at::Tensor> tensors{std::move(tensor)};
  try {
    return send ? process_group_->send(tensors, static_cast<int>(peer), static_cast<int>(tag))
                : process_group_->recv(tensors, static_cast<int>(peer), static_cast<int>(tag));
  } catch (const std::exception& e) {
    fail("starting the " + what, error_text(e));
  }
}

// Phase 1 of Note [Ordered sum]. Called with mutex_ held when bucket `index` is final.
void Reducer::start_partials_exchange(size_t index) {
  Bucket& bucket = buckets_[index];
  const int64_t world = world_size();
  const int64_t rank = process_group_->getRank();
  const int64_t own_begin = shard_begin(bucket, rank);
  const int64_t own = shard_begin(bucket, rank + 1) - own_begin;
  int64_t total = 0;
  for (const int64_t count : cover_counts_) {
    total += count;
  }
  const int64_t incoming = (total - cover_counts_[rank]) * own;
  if (!bucket.received.defined() || bucket.received.numel() != incoming) {
    bucket.received = at::empty({incoming}, bucket.flat.options());
  }
  const std::string what = "exchange of partial sums of " + bucket_name(index);
  bucket.shard_partials.clear();
  int64_t next = 0;
  for (const auto peer : c10::irange(world)) {
    if (peer == rank) {
      for (const auto j : c10::irange(cover_counts_[rank])) {
        bucket.shard_partials.push_back(
            level(bucket.buffer, j).narrow(0, bucket.offset + own_begin, own));
      }
      continue;
    }
    const int64_t first_received = next;
    for (const auto j : c10::irange(cover_counts_[peer])) {
      bucket.shard_partials.push_back(bucket.received.narrow(0, (next + j) * own, own));
    }
    next += cover_counts_[peer];
    const int64_t begin = shard_begin(bucket, peer);
    const int64_t size = shard_begin(bucket, peer + 1) - begin;
    auto sends = [&] {
      for (const auto j : c10::irange(cover_counts_[rank])) {
        if (size > 0) {
          bucket.transfers.push_back(transfer(
              level(bucket.buffer, j).narrow(0, bucket.offset + begin, size), peer,
              tag_of(index, j, 0), true, what));
        }
      }
    };
    auto receives = [&] {
      for (const auto j : c10::irange(cover_counts_[peer])) {
        if (own > 0) {
          bucket.transfers.push_back(
              transfer(bucket.received.narrow(0, (first_received + j) * own, own), peer,
                       tag_of(index, j, 0), false, what));
        }
      }
    };
    in_pair_order(rank, peer, sends, receives);
  }
}

// Combine and phase 2 of Note [Ordered sum]. Called with mutex_ held, in `finalize`.
void Reducer::combine_and_share(size_t index) {
  Bucket& bucket = buckets_[index];
  const std::string what = "exchange of partial sums of " + bucket_name(index);
  auto transfers = std::move(bucket.transfers);
  bucket.transfers.clear();
  for (const auto& transfer : transfers) {
    wait_for(transfer, what);
  }
  std::vector<at::Tensor> stack;
  TORCH_INTERNAL_ASSERT(bucket.shard_partials.size() == combine_merges_.size());
  for (const auto k : c10::irange(combine_merges_.size())) {
    stack.push_back(bucket.shard_partials[k]);
    for (int64_t m = 0; m < combine_merges_[k]; ++m) {
      at::Tensor right = std::move(stack.back());
      stack.pop_back();
      stack.back().add_(right);
    }
  }
  TORCH_INTERNAL_ASSERT(stack.size() == 1);
  bucket.shard_partials.clear();
  const int64_t world = world_size();
  const int64_t rank = process_group_->getRank();
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
        bucket.transfers.push_back(transfer(result, peer, tag_of(index, 0, 1), true, sharing));
      }
    };
    auto receive = [&] {
      if (size > 0) {
        bucket.transfers.push_back(transfer(bucket.flat.narrow(0, begin, size), peer,
                                            tag_of(index, 0, 1), false, sharing));
      }
    };
    in_pair_order(rank, peer, send, receive);
  }
}

void Reducer::discard() {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<c10::intrusive_ptr<c10d::Work>> in_flight;
  if (stats_work_) {
    in_flight.push_back(std::move(stats_work_));
  }
  for (auto& bucket : buckets_) {
    if (bucket.work) {
      in_flight.push_back(std::move(bucket.work));
    }
    for (auto& transfer : bucket.transfers) {
      in_flight.push_back(std::move(transfer));
    }
    bucket.transfers.clear();
    bucket.pending_slots.clear();
    bucket.pending_grads.clear();
    bucket.pending_bytes = 0;
  }
  for (const auto& work : in_flight) {
    try {
      work->wait(timeout_);
    } catch (const std::exception&) {
      break;  // the group is broken; the other collectives cannot complete either
    }
  }
  in_step_ = false;
  last_vn_ = false;
}

} // namespace vflow
