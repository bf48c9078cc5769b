#include "collectives.h"

#include "interrupt.h"

#include <c10/util/Exception.h>
#include <c10/util/irange.h>

#include <algorithm>
#include <optional>
#include <stdexcept>

namespace vflow {

std::string error_text(const std::exception& e) {
  if (const auto* c10_error = dynamic_cast<const c10::Error*>(&e)) {
    return c10_error->what_without_backtrace();
  }
  return e.what();
}

std::chrono::milliseconds timeout_from_seconds(double timeout_seconds) {
  TORCH_CHECK(timeout_seconds > 0, "timeout_seconds must be > 0, got ", timeout_seconds);
  return std::chrono::milliseconds(
      std::max<int64_t>(1, static_cast<int64_t>(timeout_seconds * 1000.0)));
}

namespace {

void check_group(const c10::intrusive_ptr<c10d::ProcessGroup>& group) {
  TORCH_CHECK(group, "group must be a process group, got None");
}

// A copy that no Python object refers to (Note [Collectives on tensors Python cannot
// see]); contiguous, as the backends expect.
at::Tensor private_copy(const at::Tensor& tensor) {
  return tensor.clone(at::MemoryFormat::Contiguous);
}

// `tensors` (one dtype and device) flattened into one new tensor on `device`, which is
// then what the collective runs on: the coalescing copy is also the private copy.
at::Tensor private_flat(const std::vector<at::Tensor>& tensors,
                        const std::optional<at::Device>& device) {
  TORCH_CHECK(!tensors.empty(), "tensors must hold at least one tensor");
  std::vector<at::Tensor> flat_views;
  flat_views.reserve(tensors.size());
  for (const auto i : c10::irange(tensors.size())) {
    TORCH_CHECK(tensors[i].dtype() == tensors[0].dtype() &&
                    tensors[i].device() == tensors[0].device(),
                "tensors must share one dtype and device: tensors[0] is ", tensors[0].dtype(),
                " on ", tensors[0].device(), ", tensors[", i, "] is ", tensors[i].dtype(), " on ",
                tensors[i].device());
    flat_views.push_back(tensors[i].reshape({-1}));
  }
  at::Tensor flat = at::cat(flat_views);
  return device ? flat.to(*device) : flat;
}

// Copies consecutive pieces of `flat` back into `tensors`.
void scatter_back(const at::Tensor& flat, const std::vector<at::Tensor>& tensors) {
  int64_t offset = 0;
  for (const auto& t : tensors) {
    t.copy_(flat.narrow(0, offset, t.numel()).view(t.sizes()));
    offset += t.numel();
  }
}

// Starts a collective with `start` and waits for it; backend errors, raised when
// starting or when waiting, become std::runtime_error without the C++ backtrace.
// An interrupted group fails the wait too (Note [Interrupting a wait], interrupt.cpp).
template <typename Start>
void run(const c10::intrusive_ptr<c10d::ProcessGroup>& group, Start&& start,
         std::chrono::milliseconds timeout) {
  try {
    c10::intrusive_ptr<c10d::Work> work = start();
    wait_for(group, work, timeout);
  } catch (const std::exception& e) {
    throw std::runtime_error(error_text(e));
  }
}

}  // namespace

void all_reduce_sum_(const c10::intrusive_ptr<c10d::ProcessGroup>& group,
                     const std::vector<at::Tensor>& tensors,
                     const std::optional<at::Device>& device, double timeout_seconds) {
  check_group(group);
  const auto timeout = timeout_from_seconds(timeout_seconds);
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> mine{private_flat(tensors, device)};
  c10d::AllreduceOptions options;
  options.reduceOp = c10d::ReduceOp(c10d::ReduceOp::SUM);
  options.timeout = timeout;
  run(group, [&] { return group->allreduce(mine, options); }, timeout);
  scatter_back(mine[0], tensors);
}

void broadcast_(const c10::intrusive_ptr<c10d::ProcessGroup>& group,
                const std::vector<at::Tensor>& tensors, const std::optional<at::Device>& device,
                int64_t root, double timeout_seconds) {
  check_group(group);
  TORCH_CHECK(root >= 0 && root < group->getSize(), "root must be a rank of the group (0 to ",
              group->getSize() - 1, "), got ", root);
  const auto timeout = timeout_from_seconds(timeout_seconds);
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> mine{private_flat(tensors, device)};
  c10d::BroadcastOptions options;
  options.rootRank = root;
  options.rootTensor = 0;
  options.timeout = timeout;
  run(group, [&] { return group->broadcast(mine, options); }, timeout);
  scatter_back(mine[0], tensors);
}

void all_gather_into(const c10::intrusive_ptr<c10d::ProcessGroup>& group,
                     const at::Tensor& input, const std::vector<at::Tensor>& outputs,
                     double timeout_seconds) {
  check_group(group);
  TORCH_CHECK(static_cast<int64_t>(outputs.size()) == group->getSize(),
              "outputs must hold one tensor per rank (", group->getSize(), "), got ",
              outputs.size());
  for (const auto r : c10::irange(outputs.size())) {
    TORCH_CHECK(outputs[r].sizes() == input.sizes() && outputs[r].dtype() == input.dtype() &&
                    outputs[r].device() == input.device(),
                "outputs[", r, "] must match input (", input.sizes(), ", ", input.dtype(), ", ",
                input.device(), "), got ", outputs[r].sizes(), ", ", outputs[r].dtype(), ", ",
                outputs[r].device());
  }
  const auto timeout = timeout_from_seconds(timeout_seconds);
  std::vector<at::Tensor> mine{private_copy(input)};
  std::vector<std::vector<at::Tensor>> gathered(1);
  gathered[0].reserve(outputs.size());
  for (size_t r = 0; r < outputs.size(); ++r) {
    gathered[0].push_back(at::empty_like(mine[0]));
  }
  c10d::AllgatherOptions options;
  options.timeout = timeout;
  run(group, [&] { return group->allgather(gathered, mine, options); }, timeout);
  for (const auto r : c10::irange(outputs.size())) {
    outputs[r].copy_(gathered[0][r]);
  }
}

}  // namespace vflow
