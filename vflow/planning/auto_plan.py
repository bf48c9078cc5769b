"""``plan="auto"``: the executor plans from the workers' profiles and re-plans when
their speeds change.

Note [Automatic plans]
Every rank holds every worker's profile of the step before the last (Note [Profiles],
vflow/planning/profile.py): the numbers ride in the step's statistics all-reduce, so every rank
sees the same values, and ``AutoPlan.observe`` — a pure function of them and of its own
state, which every rank updates the same way — reaches the same decision on every rank
at the same step, without an agreement round.

* The job starts on the even plan. The first step's profile is not used (it pays
  one-time costs: allocations, first touches of memory). After ``warmup`` more
  profiles of the current plan, the planner (Note [The planner's model],
  vflow/planning/planner.py) fits every worker's cost and proposes the plan with the
  smallest predicted step time: the slowest worker's compute plus the step's fixed part
  (the reduction no backward hides, the optimizer, the bookkeeping), so that a gain is
  weighed against the whole step, not against compute alone.
* A proposal is taken only if the time it saves per step beats the noise band: at
  least ``min_gain`` of the current plan's predicted step, and at least ``noise_sigmas``
  standard errors of the difference of two step times averaged over the n profiles it
  was decided from: ``step_noise_s * sqrt(2 / n)``, the noise (``planner.step_noise_s``)
  measured on the last ``NOISE_WINDOW`` profiles of any plan (a robust estimate from
  consecutive differences: a change of plan or a short stall is one or two outliers
  there, not noise). A gain smaller than
  that cannot be told from the step time's own wandering, and taking it is how plans
  oscillate; refusing it is the hysteresis that keeps a plan. A first proposal refused
  this way is weighed again on 2 and 4 times ``warmup`` profiles (``WARMUP_LOOKS``),
  where the band is narrower, while the drift rule below already watches; then the
  plan stays. Every decision, taken or not, is
  kept in ``decisions`` with its predicted gain and its band.
* After a change, once ``warmup`` profiles of the new plan are in (or as many as the
  drift rule's back-off asks, below), the plan is weighed once more on them
  ("settled"): the speeds it was chosen from were measured under
  another plan, and on shared hardware a worker's speed depends on what the others do
  (a worker that idled half of the even plan's step computed faster than it does under
  a balanced one). No drift is counted before that look, and a change it makes is not
  looked at again this way; refused within the band, it is weighed again on 2 and 4
  times as many profiles, as the first plan is.
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

``Executor.plan_history`` lists the changes with their predicted step times,
``Executor.plan_decisions`` every decision.

On one process there is one worker and nothing to plan: ``check`` warns, and the plan
stays ``[V]``.
"""

from __future__ import annotations

import logging
import math
import statistics
import warnings
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
# Note [Automatic plans]: the profiles, of any plan, the step time's noise is measured on.
NOISE_WINDOW = 16
# Note [Automatic plans]: how many windows (warmup, 2 warmup, 4 warmup profiles) the first
# plan, and the settled look, are weighed on while their gain is within the noise band.
WARMUP_LOOKS = 3


@dataclass(frozen=True)
class PlanChange:
    """One automatic change of plan.

    step: the first step run under ``new``, if the run goes on that long: a change
      decided when the run's remaining batches are all drawn names the step after them.
    reason: "profiled" (the first plan from the warm-up), "settled" (the plan weighed
      again on profiles of the plan just taken) or "drift" (speeds changed).
    predicted_old_s / predicted_new_s: the model's step time of each plan when the
      change was decided; the gain is their ratio.
    """

    step: int
    old: Plan
    new: Plan
    reason: str
    predicted_old_s: float
    predicted_new_s: float
    noise_band_s: float = 0.0  # the saving the change had to beat (Note [Automatic plans])


@dataclass(frozen=True)
class PlanDecision:
    """One time the automatic planner weighed a plan against the current one.

    step: the step the proposal would have run from.
    reason: "profiled" (after the warm-up), "settled" (on the plan just taken) or
      "drift" (speeds changed).
    current / proposed: the plan in force and the model's best (equal when the current
      plan is already the best).
    predicted_current_s / predicted_proposed_s: their model step times.
    noise_band_s: the saving a change had to beat: ``max(min_gain * predicted_current_s,
      noise_sigmas * measured step noise)``.
    taken: whether the plan changed.
    """

    step: int
    reason: str
    current: Plan
    proposed: Plan
    predicted_current_s: float
    predicted_proposed_s: float
    noise_band_s: float
    taken: bool

    @property
    def predicted_gain(self) -> float:
        """Predicted step time of the current plan over the proposed one (1.0: none)."""
        if self.predicted_proposed_s <= 0:
            return 1.0
        return self.predicted_current_s / self.predicted_proposed_s

    def describe(self) -> str:
        """One line for logs and tables, e.g. "kept [4, 4]: [6, 2] would gain 1.03x
        (0.2 ms), within the noise band (0.9 ms)"."""
        saving_ms = 1e3 * (self.predicted_current_s - self.predicted_proposed_s)
        if self.proposed == self.current:
            return f"kept {_counts(self.current)}: no better plan under the model"
        verdict = "beats" if self.taken else "within"
        head = "moved to" if self.taken else f"kept {_counts(self.current)}:"
        return (
            f"{head} {_counts(self.proposed)} {'gains' if self.taken else 'would gain'} "
            f"{self.predicted_gain:.2f}x ({saving_ms:.2g} ms), {verdict} the noise band "
            f"({1e3 * self.noise_band_s:.2g} ms)"
        )


