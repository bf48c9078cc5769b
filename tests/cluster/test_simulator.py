"""vflow.cluster.simulator against closed forms (zero costs unless a test charges them),
and its invariants on generated workloads."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from vflow.cluster.policies import POLICIES, get_policy
from vflow.cluster.simulator import MEASURED, Costs, simulate
from vflow.cluster.trace import parse_trace
from vflow.cluster.workload import VIRTUALFLOW, generate

FREE = Costs(0.0, 0.0, 0.0, 0.0)
ELASTIC = ["wfs", "wfs-any"]
STATIC = ["priority", "las"]
# The closed forms below are exact (sums of binary fractions): a tolerance that lets no
# change of the simulator's arithmetic through.
TIGHT = 1e-9


def job(name: str, arrival_s: float, demand: int, priority: float = 1, **changes: Any) -> dict:
    record = {
        "name": name,
        "arrival_s": arrival_s,
        "demand": demand,
        "priority": priority,
        "virtual_nodes": 8,
        "steps": 100,
        "step_s": {"1": 1.0, "2": 0.5, "4": 0.25, "8": 0.125},  # linear scaling
    }
    record.update(changes)
    return record


def jcts(result: dict) -> dict[str, float]:
    return {record["name"]: record["jct_s"] for record in result["jobs"]}


@pytest.mark.parametrize("name", ELASTIC + STATIC)
def test_one_job_alone_on_a_larger_cluster(name: str) -> None:
    trace = parse_trace({"slots": 16, "jobs": [job("a", 3.0, 2)]})
    result = simulate(trace, POLICIES[name], FREE)
    # elastic: all of V = 8 workers, 100 steps x 0.125 s; static: its demand of 2
    expected = 12.5 if name in ELASTIC else 50.0
    assert result["avg_jct_s"] == pytest.approx(expected, rel=TIGHT)
    assert result["jobs"][0]["start_s"] == 3.0  # a free cluster starts it at once
    assert result["makespan_s"] == pytest.approx(expected, rel=TIGHT)


@pytest.mark.parametrize("name", ELASTIC + STATIC)
def test_two_equal_jobs_ten_seconds_apart(name: str) -> None:
    trace = parse_trace({"slots": 4, "jobs": [job("a", 0.0, 4), job("b", 10.0, 4)]})
    result = simulate(trace, POLICIES[name], FREE)
    if name in STATIC:
        # b waits for a (0-25 s), then runs 25 s: JCTs 25 and 40
        assert jcts(result) == pytest.approx({"a": 25.0, "b": 40.0}, rel=TIGHT)
        assert result["jobs"][1]["start_s"] == pytest.approx(25.0)
    else:
        # a: 40 steps alone in 10 s, then 2 workers each: a's 60 steps take 30 s (ends at
        # 40), b's 60 too; b's last 40 steps alone on 4 workers: 10 s (ends at 50)
        assert jcts(result) == pytest.approx({"a": 40.0, "b": 40.0}, rel=TIGHT)
        assert result["jobs"][1]["start_s"] == 10.0


def test_priorities_are_respected() -> None:
    jobs = [job("first", 0.0, 4), job("low", 1.0, 4, priority=1), job("high", 2.0, 4, priority=10)]
    trace = parse_trace({"slots": 4, "jobs": jobs})
    static = simulate(trace, POLICIES["priority"], FREE)
    starts = {record["name"]: record["start_s"] for record in static["jobs"]}
    assert starts == pytest.approx({"first": 0.0, "high": 25.0, "low": 50.0})
    assert jcts(static) == pytest.approx({"first": 25.0, "high": 48.0, "low": 74.0}, rel=TIGHT)
    # elastic: from 2 s on, high (priority 10) holds 4 x 10/12 -> 2 (power of two) and
    # the other two 1 each (wfs-any: 3, and 1 for the oldest low-priority job): high ends
    # first of the late arrivals
    for name in ELASTIC:
        ends = {r["name"]: r["end_s"] for r in simulate(trace, POLICIES[name], FREE)["jobs"]}
        assert ends["high"] < ends["low"]


def test_costs_are_charged_as_time_without_progress() -> None:
    trace = parse_trace({"slots": 4, "jobs": [job("a", 0.0, 4), job("b", 10.0, 4)]})
    costs = Costs(start_s=2.0, grow_s=3.0, shrink_s=1.0, restart_s=0.0)
    result = simulate(trace, POLICIES["wfs"], costs)
    # a: starts (2 s), 32 steps at 0.25 s by 10 s; shrinks to 2 (1 s without progress);
    # b: starts on 2 (2 s). From 12 s both run at 2 workers (0.5 s a step): a has 68
    # steps left (ends at 11 + 34 = 45), b does 66 by 45, grows (3 s) and does its last
    # 34 at 0.25 s: 48 + 8.5 = 56.5
    assert jcts(result) == pytest.approx({"a": 45.0, "b": 46.5}, rel=TIGHT)
    kinds = [(r["kind"], r["from"], r["to"]) for r in result["jobs"][1]["resizes"]]
    assert kinds == [("start", 0, 2), ("grow", 2, 4)]
    static = simulate(trace, POLICIES["priority"], costs)
    assert jcts(static) == pytest.approx({"a": 27.0, "b": 44.0}, rel=TIGHT)


def test_a_preempted_job_pays_the_restart() -> None:
    trace = parse_trace({"slots": 4, "jobs": [job("old", 0.0, 4), job("new", 50.0, 4, steps=40)]})
    policy = get_policy("las", las_thresholds_s=[100.0], interval_s=1000.0)
    result = simulate(trace, policy, Costs(0.0, 0.0, 0.0, restart_s=5.0))
    # old: 4 workers x 25 s = 100 worker-seconds at 25 s: done before new arrives
    assert jcts(result)["old"] == pytest.approx(25.0)
    long = parse_trace(
        {"slots": 4, "jobs": [job("old", 0.0, 4, steps=400), job("new", 50.0, 4, steps=40)]}
    )
    result = simulate(long, policy, Costs(0.0, 0.0, 0.0, restart_s=5.0))
    # old passed 100 worker-seconds at 25 s: new preempts it at 50 s and runs 10 s; old
    # resumes at 60 s, pays 5 s and does its last 200 steps in 50 s
    assert jcts(result) == pytest.approx({"old": 115.0, "new": 10.0}, rel=TIGHT)
    old = result["jobs"][0]
    assert [r["kind"] for r in old["resizes"]] == ["start", "preempt", "restart"]


def test_generated_workloads_keep_the_invariants() -> None:
    shape = VIRTUALFLOW.scaled(jobs=60, slots=16, arrivals_per_hour=24)
    trace = generate(shape, seed=5)
    for name in POLICIES:
        result = simulate(trace, get_policy(name, las_thresholds_s=[1800.0]), MEASURED)
        assert len(result["jobs"]) == 60
        # the slots held at any time, rebuilt from the resizes, never exceed the cluster
        changes = sorted(
            (resize["t"], resize["to"] - resize["from"])
            for record in result["jobs"]
            for resize in record["resizes"]
        )
        ends = [(r["end_s"], -r["resizes"][-1]["to"]) for r in result["jobs"]]
        held = 0
        for _, delta in sorted(changes + ends, key=lambda c: (c[0], c[1])):
            held += delta
            assert 0 <= held <= trace.slots
        for record in result["jobs"]:
            assert record["start_s"] >= record["arrival_s"]
            assert record["end_s"] > record["start_s"]
        assert 0 < result["utilisation"] <= 1.0 + 1e-9
        assert result["p95_jct_s"] >= result["median_jct_s"]
    # elastic shares beat the static priority queue on this overloaded workload
    wfs = simulate(trace, POLICIES["wfs"], MEASURED)["avg_jct_s"]
    assert wfs < simulate(trace, POLICIES["priority"], MEASURED)["avg_jct_s"]


def test_a_start_pays_per_worker_on_top() -> None:
    trace = parse_trace({"slots": 8, "jobs": [job("a", 0.0, 2), job("b", 0.0, 8)]})
    costs = Costs(start_s=1.0, grow_s=0.0, shrink_s=0.0, restart_s=0.0, start_per_worker_s=0.5)
    result = simulate(trace, POLICIES["priority"], costs)
    # b (demand 8) waits for a; a: 1 + 2 x 0.5 = 2 s, then 100 steps at 0.5 s: ends at
    # 52; b: 1 + 8 x 0.5 = 5 s, then 12.5 s: JCT 52 + 17.5
    assert jcts(result) == pytest.approx({"a": 52.0, "b": 69.5})
    with pytest.raises(ValueError, match="start_per_worker_s must be a number of seconds >= 0"):
        Costs(start_per_worker_s=-1.0)


# Hand traces: each job's start, end and JCT worked out from Note [The simulator's model]
# and the policies' docstrings, so that a change to either fails here. job()'s step
# times scale linearly, so a job on w workers does w steps a second (w = 3 too: the
# throughput is interpolated between 2 and 4 workers, Note [Step time between the given
# counts]); every value below is exact in binary floating point, hence compared at TIGHT.


def course(result: dict) -> dict[str, tuple[float, float, float]]:
    """Each job's (start_s, end_s, jct_s)."""
    return {r["name"]: (r["start_s"], r["end_s"], r["jct_s"]) for r in result["jobs"]}


