"""What breaks clusters, on three hosts made of network namespaces
(tests/support/hosts.py): the store on host a, one worker of README.md's "### Several
machines" line on each of a, b and c (deterministic), and one fault per test:

a. host c goes silent (its link down) mid-step; b. b and c partitioned from each other
only; c. the store silent, then the store's host; d. the store restarted at its
address; e. c's clock 30 s ahead; f. c's processes stopped past the timeout; g. c's
link limited to 100 Mbit/s.

Each test ends with the job's ``--out`` bitwise equal to the same line run alone, or,
where the job cannot go on, every surviving worker exiting non-zero with a message
naming the cause and a checkpoint holding its last step. Times are bounded by what the
issue promises with a margin for a loaded 2-core machine (a step's duration); the
measured numbers are benchmarks/faults.py's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support import hosts
from tests.support.several_hosts import (
    HostJob,
    assert_bitwise_equal,
    flag,
    hosts_job,
    play_partition,
    play_silent_host,
    play_silent_store,
    play_skew,
    play_slow_link,
    play_stopped_host,
    play_store_restart,
    readme_lines,
    reference,
)

pytest.importorskip("sklearn", reason="the example trains on scikit-learn's digits")

MISSING = hosts.cannot("nft", "tc", "faketime")
pytestmark = [
    pytest.mark.skipif(MISSING is not None, reason=f"multi-host tests: {MISSING}"),
    # Their bounds are the collective timeout plus a second: no other test's processes
    # may share the cores meanwhile.
    pytest.mark.alone,
]

TIMEOUT = 4.0  # the job's collective timeout (--timeout), seconds
STORE_TIMEOUT = 5.0  # --store-timeout
# The README line's own --steps, so that its one-worker run serves these tests and the
# README's (tests/elastic/test_several_machines.py) alike.
STEPS = int(flag(readme_lines()[1], "--steps"))
FLAGS = {"sleep": "0.03", "timeout": f"{TIMEOUT:g}"}


@pytest.fixture(scope="module")
def alone(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The README's worker line alone."""
    return reference(tmp_path_factory.mktemp("alone"))


def _reasons(job: HostJob, name: str) -> list[str]:
    return [e["reason"] for e in job.events(name)]


def _assert_one_set_per_step(job: HostJob) -> None:
    """Every step was committed by one worker set: as many workers logged it as that
    set had, all with that size. Two sets training apart would log a step twice."""
    by_step = job.sets_per_step()
    assert sorted(by_step) == list(range(STEPS))
    for step, sizes in by_step.items():
        assert len(set(sizes)) == 1 and len(sizes) <= sizes[0], (step, sizes)


def test_a_host_that_goes_silent_is_dropped_and_comes_back(
    tmp_path: Path, alone: dict[str, Any]
) -> None:
    """a. c's link goes down mid-step: a and b train again within timeout_s + 1 s (and
    the step they redo). When the link returns, c's worker never trains in the old
    group: it finds itself left out, asks to join again and ends with the others."""
    with hosts_job(tmp_path / "job") as (machines, job):
        marks = play_silent_host(machines, job, FLAGS)
        codes = job.wait(["a", "b", "c"])
    assert codes == {"a": 0, "b": 0, "c": 0}, job.stderr("c")
    for name in ("a", "b"):
        assert marks[name] - marks["down"] <= TIMEOUT + 1.0 + 2 * marks["step_s"], marks
    assert_bitwise_equal(job.result(), alone)
    # c committed nothing between the fault and its return, and then only steps that a
    # committed with it.
    a_sizes = {s["step"]: s["workers"] for s in job.steps("a")}
    late = [s for s in job.steps("c") if s["t"] > marks["down"]]
    assert all(s["t"] >= marks["rejoined"] and a_sizes[s["step"]] == 3 for s in late)
    assert "joining the job again" in job.stderr("c")
    for name in ("a", "b"):
        reasons = _reasons(job, name)
        assert reasons.count("crash") == 1, reasons
        assert reasons[reasons.index("crash") + 1 :] == ["grow", "finish"], reasons
    _assert_one_set_per_step(job)


def test_two_hosts_partitioned_from_each_other_leave_one_worker_set(
    tmp_path: Path, alone: dict[str, Any]
) -> None:
    """b. b and c no longer reach each other; both still reach a and the store. Within
    timeout_s + 1 s the job trains on as one worker set of a and one of them (they
    probe each other before agreeing: Note [Probing a peer]); the other waits to join
    and never trains apart."""
    with hosts_job(tmp_path / "job") as (machines, job):
        marks = play_partition(machines, job, FLAGS)
        codes = job.wait(["a", "b", "c"])
    assert codes == {"a": 0, "b": 0, "c": 0}, job.stderr("b") + job.stderr("c")
    assert marks["a"] - marks["cut"] <= TIMEOUT + 1.0 + 2 * marks["step_s"], marks
    assert_bitwise_equal(job.result(), alone)
    _assert_one_set_per_step(job)
    later = marks["cut"] + TIMEOUT + 2
    kept = [n for n in ("b", "c") if any(s["t"] > later for s in job.steps(n))]
    assert len(kept) == 1, kept
    out = "c" if kept == ["b"] else "b"
    assert "cannot reach the job's workers" in job.stderr(out), job.stderr(out)
    assert "finished while this worker was out of its worker set" in job.stderr(out)
    assert _reasons(job, "a").count("crash") == 1, job.events("a")


