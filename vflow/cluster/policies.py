"""Scheduling policies: pure functions from the cluster's slots and its active jobs
(arrived, not finished) to an allocation, the workers each job runs on (0: it waits).

The simulator (vflow/cluster/simulator.py) and the real runner (vflow/cluster/runner.py)
call the same ``Policy`` at every arrival and every completion, and every ``interval_s``
seconds for a policy that has one; neither changes what a policy returns. A job that
arrives to a free cluster therefore starts at once, at its full allocation.

* ``priority``: VirtualFlow's baseline, not elastic. A queue in order of priority (then
  arrival); the job at its head starts when its whole demand is free and runs on exactly
  its demand until it ends; jobs behind it wait (no backfilling, as in VirtualFlow's
  scheduler: a big job is never starved by small ones).
* ``las``: least attained service after Tiresias (discretized 2D-LAS), not elastic but
  preemptive. Jobs are ranked by the queue their attained service (worker-seconds) puts
  them in, then by arrival; walking that order, each job that fits runs on its demand
  (later ones may backfill) and a running job left out is preempted (it resumes later
  from where it stopped, paying a restart). Consulted every ``interval_s`` too, since a
  job's service moves it down while it runs.
* ``wfs``: VirtualFlow's weighted fair share, elastic (Note [Weighted fair share]).
* ``wfs-any``: the same without the power-of-two rounding: vflow's uneven plans run a
  job on any worker count up to V, so shares need not be rounded down to one.

Note [Weighted fair share]
As VirtualFlow's scheduler describes it (reference: ../shared/reference, part B):

1. A job's fair share in a set of jobs is slots x priority / (sum of the set's
   priorities), capped at its demand and rounded down to an allowed worker count; jobs
   whose share reaches the cap keep the cap and the rest is shared again among the
   others (water filling). Allowed counts for ``wfs``: powers of two and the demand
   itself (VirtualFlow rounds to powers of two so that VNs per device stay whole; at its
   demand a job's VNs per device are whole by construction). For ``wfs-any``: any count.
   Every admitted job gets at least one worker: those whose share rounds to 0 take theirs
   from the jobs furthest above their exact share, lowest priority first.
2. Spare slots are handed out in priority order (then arrival), each job growing to its
   next allowed count (for ``wfs``: doubling) while that fits, in passes until none can.
3. Running jobs stay admitted. A queued job, taken in priority order, is admitted unless
   that would cut a job of higher priority below its (rounded) fair share in the new set,
   which happens when the workers given to jobs whose share rounds to 0 would come from
   it; the job then waits, and jobs of lower priority behind it are still considered.
4. Beyond VirtualFlow, which caps every job at its demand: step 2 is repeated with the
   cap raised to the job's ``max_workers`` (V, and the largest count its step times
   give), so that no slot idles while a running job could take it. This is what makes
   the policy work-conserving; VirtualFlow left such slots idle.

A running job's allocation changes whenever the set of jobs does; the caller pays the
resize (grow or shrink) it implies.
"""

from __future__ import annotations

import bisect
import functools
import heapq
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from vflow.cluster.trace import JobSpec

__all__ = [
    "LAS_THRESHOLDS_S",
    "POLICIES",
    "JobState",
    "Policy",
    "check_allocation",
    "get_policy",
    "las",
    "priority",
    "wfs",
]


@dataclass(frozen=True)
class JobState:
    """What a policy sees of an active job: its spec, the workers it runs on now (0:
    waiting), whether it has run before (a preempted job has), and the service it has
    had, in worker-seconds."""

    spec: JobSpec
    workers: int = 0
    started: bool = False
    attained_s: float = 0.0

    @property
    def name(self) -> str:
        return self.spec.name


Allocation = dict[str, int]


@dataclass(frozen=True)
class Policy:
    """A named allocation function. ``elastic``: it may change a running job's worker
    count; a policy that is not runs every job on exactly its demand (or preempts it).
    ``interval_s``: also consult it this often (None: only at arrivals and
    completions). ``preemptive``: it may put a running job back to 0 workers."""

    name: str
    allocate: Callable[[int, Sequence[JobState]], Allocation]
    elastic: bool
    interval_s: float | None = None
    preemptive: bool = False

    def __call__(self, slots: int, jobs: Sequence[JobState]) -> Allocation:
        allocation = self.allocate(slots, jobs)
        check_allocation(self, slots, jobs, allocation)
        return allocation


def _priority_key(job: JobState) -> tuple[float, float, str]:
    return (-job.spec.priority, job.spec.arrival_s, job.name)


def _by_priority(jobs: Sequence[JobState]) -> list[JobState]:
    return sorted(jobs, key=_priority_key)


