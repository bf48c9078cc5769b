"""vflow.planning.auto_plan.AutoPlan: when it plans, re-plans and keeps a plan, from synthetic
profiles (the multi-rank runs are in tests/planning/test_heterogeneous.py)."""

from __future__ import annotations

from dataclasses import astuple

import pytest

from vflow.mapping.batching import split_sizes
from vflow.mapping.plan import Plan
from vflow.planning.auto_plan import LEARNED_WORDS, AutoPlan, Learned, from_words, to_words
from vflow.planning.profile import StepProfile, VNProfile, WorkerProfile

V, B = 12, 120


def _profile(plan: Plan, per_sample: list[float], step: int = 0, comm: float = 0.01) -> StepProfile:
    sizes = split_sizes(B, V)
    workers = []
    for w, cost in enumerate(per_sample):
        vns = tuple(VNProfile(vn, sizes[vn], 0.0, sizes[vn] * cost) for vn in plan.vns(w))
        compute = sum(v.backward_s for v in vns)
        workers.append(WorkerProfile(w, step, vns, compute, comm, 0.0, compute + comm))
    return StepProfile(step, tuple(workers))


def _started(auto: AutoPlan, plan: Plan, per_sample: list[float]) -> AutoPlan:
    """``auto`` after the first step's profile, which it does not use (one-time costs)."""
    assert auto.observe(_profile(plan, [10 * c for c in per_sample]), plan, B, 1) is None
    assert auto.decisions == []
    return auto


def test_plans_after_the_warmup_and_keeps_a_good_plan() -> None:
    even = Plan.even(V, 2)
    auto = _started(AutoPlan(warmup=2), even, [1e-3, 2e-3])
    assert auto.observe(_profile(even, [1e-3, 2e-3]), even, B, 1) is None
    new = auto.observe(_profile(even, [1e-3, 2e-3]), even, B, 2)
    assert new == Plan(counts=[8, 4])
    (change,) = auto.history
    assert (change.step, change.reason, change.old, change.new) == (2, "profiled", even, new)
    assert change.predicted_old_s / change.predicted_new_s == pytest.approx(
        (60 * 2e-3 + 0.01) / (80 * 1e-3 + 0.01),
        rel=1e-9,  # slowest compute + comm
    )
    for step in range(3, 10):  # speeds as predicted: no change
        assert auto.observe(_profile(new, [1e-3, 2e-3], step), new, B, step + 1) is None
    assert len(auto.history) == 1


def test_a_straggler_is_replanned_after_patience_drifting_steps() -> None:
    plan = Plan.even(V, 2)
    auto = _started(AutoPlan(warmup=2, patience=2), plan, [1e-3, 1e-3])
    for step in range(2):
        plan = auto.observe(_profile(plan, [1e-3, 1e-3]), plan, B, step + 1) or plan
    assert plan == Plan.even(V, 2) and auto.history == []  # equal speeds: even is best
    decided = []
    for step in range(2, 10):
        speeds = [1e-3, 1e-3] if step < 5 else [1e-3, 3e-3]  # worker 1 slows 3x at step 5
        new = auto.observe(_profile(plan, speeds, step), plan, B, step + 1)
        if new is not None:
            decided.append(step + 1)
            plan = new
    assert decided == [7]  # steps 5 and 6 drift; runs under the new plan from step 7
    assert plan == Plan(counts=[9, 3])
    assert auto.history[-1].reason == "drift"


def test_small_gains_are_refused_and_foreign_profiles_ignored() -> None:
    even = Plan.even(V, 2)
    auto = _started(AutoPlan(warmup=1, min_gain=0.2), even, [1e-3, 1e-3])
    assert auto.observe(_profile(even, [1e-3, 1.2e-3]), even, B, 1) is None  # ~9 % only
    other = Plan(counts=[4, 8])
    fresh = _started(AutoPlan(warmup=1), even, [1e-3, 1e-3])
    assert fresh.observe(_profile(other, [1e-3, 2e-3]), even, B, 1) is None  # not this plan
    assert fresh.history == []


