"""vflow.cluster.policies: what each policy gives, by hand, and the rules every policy
keeps (pure, within the slots, work-conserving when elastic) over random states."""

from __future__ import annotations

import random

import pytest

from vflow.cluster.policies import (
    POLICIES,
    JobState,
    Policy,
    check_allocation,
    get_policy,
    las,
)
from vflow.cluster.trace import JobSpec

LINEAR = {1: 1.0, 2: 0.5, 4: 0.25, 8: 0.125}


def spec(
    name: str, demand: int, priority: float = 1.0, arrival_s: float = 0.0, v: int = 8
) -> JobSpec:
    return JobSpec(name, arrival_s, demand, priority, v, 100, LINEAR)


def test_a_job_alone_gets_the_cluster_up_to_v_when_elastic_and_its_demand_when_not() -> None:
    alone = [JobState(spec("a", 2))]
    assert POLICIES["wfs"](16, alone) == {"a": 8}
    assert POLICIES["wfs-any"](16, alone) == {"a": 8}
    assert POLICIES["wfs-any"](6, alone) == {"a": 6}
    # power-of-two counts: 4 of 6 slots (or the demand)
    assert POLICIES["wfs"](6, alone) == {"a": 4}
    assert POLICIES["priority"](16, alone) == {"a": 2}
    assert POLICIES["las"](16, alone) == {"a": 2}


def test_priority_keeps_running_jobs_and_starts_the_queue_in_priority_order() -> None:
    jobs = [
        JobState(spec("running", 4), workers=4, started=True),
        JobState(spec("low", 2, priority=1, arrival_s=1)),
        JobState(spec("high", 4, priority=10, arrival_s=2)),
    ]
    # the head (high) does not fit: nothing behind it starts
    assert POLICIES["priority"](6, jobs) == {"running": 4, "low": 0, "high": 0}
    assert POLICIES["priority"](8, jobs) == {"running": 4, "low": 0, "high": 4}
    assert POLICIES["priority"](10, jobs) == {"running": 4, "low": 2, "high": 4}


def test_las_ranks_by_attained_service_then_arrival_and_preempts() -> None:
    veteran = JobState(spec("veteran", 4), workers=4, started=True, attained_s=5000.0)
    newcomer = JobState(spec("newcomer", 4, arrival_s=10))
    small = JobState(spec("small", 2, arrival_s=20))
    assert las(4, [veteran, newcomer, small]) == {"veteran": 0, "newcomer": 4, "small": 0}
    # backfilling: a job that fits runs even behind one that does not
    assert las(6, [veteran, newcomer, small]) == {"veteran": 0, "newcomer": 4, "small": 2}
    # below the threshold the earlier arrival goes first, and keeps running
    young = JobState(spec("veteran", 4), workers=4, started=True, attained_s=100.0)
    assert las(4, [young, newcomer]) == {"veteran": 4, "newcomer": 0}
    assert las(4, [veteran, newcomer], thresholds_s=(10_000.0,)) == {"veteran": 4, "newcomer": 0}


def test_wfs_shares_by_priority_rounded_to_powers_of_two() -> None:
    high = JobState(spec("high", 8, priority=3), workers=8, started=True)
    low = JobState(spec("low", 8, priority=1, arrival_s=1))
    # exact shares 6 and 2: wfs rounds 6 down to 4, then doubles in priority order
    # (high 4 -> 8 does not fit in the 2 left; low 2 -> 4 does)
    assert POLICIES["wfs"](8, [high, low]) == {"high": 4, "low": 4}
    assert POLICIES["wfs-any"](8, [high, low]) == {"high": 6, "low": 2}


def test_wfs_caps_at_demand_then_hands_out_the_rest_up_to_v() -> None:
    a = JobState(spec("a", 2, priority=1), workers=8, started=True)
    b = JobState(spec("b", 2, priority=1, arrival_s=1, v=4))
    # fair shares 2 and 2 (capped at demand); then beyond demand, a (first in order)
    # grows to 4 and then to 8 is too many; b grows to its V = 4
    assert POLICIES["wfs-any"](8, [a, b]) == {"a": 4, "b": 4}
    assert POLICIES["wfs"](16, [a, b]) == {"a": 8, "b": 4}