def priority(slots: int, jobs: Sequence[JobState]) -> Allocation:
    """VirtualFlow's non-elastic baseline (module docstring)."""
    allocation = {job.name: job.workers for job in jobs}
    free = slots - sum(allocation.values())
    for job in _by_priority([job for job in jobs if job.workers == 0]):
        if job.spec.demand > free:
            break
        allocation[job.name] = job.spec.demand
        free -= job.spec.demand
    return allocation


# Tiresias' discretized LAS: the attained service (worker-seconds) at which a job moves
# to the next, lower queue. Scaled to a workload by its users (benchmarks/cluster.py).
LAS_THRESHOLDS_S: tuple[float, ...] = (3200.0,)


def las(
    slots: int, jobs: Sequence[JobState], thresholds_s: Sequence[float] = LAS_THRESHOLDS_S
) -> Allocation:
    """Tiresias-style least attained service, preemptive, not elastic (module docstring)."""

    def queue(job: JobState) -> int:
        return sum(job.attained_s >= limit for limit in thresholds_s)

    allocation = {job.name: 0 for job in jobs}
    free = slots
    for job in sorted(jobs, key=lambda j: (queue(j), j.spec.arrival_s, j.name)):
        if job.spec.demand <= free:
            allocation[job.name] = job.spec.demand
            free -= job.spec.demand
    return allocation


@functools.lru_cache(maxsize=4096)
def _powers_of_two_and_demand(demand: int, cap: int) -> tuple[int, ...]:
    counts = {1 << k for k in range(cap.bit_length()) if 1 << k <= cap}
    if demand <= cap:
        counts.add(demand)
    return tuple(sorted(counts))


@functools.lru_cache(maxsize=4096)
def _any_count(demand: int, cap: int) -> tuple[int, ...]:
    return tuple(range(1, cap + 1))


# (demand, cap) -> the worker counts a job may run on, up to cap, in increasing order
AllowedCounts = Callable[[int, int], tuple[int, ...]]


def _round_down(counts: tuple[int, ...], value: float) -> int:
    """The largest of ``counts`` <= ``value`` (with float slack), or 0."""
    index = bisect.bisect_right(counts, value + 1e-9)
    return counts[index - 1] if index else 0


def _fair_shares(
    slots: int, jobs: list[JobState], allowed: AllowedCounts
) -> tuple[Allocation, Allocation]:
    """Step 1 of Note [Weighted fair share] for ``jobs`` (in priority order, at most
    ``slots`` of them): (the shares, every job at least one worker and all within the
    slots; each job's fair share, rounded down, possibly 0)."""
    names = [job.name for job in jobs]
    demands = [job.spec.demand for job in jobs]
    weights = [job.spec.priority for job in jobs]
    # Jobs whose weighted share of what the others leave covers their demand are capped
    # at it, until none is; the sums run over the uncapped jobs in index order.
    uncapped = list(range(len(jobs)))
    budget = slots
    while True:
        weight = sum(weights[i] for i in uncapped)
        newly = [i for i in uncapped if budget * weights[i] / weight >= demands[i]]
        budget -= sum(demands[i] for i in newly)
        uncapped = [i for i in uncapped if i not in newly] if newly else uncapped
        if not newly or not uncapped:
            break
    weight = sum(weights[i] for i in uncapped)
    capped = [True] * len(jobs)
    for i in uncapped:
        capped[i] = False
    exact = [float(d) if c else budget * w / weight for d, w, c in zip(demands, weights, capped)]
    fair = [d if c else _round_down(allowed(d, d), e) for d, e, c in zip(demands, exact, capped)]
    shares = [max(1, share) for share in fair]
    # The workers given to jobs whose share rounds to 0 come from the jobs furthest above
    # their exact share, lowest priority first: each time from the job of the largest
    # (share - exact, index). Only the chosen job's key changes (it falls), so a heap
    # of the keys picks the same jobs as a scan per worker would, in O(log n) each.
    total = sum(shares)
    if total > slots:
        heap = [(exact[i] - share, -i) for i, share in enumerate(shares) if share > 1]
        heapq.heapify(heap)
        while total > slots:
            i = -heapq.heappop(heap)[1]
            lower = _round_down(allowed(demands[i], shares[i]), shares[i] - 1)
            total -= shares[i] - lower
            shares[i] = lower
            if lower > 1:
                heapq.heappush(heap, (exact[i] - lower, -i))
    return dict(zip(names, shares)), dict(zip(names, fair))