def test_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="kind must be 'counts' or 'sizes'"):
        AutoPlan("fast")
    with pytest.raises(ValueError, match="warmup must be an int >= 1"):
        AutoPlan(warmup=0)
    with pytest.raises(ValueError, match="threshold must be a number"):
        AutoPlan(threshold=-1)
    with pytest.raises(ValueError, match=r"max_vn_size\[1\] must be an int >= 1 or None"):
        AutoPlan(max_vn_size=[None, 0])
    with pytest.raises(ValueError, match="deterministic mode"):
        AutoPlan("sizes").check(deterministic=True, world_size=2)
    with pytest.raises(ValueError, match="has 1 entries but the process group has 2"):
        AutoPlan(max_vn_size=[8]).check(deterministic=False, world_size=2)


def test_sizes_plans_balance_when_v_equals_w() -> None:
    auto = AutoPlan("sizes", warmup=1)
    even = Plan.even(2, 2)
    sizes = split_sizes(B, 2)
    profile = lambda: StepProfile(  # noqa: E731
        0,
        tuple(
            WorkerProfile(w, 0, (VNProfile(w, sizes[w], 0.0, sizes[w] * c),), 0.0, 0.0, 0.0, 0.0)
            for w, c in enumerate([1e-3, 2e-3])
        ),
    )
    assert auto.observe(profile(), even, B, 1) is None  # the first step: one-time costs
    new = auto.observe(profile(), even, B, 2)
    assert new is not None and new.sizes == ((80,), (40,))


def test_returning_to_the_plan_just_left_backs_off_and_quiet_steps_recover() -> None:
    from vflow.planning.auto_plan import MAX_BACKOFF, RECOVERY_STEPS

    plan = Plan.even(V, 2)
    auto = _started(AutoPlan(warmup=1, patience=2), plan, [1e-3, 1e-3])
    step = 0

    def run(speeds: list[float], steps: int) -> list[int]:
        """Observes ``steps`` steps at ``speeds``; the steps whose profile changed the plan."""
        nonlocal plan, step
        changed = []
        for _ in range(steps):
            new = auto.observe(_profile(plan, speeds, step), plan, B, step + 1)
            if new is not None:
                changed.append(step)
                plan = new
            step += 1
        return changed

    slow, equal = [1e-3, 2e-3], [1e-3, 1e-3]
    assert run(slow, 1) == [0] and plan == Plan(counts=[8, 4])
    assert run(slow, 2 * RECOVERY_STEPS) == []  # speeds as predicted: no change
    # Worker 1 speeds up: seen although it is not the slowest; long after the last
    # change, so going back to the even plan is a change of speed, not noise.
    assert run(equal, 2) == [2 * RECOVERY_STEPS + 2] and plan == Plan.even(V, 2)
    assert auto.drift_patience == 2
    assert run(slow, 2) == [2 * RECOVERY_STEPS + 4] and plan == Plan(counts=[8, 4])
    assert auto.drift_patience == 4  # straight back to the plan just left: noise
    assert run(equal, 3) == [] and run(equal, 1) == [2 * RECOVERY_STEPS + 8]
    assert auto.drift_patience == 8
    assert run(slow, 7) == [] and run(slow, 1) != []
    assert auto.drift_patience == 2 * MAX_BACKOFF  # the cap
    assert run(equal, 16) != [] and auto.drift_patience == 2 * MAX_BACKOFF
    # Quiet steps halve the back-off, down to the plain patience.
    assert run(equal, 2 * RECOVERY_STEPS) == [] and auto.drift_patience == MAX_BACKOFF
    assert run(equal, 3 * 2 * RECOVERY_STEPS) == [] and auto.drift_patience == 2


def _noisy(plan: Plan, per_sample: list[float], step: int, jitter_s: float) -> StepProfile:
    """A profile whose step time is ``jitter_s`` longer on odd steps: noise that the
    compute does not show (a busy machine's waits)."""
    profile = _profile(plan, per_sample, step)
    extra = jitter_s if step % 2 else 0.0
    workers = tuple(
        WorkerProfile(w.rank, step, w.vns, w.compute_s, w.exposed_comm_s + extra, 0.0,
                      w.step_s + extra)
        for w in profile.workers
    )  # fmt: skip
    return StepProfile(step, workers)


