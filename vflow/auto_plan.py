"""``plan="auto"``: the executor plans from the workers' profiles and re-plans when
their speeds change.

Note [Automatic plans]
Every rank holds every worker's profile of the step before the last (Note [Profiles],
vflow/profile.py): the numbers ride in the step's statistics all-reduce, so every rank
sees the same values, and ``AutoPlan.observe`` — a pure function of them and of its own
state, which every rank updates the same way — reaches the same decision on every rank
at the same step, without an agreement round.

* The job starts on the even plan. After ``warmup`` profiles of the current plan, the
  planner (Note [The planner's model], vflow/planner.py) fits every worker's cost and
  proposes the plan with the smallest predicted step time.
* A proposal is taken only if it predicts a step at least ``min_gain`` (relative)
  faster than the current plan under the same models: small gains are noise, and
  refusing them is the hysteresis that keeps plans from oscillating.
* Each step, the measured slowest compute is compared with the prediction. After
  ``patience`` steps in a row off by more than ``threshold`` (relative) — a straggler,
  a throttled device, a co-located job — the models are fitted again from those
  steps only (the old speeds no longer hold) and the proposal rule above applies.
* Profiles of another plan (the one step in flight when the plan changes) are ignored.

``Executor.plan_history`` lists the changes with their predicted step times.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from vflow import planner
from vflow.plan import Plan
from vflow.profile import StepProfile

_log = logging.getLogger("vflow")


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
        self._recent: deque[StepProfile] = deque(maxlen=max(warmup, patience))
        self._planned = False
        self._predicted_compute: float | None = None
        self._drifting = 0

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
        measured = max(w.compute_s for w in profile.workers)
        predicted = self._predicted_compute
        if (
            predicted is not None
            and predicted > 0
            and abs(measured - predicted) > self.threshold * predicted
        ):
            self._drifting += 1
        else:
            self._drifting = 0
        if self._drifting < self.patience:
            return None
        self._drifting = 0
        return self._decide(
            list(self._recent)[-self.patience :], plan, batch_size, next_step, "drift"
        )

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
        self._predicted_compute = chosen.step_s - comm
        if keep:
            return None
        self._recent.clear()
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


def _ran(profile: StepProfile, plan: Plan, batch_size: int) -> bool:
    """Whether ``profile`` is of a step run under ``plan`` (same VNs and VN sizes)."""
    if len(profile.workers) != plan.num_workers:
        return False
    sizes = plan.vn_sizes(batch_size)
    return all(
        [(vn.vn, vn.size) for vn in worker.vns] == [(k, sizes[k]) for k in plan.vns(w)]
        for w, worker in enumerate(profile.workers)
    )
