"""``plan="auto"``: the executor plans from the workers' profiles and re-plans when
their speeds change.

Note [Automatic plans]
Every rank holds every worker's profile of the step before the last (Note [Profiles],
vflow/planning/profile.py): the numbers ride in the step's statistics all-reduce, so every rank
sees the same values, and ``AutoPlan.observe`` — a pure function of them and of its own
state, which every rank updates the same way — reaches the same decision on every rank
at the same step, without an agreement round.

* The job starts on the even plan. After ``warmup`` profiles of the current plan, the
  planner (Note [The planner's model], vflow/planning/planner.py) fits every worker's cost and
  proposes the plan with the smallest predicted step time.
* A proposal is taken only if it predicts a step at least ``min_gain`` (relative)
  faster than the current plan under the same models: small gains are noise, and
  refusing them is the hysteresis that keeps plans from oscillating.
* Each step, every worker's measured compute is compared with the prediction; a
  departure counts when it exceeds ``threshold`` times the predicted slowest compute
  (the step), so a worker that speeds up is seen as well as one that slows down, while
  noise on a worker with little work is not. A worker's compute is measured as its
  number of VNs times its median VN time, so that one VN that the operating system
  preempted is not a change of speed. After ``patience`` steps in a row that depart —
  a straggler, a throttled device that recovers, a co-located job — the models are
  fitted again from those steps only (the old speeds no longer hold) and the proposal
  rule above applies.
* A quick change back to the plan that the previous change left (within ``patience *
  RECOVERY_STEPS`` steps) is a sign of noise, not of speeds that changed: each such
  return doubles the patience of the drift rule (up to
  ``MAX_BACKOFF`` times), and every ``patience * RECOVERY_STEPS`` steps without a change
  halve it again. So a noisy machine settles on a plan, while a machine that was quiet
  for a while still reacts to a straggler within ``patience`` steps.
* Profiles of another plan (the one step in flight when the plan changes) are ignored.

``Executor.plan_history`` lists the changes with their predicted step times.
"""

from __future__ import annotations

import logging
import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from vflow.mapping.plan import Plan
from vflow.planning import planner
from vflow.planning.profile import StepProfile, WorkerProfile

_log = logging.getLogger("vflow")

# Note [Automatic plans]: the largest factor on the drift rule's patience, and the
# steps (in units of patience) without a change after which the factor halves.
MAX_BACKOFF = 8
RECOVERY_STEPS = 25


@dataclass(frozen=True)
class PlanChange:
    """One automatic change of plan.

    step: the first step run under ``new``.
    reason: "profiled" (the first plan from the warm-up) or "drift" (speeds changed).
    predicted_old_s / predicted_new_s: the model's step time of each plan when the
      change was decided; the gain is their ratio.
    """

    step: int
    old: Plan
    new: Plan
    reason: str
    predicted_old_s: float
    predicted_new_s: float


