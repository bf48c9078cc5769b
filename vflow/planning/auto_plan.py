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
* A change of worker set keeps what was learned about the workers that stayed (Note
  [Plans across worker sets], below).

``Executor.plan_history`` lists the changes with their predicted step times,
``Executor.plan_decisions`` every decision.

On one process there is one worker and nothing to plan: ``check`` warns, and the plan
stays ``[V]``.

Note [Plans across worker sets]
A worker's speed does not change when the worker set does, so what a set learned about
its workers goes with them to the next set (``Executor.reconfigure``: a grow, a shrink
after a crash or a leave) instead of being profiled again from scratch.

* What travels. Each worker brings ``learned(rank)`` about itself: its cost model
  (Note [The planner's model]) fitted on the last ``warmup`` profiles of its set (of
  any plan: a VN's cost does not depend on the plan), with that set's fixed part of a
  step, its step noise and how many profiles they were measured on (``Learned``).
  Nothing before the set has ``warmup`` profiles (a warm-up cut short says too little);
  then a worker still brings what it brought to that set, so that knowledge survives
  reconfigures in a row (a recovery retried). It travels as a few int64 words in the
  all-gather that every change of worker set already runs (Note [Joining a worker
  set], vflow/world/membership.py), so every rank of the new set — newcomers included,
  whose planner has seen nothing — reads the same table and ``carry`` sets every rank's
  planner alike: every per-set state is rebuilt from the table, none is kept from the
  rank's own past (not even the plan the last change left, which the back-off compares
  with), so the ranks go on deciding alike without an agreement round. A worker
  speaks only for itself, so nothing has to say which rank it had before, and workers
  from different previous sets cannot be confused.
* The first plan ("carried") is weighed on the new set's first step, the earliest one
  at which every rank holds the plan in force and the batch size: the workers that
  brought a model keep it, each newcomer is assumed as fast as the median of them
  (the lower median, a model that was measured), the fixed part and the noise are the
  (lower) medians of what was brought, and the proposal must beat the noise band on
  the number of profiles they came from, as any proposal does. A change runs from
  the next step that no rank has drawn ahead (Note [Plan changes wait for the data]).
* Then, when every worker brought a model (a shrink), the plan counts as planned and
  is weighed once more ("settled") on profiles of the new set, as after any change:
  the fixed part of a step and the contention of the new set are not the old one's;
  the drift rule watches from that look on. When newcomers came (a grow), their speeds
  are a guess: the new set profiles as a fresh one does and weighs the plan on
  ``warmup`` profiles of its own ("profiled"), every worker's speed measured anew.
* An executor that drops its broken group (``Executor.abort_group``, before the
  survivors form their set again) keeps what its planner learned: the crash's
  survivors bring it to their next set.
* The new set's first step pays one-time costs for every worker, stayers included (the
  new group's first collectives, the statistics' new layout, a newcomer's first
  allocations): its profile is not used, as on a fresh set. If the carried plan was
  taken, that step ran under the plan it replaced and its profile is ignored anyway.
* ``reset`` (``set_plan``) keeps its meaning: the same workers, profiled again from the
  hand-set plan. The pipeline executor does not carry: it starts over on a new grid.
