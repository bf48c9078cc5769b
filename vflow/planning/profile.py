"""Per-step timings: what each worker spent on each of its VNs, computing and waiting.

Note [Profiles]
A step records, for this worker, every VN's forward and backward time, their sum (its
compute), the time it sat blocked on collectives that backward did not hide (its
exposed communication, which also holds any wait for slower workers) and the time of
the optimizer step. ``StepResult.profile`` carries these numbers for the step just
run. A planner needs every worker's, on every rank: they travel in the statistics
all-reduce that every step already runs (vflow.runtime.step_stats), one step late — the
statistics are sent before the last backward, when the step's own times are not yet
known — so gathering them costs no collective. ``Executor.last_profile`` is therefore
the latest step that every rank holds for all workers: the previous one on several
workers, the current one on a single process. A new worker set starts without one.

The step measures them with vflow.runtime.clock.StepClock.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class VNProfile:
    """One VN as run by one worker."""

    vn: int
    size: int  # samples
    forward_s: float
    backward_s: float


@dataclass(frozen=True)
class WorkerProfile:
    """One worker's step (Note [Profiles])."""

    rank: int
    step: int
    vns: tuple[VNProfile, ...]
    compute_s: float  # sum of the VNs' forward and backward times
    exposed_comm_s: float  # blocked on collectives (incl. waiting for slower workers)
    optimizer_s: float
    step_s: float  # the whole step

    @property
    def samples(self) -> int:
        return sum(vn.size for vn in self.vns)


@dataclass(frozen=True)
class StepProfile:
    """Every worker's profile of one step, in rank order."""

    step: int
    workers: tuple[WorkerProfile, ...]
