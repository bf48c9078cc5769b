// Waits on a process group's collectives that another thread can cut short
// (Note [Interrupting a wait] in interrupt.cpp).
#pragma once

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <chrono>
#include <stdexcept>

namespace vflow {

// A wait ended because its group was interrupted (`interrupt_group`), not because the
// collective failed or timed out.
class Interrupted : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// From any thread: every wait on `group`'s collectives, now or later, ends at once
// with Interrupted. The group stays interrupted for as long as it exists.
void interrupt_group(const c10::intrusive_ptr<c10d::ProcessGroup>& group);

// Whether `group` was interrupted.
bool group_interrupted(const c10::intrusive_ptr<c10d::ProcessGroup>& group);

// Whether a collective of `group` that an interrupted wait left behind is still
// running on the backend's thread (the group's destructor would wait for it). Once
// none is, they are forgotten.
bool group_busy(const c10::intrusive_ptr<c10d::ProcessGroup>& group);

// Waits for `work`, a collective of `group`, at most `timeout`: returns when it
// succeeded, throws the backend's error when it failed or timed out, and throws
// Interrupted as soon as `group` is interrupted (the collective is then left to
// run out on the backend's thread).
void wait_for(const c10::intrusive_ptr<c10d::ProcessGroup>& group,
              const c10::intrusive_ptr<c10d::Work>& work, std::chrono::milliseconds timeout);

// `work` of `group` will not be waited for: counted by group_busy while it runs.
void abandon(const c10::intrusive_ptr<c10d::ProcessGroup>& group,
             const c10::intrusive_ptr<c10d::Work>& work);

}  // namespace vflow
