#include "reducer.h"

#include <c10/util/Exception.h>
#include <c10/util/irange.h>

#include <sstream>
#include <utility>

namespace vflow {

namespace {

std::string error_text(const std::exception& e) {
  if (const auto* c10_error = dynamic_cast<const c10::Error*>(&e)) {
    return c10_error->what_without_backtrace();
  }
  return e.what();
}

const std::string kStatsName = "all-reduce of the step's loss and item totals";

// The bytes of one element of a bucket on the wire in exact mode: an int8 top bin
// (MAX) and an int64 packed sum (SUM).
constexpr int64_t kExactWireBytes = 1 + 8;

} // namespace

Reducer::Reducer(
    const std::vector<std::vector<at::Tensor>>& groups,
    const std::vector<at::ScalarType>& dtypes,
    int64_t first_bucket_bytes,
    int64_t bucket_cap_bytes,
    c10::intrusive_ptr<c10d::ProcessGroup> process_group,
    std::chrono::milliseconds timeout,
    std::string description,
    bool exact)
    : exact_(exact),
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
  for (const auto& bucket : buckets_) {
    bytes += bucket.flat.numel() *
        (exact_ ? kExactWireBytes : static_cast<int64_t>(bucket.flat.element_size()));
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
  for (auto& bucket : buckets_) {
    TORCH_INTERNAL_ASSERT(!bucket.work && bucket.pending_grads.empty());
    bucket.final = false;
  }
  for (auto& flags : written_) {
    std::fill(flags.begin(), flags.end(), 0);
  }
  next_launch_ = 0;
  early_launches_ = 0;
  stats_work_.reset();
  in_step_ = true;
  last_vn_ = false;
  step_ = step;
}

void Reducer::begin_vn(double weight, bool last) {
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_CHECK(in_step_, "Reducer::begin_vn called outside a step");
  TORCH_CHECK(!last_vn_, "Reducer::begin_vn called after the step's last VN");
  weight_ = weight;
  last_vn_ = last;
  for (auto& bucket : buckets_) {
    bucket.arrived = 0;
  }
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
  if (!exact_) {
    buffers_[buffer]->zero_slots_(first, last);
    return;
  }
  const auto& offsets = buffers_[buffer]->offsets();
  const int64_t begin = offsets[first];
  const int64_t numel = offsets[last] + buffers_[buffer]->numels()[last] - begin;
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
  if (complete && last_vn_) {
    make_final(bucket);
    launch_ready();
  }
}

void Reducer::end_vn() {
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_CHECK(in_step_, "Reducer::end_vn called outside a step");
  for (auto& bucket : buckets_) {
    fold(bucket);
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
  if (reduces()) {
    stats_work_ = launch(stats, kStatsName);
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

void Reducer::wait_stats() {
  c10::intrusive_ptr<c10d::Work> work;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    work = stats_work_;
  }
  if (work) {
    wait_for(work, kStatsName);
    std::lock_guard<std::mutex> lock(mutex_);
    stats_work_.reset();
  }
}

void Reducer::finalize(double factor, const std::vector<at::Tensor>& found_nonfinite) {
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_CHECK(in_step_ && last_vn_ && next_launch_ == buckets_.size(),
              "Reducer::finalize must follow the end of the step's last VN");
  TORCH_CHECK(found_nonfinite.empty() || found_nonfinite.size() == buffers_.size(),
              "found_nonfinite must be empty or hold one flag per buffer");
  const auto start = std::chrono::steady_clock::now();
  for (const auto b : c10::irange(buckets_.size())) {
    auto work = std::move(buckets_[b].work);
    if (work) {
      wait_for(work, bucket_name(b));
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