class AutoPlan:
    """Settings of ``Executor(plan=vflow.AutoPlan(...))``; ``plan="auto"`` is
    ``AutoPlan()``. See Note [Automatic plans].

    Args:
        kind: "counts" (equal VN sizes; the only kind allowed in deterministic mode, and
            the default) or "sizes" (VirtualFlow's uneven VN sizes).
        warmup: profiles of the even plan before the first planned one.
        threshold: relative departure of the measured from the predicted compute that
            counts as a drift.
        patience: drifting steps in a row before re-planning.
        min_gain: smallest relative predicted gain for which the plan is changed.
        max_vn_size: per worker, a cap on a VN's samples (memory), or None.
    """

    def __init__(
        self,
        kind: str = "counts",
        *,
        warmup: int = 2,
        threshold: float = 0.15,
        patience: int = 2,
        min_gain: float = 0.05,
        max_vn_size: Sequence[int | None] | None = None,
    ) -> None:
        if kind not in ("counts", "sizes"):
            raise ValueError(f"kind must be 'counts' or 'sizes', got {kind!r}")
        for name, value in (("warmup", warmup), ("patience", patience)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        for name, number in (("threshold", threshold), ("min_gain", min_gain)):
            if (
                isinstance(number, bool)
                or not isinstance(number, (int, float))
                or not (0 <= number < 10)
            ):
                raise ValueError(f"{name} must be a number in [0, 10), got {number!r}")
        if max_vn_size is not None:
            for w, cap in enumerate(max_vn_size):
                if cap is not None and (
                    isinstance(cap, bool) or not isinstance(cap, int) or cap < 1
                ):
                    raise ValueError(f"max_vn_size[{w}] must be an int >= 1 or None, got {cap!r}")
        self.kind = kind
        self.warmup = warmup
        self.threshold = float(threshold)
        self.patience = patience
        self.min_gain = float(min_gain)
        self.max_vn_size = None if max_vn_size is None else list(max_vn_size)
        self.history: list[PlanChange] = []
        self._recent: deque[StepProfile] = deque(maxlen=max(warmup, patience * MAX_BACKOFF))
        self._planned = False
        # Each worker's compute that the model predicts for the current plan.
        self._predicted_compute: tuple[float, ...] | None = None
        self._drifting = 0
        self._backoff = 1
        self._quiet_steps = 0
        self._since_change = 0

    def __repr__(self) -> str:
        return (
            f"AutoPlan(kind={self.kind!r}, warmup={self.warmup}, threshold={self.threshold}, "
            f"patience={self.patience}, min_gain={self.min_gain}, max_vn_size={self.max_vn_size})"
        )

    def check(self, deterministic: bool, world_size: int) -> None:
        """Raises before training when the settings cannot work for this executor."""
        if deterministic and self.kind != "counts":
            raise ValueError(
                "plan=AutoPlan(kind='sizes') changes VN sizes, which deterministic mode "
                "forbids (a VN's samples would depend on the hardware); use kind='counts'"
            )
        if self.max_vn_size is not None and len(self.max_vn_size) != world_size:
            raise ValueError(
                f"AutoPlan max_vn_size has {len(self.max_vn_size)} entries but the process "
                f"group has {world_size} workers"
            )

    def reset(self) -> None:
        """Forgets the profiles (a new worker set: other workers, other speeds)."""
        self._recent.clear()
        self._planned = False
        self._predicted_compute = None
        self._drifting = 0
        self._backoff = 1
        self._quiet_steps = 0
        self._since_change = 0

    @property
    def drift_patience(self) -> int:
        """Drifting steps in a row that trigger a re-plan now: ``patience`` times the
        back-off of Note [Automatic plans]."""
        return self.patience * self._backoff

    def observe(
        self, profile: StepProfile, plan: Plan, batch_size: int, next_step: int
    ) -> Plan | None:
        """Takes every worker's profile of a step; returns the plan to run from
        ``next_step`` on, or None to keep ``plan``."""
        if not _ran(profile, plan, batch_size):
            return None
        self._recent.append(profile)
        if not self._planned:
            if len(self._recent) < self.warmup:
                return None
            self._planned = True
            return self._decide(
                list(self._recent)[-self.warmup :], plan, batch_size, next_step, "profiled"
            )
        self._quiet_steps += 1
        self._since_change += 1
        if self._backoff > 1 and self._quiet_steps >= self.patience * RECOVERY_STEPS:
            self._backoff //= 2
            self._quiet_steps = 0
        predicted = self._predicted_compute
        slowest = max(predicted) if predicted else 0.0
        if slowest > 0 and any(
            abs(_robust_compute(worker) - expected) > self.threshold * slowest
            for worker, expected in zip(profile.workers, predicted or (), strict=True)
        ):
            self._drifting += 1
        else:
            self._drifting = 0
        drifted = self._drifting
        if drifted < self.drift_patience:
            return None
        self._drifting = 0
        return self._decide(list(self._recent)[-drifted:], plan, batch_size, next_step, "drift")

    def _decide(
        self, profiles: list[StepProfile], plan: Plan, batch_size: int, next_step: int, reason: str
    ) -> Plan | None:
        models = planner.models_from_profiles(profiles, self.max_vn_size)
        comm = planner.exposed_comm(profiles)
        current = planner.predict(plan, models, batch_size, comm)
        solve = planner.plan_counts if self.kind == "counts" else planner.plan_sizes
        best = solve(models, plan.virtual_nodes, batch_size, comm)
        keep = best.plan == plan or best.step_s > current.step_s * (1 - self.min_gain)
        chosen = current if keep else best
        self._predicted_compute = chosen.worker_s
        if keep:
            return None
        self._recent.clear()
        quick = self._since_change < self.patience * RECOVERY_STEPS
        if quick and self.history and best.plan == self.history[-1].old:
            self._backoff = min(2 * self._backoff, MAX_BACKOFF)
        self._quiet_steps = self._since_change = 0
        change = PlanChange(next_step, plan, best.plan, reason, current.step_s, best.step_s)
        self.history.append(change)
        _log.info(
            "vflow auto plan, step %d (%s): %s -> %s, predicted step %.4g s -> %.4g s (%.2fx)",
            next_step,
            reason,
            plan,
            best.plan,
            current.step_s,
            best.step_s,
            current.step_s / best.step_s if best.step_s > 0 else float("inf"),
        )
        return best.plan


def _robust_compute(worker: WorkerProfile) -> float:
    """The worker's compute as its VN count times its median VN time."""
    if not worker.vns:
        return 0.0
    return len(worker.vns) * statistics.median(vn.forward_s + vn.backward_s for vn in worker.vns)


def _ran(profile: StepProfile, plan: Plan, batch_size: int) -> bool:
    """Whether ``profile`` is of a step run under ``plan`` (same VNs and VN sizes)."""
    if len(profile.workers) != plan.num_workers:
        return False
    sizes = plan.vn_sizes(batch_size)
    return all(
        [(vn.vn, vn.size) for vn in worker.vns] == [(k, sizes[k]) for k in plan.vns(w)]
        for w, worker in enumerate(profile.workers)
    )
