#include "reducer.h"

#include "collectives.h"

#include <ATen/record_function.h>
#include <c10/util/Exception.h>
#include <c10/util/irange.h>

#include <utility>

namespace vflow {

namespace {

const std::string kStatsName = "all-reduce of the step's loss and item totals";

} // namespace

Reducer::Reducer(const std::vector<std::shared_ptr<GradBuffer>>& buffers,
                 const std::vector<BucketSpec>& buckets,
                 std::shared_ptr<Reduction> reduction,
                 c10::intrusive_ptr<c10d::ProcessGroup> process_group,
                 std::chrono::milliseconds timeout,
                 std::string description)
    : buffers_(buffers),
      reduction_(std::move(reduction)),
      comm_(std::move(process_group), timeout, std::move(description)) {
  TORCH_CHECK(!buffers_.empty(), "buffers must hold at least one GradBuffer");
  TORCH_CHECK(reduction_, "reduction must be a vflow reduction strategy, got None");
  TORCH_CHECK(!reduction_->bound(), "reduction is already used by another Reducer; make one "
              "per Reducer");
  for (const auto& buffer : buffers_) {
    TORCH_CHECK(buffer, "buffers must not hold None");
    bucket_of_slot_.emplace_back(buffer->num_slots(), -1);
    written_.emplace_back(buffer->num_slots(), 0);
  }
  // Note [Buckets]: buffer by buffer, each buffer's slots covered in order.
  int64_t expected_buffer = 0;
  int64_t expected_slot = 0;
  std::vector<BucketInfo> infos;
  for (const auto i : c10::irange(buckets.size())) {
    const BucketSpec& spec = buckets[i];
    if (expected_buffer < static_cast<int64_t>(buffers_.size()) &&
        expected_slot == buffers_[expected_buffer]->num_slots()) {
      ++expected_buffer;
      expected_slot = 0;
    }
    TORCH_CHECK(spec.buffer == expected_buffer && spec.first_slot == expected_slot,
                "buckets[", i, "] = (buffer ", spec.buffer, ", slots ", spec.first_slot, "..",
                spec.last_slot, ") should start at buffer ", expected_buffer, ", slot ",
                expected_slot, ": buckets must cover every buffer's slots in order, once");
    TORCH_CHECK(expected_buffer < static_cast<int64_t>(buffers_.size()) &&
                    spec.last_slot >= spec.first_slot &&
                    spec.last_slot < buffers_[spec.buffer]->num_slots(),
                "buckets[", i, "] ends at slot ", spec.last_slot, ", outside buffer ", spec.buffer);
    const GradBuffer& buffer = *buffers_[spec.buffer];
    const int64_t offset = buffer.offsets()[spec.first_slot];
    const int64_t end = buffer.offsets()[spec.last_slot] + buffer.numels()[spec.last_slot];
    for (int64_t s = spec.first_slot; s <= spec.last_slot; ++s) {
      bucket_of_slot_[spec.buffer][s] = static_cast<int64_t>(i);
    }
    Bucket bucket;
    bucket.info = {spec.buffer, spec.first_slot, spec.last_slot, offset,
                   buffer.data().narrow(0, offset, end - offset)};
    infos.push_back(bucket.info);
    buckets_.push_back(std::move(bucket));
    expected_slot = spec.last_slot + 1;
  }
  TORCH_CHECK(expected_buffer == static_cast<int64_t>(buffers_.size()) - 1 &&
                  expected_slot == buffers_.back()->num_slots(),
              "buckets leave slots of the buffers uncovered: they must cover every buffer's "
              "slots in order, once");
  reduction_->bind(buffers_, infos);
  reduction_->set_world(comm_);
}

void Reducer::set_group(c10::intrusive_ptr<c10d::ProcessGroup> process_group,
                        std::chrono::milliseconds timeout, std::string description) {
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_CHECK(!in_step_, "Reducer::set_group called during a step; change the worker set "
              "between steps");
  Comm comm(std::move(process_group), timeout, std::move(description));
  reduction_->set_world(comm);
  comm_ = std::move(comm);
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
    const BucketInfo& info = bucket.info;
    out.push_back({info.buffer, info.first_slot, info.last_slot, info.offset,
                   info.flat.numel()});
  }
  return out;
}

int64_t Reducer::world_size() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return comm_.size();
}

int64_t Reducer::rank() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return comm_.rank();
}

bool Reducer::in_step() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return in_step_;
}

int64_t Reducer::bytes_per_step() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return reduction_->bytes_per_step(comm_);
}