def resizes(result: dict) -> dict[str, list[tuple[float, str, int, int]]]:
    """Each job's worker changes as (time, kind, from, to)."""
    return {
        r["name"]: [(c["t"], c["kind"], c["from"], c["to"]) for c in r["resizes"]]
        for r in result["jobs"]
    }


def test_hand_trace_priority_does_not_backfill() -> None:
    jobs = [job("a", 0.0, 2), job("b", 5.0, 4), job("c", 10.0, 2)]
    trace = parse_trace({"slots": 4, "jobs": jobs})
    costs = Costs(start_s=1.0, grow_s=0.0, shrink_s=0.0, restart_s=0.0)
    result = simulate(trace, POLICIES["priority"], costs)
    # a: starts at 0 on its demand 2, pays the 1 s start, 100 steps at 2/s: ends at
    #    0 + 1 + 50 = 51, JCT 51.
    # b: arrives at 5 with 2 slots free, needs 4: waits for a; starts at 51, pays 1 s,
    #    100 steps at 4/s: ends at 51 + 1 + 25 = 77, JCT 77 - 5 = 72.
    # c: arrives at 10; 2 slots are free but b (same priority, earlier) heads the queue
    #    and nothing backfills: c starts when b ends, at 77: 77 + 1 + 50 = 128, JCT 118.
    assert course(result) == {
        "a": pytest.approx((0.0, 51.0, 51.0), rel=TIGHT),
        "b": pytest.approx((51.0, 77.0, 72.0), rel=TIGHT),
        "c": pytest.approx((77.0, 128.0, 118.0), rel=TIGHT),
    }
    assert result["avg_jct_s"] == pytest.approx((51 + 72 + 118) / 3, rel=TIGHT)
    assert result["makespan_s"] == pytest.approx(128.0, rel=TIGHT)
    assert result["resizes"] == 0


