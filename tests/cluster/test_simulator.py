"""vflow.cluster.simulator against closed forms (zero costs unless a test charges them),
and its invariants on generated workloads."""

from __future__ import annotations

from typing import Any

import pytest

from vflow.cluster.policies import POLICIES, get_policy
from vflow.cluster.simulator import MEASURED, Costs, simulate
from vflow.cluster.trace import parse_trace
from vflow.cluster.workload import VIRTUALFLOW, generate

FREE = Costs(0.0, 0.0, 0.0, 0.0)
ELASTIC = ["wfs", "wfs-any"]
STATIC = ["priority", "las"]


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
    assert result["avg_jct_s"] == pytest.approx(expected, rel=0.01)
    assert result["jobs"][0]["start_s"] == 3.0  # a free cluster starts it at once
    assert result["makespan_s"] == pytest.approx(expected, rel=0.01)


@pytest.mark.parametrize("name", ELASTIC + STATIC)
def test_two_equal_jobs_ten_seconds_apart(name: str) -> None:
    trace = parse_trace({"slots": 4, "jobs": [job("a", 0.0, 4), job("b", 10.0, 4)]})
    result = simulate(trace, POLICIES[name], FREE)
    if name in STATIC:
        # b waits for a (0-25 s), then runs 25 s: JCTs 25 and 40
        assert jcts(result) == pytest.approx({"a": 25.0, "b": 40.0}, rel=0.01)
        assert result["jobs"][1]["start_s"] == pytest.approx(25.0)
    else:
        # a: 40 steps alone in 10 s, then 2 workers each: a's 60 steps take 30 s (ends at
        # 40), b's 60 too; b's last 40 steps alone on 4 workers: 10 s (ends at 50)
        assert jcts(result) == pytest.approx({"a": 40.0, "b": 40.0}, rel=0.01)
        assert result["jobs"][1]["start_s"] == 10.0


def test_priorities_are_respected() -> None:
    jobs = [job("first", 0.0, 4), job("low", 1.0, 4, priority=1), job("high", 2.0, 4, priority=10)]
    trace = parse_trace({"slots": 4, "jobs": jobs})
    static = simulate(trace, POLICIES["priority"], FREE)
    starts = {record["name"]: record["start_s"] for record in static["jobs"]}
    assert starts == pytest.approx({"first": 0.0, "high": 25.0, "low": 50.0})
    assert jcts(static) == pytest.approx({"first": 25.0, "high": 48.0, "low": 74.0}, rel=0.01)
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
    assert jcts(result) == pytest.approx({"a": 45.0, "b": 46.5}, rel=0.01)
    kinds = [(r["kind"], r["from"], r["to"]) for r in result["jobs"][1]["resizes"]]
    assert kinds == [("start", 0, 2), ("grow", 2, 4)]
    static = simulate(trace, POLICIES["priority"], costs)
    assert jcts(static) == pytest.approx({"a": 27.0, "b": 44.0}, rel=0.01)


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
    assert jcts(result) == pytest.approx({"old": 115.0, "new": 10.0}, rel=0.01)
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