def _hand_out(
    slots: int,
    jobs: list[JobState],
    shares: Allocation,
    allowed: AllowedCounts,
    cap_of: Callable[[JobSpec], int],
) -> None:
    """Step 2 (and 4) of Note [Weighted fair share]: grows jobs in priority order to their
    next allowed count while slots are spare."""
    free = slots - sum(shares.values())
    grown = True
    while grown and free > 0:
        grown = False
        for job in jobs:
            current = shares[job.name]
            counts = allowed(job.spec.demand, cap_of(job.spec))
            index = bisect.bisect_right(counts, current)
            if index < len(counts) and counts[index] - current <= free:
                free -= counts[index] - current
                shares[job.name] = counts[index]
                grown = True


def _weighted_fair_share(
    slots: int, jobs: Sequence[JobState], allowed: AllowedCounts
) -> Allocation:
    admitted = _by_priority([job for job in jobs if job.workers > 0])
    for candidate in _by_priority([job for job in jobs if job.workers == 0]):
        if len(admitted) == slots:
            break
        trial = list(admitted)
        bisect.insort(trial, candidate, key=_priority_key)  # admitted is in that order
        shares, fair = _fair_shares(slots, trial, allowed)
        higher = [job for job in admitted if job.spec.priority > candidate.spec.priority]
        if all(shares[job.name] >= fair[job.name] for job in higher):
            admitted = trial
    shares = _fair_shares(slots, admitted, allowed)[0] if admitted else {}
    _hand_out(slots, admitted, shares, allowed, lambda spec: spec.demand)
    _hand_out(slots, admitted, shares, allowed, lambda spec: spec.max_workers)
    return {job.name: shares.get(job.name, 0) for job in jobs}


def wfs(slots: int, jobs: Sequence[JobState]) -> Allocation:
    """VirtualFlow's weighted fair share, power-of-two counts (Note [Weighted fair share])."""
    return _weighted_fair_share(slots, jobs, _powers_of_two_and_demand)


def wfs_any(slots: int, jobs: Sequence[JobState]) -> Allocation:
    """Weighted fair share on any worker count (Note [Weighted fair share])."""
    return _weighted_fair_share(slots, jobs, _any_count)


POLICIES: dict[str, Policy] = {
    "priority": Policy("priority", priority, elastic=False),
    "las": Policy("las", las, elastic=False, interval_s=60.0, preemptive=True),
    "wfs": Policy("wfs", wfs, elastic=True),
    "wfs-any": Policy("wfs-any", wfs_any, elastic=True),
}


def get_policy(
    name: str, *, las_thresholds_s: Sequence[float] | None = None, interval_s: float | None = None
) -> Policy:
    """The policy called ``name`` (one of POLICIES); ``las_thresholds_s`` and
    ``interval_s`` override las' queue limits and any policy's scheduling interval."""
    if name not in POLICIES:
        raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {name!r}")
    policy = POLICIES[name]
    allocate = policy.allocate
    if las_thresholds_s is not None:
        limits = tuple(las_thresholds_s)
        if any(not (math.isfinite(t) and t > 0) for t in limits) or list(limits) != sorted(limits):
            raise ValueError(f"las_thresholds_s must be increasing seconds > 0, got {list(limits)}")
        if name == "las":
            allocate = lambda slots, jobs: las(slots, jobs, limits)  # noqa: E731
    if interval_s is not None and not (math.isfinite(interval_s) and interval_s > 0):
        raise ValueError(f"interval_s must be seconds > 0, got {interval_s!r}")
    return Policy(
        name,
        allocate,
        policy.elastic,
        interval_s if interval_s is not None else policy.interval_s,
        policy.preemptive,
    )


def check_allocation(
    policy: Policy, slots: int, jobs: Sequence[JobState], allocation: Allocation
) -> None:
    """Raises RuntimeError if ``allocation`` breaks the rules every policy keeps: a count
    for every job, within 0..max_workers, at most ``slots`` in all, and for a policy that
    is not elastic, a running job either kept as it is or preempted, a started one on its
    demand."""
    names = {job.name for job in jobs}
    if set(allocation) != names:
        raise RuntimeError(
            f"policy {policy.name!r} allocated {sorted(allocation)}, not the jobs {sorted(names)}"
        )
    for job in jobs:
        workers = allocation[job.name]
        if not 0 <= workers <= job.spec.max_workers:
            raise RuntimeError(
                f"policy {policy.name!r} gave job {job.name!r} {workers} workers "
                f"(allowed 0..{job.spec.max_workers})"
            )
        if not policy.elastic and workers not in (0, job.spec.demand):
            raise RuntimeError(
                f"policy {policy.name!r} is not elastic but gave job {job.name!r} {workers} "
                f"workers, not its demand {job.spec.demand}"
            )
    if sum(allocation.values()) > slots:
        raise RuntimeError(
            f"policy {policy.name!r} allocated {sum(allocation.values())} of {slots} slots"
        )