def test_wfs_admits_a_job_only_if_no_higher_priority_job_falls_below_its_share() -> None:
    # exact shares on 4 slots: high 3.33 (fair 3), each low 0.33 (rounded to 0, given 1):
    # the second low job's worker would come from high, leaving it 2 < 3
    high = JobState(spec("high", 3, priority=10), workers=3, started=True)
    low1 = JobState(spec("low1", 1, priority=1, arrival_s=1), workers=1, started=True)
    low2 = JobState(spec("low2", 1, priority=1, arrival_s=2))
    assert POLICIES["wfs-any"](4, [high, low1, low2]) == {"high": 3, "low1": 1, "low2": 0}
    # with a fifth slot high is capped at its demand and both low jobs fit
    assert POLICIES["wfs-any"](5, [high, low1, low2]) == {"high": 3, "low1": 1, "low2": 1}


def _random_states(rng: random.Random, slots: int) -> list[JobState]:
    jobs = []
    used = 0
    for index in range(rng.randint(1, 12)):
        demand = rng.randint(1, slots)
        v = rng.choice([demand, max(demand, 8), 16])
        counts = sorted({1, 2, 4, demand, rng.randint(1, 16), 16})
        table = {c: 1.0 / c + rng.uniform(0, 0.1) for c in counts if c <= v}
        job = JobSpec(
            f"j{index}", rng.uniform(0, 100), demand, rng.choice([1, 5, 10]), v, 10, table
        )
        workers = 0
        if rng.random() < 0.5 and used + demand <= slots:
            workers = demand
            used += demand
        jobs.append(JobState(job, workers, workers > 0, rng.uniform(0, 8000)))
    return jobs


@pytest.mark.parametrize("name", list(POLICIES))
def test_every_policy_keeps_the_rules_on_random_states(name: str) -> None:
    rng = random.Random(23)
    policy = POLICIES[name]
    for _ in range(400):
        slots = rng.randint(1, 16)
        jobs = _random_states(rng, slots)
        before = list(jobs)
        allocation = policy(slots, jobs)  # check_allocation runs inside
        assert jobs == before
        assert policy(slots, jobs) == allocation  # pure: the same answer again
        if name == "priority":
            assert all(allocation[j.name] == j.workers for j in jobs if j.workers)
        if policy.elastic:
            free = slots - sum(allocation.values())
            running = [j for j in jobs if allocation[j.name] > 0]
            assert all(allocation[j.name] > 0 for j in jobs if j.workers > 0)
            if name == "wfs-any" and free > 0:
                # work-conserving: a slot idles only when every job is at its most
                assert all(allocation[j.name] == j.spec.max_workers for j in running)
                assert len(running) == len(jobs)
            if running and free == slots:
                pytest.fail("an elastic policy left the whole cluster idle")


def test_an_allocation_that_breaks_the_rules_is_caught() -> None:
    static = Policy("static", lambda slots, jobs: {}, elastic=False)
    jobs = [JobState(spec("a", 2))]
    with pytest.raises(RuntimeError, match="not the jobs"):
        check_allocation(static, 4, jobs, {})
    with pytest.raises(RuntimeError, match="not its demand 2"):
        check_allocation(static, 4, jobs, {"a": 1})
    with pytest.raises(RuntimeError, match=r"allowed 0..8"):
        check_allocation(POLICIES["wfs"], 16, jobs, {"a": 9})
    with pytest.raises(RuntimeError, match="allocated 3 of 2 slots"):
        check_allocation(POLICIES["wfs"], 2, jobs, {"a": 3})


def test_get_policy_refuses_unknown_names_and_bad_settings() -> None:
    with pytest.raises(ValueError, match="policy must be one of priority, las, wfs, wfs-any"):
        get_policy("fifo")
    with pytest.raises(ValueError, match="las_thresholds_s must be increasing"):
        get_policy("las", las_thresholds_s=[100.0, 10.0])
    with pytest.raises(ValueError, match="interval_s must be seconds > 0"):
        get_policy("wfs", interval_s=0.0)
    tuned = get_policy("las", las_thresholds_s=[10.0], interval_s=5.0)
    assert tuned.interval_s == 5.0
    veteran = JobState(spec("v", 4), workers=4, started=True, attained_s=50.0)
    assert tuned(4, [veteran, JobState(spec("n", 4, arrival_s=1))]) == {"v": 0, "n": 4}