void Reducer::begin_step(int64_t step) {
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_CHECK(!in_step_, "Reducer::begin_step: the previous step was neither finalized nor "
              "discarded");
  reduction_->check_ready(comm_);
  for (auto& bucket : buckets_) {
    TORCH_INTERNAL_ASSERT(bucket.pending_grads.empty());
    bucket.final = false;
  }
  for (auto& flags : written_) {
    std::fill(flags.begin(), flags.end(), 0);
  }
  next_launch_ = 0;
  early_launches_ = 0;
  stats_work_.reset();
  stats_sum_ = at::Tensor();
  stats_carried_ = false;
  stats_wait_seconds_ = 0.0;
  in_step_ = true;
  last_vn_ = false;
  comm_.set_step(step);
  comm_.clear_failure();
  reduction_->begin_step();
}

void Reducer::begin_vn(double weight, bool last, int64_t level, int64_t merges) {
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_CHECK(in_step_, "Reducer::begin_vn called outside a step");
  TORCH_CHECK(!last_vn_, "Reducer::begin_vn called after the step's last VN");
  reduction_->begin_vn(level, merges);
  if (reduction_->fresh_each_vn()) {
    for (auto& flags : written_) {
      std::fill(flags.begin(), flags.end(), 0);
    }
  }
  weight_ = weight;
  last_vn_ = last;
  for (auto& bucket : buckets_) {
    bucket.arrived = 0;
    bucket.vn_done = false;
  }
  in_vn_.store(true, std::memory_order_release);
}

// See Note [First fold overwrites]: slots seen for the first time are overwritten, the
// others added to, in at most two strategy calls.
void Reducer::fold(Bucket& bucket) {
  if (bucket.pending_slots.empty()) {
    return;
  }
  RECORD_FUNCTION("vflow::fold", std::vector<c10::IValue>());
  auto& written = written_[bucket.info.buffer];
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
  if (!first_slots.empty()) {
    reduction_->fold(bucket.info, first_slots, first_grads, weight_, /*first=*/true);
  }
  if (!later_slots.empty()) {
    reduction_->fold(bucket.info, later_slots, later_grads, weight_, /*first=*/false);
  }
}

// The bucket holds the current VN: zeroes the runs of slots that received nothing (in
// this step, or in this VN for strategies that write each VN afresh).
void Reducer::complete_vn(Bucket& bucket) {
  const BucketInfo& info = bucket.info;
  const GradBuffer& buffer = *buffers_[info.buffer];
  auto& written = written_[info.buffer];
  int64_t slot = info.first_slot;
  while (slot <= info.last_slot) {
    if (written[slot]) {
      ++slot;
      continue;
    }
    const int64_t run_start = slot;
    while (slot <= info.last_slot && !written[slot]) {
      written[slot] = 1;
      ++slot;
    }
    const int64_t begin = buffer.offsets()[run_start];
    const int64_t end = buffer.offsets()[slot - 1] + buffer.numels()[slot - 1];
    reduction_->zero(info, begin, end - begin);
  }
  reduction_->vn_complete(info);
  bucket.vn_done = true;
  bucket.final = last_vn_;
}

void Reducer::receive_grad(int64_t buffer, int64_t slot, const at::Tensor& grad) {
  add_grad(bucket_of(buffer, slot), slot, grad);
}

void Reducer::add_grad(int64_t bucket_index, int64_t slot, const at::Tensor& grad) {
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_CHECK(in_step_, "Reducer::add_grad called outside a step");
  TORCH_CHECK(bucket_index >= 0 && bucket_index < num_buckets(), "bucket must be in [0, ",
              num_buckets(), "), got ", bucket_index);
  Bucket& bucket = buckets_[bucket_index];
  TORCH_CHECK(slot >= bucket.info.first_slot && slot <= bucket.info.last_slot, "slot ", slot,
              " is not in bucket ", bucket_index, " (slots ", bucket.info.first_slot, "..",
              bucket.info.last_slot, ")");
  TORCH_INTERNAL_ASSERT(!bucket.final, "gradient for bucket ", bucket_index,
                        " arrived after the bucket was final");
  bucket.pending_slots.push_back(slot);
  bucket.pending_grads.push_back(grad);
  bucket.pending_bytes += static_cast<int64_t>(grad.nbytes());
  const bool complete = ++bucket.arrived == bucket.num_slots();
  if (complete || bucket.pending_bytes >= kFoldBytes) {
    fold(bucket);
  }
  if (complete && (last_vn_ || reduction_->fresh_each_vn())) {
    complete_vn(bucket);
  }
  if (complete && last_vn_) {
    launch_ready();
  }
}