def test_a_gain_within_the_noise_band_keeps_the_plan_and_says_so() -> None:
    even = Plan.even(V, 2)
    # Worker 1 1.5x slower: [7, 5] saves 0.015 s of a 0.125 s step (12 %), but
    # consecutive steps differ by 0.05 s.
    speeds = [1e-3, 1.5e-3]
    auto = _started(AutoPlan(warmup=4), even, speeds)
    for step in range(1, 1 + 4 * 4 + 4):
        assert auto.observe(_noisy(even, speeds, step, 0.05), even, B, step + 1) is None
    assert auto.history == []
    assert [d.taken for d in auto.decisions] == [False, False, False]  # warmup x 1, 2, 4
    last = auto.decisions[-1]
    assert last.proposed == Plan(counts=[7, 5]) and last.current == even
    assert last.predicted_gain > 1.05  # above min_gain: the noise is what refuses it
    assert last.predicted_current_s - last.predicted_proposed_s < last.noise_band_s
    assert "within the noise band" in last.describe()


def test_a_refused_gain_is_weighed_again_on_more_steps_where_the_band_is_narrower() -> None:
    even = Plan.even(V, 2)
    speeds = [1e-3, 2e-3]  # [8, 4] saves 0.04 s per step
    auto = _started(AutoPlan(warmup=2), even, speeds)
    taken_at = None
    for step in range(1, 12):
        new = auto.observe(_noisy(even, speeds, step, 0.03), even, B, step + 1)
        if new is not None:
            taken_at = step + 1
            break
    # The band is 2 * 1.4826 * 0.03 / sqrt(2) * sqrt(2 / n): 0.063 s on 2 profiles,
    # 0.044 s on 4, 0.031 s on 8: the first two looks refuse, the last takes it.
    assert [d.taken for d in auto.decisions] == [False, False, True]
    assert taken_at == 9 and auto.history[0].new == Plan(counts=[8, 4])
    assert auto.history[0].noise_band_s == auto.decisions[-1].noise_band_s


def test_the_fixed_part_of_a_step_weighs_the_gain() -> None:
    even = Plan.even(V, 2)
    speeds = [1e-3, 1.3e-3]  # [7, 5] saves 0.0134 s of compute
    for fixed, changes in ((0.0, 1), (0.5, 0)):  # 0.5 s not compute: the gain is < 5 %
        auto = _started(AutoPlan(warmup=2), even, speeds)
        for step in range(1, 4):
            auto.observe(_profile(even, speeds, step, comm=fixed), even, B, step + 1)
        assert len(auto.history) == changes
        assert auto.decisions[0].predicted_current_s == pytest.approx(60 * 1.3e-3 + fixed)


def test_one_process_warns_that_there_is_nothing_to_plan() -> None:
    with pytest.warns(UserWarning, match="single process: there is one worker"):
        AutoPlan().check(deterministic=True, world_size=1)


def test_a_new_plan_is_weighed_once_more_on_its_own_profiles() -> None:
    even = Plan.even(V, 2)
    auto = _started(AutoPlan(warmup=2), even, [1e-3, 2e-3])
    plan, changed = even, []
    for step in range(1, 12):
        # Under a balanced plan worker 1 is 3x slower, not 2x as while worker 0 idled.
        speeds = [1e-3, 2e-3] if plan == even else [1e-3, 3e-3]
        new = auto.observe(_profile(plan, speeds, step), plan, B, step + 1)
        if new is not None:
            changed.append((step + 1, new.counts))
            plan = new
    # [8, 4] from the even plan's speeds; three profiles of it later (as many as the
    # drift rule's patience), [9, 3]; then no further look (that change was the look's).
    assert changed == [(3, (8, 4)), (6, (9, 3))]
    assert [c.reason for c in auto.history] == ["profiled", "settled"]
    assert [d.reason for d in auto.decisions] == ["profiled", "settled"]


def test_a_refused_settled_look_is_weighed_again_on_more_profiles() -> None:
    even = Plan.even(V, 2)
    auto = _started(AutoPlan(warmup=2), even, [1e-3, 2e-3])
    plan, changed = even, []
    for step in range(1, 20):
        if plan == even:
            profile = _profile(plan, [1e-3, 2e-3], step)
        else:  # worker 1 is 3x slower under [8, 4], and its steps are noisy
            profile = _noisy(plan, [1e-3, 3e-3], step, 0.03)
        new = auto.observe(profile, plan, B, step + 1)
        if new is not None:
            changed.append((step + 1, new.counts))
            plan = new
    # [9, 3] would save 0.03 s a step: within the band on 3 and 6 profiles of [8, 4],
    # beyond it on 12, where the band is narrower.
    assert changed == [(3, (8, 4)), (15, (9, 3))]
    assert [(d.reason, d.taken) for d in auto.decisions] == [
        ("profiled", True),
        ("settled", False),
        ("settled", False),
        ("settled", True),
    ]
    assert [c.reason for c in auto.history] == ["profiled", "settled"]