def test_hand_trace_las_demotes_at_a_tick_and_restarts() -> None:
    jobs = [job("a", 0.0, 4, steps=200), job("b", 5.0, 2, steps=30)]
    trace = parse_trace({"slots": 4, "jobs": jobs})
    policy = get_policy("las", las_thresholds_s=[40.0], interval_s=10.0)
    costs = Costs(start_s=1.0, grow_s=0.0, shrink_s=0.0, restart_s=3.0, start_per_worker_s=0.25)
    result = simulate(trace, policy, costs)
    # a: starts at 0 on 4 and pays 1 + 4 x 0.25 = 2 s. At 5 b arrives; a has 4 x 5 = 20
    #    worker-seconds < 40, so both are in queue 0 and a, the earlier, keeps the slots.
    #    At the tick at 10 a has 4 x 10 = 40: queue 1, behind b; b takes 2 and a (demand
    #    4) no longer fits: preempted at 10 with (10 - 2) x 4 = 32 of 200 steps done.
    # b: starts at 10 on 2, pays 1 + 2 x 0.25 = 1.5 s, 30 steps at 2/s: ends at
    #    10 + 1.5 + 15 = 26.5 (at the tick at 20 it has 2 x 10 = 20 < 40: still queue 0),
    #    JCT 21.5.
    # a: alone again at 26.5, restarts on 4 and pays 3 + 4 x 0.25 = 4 s, then its 168
    #    steps left at 4/s: ends at 26.5 + 4 + 42 = 72.5, JCT 72.5.
    assert course(result) == {
        "a": pytest.approx((0.0, 72.5, 72.5), rel=TIGHT),
        "b": pytest.approx((10.0, 26.5, 21.5), rel=TIGHT),
    }
    assert resizes(result) == {
        "a": [(0.0, "start", 0, 4), (10.0, "preempt", 4, 0), (26.5, "restart", 0, 4)],
        "b": [(10.0, "start", 0, 2)],
    }
    # held: a 4 x 10 + 4 x (72.5 - 26.5) = 224, b 2 x 16.5 = 33, over 4 slots x 72.5 s
    assert result["utilisation"] == pytest.approx((224 + 33) / (4 * 72.5), rel=TIGHT)