def test_a_silent_store_stops_nothing_until_the_worker_set_must_change(tmp_path: Path) -> None:
    """c. The store goes silent (its port drops everything): the workers train on, no
    step waits for it. Then its host goes silent with worker a: b and c need the store
    to go on without a, and each exits within timeout_s + store_timeout_s (+ 2 s),
    non-zero, naming the store, its checkpoint holding its last step."""
    with hosts_job(tmp_path / "job") as (machines, job):
        marks = play_silent_store(machines, job, FLAGS, STORE_TIMEOUT)
        codes = {name: job.procs[name].returncode for name in ("b", "c")}
    assert codes == {"b": 1, "c": 1}, job.stderr("b") + job.stderr("c")
    assert job.longest_gap("b", marks["silent"]) < 1.0  # no step waited for the store
    # Both exit within the bound, the one waited on after the other.
    assert marks["ended"] - marks["down"] <= TIMEOUT + STORE_TIMEOUT + 2.0 + 5.0
    for name in ("b", "c"):
        said = job.stderr(name)
        assert f"the rendezvous store at {job.endpoint} cannot be reached" in said, said
        saved = torch.load(job.folder / f"{name}.pt", weights_only=True)
        assert saved["executor"]["step_count"] == job.steps(name)[-1]["step"] + 1


def test_a_restarted_store_knows_the_job_and_a_late_worker_joins_it(
    tmp_path: Path, alone: dict[str, Any]
) -> None:
    """d. The store is killed and started again at its address while a, b and c train:
    they train on, re-register the job in the new store (Note [Fencing a job]), and a
    worker started afterwards with the same --job joins the running job bitwise; it
    never starts a second copy from step 0."""
    with hosts_job(tmp_path / "job") as (machines, job):
        marks = play_store_restart(machines, job, FLAGS)
        codes = job.wait(["a", "b", "c", "late"])
    assert codes == {"a": 0, "b": 0, "c": 0, "late": 0}, job.stderr("late")
    assert_bitwise_equal(job.result(), alone)
    late = job.steps("late")
    first = job.events("late")[0]
    assert late and late[0]["step"] == first["step"] > 0 and first["reason"] == "start"
    assert all(s["workers"] == 4 for s in late), late[:3]
    assert any(s["t"] > marks["killed"] for s in job.steps("a"))
    _assert_one_set_per_step(job)
    for name in "abc":
        assert "crash" not in _reasons(job, name), job.events(name)


def test_a_clock_30_s_ahead_drops_nobody(tmp_path: Path, alone: dict[str, Any]) -> None:
    """e. c's processes run 30 s ahead (faketime) in the job's first round, whose
    heartbeats are wall-clock times: in 200 steps nobody is dropped or judged gone
    (Note [Heartbeats across clocks]), and the result is bitwise."""
    with hosts_job(tmp_path / "job") as (machines, job):
        play_skew(machines, job, FLAGS)
        codes = job.wait(["a", "b", "c"])
    assert codes == {"a": 0, "b": 0, "c": 0}, job.stderr("c")
    assert_bitwise_equal(job.result(), alone)
    for name in "abc":
        assert _reasons(job, name) == ["start", "finish"], job.events(name)
        assert [s["step"] for s in job.steps(name)] == list(range(STEPS))
        assert {s["workers"] for s in job.steps(name)} == {3}


def test_a_stopped_host_costs_the_others_one_timeout_and_joins_again(
    tmp_path: Path, alone: dict[str, Any]
) -> None:
    """f. Every process of host c stopped (SIGSTOP) past timeout_s, then continued: a
    and b lose at most one timeout_s (and a recovery), not two; c's worker finds itself
    out, asks to join and ends with the others."""
    with hosts_job(tmp_path / "job") as (machines, job):
        marks = play_stopped_host(machines, job, FLAGS)
        codes = job.wait(["a", "b", "c"])
    assert codes == {"a": 0, "b": 0, "c": 0}, job.stderr("c")
    assert_bitwise_equal(job.result(), alone)
    for name in ("a", "b"):
        gap = job.longest_gap(name)
        assert gap <= TIMEOUT + 1.0 + 2 * marks["step_s"], (name, gap)  # two timeouts: 8 s
    reasons = _reasons(job, "c")
    assert reasons.count("crash") == 1 and reasons[-1] == "finish", reasons
    _assert_one_set_per_step(job)


def test_a_slow_link_drops_nobody_and_carries_the_state_at_its_speed(
    tmp_path: Path, alone: dict[str, Any]
) -> None:
    """g. c's link limited to 100 Mbit/s (tbf) before c joins: the state crosses it at
    that speed (c's join takes at least the state's bytes over the rate) and the job
    trains on to the end with nobody dropped."""
    with hosts_job(tmp_path / "job") as (machines, job):
        play_slow_link(machines, job, FLAGS)
        codes = job.wait(["a", "b", "c"])
    assert codes == {"a": 0, "b": 0, "c": 0}, job.stderr("c")
    assert_bitwise_equal(job.result(), alone)
    for name in "abc":
        assert "crash" not in _reasons(job, name), job.events(name)
    state_bytes = sum(
        t.numel() * t.element_size()
        for part in (alone["model"], *alone["optimizer"]["state"].values())
        for t in part.values()
        if isinstance(t, torch.Tensor)
    )
    joined = job.events("c")[0]
    assert joined["reason"] == "start" and joined["workers"] == 3
    assert joined["seconds"] >= state_bytes * 8 / 100e6
    assert any(s["workers"] == 3 for s in job.steps("c"))
