#include "interrupt.h"

#include <algorithm>
#include <atomic>
#include <mutex>
#include <string>
#include <vector>

namespace vflow {

// Note [Interrupting a wait]
// Gloo cannot cancel a collective: ProcessGroupGloo::abort leaves it running, and a
// collective blocked on a peer that is alive but blocked too ends only at its own
// timeout. That happens after a crash: the failure travels along Gloo's ring only
// while each failing worker's closed connections reach a peer's pending transfer, and
// a survivor whose transfers with the failed ones had already completed waits on
// another survivor, which waits on it or on a third, until `timeout_s`. The elastic
// job knows better much sooner (the other survivors have begun to agree without it:
// Note [A survivor blocked on survivors], vflow/elastic/agreement.py), so it needs a
// way to stop waiting.
//
// A wait for a collective (not a send or receive) on a group that is not NCCL's
// therefore waits in slices of kSlice: a collective that completes wakes it at once
// (Work::wait returns on completion), and between slices it looks whether another
// thread interrupted the group. An interrupted wait throws Interrupted and leaves the
// collective to the backend's thread, which ends it at the collective's own timeout.
// Two things follow:
// - the group must outlive that collective, since ProcessGroupGloo's destructor joins
//   its threads, blocking whichever thread drops the last reference for up to the
//   timeout; the caller keeps an interrupted group while group_busy says a collective
//   it left behind still runs (vflow.world.group.retire);
// - the collective keeps its tensors, which are private to vflow (Note [Collectives
//   on tensors Python cannot see], collectives.h). It writes nothing more into them:
//   a ring's transfer completes only after its peer's previous one did, and the chain
//   of peers ends at the worker that failed, so no data is on its way.
// Sends and receives are not sliced (Note [Point-to-point waits are whole]): a worker
// blocked in one (the ordered strategy's exchanges, a state transfer) still waits for
// the timeout.
// The registry holds each interrupted group weakly: a group that is destroyed drops
// out, and while an entry exists its memory is not freed (intrusive_ptr frees it only
// once the weak references are gone too), so a new group can never take its address
// and be taken for interrupted. The destructor of the group's backends is not delayed:
// ProcessGroup::release_resources drops them with the last strong reference.
// Note [Interrupting an NCCL wait]
// An NCCL collective whose peer died hangs in its kernel, and a survivor's host waits
// with it: Work::wait given a timeout (as every wait here is) blocks the host until the
// collective completes or the timeout passes. Neither slicing nor a wait's own timeout
// helps: a blocking wait that times out aborts the group's communicators. What ends
// the hang at once is aborting the communicators (ncclCommAbort makes the kernels
// exit), which vflow.world.group.World.interrupt does from the thread that learns the
// set broke, after marking the group interrupted. The wait then returns, completed or
// failed, and since the group is marked, throws Interrupted: an aborted collective's
// output is garbage, never used. A survivor's bound is thus: the first survivor's
// failure (NCCL's own error detection, or timeout_s for a silent peer), the message to
// the others through the store (Note [A survivor blocked on survivors],
// vflow/elastic/agreement.py) and the abort. Read against torch's ProcessGroupNCCL,
// built, not run here: no GPU (docs/design.md, Limits).

namespace {

// How long a wait blocks before it looks for an interrupt: well under the agreement's
// poll (vflow.elastic.agreement.POLL_S), and long enough to cost nothing measurable
// (a slice that ends throws and catches one exception).
constexpr std::chrono::milliseconds kSlice{50};

struct Entry {
  c10::weak_intrusive_ptr<c10d::ProcessGroup> group;
  std::vector<c10::intrusive_ptr<c10d::Work>> abandoned;
};

std::mutex registry_mutex;
std::vector<Entry> registry;
// Whether the registry holds anything: a wait reads only this when nothing was ever
// interrupted.
std::atomic<bool> any_interrupted{false};

// The entry of `group`, or null; the caller holds registry_mutex.
Entry* find(const c10d::ProcessGroup* group) {
  for (auto& entry : registry) {
    if (entry.group._unsafe_get_target() == group && !entry.group.expired()) {
      return &entry;
    }
  }
  return nullptr;
}

bool interrupted(const c10d::ProcessGroup* group) {
  if (!any_interrupted.load(std::memory_order_acquire)) {
    return false;
  }
  std::lock_guard<std::mutex> lock(registry_mutex);
  return find(group) != nullptr;
}

// Leaves `work` to the backend's thread and throws Interrupted when `group` was
// interrupted; `before` says what the worker was doing, for the message.
void leave_if_interrupted(const c10::intrusive_ptr<c10d::ProcessGroup>& group,
                          const c10::intrusive_ptr<c10d::Work>& work, const char* before);

}  // namespace

void interrupt_group(const c10::intrusive_ptr<c10d::ProcessGroup>& group) {
  TORCH_CHECK(group, "group must be a process group, got None");
  std::lock_guard<std::mutex> lock(registry_mutex);
  registry.erase(std::remove_if(registry.begin(), registry.end(),
                                [](const Entry& e) { return e.group.expired(); }),
                 registry.end());
  if (find(group.get()) == nullptr) {
    registry.push_back(Entry{c10::weak_intrusive_ptr<c10d::ProcessGroup>(group), {}});
  }
  any_interrupted.store(true, std::memory_order_release);
}

bool group_interrupted(const c10::intrusive_ptr<c10d::ProcessGroup>& group) {
  TORCH_CHECK(group, "group must be a process group, got None");
  return interrupted(group.get());
}

bool group_busy(const c10::intrusive_ptr<c10d::ProcessGroup>& group) {
  TORCH_CHECK(group, "group must be a process group, got None");
  std::lock_guard<std::mutex> lock(registry_mutex);
  Entry* entry = find(group.get());
  if (entry == nullptr) {
    return false;
  }
  const bool busy =
      std::any_of(entry->abandoned.begin(), entry->abandoned.end(),
                  [](const c10::intrusive_ptr<c10d::Work>& w) { return !w->isCompleted(); });
  if (!busy) {
    // A Gloo Work holds its group's connections: kept, they would stay open after
    // the group is gone, and its peers would not see it close.
    entry->abandoned.clear();
  }
  return busy;
}

void abandon(const c10::intrusive_ptr<c10d::ProcessGroup>& group,
             const c10::intrusive_ptr<c10d::Work>& work) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  Entry* entry = find(group.get());
  if (entry == nullptr) {
    registry.push_back(Entry{c10::weak_intrusive_ptr<c10d::ProcessGroup>(group), {}});
    entry = &registry.back();
    any_interrupted.store(true, std::memory_order_release);
  }
  entry->abandoned.push_back(work);
}

