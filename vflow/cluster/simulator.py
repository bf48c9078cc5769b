"""A discrete-event simulator of a cluster running a trace under a policy.

Note [The simulator's model]
* Time is continuous. A running job on w workers progresses at ``1 / step_time(w)``
  steps per second (Note [Step time between the given counts], trace.py); it ends when
  its progress reaches ``steps``. A step is not atomic here: a resize takes effect at
  once, where a real job resizes at its next step boundary (half a step later on
  average; the real runner's measured costs include it). A preemption keeps the step
  in flight: the job is credited with it (a real job suspends after it), and when it
  is the job's last the job ends then instead of being suspended.
* The policy is consulted at every arrival, every completion and, if it has an
  interval, at every multiple of it; each consultation sees every active job (arrived,
  not finished) with its current workers and attained service (worker-seconds held).
* Slots move at the decision: a job given workers holds them at once, and a job's
  released slots are free at once; unless ``release_s`` > 0 (Note [Slots released
  late]).
* A change of a job's workers costs it seconds without progress, while it holds its
  new allocation (Pollux's charge): ``start_s`` for its first start, ``grow_s`` and
  ``shrink_s`` for an elastic resize, ``restart_s`` when a preempted job resumes; a
  start and a restart also pay ``start_per_worker_s`` per worker (0 by default: on a
  cluster each worker starts on a machine of its own; the real runner's workers share 2
  cores while they start, and it measures that slope for the simulator). Costs that
  overlap add up (a job grown while it starts pays both).
* Not modelled: placement (every slot is alike and any set of slots works), failures.

The default costs are vflow's, measured on this project's 2-core machine by
``benchmarks/elastic.py`` (benchmarks/README.md, results at 5de9736): the overhead of a
grow (wall time beyond steady training at the new size, the joiner's start-up
included) 0.85 s; of a leave or a SIGTERM, 0.06-0.42 s (0.2 s taken); a fresh worker's
imports and executor, 2.6 s, for a start, and for a restart from a checkpoint too.

Note [Slots released late]
On a cluster a released slot is not free at the decision: a shrunk job's leavers finish
their step, a preempted job stops at a step and saves its state, then the processes exit
and the cluster manager takes the device back (Slurm: a job's GPUs return when it ends;
VirtualFlow held released GPUs for 10 s). With ``release_s`` > 0 the slots a job
releases are free ``release_s`` after the step boundary it can stop at (after its start
or restart, if it is still paying for one). A start or restart that needs more slots
than are free at its decision waits until enough released ones are (every job started
at that decision waits: the cluster starts them as slots come free, and a job's first
step needs all its workers); then it pays its cost. A grow does not wait: the job runs
on at its old size while its joiners wait, which the grow's cost holds. The real runner
measures ``release_s`` (vflow/cluster/runner.py, Note [What the runner measures]); 0,
the default, is the paper's simulator: slots move at the decision.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from vflow.cluster.policies import JobState, Policy
from vflow.cluster.trace import JobSpec, Trace

__all__ = ["MEASURED", "Costs", "SimulatedJob", "simulate", "summarize"]


@dataclass(frozen=True)
class Costs:
    """Seconds a job makes no progress after a change of its workers (Note [The
    simulator's model])."""

    start_s: float = 2.6
    grow_s: float = 0.85
    shrink_s: float = 0.2
    restart_s: float = 2.6
    # added per worker to a start's and a restart's cost
    start_per_worker_s: float = 0.0
    # a released slot is free this long after its job's next step boundary (Note [Slots
    # released late]); 0: at once
    release_s: float = 0.0

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"{name} must be a number of seconds >= 0, got {value!r}")
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a number of seconds >= 0, got {value!r}")


MEASURED = Costs()

# Progress within this fraction of a step of the end counts as the end (float sums).
_EPSILON_STEPS = 1e-9


@dataclass
class SimulatedJob:
    """One job's course through a simulation; times in seconds from the trace's zero."""

    spec: JobSpec
    workers: int = 0
    started: bool = False
    progress: float = 0.0
    attained_s: float = 0.0
    # no progress before this time (the cost of the last change)
    paused_until: float = 0.0
    start_s: float | None = None
    end_s: float | None = None
    resizes: list[dict[str, Any]] = field(default_factory=list)

    def finish_time(self, now: float) -> float:
        """When the job ends if nothing changes; inf when it does not run."""
        if self.workers == 0:
            return math.inf
        left = max(0.0, self.spec.steps - self.progress)
        return max(now, self.paused_until) + left / self.spec.throughput(self.workers)

    def advance(self, now: float, until: float) -> None:
        if self.workers == 0:
            return
        self.attained_s += self.workers * (until - now)
        running = until - max(now, self.paused_until)
        if running > 0:
            self.progress += running * self.spec.throughput(self.workers)

    def state(self) -> JobState:
        return JobState(self.spec, self.workers, self.started, self.attained_s)

    def record(self) -> dict[str, Any]:
        assert self.start_s is not None and self.end_s is not None
        return {
            "name": self.spec.name,
            "arrival_s": self.spec.arrival_s,
            "start_s": self.start_s,
            "end_s": self.end_s,
            "jct_s": self.end_s - self.spec.arrival_s,
            "queue_s": self.start_s - self.spec.arrival_s,
            "demand": self.spec.demand,
            "priority": self.spec.priority,
            "worker_seconds": self.attained_s,
            "resizes": self.resizes,
        }


def _apply(job: SimulatedJob, workers: int, now: float, costs: Costs, free_at: float) -> None:
    """Gives ``job`` ``workers``; a start or restart waits until ``free_at`` for its
    slots (Note [Slots released late])."""
    before = job.workers
    if workers == before:
        return
    if before == 0:
        kind, cost = ("restart", costs.restart_s) if job.started else ("start", costs.start_s)
        cost += costs.start_per_worker_s * workers
        if not job.started:
            job.start_s = now
        job.started = True
        job.paused_until = max(now, free_at) + cost
    else:
        kind = "preempt" if workers == 0 else "grow" if workers > before else "shrink"
        cost = 0.0 if workers == 0 else costs.grow_s if workers > before else costs.shrink_s
        job.paused_until = max(job.paused_until, now) + cost
        if workers == 0 and now >= job.paused_until:
            # The step in flight completes (Note [The simulator's model]).
            boundary = min(math.ceil(job.progress - _EPSILON_STEPS), job.spec.steps)
            if boundary >= job.spec.steps:
                job.end_s = now + (job.spec.steps - job.progress) / job.spec.throughput(before)
            job.progress = float(boundary)
    job.workers = workers
    job.resizes.append({"t": now, "from": before, "to": workers, "kind": kind})


def simulate(
    trace: Trace, policy: Policy, costs: Costs = MEASURED, *, max_events: int | None = None
) -> dict[str, Any]:
    """Runs ``trace`` under ``policy`` (Note [The simulator's model]); returns the result
    (``summarize``'s record). RuntimeError if the policy leaves the cluster stuck (jobs
    wait, none runs, and no event is due) or ``max_events`` (default: 1000 per job) pass."""
    pending = list(trace.jobs)  # in order of arrival
    active: list[SimulatedJob] = []
    done: list[SimulatedJob] = []
    now = 0.0
    next_arrival = 0
    interval = policy.interval_s
    releasing: list[tuple[float, int]] = []  # slots not free yet: (free at, count)
    limit = max_events if max_events is not None else 1000 * len(pending) + 1000
    for _ in range(limit):
        arrival_at = pending[next_arrival].arrival_s if next_arrival < len(pending) else math.inf
        finish_at = min((job.finish_time(now) for job in active), default=math.inf)
        tick_at = math.inf
        if interval is not None and active:
            tick_at = (math.floor(now / interval + 1e-9) + 1) * interval
        until = min(arrival_at, finish_at, tick_at)
        if until == math.inf:
            if not active:
                return summarize(trace, policy, costs, done)
            raise RuntimeError(
                f"policy {policy.name!r} leaves jobs {[j.spec.name for j in active]} waiting "
                f"at {now:.1f} s with nothing running"
            )
        for job in active:
            job.advance(now, until)
        now = until
        while next_arrival < len(pending) and pending[next_arrival].arrival_s <= now:
            active.append(SimulatedJob(pending[next_arrival]))
            next_arrival += 1
        for job in [j for j in active if j.progress >= j.spec.steps * (1 - _EPSILON_STEPS)]:
            job.end_s = now
            job.workers = 0
            active.remove(job)
            done.append(job)
        if active:
            allocation = policy(trace.slots, [job.state() for job in active])
            free_at = _slots_free_at(trace.slots, active, allocation, releasing, now, costs)
            for job in active:
                _apply(job, allocation[job.spec.name], now, costs, free_at)
            # A job preempted in its last step ended with it.
            done += [job for job in active if job.end_s is not None]
            active = [job for job in active if job.end_s is None]
    raise RuntimeError(f"the simulation did not end within {limit} events")


def _slots_free_at(
    slots: int,
    active: list[SimulatedJob],
    allocation: dict[str, int],
    releasing: list[tuple[float, int]],
    now: float,
    costs: Costs,
) -> float:
    """When the starts and restarts of this decision have their slots (Note [Slots
    released late]); notes the slots it releases in ``releasing`` (free time, count),
    from which it drops those free by ``now``."""
    if costs.release_s == 0:
        return now
    releasing[:] = [(t, n) for t, n in releasing if t > now]
    free = slots - sum(job.workers for job in active) - sum(n for _, n in releasing)
    for job in active:
        if allocation[job.spec.name] < job.workers:
            at = max(now, job.paused_until) + costs.release_s
            releasing.append((at, job.workers - allocation[job.spec.name]))
    # Grows take free slots too (the runner launches the smaller gains first).
    needed = sum(max(0, allocation[job.spec.name] - job.workers) for job in active) - free
    free_at = now
    for at, count in sorted(releasing):
        if needed <= 0:
            break
        needed -= count
        free_at = at
    return free_at


def _percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    position = (len(ordered) - 1) * q
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def summarize(
    trace: Trace, policy: Policy, costs: Costs, jobs: Sequence[SimulatedJob]
) -> dict[str, Any]:
    """The result record: the contract's ``policy``, ``avg_jct_s``, ``makespan_s`` and
    ``jobs`` (name, arrival_s, start_s, end_s, jct_s, and more per job), with the
    median and p95 JCT, the average queueing delay, the utilisation (worker-seconds held
    over slots x makespan) and the costs."""
    records = sorted((job.record() for job in jobs), key=lambda r: (r["arrival_s"], r["name"]))
    jcts = [r["jct_s"] for r in records]
    first = min(r["arrival_s"] for r in records)
    makespan = max(r["end_s"] for r in records) - first
    held = sum(r["worker_seconds"] for r in records)
    return {
        "policy": policy.name,
        "avg_jct_s": statistics.fmean(jcts),
        "makespan_s": makespan,
        "median_jct_s": statistics.median(jcts),
        "p95_jct_s": _percentile(jcts, 0.95),
        "avg_queue_s": statistics.fmean(r["queue_s"] for r in records),
        "utilisation": held / (trace.slots * makespan) if makespan > 0 else 0.0,
        "resizes": sum(len(r["resizes"]) - 1 for r in records),
        "slots": trace.slots,
        "costs": asdict(costs),
        "jobs": records,
    }
