#include "comm.h"

#include "collectives.h"
#include "interrupt.h"

#include <ATen/record_function.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cctype>
#include <sstream>
#include <utility>
#include <vector>

namespace vflow {

Comm::Comm(c10::intrusive_ptr<c10d::ProcessGroup> group, std::chrono::milliseconds timeout,
           std::string description)
    : group_(std::move(group)), timeout_(timeout), description_(std::move(description)) {
  TORCH_CHECK(timeout.count() > 0, "timeout must be > 0 ms, got ", timeout.count());
  if (group_) {
    rank_ = group_->getRank();
    size_ = group_->getSize();
  }
}

c10::intrusive_ptr<c10d::Work> Comm::all_reduce(at::Tensor tensor, const std::string& what,
                                                c10d::ReduceOp::RedOpType op) {
  RECORD_FUNCTION("vflow::all_reduce", std::vector<c10::IValue>());
  std::vector<at::Tensor> tensors{std::move(tensor)};
  c10d::AllreduceOptions options;
  options.reduceOp = c10d::ReduceOp(op);
  options.timeout = timeout_;
  try {
    return group_->allreduce(tensors, options);
  } catch (const std::exception& e) {
    fail("starting the " + what, error_text(e));
  }
}

c10::intrusive_ptr<c10d::Work> Comm::all_gather(at::Tensor input, std::vector<at::Tensor> outputs,
                                                const std::string& what) {
  RECORD_FUNCTION("vflow::all_gather", std::vector<c10::IValue>());
  std::vector<at::Tensor> inputs{std::move(input)};
  std::vector<std::vector<at::Tensor>> gathered{std::move(outputs)};
  c10d::AllgatherOptions options;
  options.timeout = timeout_;
  try {
    return group_->allgather(gathered, inputs, options);
  } catch (const std::exception& e) {
    fail("starting the " + what, error_text(e));
  }
}

c10::intrusive_ptr<c10d::Work> Comm::send(at::Tensor tensor, int64_t peer, int tag,
                                          const std::string& what) {
  return point_to_point(/*send=*/true, std::move(tensor), peer, tag, what);
}

c10::intrusive_ptr<c10d::Work> Comm::recv(at::Tensor tensor, int64_t peer, int tag,
                                          const std::string& what) {
  return point_to_point(/*send=*/false, std::move(tensor), peer, tag, what);
}

c10::intrusive_ptr<c10d::Work> Comm::point_to_point(bool send, at::Tensor tensor, int64_t peer,
                                                    int tag, const std::string& what) {
  std::vector<at::Tensor> tensors{std::move(tensor)};
  try {
    return send ? group_->send(tensors, static_cast<int>(peer), tag)
                : group_->recv(tensors, static_cast<int>(peer), tag);
  } catch (const std::exception& e) {
    fail("starting the " + what, error_text(e));
  }
}

void Comm::wait(const c10::intrusive_ptr<c10d::Work>& work, const std::string& what) const {
  RECORD_FUNCTION("vflow::wait", std::vector<c10::IValue>());
  const auto start = std::chrono::steady_clock::now();
  try {
    wait_for(group_, work, timeout_);
  } catch (const std::exception& e) {
    const std::chrono::duration<double> waited = std::chrono::steady_clock::now() - start;
    fail(what, error_text(e), waited.count());
  }
}

void Comm::drain(const std::vector<c10::intrusive_ptr<c10d::Work>>& works) const {
  for (size_t i = 0; i < works.size(); ++i) {
    try {
      wait_for(group_, works[i], timeout_);
    } catch (const std::exception&) {
      // The group is broken: the collectives after this one cannot complete either.
      // After an interrupt they still run on the backend's thread (Note [Interrupting
      // a wait], interrupt.cpp), where the group's owner must wait them out.
      if (group_interrupted(group_)) {
        for (size_t j = i + 1; j < works.size(); ++j) {
          abandon(group_, works[j]);
        }
      }
      return;
    }
  }
}

// Note [Saying what failed]
// A peer that died closes its connections: the wait fails at once, long before the
// timeout. Only a wait that reached the timeout, or whose backend says it timed out,
// is reported as a timeout; any other failure says how long it waited, so that a
// crash never reads as a hang.
void Comm::fail(const std::string& what, const std::string& cause, double waited_s) const {
  const double timeout_s = static_cast<double>(timeout_.count()) / 1000.0;
  std::string lower = cause;
  std::transform(lower.begin(), lower.end(), lower.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  const bool timed_out = waited_s >= timeout_s || lower.find("timed out") != std::string::npos ||
                         lower.find("timeout") != std::string::npos;
  std::ostringstream out;
  out << "vflow step " << step_ << ": " << what << " on " << description_;
  if (timed_out) {
    out << " timed out (timeout " << timeout_s << " s): ";
  } else if (waited_s > 0.0) {
    out.setf(std::ios::fixed);
    out.precision(1);
    out << " failed after " << waited_s << " s: ";
  } else {
    out << " failed: ";
  }
  out << cause;
  last_failure_ = out.str();
  throw CollectiveError(last_failure_);
}

} // namespace vflow