# ---- across worker sets (Note [Plans across worker sets]) ----------------------------


def _learned_on(speeds: list[float], warmup: int = 2) -> AutoPlan:
    """An AutoPlan that profiled ``warmup`` steps of workers at ``speeds`` on the even
    plan, quiet (no noise), and took whatever plan that implied."""
    plan = Plan.even(V, len(speeds))
    auto = _started(AutoPlan(warmup=warmup), plan, speeds)
    for step in range(1, warmup + 1):
        plan = auto.observe(_profile(plan, speeds, step), plan, B, step + 1) or plan
    return auto


def test_a_worker_set_learns_each_worker_after_its_warmup() -> None:
    plan = Plan.even(V, 2)
    auto = _started(AutoPlan(warmup=2), plan, [1e-3, 3e-3])
    assert auto.observe(_profile(plan, [1e-3, 3e-3], 1), plan, B, 2) is None
    assert auto.learned(1) is None  # one profile: a warm-up cut short says too little
    auto.observe(_profile(plan, [1e-3, 3e-3], 2), plan, B, 3)
    slow = auto.learned(1)
    fast = auto.learned(0)
    assert slow is not None and fast is not None
    # Per sample (one VN size: no per-VN part), the comm as the fixed part, no noise.
    assert astuple(slow) == pytest.approx((0.0, 3e-3, 0.01, 0.0, 2))
    assert astuple(fast) == pytest.approx((0.0, 1e-3, 0.01, 0.0, 2))
    # It travels as int64 words, every float bit for bit.
    assert from_words(to_words(slow)) == slow and len(to_words(slow)) == LEARNED_WORDS
    assert from_words(to_words(None)) is None
    with pytest.raises(ValueError, match="words must hold 5 ints, got 2"):
        from_words((1, 2))
    with pytest.raises(ValueError, match="noise_s must be finite and >= 0"):
        Learned(1e-3, 1e-3, 0.0, -1.0, 2)
    with pytest.raises(ValueError, match="profiles must be >= 1"):
        Learned(1e-3, 1e-3, 0.0, 0.0, 0)
    with pytest.raises(TypeError, match=r"brought\[1\] must be a vflow.planning.auto_plan"):
        auto.carry([slow, "fast"])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="rank must be < 2, the workers profiled"):
        auto.learned(2)


def test_a_shrink_plans_at_once_from_what_the_workers_that_stayed_brought() -> None:
    old = _learned_on([1e-3, 3e-3, 1e-3])
    before = len(old.decisions)
    # Old rank 0 left: old 1 (slow) is rank 0 of the new set, old 2 rank 1.
    brought = [old.learned(1), old.learned(2)]
    # The stayers' planners carry it, and so would a newcomer's (a fresh one): the
    # same table, the same planner, the same decisions.
    fresh = AutoPlan(warmup=2)
    even = Plan.even(V, 2)
    for auto in (old, fresh):
        auto.carry(brought)
        assert auto.learned(0) == brought[0] and auto.learned(1) == brought[1]  # remapped
        # On the new set's first step, which has no profile yet: 3x slower at 10
        # samples a VN, [3, 9] balances (0.09 s each).
        assert auto.observe(None, even, B, 5) == Plan(counts=[3, 9])
    assert old.decisions[before:] == fresh.decisions
    (carried,) = fresh.decisions
    assert (carried.step, carried.reason, carried.taken) == (5, "carried", True)
    assert carried.predicted_current_s == pytest.approx(6 * 0.03 + 0.01)
    assert [c.reason for c in old.history][-1] == "carried"  # history goes on
    # No fresh warm-up: the first step ran under the even plan (ignored), and three
    # profiles of [3, 9] (the drift rule's patience) settle it.
    plan, speeds = Plan(counts=[3, 9]), [3e-3, 1e-3]
    for auto in (old, fresh):
        assert auto.observe(_profile(even, speeds, 4), plan, B, 6) is None
        for step in range(5, 8):
            assert auto.observe(_profile(plan, speeds, step), plan, B, step + 1) is None
    assert [(d.reason, d.proposed) for d in fresh.decisions] == [
        ("carried", plan),
        ("settled", plan),  # speeds as brought: nothing better
    ]
    assert old.decisions[before:] == fresh.decisions