void wait_for(const c10::intrusive_ptr<c10d::ProcessGroup>& group,
              const c10::intrusive_ptr<c10d::Work>& work, std::chrono::milliseconds timeout) {
  if (!group) {
    work->wait(timeout);
    return;
  }
  if (group->getBackendName() == "nccl") {
    // Note [Interrupting an NCCL wait]
    leave_if_interrupted(group, work, "before this worker's wait");
    work->wait(timeout);
    if (interrupted(group.get())) {
      throw Interrupted(
          "interrupted: the worker set broke elsewhere and this worker's communicators "
          "were aborted (the collective's results cannot be trusted)");
    }
    return;
  }
  if (c10d::isP2POp(work->retrieveOpType())) {
    // Note [Point-to-point waits are whole]: Gloo's send and receive wait on the
    // transfer itself, and a wait that times out signals the error to every pair of
    // the group, breaking it (a 50 ms slice would break any transfer longer than
    // that). They are looked at for an interrupt once, before they wait.
    leave_if_interrupted(group, work, "before this worker's transfer");
    work->wait(timeout);
    return;
  }
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (true) {
    leave_if_interrupted(group, work,
                         "this worker's collective was still waiting on a live peer");
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    const bool last = left <= kSlice;
    try {
      work->wait(last ? std::max(left, std::chrono::milliseconds(1)) : kSlice);
      return;
    } catch (const std::exception&) {
      // A slice that ran out leaves the collective running; a collective that ended
      // (failed, or completed just after the slice ran out) is waited for again, which
      // returns or throws its own outcome at once.
      if (work->isCompleted()) {
        work->wait(std::chrono::milliseconds(1));
        return;
      }
      if (last) {
        throw;
      }
    }
  }
}

namespace {

void leave_if_interrupted(const c10::intrusive_ptr<c10d::ProcessGroup>& group,
                          const c10::intrusive_ptr<c10d::Work>& work, const char* before) {
  if (interrupted(group.get())) {
    abandon(group, work);
    throw Interrupted(std::string("interrupted: the worker set broke elsewhere (") + before +
                      ")");
  }
}

}  // namespace

}  // namespace vflow
