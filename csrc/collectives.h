// Collectives that vflow's Python layer starts (agreement checks, the initial
// broadcast, loss sums, the inference all-gather), run so that no backend thread
// ever holds a tensor Python can see.
//
// Note [Collectives on tensors Python cannot see]
// A backend keeps every tensor of a collective until its worker thread (Gloo) or
// watchdog (NCCL) drops the finished Work, which can happen after wait() returned.
// When such a tensor has a Python object, dropping the C++ reference must take the
// GIL (c10::TensorImpl::decref_pyobject). If the interpreter is finalizing by then,
// the thread's attempt to take the GIL ends it with pthread_exit, whose forced unwind
// through a noexcept frame aborts the process ("terminate called without an active
// exception"): a script that ran correctly dies at exit, about once in 30 runs of a
// 2-rank job that all-gathers just before returning. So the Works vflow starts hold
// only tensors created in C++ that Python never sees: these functions copy the
// caller's tensors into private ones, run the collective on those, wait, and copy
// the results back on the calling thread; the Reducer's bucket and stats tensors
// follow the same rule. The copies are of small or one-off tensors.
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <chrono>
#include <cstdint>
#include <exception>
#include <optional>
#include <string>
#include <vector>

namespace vflow {

// The message of `e` without a C++ backtrace.
std::string error_text(const std::exception& e);

// A `timeout_seconds` argument from Python as a wait bound of at least 1 ms; it must
// be > 0.
std::chrono::milliseconds timeout_from_seconds(double timeout_seconds);

// Every rank's `tensors` (one dtype and device, the same shapes on every rank) become
// their elementwise sums over `group`. They are reduced as one flat copy on `device`
// (default: theirs), the backend's device. Waits at most `timeout_seconds`; a failed
// or timed-out collective throws std::runtime_error with the backend's message and
// leaves `tensors` unchanged.
void all_reduce_sum_(const c10::intrusive_ptr<c10d::ProcessGroup>& group,
                     const std::vector<at::Tensor>& tensors,
                     const std::optional<at::Device>& device, double timeout_seconds);

// Every rank's `tensors` become group rank `root`'s. Copies, waits and fails as
// all_reduce_sum_.
void broadcast_(const c10::intrusive_ptr<c10d::ProcessGroup>& group,
                const std::vector<at::Tensor>& tensors, const std::optional<at::Device>& device,
                int64_t root, double timeout_seconds);

// outputs[r] becomes group rank r's `input`; `outputs` has one tensor per rank, each
// shaped like `input`. Waits and fails as all_reduce_sum_.
void all_gather_into(const c10::intrusive_ptr<c10d::ProcessGroup>& group,
                     const at::Tensor& input, const std::vector<at::Tensor>& outputs,
                     double timeout_seconds);

}  // namespace vflow