@pytest.mark.parametrize(
    ("b_arrives", "a_course"),
    [
        # At 5.25 a has done 10.5 steps: it suspends after step 11 (credited at once),
        # restarts when b ends at 10.25 and runs its 9 steps left: ends at 14.75.
        (5.25, (0.0, 14.75, 14.75)),
        # At 9.75 a is in its last step (19.5 of 20 done): it ends with it, at 10.0,
        # and is never restarted.
        (9.75, (0.0, 10.0, 10.0)),
    ],
)
def test_hand_trace_a_preempted_job_keeps_the_step_in_flight(
    b_arrives: float, a_course: tuple[float, float, float]
) -> None:
    jobs = [job("a", 0.0, 2, steps=20), job("b", b_arrives, 2, steps=10)]
    trace = parse_trace({"slots": 2, "jobs": jobs})
    policy = get_policy("las", las_thresholds_s=[5.0], interval_s=1000.0)
    result = simulate(trace, policy, FREE)
    # a: 2 steps a second from 0; b (queue 0) preempts it (queue 1) on arrival and runs
    # its 10 steps in 5 s.
    assert course(result) == {
        "a": pytest.approx(a_course, rel=TIGHT),
        "b": pytest.approx((b_arrives, b_arrives + 5.0, 5.0), rel=TIGHT),
    }
    kinds = [kind for _, kind, _, _ in resizes(result)["a"]]
    assert kinds == (["start", "preempt", "restart"] if b_arrives < 9 else ["start", "preempt"])