"""

from __future__ import annotations

import logging
import math
import statistics
import struct
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
      again on profiles of the plan just taken), "drift" (speeds changed) or "carried"
      (a new worker set's first plan, from what its workers brought: Note [Plans across
      worker sets]).
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
    reason: "profiled" (after the warm-up), "settled" (on the plan just taken),
      "drift" (speeds changed) or "carried" (on a new worker set's first step, from
      what its workers brought).
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


@dataclass(frozen=True)
class Learned:
    """What a worker set's automatic planner learned about one of its workers, which the
    worker brings to its next set (Note [Plans across worker sets]).

    per_vn_s / per_sample_s: the worker's cost model (``planner.WorkerModel``).
    fixed_s: the set's fixed part of a step (``planner.fixed_step_s``).
    noise_s: the set's step-time noise (``planner.step_noise_s``).
    profiles: how many profiles the model was fitted on.
    """

    per_vn_s: float
    per_sample_s: float
    fixed_s: float
    noise_s: float
    profiles: int

    def __post_init__(self) -> None:
        for name in ("per_vn_s", "per_sample_s", "fixed_s", "noise_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"{name} must be a float, got {type(value).__name__}")
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be finite and >= 0, got {value!r}")
        if isinstance(self.profiles, bool) or not isinstance(self.profiles, int):
            raise TypeError(f"profiles must be an int, got {type(self.profiles).__name__}")
        if self.profiles < 1:
            raise ValueError(f"profiles must be >= 1, got {self.profiles}")

    def model(self, max_vn_size: int | None = None) -> planner.WorkerModel:
        return planner.WorkerModel(self.per_vn_s, self.per_sample_s, max_vn_size)


# Note [Plans across worker sets]: a Learned as int64 words in the join's all-gather:
# its profile count (0: nothing learned), then its four floats' IEEE 754 bits.
LEARNED_WORDS = 5


def to_words(learned: Learned | None) -> tuple[int, ...]:
    """``learned`` as LEARNED_WORDS int64 words (all 0 for None)."""
    if learned is None:
        return (0,) * LEARNED_WORDS
    floats = (learned.per_vn_s, learned.per_sample_s, learned.fixed_s, learned.noise_s)
    return (learned.profiles, *struct.unpack("<4q", struct.pack("<4d", *floats)))


def from_words(words: Sequence[int]) -> Learned | None:
    """The Learned that ``to_words`` wrote into ``words``, or None."""
    if len(words) != LEARNED_WORDS:
        raise ValueError(f"words must hold {LEARNED_WORDS} ints, got {len(words)}: {words!r}")
    if words[0] == 0:
        return None
    floats = struct.unpack("<4d", struct.pack("<4q", *words[1:]))
    return Learned(*floats, profiles=int(words[0]))


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
        # The plan the last change of this worker set left: a change back to it soon is
        # noise (the back-off). Per set, so that every rank of a set holds the same one
        # (a newcomer has no history of the sets before).
        self._left: Plan | None = None
        # Note [Plans across worker sets]: what each worker of this set brought from its
        # previous one, and whether the set's first step is still to weigh it.
        self._brought: tuple[Learned | None, ...] = ()
        self._weigh_brought = False

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
        """Forgets the profiles and profiles again from the plan in force (a hand-set
        plan: ``set_plan``)."""
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
        self._weigh_brought = False

    def carry(self, brought: Sequence[Learned | None]) -> None:
        """Starts a new worker set whose rank w brought ``brought[w]`` from its previous
        set (``learned`` there; None: nothing, a newcomer). Note [Plans across worker
        sets]: the same ``brought`` leaves every rank's planner in the same state,
        whatever it learned before; with nothing brought, the set profiles from
        scratch. ``history`` and ``decisions`` go on."""
        if isinstance(brought, (str, bytes)) or not isinstance(brought, Sequence):
            raise TypeError(
                f"brought must be a sequence of Learned or None, got {type(brought).__name__}"
            )
        for w, item in enumerate(brought):
            if item is not None and not isinstance(item, Learned):
                raise TypeError(
                    f"brought[{w}] must be a vflow.planning.auto_plan.Learned or None, got "
                    f"{type(item).__name__}"
                )
        self.reset()
        self._left = None
        self._brought = tuple(brought)
        self._weigh_brought = any(item is not None for item in brought)

    def learned(self, rank: int) -> Learned | None:
        """What this worker set learned about its worker ``rank``, for it to bring to its
        next set (Note [Plans across worker sets]): fitted on the last ``warmup``
        profiles once there are that many; before, what the worker brought to this set."""
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
            raise ValueError(f"rank must be an int >= 0, got {rank!r}")
        wanted = min(self.warmup, NOISE_WINDOW)
        if len(self._noise_window) < wanted:
            return self._brought[rank] if rank < len(self._brought) else None
        profiles = list(self._noise_window)[-wanted:]
        workers = len(profiles[0].workers)
        if rank >= workers:
            raise ValueError(f"rank must be < {workers}, the workers profiled, got {rank}")
        model = planner.models_from_profiles(profiles)[rank]
        return Learned(
            model.per_vn_s,
            model.per_sample_s,
            planner.fixed_step_s(profiles),
            planner.step_noise_s(list(self._noise_window)),
            len(profiles),
        )

    @property
    def drift_patience(self) -> int:
        """Drifting steps in a row that trigger a re-plan now: ``patience`` times the
        back-off of Note [Automatic plans]."""
        return self.patience * self._backoff

    def observe(
        self,
        profile: StepProfile | None,
        plan: Plan,
        batch_size: int,
        next_step: int,
        min_vns: int = 1,
    ) -> Plan | None:
        """Takes every worker's profile of a step, or None after a worker set's first
        step, which has none yet (Note [Profiles]); returns the plan to run from
        ``next_step`` on, or None to keep ``plan``. Plans give every worker at least
        ``min_vns`` VNs."""
        self._min_vns = min_vns
        if self._weigh_brought:
            self._weigh_brought = False
            return self._weigh_carried(profile, plan, batch_size, next_step)
        if profile is None or not _ran(profile, plan, batch_size):
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

    def _weigh_carried(
        self, profile: StepProfile | None, plan: Plan, batch_size: int, next_step: int
    ) -> Plan | None:
        """Note [Plans across worker sets]: the new set's first plan, from what its
        workers brought; a newcomer is assumed as fast as the median worker that brought
        a model. ``profile``, if any, is the set's first (one-time costs): not used."""
        brought = self._brought
        if len(brought) != plan.num_workers:
            return None  # not this set's plan: profile from scratch
        known = [item for item in brought if item is not None]
        size = max(1, batch_size // plan.virtual_nodes)
        # The lower median by the cost of a VN at the current size: a model measured.
        ranked = sorted(known, key=lambda item: (item.model().seconds(1, size), item.per_vn_s))
        median = ranked[(len(ranked) - 1) // 2]
        caps = self.max_vn_size or [None] * len(brought)
        models = [
            (median if item is None else item).model(cap)
            for item, cap in zip(brought, caps, strict=True)
        ]
        new = self._weigh(
            models,
            statistics.median_low(item.fixed_s for item in known),
            statistics.median_low(item.noise_s for item in known),
            min(item.profiles for item in known),
            plan,
            batch_size,
            next_step,
            "carried",
        )
        # Stayers only: planned, to be weighed again on the new set's own profiles.
        # With newcomers: their speeds are a guess, so the set profiles as a fresh one.
        self._planned = self._settling = len(known) == len(brought)
        # The first step's profile, not used: the one given now, or, if the plan stays,
        # the one the next step brings (a change makes it another plan's).
        self._seen_first = new is not None or profile is not None
        return new

    def _decide(
        self, profiles: list[StepProfile], plan: Plan, batch_size: int, next_step: int, reason: str
    ) -> Plan | None:
        return self._weigh(
            planner.models_from_profiles(profiles, self.max_vn_size),
            planner.fixed_step_s(profiles),
            # Measured on the last NOISE_WINDOW profiles: a drift's window of a few
            # steps says little about it.
            planner.step_noise_s(list(self._noise_window)),
            len(profiles),
            plan,
            batch_size,
            next_step,
            reason,
        )

    def _weigh(
        self,
        models: list[planner.WorkerModel],
        fixed: float,
        noise_s: float,
        evidence: int,
        plan: Plan,
        batch_size: int,
        next_step: int,
        reason: str,
    ) -> Plan | None:
        """The model's best plan against ``plan``, taken when its saving beats the
        noise band on ``evidence`` profiles (Note [Automatic plans])."""
        current = planner.predict(plan, models, batch_size, fixed)
        if self.kind == "counts":
            best = planner.plan_counts(models, plan.virtual_nodes, batch_size, fixed, self._min_vns)
        else:
            best = planner.plan_sizes(models, plan.virtual_nodes, batch_size, fixed)
        # The standard error of the difference of two step times averaged over
        # ``evidence`` profiles: what comparing two plans measured for that long could
        # not resolve.
        noise = noise_s * math.sqrt(2 / evidence)
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
        if quick and best.plan == self._left:
            self._backoff = min(2 * self._backoff, MAX_BACKOFF)
        self._left = plan
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