void Reducer::end_vn() {
  std::lock_guard<std::mutex> lock(mutex_);
  in_vn_.store(false, std::memory_order_release);
  TORCH_CHECK(in_step_, "Reducer::end_vn called outside a step");
  for (auto& bucket : buckets_) {
    fold(bucket);
  }
  if (last_vn_ || reduction_->fresh_each_vn()) {
    for (auto& bucket : buckets_) {
      if (!bucket.vn_done) {
        complete_vn(bucket);
      }
    }
  }
  reduction_->end_vn(last_vn_, comm_);
  if (last_vn_) {
    early_launches_ = static_cast<int64_t>(next_launch_);
    launch_ready();
    TORCH_INTERNAL_ASSERT(next_launch_ == buckets_.size());
  }
}

void Reducer::clear_pending() {
  for (auto& bucket : buckets_) {
    bucket.pending_slots.clear();
    bucket.pending_grads.clear();
    bucket.pending_bytes = 0;
  }
}

void Reducer::abort_vn() {
  std::lock_guard<std::mutex> lock(mutex_);
  in_vn_.store(false, std::memory_order_release);
  clear_pending();
}

// See Note [Launch order]. Called with mutex_ held.
void Reducer::launch_ready() {
  while (next_launch_ < buckets_.size() && buckets_[next_launch_].final) {
    RECORD_FUNCTION("vflow::start_reduction", std::vector<c10::IValue>());
    reduction_->start(next_launch_, comm_);
    ++next_launch_;
  }
}

void Reducer::start_stats(const at::Tensor& stats, bool with_buckets) {
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_CHECK(in_step_, "Reducer::start_stats called outside a step");
  TORCH_CHECK(next_launch_ == 0 && !stats_sum_.defined(),
              "Reducer::start_stats must precede every bucket's reduction and run once");
  TORCH_CHECK(!with_buckets || (stats.scalar_type() == at::kDouble && stats.dim() == 1),
              "statistics that ride with the buckets must be a 1-D float64 tensor, got ",
              stats.scalar_type(), " of shape ", stats.sizes());
  stats_sum_ = stats.clone(at::MemoryFormat::Contiguous);
  if (!comm_.reduces()) {
    return;
  }
  if (with_buckets && reduction_->carries_stats(comm_, stats_sum_.numel())) {
    reduction_->attach_stats(stats_sum_);
    stats_carried_ = true;
    return;
  }
  stats_work_ = comm_.all_reduce(stats_sum_, kStatsName);
}

bool Reducer::stats_with_buckets() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return stats_carried_;
}

at::Tensor Reducer::wait_stats() {
  c10::intrusive_ptr<c10d::Work> work;
  at::Tensor sums;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    TORCH_CHECK(stats_sum_.defined(), "Reducer::wait_stats must follow start_stats");
    if (stats_carried_) {
      TORCH_CHECK(in_step_ && next_launch_ == buckets_.size(),
                  "Reducer::wait_stats: statistics that ride with the buckets are waited for "
                  "after the step's last VN");
      const auto start = std::chrono::steady_clock::now();
      at::Tensor carried = reduction_->wait_stats(comm_);
      stats_wait_seconds_ =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      return carried;
    }
    work = stats_work_;
    sums = stats_sum_;
  }
  if (work) {
    comm_.wait(work, kStatsName);
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
  RECORD_FUNCTION("vflow::finalize", std::vector<c10::IValue>());
  const auto start = std::chrono::steady_clock::now();
  reduction_->wait_all(comm_);
  if (stats_work_) {
    auto work = std::move(stats_work_);
    comm_.wait(work, kStatsName);
  }
  // Time blocked on bucket 0 in wait_stats counts as waiting for the buckets.
  last_wait_seconds_ = stats_wait_seconds_ +
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  factor = reduction_->write_result(factor);
  for (const auto b : c10::irange(buffers_.size())) {
    if (found_nonfinite.empty()) {
      buffers_[b]->scale_(factor);
    } else {
      buffers_[b]->scale_check_(factor, found_nonfinite[b]);
    }
  }
  end_step();
}

void Reducer::end_step() {
  in_vn_.store(false, std::memory_order_release);
  in_step_ = false;
  last_vn_ = false;
  reduction_->end_step();
}

void Reducer::discard() {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<c10::intrusive_ptr<c10d::Work>> in_flight = reduction_->take_in_flight();
  if (stats_work_) {
    in_flight.push_back(std::move(stats_work_));
  }
  clear_pending();
  comm_.drain(in_flight);
  end_step();
}

void Reducer::reduce_as_is(int64_t step) {
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_CHECK(!in_step_, "Reducer::reduce_as_is called during a step");
  reduction_->check_ready(comm_);
  comm_.set_step(step);
  reduction_->begin_step();
  try {
    for (const auto b : c10::irange(buckets_.size())) {
      reduction_->start(b, comm_);
    }
    reduction_->wait_all(comm_);
    reduction_->write_result(1.0);
  } catch (...) {
    comm_.drain(reduction_->take_in_flight());
    reduction_->end_step();
    throw;
  }
  reduction_->end_step();
}

} // namespace vflow