def test_hand_trace_a_start_waits_for_the_slots_a_preemption_releases_late() -> None:
    jobs = [job("a", 0.0, 4, steps=200), job("b", 5.0, 2, steps=30)]
    trace = parse_trace({"slots": 4, "jobs": jobs})
    policy = get_policy("las", las_thresholds_s=[10.0], interval_s=100.0)
    costs = Costs(start_s=8.0, grow_s=0.0, shrink_s=0.0, restart_s=3.0, release_s=2.0)
    result = simulate(trace, policy, costs)
    # a: starts at 0 on 4, paying 8 s. At 5 b arrives; a has 4 x 5 = 20 >= 10
    #    worker-seconds: queue 1, behind b, and preempted, while still starting: its
    #    slots are free 2 s after its start is done, at 8 + 2 = 10 (Note [Slots released
    #    late]).
    # b: no slot is free at 5, so it waits for a's until 10, then pays its 8 s start:
    #    30 steps at 2/s from 18, ends at 33, JCT 28.
    # a: at 33 b's slots are free at once (a job that ends holds none); a restarts
    #    without waiting and pays 3 s: 200 steps at 4/s from 36, ends at 86.
    assert course(result) == {
        "a": pytest.approx((0.0, 86.0, 86.0), rel=TIGHT),
        "b": pytest.approx((5.0, 33.0, 28.0), rel=TIGHT),
    }
    assert resizes(result)["a"] == [
        (0.0, "start", 0, 4),
        (5.0, "preempt", 4, 0),
        (33.0, "restart", 0, 4),
    ]
    # Without the late release, b starts at once: ends at 5 + 8 + 15 = 28.
    free = simulate(trace, policy, dataclasses.replace(costs, release_s=0.0))
    assert course(free)["b"] == pytest.approx((5.0, 28.0, 23.0), rel=TIGHT)
    with pytest.raises(ValueError, match="release_s must be a number of seconds >= 0"):
        Costs(release_s=-1.0)


@pytest.mark.parametrize("name", ELASTIC)
def test_hand_trace_weighted_shares_shrink_and_grow(name: str) -> None:
    jobs = [job("a", 0.0, 2), job("b", 10.0, 4, priority=2, steps=99)]
    trace = parse_trace({"slots": 4, "jobs": jobs})
    costs = Costs(start_s=1.0, grow_s=2.0, shrink_s=0.5, restart_s=0.0)
    result = simulate(trace, POLICIES[name], costs)
    # Both: a, alone at 0, is capped at its demand 2, then grows (step 4: up to V = 8)
    # to all 4 slots, paying the 1 s start; by 10 it has
    # done (10 - 1) x 4 = 36 steps. At 10 b (priority 2) arrives: exact shares
    # 4 x 2/3 = 2.67 for b and 4 x 1/3 = 1.33 for a, neither capped at its demand.
    if name == "wfs":
        # Powers of two (and the demand): b 2, a 1, and the spare slot cannot double b
        # (2 -> 4 needs 2), so it grows a to 2. a shrinks 4 -> 2 (0.5 s: progress from
        # 10.5), b starts on 2 (1 s: from 11).
        # a: 64 steps left at 2/s: ends at 10.5 + 32 = 42.5, JCT 42.5.
        # b: by 42.5 it has done (42.5 - 11) x 2 = 63 steps; alone, it grows 2 -> 4 (2 s)
        #    and does its last 36 at 4/s: ends at 42.5 + 2 + 9 = 53.5, JCT 43.5.
        expected = {"a": (0.0, 42.5, 42.5), "b": (10.0, 53.5, 43.5)}
        changes = {
            "a": [(0.0, "start", 0, 4), (10.0, "shrink", 4, 2)],
            "b": [(10.0, "start", 0, 2), (42.5, "grow", 2, 4)],
        }
    else:
        # Any count: b 2, a 1, and the spare slot grows b (higher priority) to 3. a shrinks
        # 4 -> 1 (0.5 s: progress from 10.5), b starts on 3 (1 s: from 11).
        # b: 99 steps at 3/s: ends at 11 + 33 = 44, JCT 34.
        # a: by 44 it has done 36 + (44 - 10.5) x 1 = 69.5 steps; alone, it grows 1 -> 4
        #    (2 s) and does its last 30.5 at 4/s: ends at 44 + 2 + 7.625 = 53.625.
        expected = {"a": (0.0, 53.625, 53.625), "b": (10.0, 44.0, 34.0)}
        changes = {
            "a": [(0.0, "start", 0, 4), (10.0, "shrink", 4, 1), (44.0, "grow", 1, 4)],
            "b": [(10.0, "start", 0, 3)],
        }
    assert course(result) == {k: pytest.approx(v, rel=TIGHT) for k, v in expected.items()}
    assert resizes(result) == changes