def test_a_grow_plans_newcomers_at_the_median_then_profiles_the_new_set() -> None:
    old = _learned_on([1e-3, 3e-3])
    # Rank 0 of the new set is old rank 1 (slow), rank 1 a newcomer, rank 2 old rank 0.
    brought = [old.learned(1), None, old.learned(0)]
    auto = AutoPlan(warmup=2)
    auto.carry(brought)
    assert (auto.learned(0), auto.learned(1), auto.learned(2)) == tuple(brought)
    even = Plan.even(V, 3)
    # The newcomer is assumed as fast as the lower median of the two (old rank 0): at
    # 10 samples a VN the slowest predicted compute is 0.06 s (the slow worker's 2 VNs
    # or a fast worker's 6), not the even plan's 0.12 s.
    plan = auto.observe(None, even, B, 5)
    assert plan is not None and plan.counts[0] <= 2
    assert auto.decisions[0].predicted_proposed_s == pytest.approx(0.06 + 0.01)
    assert plan.sizes is None  # kind="counts": deterministic mode's kind still holds
    # The newcomer turns out 2x slower than assumed: after the warm-up on profiles of
    # the new set (the first step's, under the even plan, ignored) it gets fewer VNs.
    speeds = [3e-3, 2e-3, 1e-3]
    assert auto.observe(_profile(even, speeds, 4), plan, B, 6) is None
    assert auto.observe(_profile(plan, speeds, 5), plan, B, 7) is None
    profiled = auto.observe(_profile(plan, speeds, 6), plan, B, 8)
    assert profiled is not None and profiled.counts[1] < profiled.counts[2]
    assert [(d.step, d.reason) for d in auto.decisions] == [(5, "carried"), (8, "profiled")]
    assert auto.learned(1) is not None  # now learned on the new set


def test_with_nothing_brought_a_new_set_profiles_from_scratch() -> None:
    auto = AutoPlan(warmup=2)
    auto.carry([None, None])
    even = Plan.even(V, 2)
    assert auto.observe(None, even, B, 1) is None and auto.decisions == []
    assert auto.observe(_profile(even, [1e-3, 2e-3], 0), even, B, 2) is None  # first: unused
    assert auto.observe(_profile(even, [1e-3, 2e-3], 1), even, B, 3) is None
    assert auto.observe(_profile(even, [1e-3, 2e-3], 2), even, B, 4) == Plan(counts=[8, 4])
    assert [d.reason for d in auto.decisions] == ["profiled"]
    # A hand-set plan (set_plan's reset) before the set's first step: weighed from
    # its own profiles, not from what was brought.
    hand = AutoPlan(warmup=2)
    hand.carry([Learned(0.0, 1e-3, 0.0, 0.0, 2), Learned(0.0, 2e-3, 0.0, 0.0, 2)])
    hand.reset()
    assert hand.observe(None, even, B, 1) is None and hand.decisions == []


def test_what_a_rank_did_before_its_set_does_not_set_its_back_off() -> None:
    # The old set changed even -> [8, 4]: a change back to even soon is a return.
    old = _learned_on([1e-3, 2e-3])
    assert [(c.old, c.new) for c in old.history] == [(Plan.even(V, 2), Plan(counts=[8, 4]))]
    # A worker replaced by an equally fast one: the new set starts on [8, 4] and the
    # carried plan is even, the plan the old set left, which the stayer remembers and
    # the newcomer cannot: both must decide alike, so it is no return.
    brought = [old.learned(0), None]
    fresh = AutoPlan(warmup=2)
    for auto in (old, fresh):
        auto.carry(brought)
        assert auto.observe(None, Plan(counts=[8, 4]), B, 5) == Plan.even(V, 2)
        assert auto.drift_patience == auto.patience
