// Comm: the Reducer's replaceable view of one worker set — a c10d ProcessGroup, this
// worker's rank in it, the bound on every wait and the words that name the group in
// errors. `Reducer::set_group` swaps it between steps; nothing else in the reducer
// or its strategies holds the group.
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <chrono>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace vflow {

// A collective of a step failed or did not finish within the timeout (a worker died,
// hung, or the group is broken). Python sees it as vflow.CollectiveError, a
// RuntimeError. The message names the step, the collective and the process group.
class CollectiveError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class Comm {
 public:
  // `group` may be null: one worker, nothing to reduce.
  Comm(c10::intrusive_ptr<c10d::ProcessGroup> group, std::chrono::milliseconds timeout,
       std::string description);

  // Whether there is anyone to reduce with (a group of more than one rank).
  bool reduces() const {
    return size_ > 1;
  }
  int64_t rank() const {
    return rank_;
  }
  int64_t size() const {
    return size_;
  }
  std::chrono::milliseconds timeout() const {
    return timeout_;
  }
  // The step named in error messages.
  void set_step(int64_t step) {
    step_ = step;
  }

  // Asynchronous all-reduce of `tensor` in place. `what` names it in errors.
  c10::intrusive_ptr<c10d::Work> all_reduce(at::Tensor tensor, const std::string& what,
                                            c10d::ReduceOp::RedOpType op = c10d::ReduceOp::SUM);
  // Asynchronous all-gather: `outputs[r]` becomes rank r's `input` (one output per rank,
  // each shaped like `input`).
  c10::intrusive_ptr<c10d::Work> all_gather(at::Tensor input, std::vector<at::Tensor> outputs,
                                            const std::string& what);
  // Asynchronous point-to-point transfer with `peer` (a rank of the group).
  c10::intrusive_ptr<c10d::Work> send(at::Tensor tensor, int64_t peer, int tag,
                                      const std::string& what);
  c10::intrusive_ptr<c10d::Work> recv(at::Tensor tensor, int64_t peer, int tag,
                                      const std::string& what);
  // Waits at most the timeout, or until the group is interrupted (Note [Interrupting a
  // wait] in interrupt.cpp); a failure or an interrupt throws CollectiveError.
  void wait(const c10::intrusive_ptr<c10d::Work>& work, const std::string& what) const;
  // After a failed step: waits for each of `works` in turn until one fails, leaving
  // the rest (Note [Interrupting a wait] in interrupt.cpp); never throws.
  void drain(const std::vector<c10::intrusive_ptr<c10d::Work>>& works) const;
  // Throws CollectiveError naming the step, `what` and the group; `waited_s` is how
  // long the failed wait lasted (Note [Saying what failed] in comm.cpp).
  [[noreturn]] void fail(const std::string& what, const std::string& cause,
                         double waited_s = 0.0) const;
  // The message of the latest failure since `clear_failure`, empty if none. A failure
  // inside an autograd hook reaches Python as a plain RuntimeError (autograd does not
  // know CollectiveError), so the caller asks here whether it was the group's.
  const std::string& last_failure() const {
    return last_failure_;
  }
  void clear_failure() {
    last_failure_.clear();
  }

 private:
  c10::intrusive_ptr<c10d::Work> point_to_point(bool send, at::Tensor tensor, int64_t peer,
                                                int tag, const std::string& what);

  c10::intrusive_ptr<c10d::ProcessGroup> group_;
  std::chrono::milliseconds timeout_;
  std::string description_;
  int64_t rank_ = 0;
  int64_t size_ = 1;
  int64_t step_ = 0;
  mutable std::string last_failure_;
};

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

} // namespace vflow
