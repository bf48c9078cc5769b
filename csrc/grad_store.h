// GradStore: the flat gradient buffers of an Executor's parameters and the autograd
// hooks that capture their gradients, for the executor's whole lifetime.
//
// Note [Gradient store and reducer]
// The store owns what must never change while a job runs: the GradBuffers that
// `param.grad` point into (Note [Flat buffer layout]) and one hook per parameter.
// Everything that depends on the worker set (the process group, buckets in flight,
// the shards and tree of deterministic mode) lives in the Reducer and its Reduction
// strategy, which the store hands each captured gradient to. A new worker set
// therefore rebuilds the reducer's world-dependent state only: the buffers, the
// `param.grad` views into them, the hooks and everything the optimizer holds stay.
//
// Note [Capturing gradients]
// While a VN's backward runs, every managed parameter has `grad` undefined. Autograd
// then hands each new gradient to the parameter without a copy, and a post hook on
// the parameter's AccumulateGrad node (the mechanism PyTorch DDP's reducer uses)
// takes it away again and gives it to the sink. The hook is C++ and runs on
// autograd's thread without the GIL: a Python hook per parameter and VN cost more
// than the fold itself for small models. The sink says when it takes gradients (the
// Reducer: between a VN's begin_vn and end_vn); at any other time the hook does
// nothing, so a backward the user runs outside vflow keeps PyTorch's semantics.
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/variable.h>

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "grad_buffer.h"

namespace vflow {

// Receives the gradients the store captures. `accepts` and `receive_grad` may be called
// from several autograd threads (one per device) at once.
class GradSink {
 public:
  virtual ~GradSink() = default;
  // Whether gradients are taken now (Note [Capturing gradients]).
  virtual bool accepts() const = 0;
  virtual void receive_grad(int64_t buffer, int64_t slot, const at::Tensor& grad) = 0;
};

class GradStore : public std::enable_shared_from_this<GradStore> {
 public:
  // One GradBuffer per entry of `groups` (parameters in slot order, one device per
  // group) with accumulator dtype `dtypes[i]`. Parameters must be leaf tensors that
  // require grad; each may appear once. Hooks are installed by `install_hooks`.
  GradStore(const std::vector<std::vector<at::Tensor>>& groups,
            const std::vector<at::ScalarType>& dtypes);
  ~GradStore();

  GradStore(const GradStore&) = delete;
  GradStore& operator=(const GradStore&) = delete;

  // Installs one hook per parameter (call once, after the store is owned by a
  // shared_ptr: the hooks keep a weak reference to it).
  void install_hooks();
  // Removes the hooks; gradients stay where they are. Idempotent.
  void remove_hooks();

  // Where captured gradients go (null: nowhere; gradients stay in `param.grad`). Set
  // once, before the first backward.
  void set_sink(std::shared_ptr<GradSink> sink);

  // Sets `grad` of every managed parameter to undefined (before a step's backward).
  void detach_grads();
  // Points `grad` of every parameter at its slot of the buffer, or, for a group whose
  // parameters have another dtype than the accumulator, at a flat copy in their dtype
  // refreshed from the buffer first (optimizers require grad.dtype == param.dtype).
  void publish();

  const std::vector<std::shared_ptr<GradBuffer>>& buffers() const {
    return buffers_;
  }
  int64_t num_params() const {
    return static_cast<int64_t>(params_.size());
  }

  // Called by the hooks.
  void on_gradient(int64_t buffer, int64_t slot);

 private:
  struct Param {
    at::Tensor tensor;
    int64_t buffer;
    int64_t slot;
  };
  using NodePtr = decltype(torch::autograd::impl::grad_accumulator(std::declval<at::Tensor>()));

  std::vector<std::shared_ptr<GradBuffer>> buffers_;
  // [buffer]: a flat copy in the parameters' dtype when it differs from the buffer's.
  std::vector<at::Tensor> mirrors_;
  std::vector<std::vector<at::Tensor>> mirror_views_;
  std::vector<Param> params_;
  // [buffer][slot] -> index into params_.
  std::vector<std::vector<int64_t>> param_index_;
  std::vector<std::pair<NodePtr, uintptr_t>> hooks_;
  std::shared_ptr<GradSink> sink_;
};

} // namespace vflow