def _counts(plan: Plan) -> str:
    return str(list(plan.counts)) if plan.sizes is None else repr(plan)


class AutoPlan:
    """Settings of ``Executor(plan=vflow.AutoPlan(...))``; ``plan="auto"`` is
    ``AutoPlan()``. See Note [Automatic plans].

    Args:
        kind: "counts" (equal VN sizes; the only kind allowed in deterministic mode, and
            the default) or "sizes" (VirtualFlow's uneven VN sizes).
        warmup: profiles of the even plan before the first planned one (they also
            measure the step time's noise, so a few more than one).
        threshold: relative departure of the measured from the predicted compute that
            counts as a drift.
        patience: drifting steps in a row before re-planning.
        min_gain: smallest relative predicted gain for which the plan is changed.
        noise_sigmas: a change must also save this many times the step time's
            measured noise (a robust standard deviation over the profiles it is
            decided from); 0 ignores the noise.
        max_vn_size: per worker, a cap on a VN's samples (memory), or None.
    """

    def __init__(
        self,
        kind: str = "counts",
        *,
        warmup: int = 4,
        threshold: float = 0.15,
        patience: int = 3,
        min_gain: float = 0.05,
        noise_sigmas: float = 2.0,
        max_vn_size: Sequence[int | None] | None = None,
    ) -> None:
        if kind not in ("counts", "sizes"):
            raise ValueError(f"kind must be 'counts' or 'sizes', got {kind!r}")
        for name, value in (("warmup", warmup), ("patience", patience)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        for name, number in (
            ("threshold", threshold),
            ("min_gain", min_gain),
            ("noise_sigmas", noise_sigmas),
        ):
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
        self.noise_sigmas = float(noise_sigmas)
        self.max_vn_size = None if max_vn_size is None else list(max_vn_size)
        self.history: list[PlanChange] = []
        self.decisions: list[PlanDecision] = []
        # Windows (sizes of _recent) at which a refused first plan is weighed again, up
        # to the last.
        self._looks: tuple[int, ...] = ()
        self._look_reason = "profiled"
        self._last_look = warmup * 2 ** (WARMUP_LOOKS - 1)
        # Every profile seen lately, of any plan: the step time's noise is measured on
        # these, so that a change of plan (one jump) or a short stall (two) does not
        # widen or narrow the band.
        self._noise_window: deque[StepProfile] = deque(maxlen=NOISE_WINDOW)
        self._recent: deque[StepProfile] = deque(
            maxlen=max(self._last_look, patience * MAX_BACKOFF)
        )
        self._planned = False
        self._seen_first = False
        self._settling = False
        self._min_vns = 1  # what observe's caller requires of every plan
        # Each worker's compute that the model predicts for the current plan.
        self._predicted_compute: tuple[float, ...] | None = None
        self._drifting = 0
        self._backoff = 1
        self._quiet_steps = 0
        self._since_change = 0

    def __repr__(self) -> str:
        return (
            f"AutoPlan(kind={self.kind!r}, warmup={self.warmup}, threshold={self.threshold}, "
            f"patience={self.patience}, min_gain={self.min_gain}, "
            f"noise_sigmas={self.noise_sigmas}, max_vn_size={self.max_vn_size})"
        )

    def check(self, deterministic: bool, world_size: int) -> None:
        """Raises before training when the settings cannot work for this executor; warns
        when there is nothing to plan (one worker)."""
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
        if world_size == 1:
            warnings.warn(
                "plan='auto' on a single process: there is one worker, so nothing to plan "
                "and the plan stays [V]; it plans once the executor runs on several "
                "workers (a process group, or reconfigure)",
                UserWarning,
                stacklevel=3,
            )

    def reset(self) -> None:
        """Forgets the profiles (a new worker set: other workers, other speeds)."""
        self._recent.clear()
        self._noise_window.clear()
        self._looks = ()
        self._planned = False
        self._seen_first = False
        self._settling = False
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
        self,
        profile: StepProfile,
        plan: Plan,
        batch_size: int,
        next_step: int,
        min_vns: int = 1,
    ) -> Plan | None:
        """Takes every worker's profile of a step; returns the plan to run from
        ``next_step`` on, or None to keep ``plan``. Plans give every worker at least
        ``min_vns`` VNs."""
        self._min_vns = min_vns
        if not _ran(profile, plan, batch_size):
            return None
        if not self._seen_first:
            # The first step of an executor or of a worker set pays one-time costs
            # (allocations, first touches of memory, connections): not a speed.
            self._seen_first = True
            return None
        self._recent.append(profile)
        self._noise_window.append(profile)
        if not self._planned:
            if len(self._recent) < self.warmup:
                return None
            self._planned = True
            return self._look(plan, batch_size, next_step, "profiled")
        self._quiet_steps += 1
        self._since_change += 1
        if self._backoff > 1 and self._quiet_steps >= self.patience * RECOVERY_STEPS:
            self._backoff //= 2
            self._quiet_steps = 0
        if self._settling:
            # As much evidence as the drift rule would want now (its back-off included).
            if len(self._recent) < max(self.warmup, self.drift_patience):
                return None
            self._settling = False
            return self._look(plan, batch_size, next_step, "settled")
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
        if drifted >= self.drift_patience:
            self._drifting = 0
            return self._decide(list(self._recent)[-drifted:], plan, batch_size, next_step, "drift")
        if self._looks and len(self._recent) >= self._looks[0] and not drifted:
            # Not while speeds are moving: the look would fit old and new speeds at once.
            return self._look(plan, batch_size, next_step, self._look_reason)
        return None

    def _look(self, plan: Plan, batch_size: int, next_step: int, reason: str) -> Plan | None:
        """The plan weighed on every profile of the current plan so far: the first plan
        ("profiled") or the plan just taken ("settled"). Refused within the noise band,
        it is weighed again on 2 and 4 times as many profiles (the drift rule watches in
        between)."""
        new = self._decide(list(self._recent), plan, batch_size, next_step, reason)
        refused = new is None and self.decisions[-1].proposed != plan
        done = len(self._recent) >= self._last_look
        self._looks = () if not refused or done else (2 * len(self._recent),)
        self._look_reason = reason
        return new

    def _decide(
        self, profiles: list[StepProfile], plan: Plan, batch_size: int, next_step: int, reason: str
    ) -> Plan | None:
        models = planner.models_from_profiles(profiles, self.max_vn_size)
        fixed = planner.fixed_step_s(profiles)
        current = planner.predict(plan, models, batch_size, fixed)
        if self.kind == "counts":
            best = planner.plan_counts(models, plan.virtual_nodes, batch_size, fixed, self._min_vns)
        else:
            best = planner.plan_sizes(models, plan.virtual_nodes, batch_size, fixed)
        # The standard error of the difference of two step times averaged over the
        # window: what comparing two plans measured for that long could not resolve.
        # The noise itself is measured on the last NOISE_WINDOW profiles (a drift's
        # window of a few steps says little about it).
        noise = planner.step_noise_s(list(self._noise_window)) * math.sqrt(2 / len(profiles))
        band = max(self.min_gain * current.step_s, self.noise_sigmas * noise)
        taken = best.plan != plan and current.step_s - best.step_s > band
        decision = PlanDecision(
            next_step, reason, plan, best.plan, current.step_s, best.step_s, band, taken
        )
        self.decisions.append(decision)
        chosen = best if taken else current
        self._predicted_compute = chosen.worker_s
        if not taken:
            if best.plan != plan:
                _log.info(
                    "vflow auto plan, step %d (%s): %s", next_step, reason, decision.describe()
                )
            return None
        self._recent.clear()
        self._looks = ()
        # The speeds were measured under another plan; on shared hardware a worker's
        # speed depends on what the others do, so the new plan is weighed once more on
        # profiles of its own (not after that look's own change: no chain of looks).
        self._settling = reason != "settled"
        quick = self._since_change < self.patience * RECOVERY_STEPS
        if quick and self.history and best.plan == self.history[-1].old:
            self._backoff = min(2 * self._backoff, MAX_BACKOFF)
        self._quiet_steps = self._since_change = 0
        change = PlanChange(next_step, plan, best.plan, reason, current.step_s, best.step_s, band)
        self.history.append(change)
        _log.info(
            "vflow auto plan, step %d (%s): %s -> %s, predicted step %.4g s -> %.4g s (%.2fx; "
            "noise band %.2g s)",
            next_step,
            reason,
            plan,
            best.plan,
            current.step_s,
            best.step_s,
            decision.predicted_gain,
            band,
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


def resolve(plan: object) -> AutoPlan | None:
    """The automatic plan an executor's ``plan`` argument asks for: ``"auto"`` (the
    default settings) or an ``AutoPlan``; None for anything else (a fixed plan)."""
    if isinstance(plan, str):
        if plan != "auto":
            raise ValueError(
                f"plan must be a vflow.Plan, 'auto', a vflow.AutoPlan or None, got {plan!r}"
            )
        return AutoPlan()
    return plan if isinstance(plan, AutoPlan) else None
