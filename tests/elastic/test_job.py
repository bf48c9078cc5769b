"""vflow.elastic end to end: worker processes (tests/support/elastic_worker.py) that join,
leave, crash (SIGKILL at five points of a step), hang (SIGSTOP), fail twice in a row or
die while receiving the state, against the uninterrupted one-process run: bitwise in
deterministic mode, within 1e-6 relative otherwise; and every step used its own global
batch exactly once. Every process and wait is bounded."""

from __future__ import annotations

import itertools
import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.support import elastic_worker
from tests.support.rendezvous import store_process
from vflow.data import VNBatchSampler
from vflow.elastic import ElasticJob
from vflow.mapping.plan import Plan
from vflow.runtime.executor import Executor

WORKER = Path(elastic_worker.__file__)
STEPS = 80
# Seconds per step until a worker has seen the test's full worker set: time for the
# others to start and join (about 20 s), then full speed.
SLEEP = "0.25"
# Steps of a job whose pace the test holds (Job.held): enough that it cannot end before
# its scenario does, on a loaded machine too; those after the release run at full speed.
HELD_STEPS = 200


@pytest.fixture(scope="module")
def rendezvous() -> Iterator[str]:
    with store_process() as (proc, endpoint):
        assert endpoint.startswith("127.0.0.1:"), endpoint
        yield endpoint
        proc.terminate()
        assert proc.wait(timeout=30) == 0  # ends cleanly on SIGTERM


class Job:
    """Worker processes of one job, each with its own log; all killed at the end."""

    def __init__(
        self, endpoint: str, tmp_path: Path, name: str, deterministic: bool = True, workers: int = 2
    ):
        self.endpoint, self.tmp, self.name = endpoint, tmp_path, name
        self.deterministic = deterministic
        self.workers = workers  # the full worker set of the scenario (worker --workers)
        self.procs: dict[str, subprocess.Popen] = {}
        # Workers started with ``*job.held`` sleep every step while this file exists.
        self.pace = tmp_path / "pace"
        self.pace.touch()
        self.held = ("--sleep-while", str(self.pace))

    def release(self) -> None:
        """Lets the workers started with ``*self.held`` run at full speed: the scenario
        they were held for is over."""
        self.pace.unlink(missing_ok=True)

    def start(self, worker: str, *extra: str, steps: int = STEPS) -> subprocess.Popen:
        args = [
            sys.executable,
            str(WORKER),
            "--rdzv",
            self.endpoint,
            "--job",
            self.name,
            "--steps",
            str(steps),
            "--log",
            str(self.log(worker)),
            "--out",
            str(self.tmp / "out.pt"),
            "--sleep",
            SLEEP,
            "--workers",
            str(self.workers),
            *(["--deterministic"] if self.deterministic else []),
            *extra,
        ]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
        proc = subprocess.Popen(args, env=env, stderr=open(self.tmp / f"{worker}.err", "w"))
        self.procs[worker] = proc
        return proc

    def log(self, worker: str) -> Path:
        return self.tmp / f"{worker}.log"

    def lines(self, worker: str) -> list[dict[str, Any]]:
        if not self.log(worker).exists():
            return []
        return [json.loads(line) for line in self.log(worker).read_text().splitlines() if line]

    def steps(self, worker: str) -> list[dict[str, Any]]:
        return [line for line in self.lines(worker) if "indices" in line]

    def wait_steps(self, worker: str, count: int, timeout: float = 90.0) -> None:
        deadline = time.monotonic() + timeout
        while len(self.steps(worker)) < count:
            if self.procs[worker].poll() is not None:
                raise AssertionError(f"{worker} ended early:\n{self.stderr(worker)}")
            if time.monotonic() > deadline:
                raise AssertionError(f"{worker} ran fewer than {count} steps in {timeout} s")
            time.sleep(0.05)

    def stderr(self, worker: str) -> str:
        return (self.tmp / f"{worker}.err").read_text()[-4000:]

    def wait(self, timeout: float = 150.0, only: list[str] | None = None) -> dict[str, int]:
        """Exit codes of the workers (or of ``only`` those); kills every worker after."""
        deadline = time.monotonic() + timeout
        codes = {}
        try:
            for worker, proc in self.procs.items():
                if only is None or worker in only:
                    codes[worker] = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        finally:
            self.kill()
        return codes

    def kill(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)

    def events(self, worker: str) -> list[dict[str, Any]]:
        ends = [line for line in self.lines(worker) if "events" in line]
        assert ends, f"{worker} wrote no events:\n{self.stderr(worker)}"
        return ends[-1]["events"]

    def result(self) -> dict[str, Any]:
        return torch.load(self.tmp / "out.pt", weights_only=True)


@pytest.fixture
def job(rendezvous: str, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Job]:
    name = "t" + str(abs(hash(request.node.nodeid)))[:12] + str(os.getpid())
    running = Job(rendezvous, tmp_path, name)
    yield running
    running.kill()


_REFERENCES: dict[tuple[int, bool, int], dict[str, Any]] = {}


def _reference(steps: int, deterministic: bool, virtual_nodes: int) -> dict[str, Any]:
    key = (steps, deterministic, virtual_nodes)
    if key not in _REFERENCES:
        _REFERENCES[key] = elastic_worker.reference(steps, deterministic, virtual_nodes)
    return _REFERENCES[key]


def _assert_same_training(
    job: Job, steps: int = STEPS, virtual_nodes: int = elastic_worker.V
) -> None:
    got, want = job.result(), _reference(steps, job.deterministic, virtual_nodes)
    assert got["step"] == steps
    for part in ("model", "optimizer"):
        flat_got, flat_want = _flatten(got[part]), _flatten(want[part])
        assert flat_got.keys() == flat_want.keys()
        for key, value in flat_want.items():
            if not isinstance(value, torch.Tensor):
                assert flat_got[key] == value, f"{part} {key} differs"
            elif job.deterministic:
                assert torch.equal(flat_got[key], value), f"{part} {key} differs"
            else:
                # Relative 2-norm error of the tensor, as in tests/test_reconfigure.py:
                # single elements near zero carry rounding far above 1e-6 of themselves.
                error = (flat_got[key] - value).norm() / value.norm().clamp_min(1e-30)
                assert error <= 1e-6, f"{part} {key}: relative error {error:.2e}"
    _assert_each_batch_once(job, steps)


def _assert_each_batch_once(job: Job, steps: int) -> None:
    """Every step up to ``steps`` was committed, and the worker set that committed it
    (its workers' lines: the same worker count and plan) computed global batch
    ``step`` whole, each sample once. A step that a worker committed just before a
    crash and the survivors computed again shows two such sets. A worker killed
    after the step's reduction (in the optimizer) computed its part but wrote no line:
    only at the step of a crash may a set lack lines, and then its lines must still be
    disjoint parts of the batch."""
    crashed = {
        event["step"]
        for worker in job.procs
        for line in job.lines(worker)
        if "events" in line
        for event in line["events"]
        if event["reason"] == "crash"
    }
    sampler = VNBatchSampler(
        elastic_worker.SAMPLES,
        elastic_worker.B,
        Plan.even(elastic_worker.V, 1),
        0,
        seed=elastic_worker.SEED,
    )
    by_step: dict[int, dict[tuple[int, tuple[int, ...]], list[list[int]]]] = {}
    for worker in job.procs:
        for line in job.steps(worker):
            worker_set = (line["workers"], tuple(line["counts"]))
            by_step.setdefault(line["step"], {}).setdefault(worker_set, []).append(line["indices"])
    assert sorted(by_step) == list(range(steps))
    for step, sets in by_step.items():
        batch = sorted(sampler.step_indices(step)[0])
        for (workers, counts), parts in sets.items():
            seen = sorted(i for part in parts for i in part)
            if len(parts) < workers and step + 1 in crashed:
                assert len(seen) == len(set(seen)) and set(seen) <= set(batch), step
                continue
            assert seen == batch, (
                f"step {step}: the worker set of {workers} ({list(counts)}) computed "
                f"{len(seen)} samples ({len(set(seen))} distinct) of its {len(batch)}"
            )


def _flatten(state: Any, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    if isinstance(state, dict):
        for key, value in state.items():
            out.update(_flatten(value, f"{prefix}/{key}"))
    elif isinstance(state, (list, tuple)):
        for i, value in enumerate(state):
            out.update(_flatten(value, f"{prefix}/{i}"))
    else:
        out[prefix] = state
    return out


def _reasons(job: Job, worker: str) -> list[str]:
    return [e["reason"] for e in job.events(worker)]


def _logged(job: Job, worker: str, level: str) -> list[str]:
    """The messages of the ``vflow`` logger at ``level`` in the worker's stderr (it logs
    as ``LEVEL name: message``)."""
    prefix = f"{level} vflow: "
    text = (job.tmp / f"{worker}.err").read_text()
    return [line.removeprefix(prefix) for line in text.splitlines() if line.startswith(prefix)]


def _assert_calm_recovery(job: Job, worker: str, failure: str, workers: int, lost: int) -> None:
    """The worker's log says what failed and what the job did about it (Note [Saying
    what a recovery does]): a WARNING matching the regular expression ``failure`` (its
    ``{step}`` is the crash event's step), then "redoing step {step} with ..." at INFO;
    the raw CollectiveError only at DEBUG."""
    crash = next(e for e in job.events(worker) if e["reason"] == "crash")
    step = crash["step"]
    warnings, infos = _logged(job, worker, "WARNING"), _logged(job, worker, "INFO")
    debug = _logged(job, worker, "DEBUG")
    said = f"vflow elastic: {failure.replace('{step}', str(step))}; re-forming the worker set"
    assert any(re.fullmatch(said, line) for line in warnings), (said, warnings)
    redo = f"vflow elastic: redoing step {step} with {workers} worker"
    redo += ("" if workers == 1 else "s") + (f" ({lost} lost)" if lost else "")
    assert redo in infos, (redo, infos)
    assert infos.index(redo) < infos.index(
        f"vflow elastic: step {step}, round {crash['round']}, {workers} worker(s), crash, "
        f"{crash['seconds']:.2f} s"
    )
    raw = [line for line in debug if line.startswith(f"vflow elastic: step {step}: vflow step")]
    assert raw, debug
    for line in warnings:
        assert "vflow step" not in line and "Connection closed" not in line, line


# ---- grow and leave ---------------------------------------------------------------


def test_workers_joining_a_running_job_train_bitwise_as_one_process(job: Job) -> None:
    job.workers = 3
    job.start("a")
    job.wait_steps("a", 3)
    job.start("b")
    job.wait_steps("b", 2)
    job.start("c")
    codes = job.wait()
    assert codes == {"a": 0, "b": 0, "c": 0}, job.stderr("a")
    _assert_same_training(job)
    assert _reasons(job, "a")[0] == "start" and _reasons(job, "a").count("grow") >= 2
    assert max(line["workers"] for line in job.steps("a")) == 3


def test_grow_without_deterministic_mode_is_within_rounding(
    rendezvous: str, tmp_path: Path
) -> None:
    job = Job(rendezvous, tmp_path, f"nondet{os.getpid()}", deterministic=False)
    try:
        job.start("a")
        job.wait_steps("a", 3)
        job.start("b")
        assert job.wait() == {"a": 0, "b": 0}
        _assert_same_training(job)
    finally:
        job.kill()


@pytest.mark.alone  # its planner's decisions read step times
def test_an_automatic_plan_with_a_bound_sampler_trains_bitwise_as_one_process(job: Job) -> None:
    """plan="auto" with one worker 20x slower in compute (tiny next to the step's
    communication otherwise): the plan changes between steps on its own and the bound
    sampler (``bind(ex)``, ``step_indices(step)``) follows it and every
    worker set."""
    # Enough steps after b joins (however long it takes to start) for the planner's
    # warm-up, and its second look if the first cannot tell the gain from noise.
    steps = STEPS
    job.start("a", "--auto", steps=steps)
    job.wait_steps("a", 3)
    job.start("b", "--auto", "--slow", "20", steps=steps)
    assert job.wait() == {"a": 0, "b": 0}, job.stderr("a")
    _assert_same_training(job, steps)
    assert "grow" in _reasons(job, "a")
    counts = {tuple(line["counts"]) for line in job.steps("a") if line["workers"] == 2}
    assert len(counts) > 1, f"the automatic planner never re-planned: {counts}"


def test_a_worker_asked_to_leave_finishes_its_step_and_the_others_go_on(job: Job) -> None:
    job.workers = 3
    job.start("a")
    job.wait_steps("a", 2)
    job.start("b", "--leave-step", "3")  # vflow.elastic.ElasticJob.leave()
    job.start("c", "--sigterm-step", "6")  # SIGTERM: leave after this step
    codes = job.wait()
    assert codes == {"a": 0, "b": 0, "c": 0}, job.stderr("a")
    _assert_same_training(job)
    assert "leave" in _reasons(job, "a")
    assert job.steps("a")[-1]["workers"] == 1


# ---- crashes -------------------------------------------------------------------------

# Where in a step the killed worker dies, as its peer sees it: before it took part in
# any collective of the step (middle-backward; "start", the same for the peer, serves
# the scenarios below), with only the statistics all-reduce started (stats), with
# gradient buckets in flight (allreduce), waiting for them (finalize), after all of
# them (optimizer).
FAULT_POINTS = ["middle-backward", "stats", "allreduce", "finalize", "optimizer"]


@pytest.mark.parametrize("point", FAULT_POINTS)
def test_a_worker_killed_during_a_step_costs_nothing(job: Job, point: str) -> None:
    job.start("a")
    job.wait_steps("a", 1)
    job.start("b", "--fault", point, "--fault-step", "2")
    codes = job.wait()
    assert codes["b"] == -signal.SIGKILL
    assert codes["a"] == 0, job.stderr("a")
    _assert_same_training(job)
    assert "crash" in _reasons(job, "a")
    _assert_calm_recovery(job, "a", "worker lost during step {step}", workers=1, lost=1)
    # A dead peer closes its connections: no timeout expired, and none is named.
    assert not [line for line in _logged(job, "a", "WARNING") if "timeout" in line]


def test_a_hung_worker_is_dropped_after_the_timeout(job: Job) -> None:
    job.start("a", "--timeout", "3")
    job.wait_steps("a", 1)
    job.start(
        "b",
        "--timeout",
        "3",
        "--fault",
        "middle-backward",
        "--fault-step",
        "2",
        "--fault-signal",
        "SIGSTOP",
    )
    codes = job.wait(timeout=120, only=["a"])  # b stays stopped, then is killed
    assert codes["a"] == 0, job.stderr("a")
    _assert_same_training(job)
    crash = [e for e in job.events("a") if e["reason"] == "crash"]
    assert crash
    _assert_calm_recovery(
        job,
        "a",
        r"worker hung or lost during step {step} \(no answer within the 3 s timeout\)",
        workers=1,
        lost=1,
    )


def test_a_worker_stopped_past_the_timeout_is_left_out_then_joins_again(job: Job) -> None:
    """b is stopped (SIGSTOP) long enough for a to time out and go on alone, and for the
    rendezvous to drop it; continued, it finds itself out of the worker set and joins
    again as a newcomer would, receiving a's state."""
    job.start("a", "--timeout", "3", *job.held, steps=HELD_STEPS)  # held until b is back
    job.wait_steps("a", 1)
    job.start("b", "--timeout", "3", *job.held, steps=HELD_STEPS)
    deadline = time.monotonic() + 90
    while sum(line["workers"] == 2 for line in job.steps("a")) < 3:
        assert time.monotonic() < deadline, job.stderr("a")
        time.sleep(0.05)
    job.procs["b"].send_signal(signal.SIGSTOP)
    alone = len(job.steps("a")) + 3
    while (
        sum(line["workers"] == 1 for line in job.steps("a")[-3:]) < 3 or len(job.steps("a")) < alone
    ):
        assert time.monotonic() < deadline, job.stderr("a")
        time.sleep(0.05)
    job.procs["b"].send_signal(signal.SIGCONT)
    while job.steps("a")[-1]["workers"] < 2:  # b is back
        assert time.monotonic() < deadline and job.procs["a"].poll() is None, job.stderr("a")
        time.sleep(0.05)
    job.release()
    codes = job.wait()
    assert codes == {"a": 0, "b": 0}, job.stderr("a") + job.stderr("b")
    _assert_same_training(job, steps=HELD_STEPS)
    reasons = _reasons(job, "a")
    assert reasons[:3] == ["start", "grow", "crash"] and "grow" in reasons[3:], reasons
    assert job.steps("b")[-1]["workers"] == 2


def test_a_worker_the_rendezvous_dropped_does_not_stall_the_others(job: Job) -> None:
    """The worker of rank 0 stops its rendezvous heartbeats (a CPU-starved process) and
    the rendezvous drops it; it leaves its worker set and joins again. The others recover
    without waiting for its answer, which never comes: at their timeout (60 s) before."""
    job.workers = 3
    flags = ("--lapse-step", "2", "--timeout", "60")
    job.start("a", *flags)
    job.wait_steps("a", 1)
    job.start("b", *flags)
    job.start("c", *flags)
    codes = job.wait(timeout=240)
    assert codes == {"a": 0, "b": 0, "c": 0}, job.stderr("a") + job.stderr("b") + job.stderr("c")
    _assert_same_training(job)
    dropped = [
        w
        for w in "abc"
        if any("heartbeats lapsed and round" in line for line in _logged(job, w, "WARNING"))
    ]
    assert len(dropped) == 1, [job.stderr(w) for w in "abc"]
    for worker in sorted(set("abc") - set(dropped)):
        crash = next(e for e in job.events(worker) if e["reason"] == "crash")
        assert crash["seconds"] < 30, (worker, job.events(worker))


def test_two_failures_in_a_row(job: Job) -> None:
    job.workers = 3
    job.start("a")
    job.wait_steps("a", 1)
    job.start("b", "--fault", "start", "--fault-step", "2")
    job.start("c", "--fault", "recovery")
    job.wait_steps("c", 1)
    codes = job.wait()
    assert codes["b"] == -signal.SIGKILL and codes["c"] == -signal.SIGKILL
    assert codes["a"] == 0, job.stderr("a")
    _assert_same_training(job)
    # c dies while the survivors of b's crash form their worker set again, after it
    # answered: that attempt fails too, and a goes on alone in the same round.
    _assert_calm_recovery(job, "a", "worker lost during step {step}", workers=1, lost=2)
    warnings = _logged(job, "a", "WARNING")
    again = "vflow elastic: a worker failed while the survivors re-formed the worker set "
    assert f"{again}(attempt 1); trying again" in warnings, warnings
    rounds = {e["round"] for e in job.events("a") if e["reason"] in ("crash", "finish")}
    assert len(rounds) == 1, job.events("a")


def test_out_of_recovery_attempts_the_survivor_falls_back_to_a_new_round(job: Job) -> None:
    """As above, with one attempt allowed to re-form within the round: the survivor
    then forms a new round, alone, and goes on from the same step."""
    job.workers = 3
    job.start("a", "--max-recoveries", "1")
    job.wait_steps("a", 1)
    job.start("b", "--fault", "start", "--fault-step", "2", "--max-recoveries", "1")
    job.start("c", "--fault", "recovery", "--max-recoveries", "1")
    job.wait_steps("c", 1)
    codes = job.wait()
    assert codes["b"] == -signal.SIGKILL and codes["c"] == -signal.SIGKILL
    assert codes["a"] == 0, job.stderr("a")
    _assert_same_training(job)
    events = job.events("a")
    crash = next(e for e in events if e["reason"] == "crash")
    before = events[events.index(crash) - 1]
    assert crash["round"] > before["round"] and crash["workers"] == 1, events


def test_a_joiner_dying_while_it_receives_the_state(job: Job) -> None:
    job.start("a")
    job.wait_steps("a", 2)
    job.start("b", "--fault", "receiving")
    assert job.procs["b"].wait(timeout=90) == -signal.SIGKILL
    job.start("c")
    codes = job.wait()
    assert codes["a"] == 0 and codes["c"] == 0, job.stderr("a")
    _assert_same_training(job)


def test_a_joiner_dying_right_after_its_answer_costs_the_members_one_timeout(job: Job) -> None:
    """b dies between the members' answer and its connection: their group's creation
    times out (3 s here) and they go on without it, as after any failure while a set
    forms; c joins later."""
    job.start("a", "--timeout", "3")
    job.wait_steps("a", 2)
    job.start("b", "--timeout", "3", "--fault", "answered")
    assert job.procs["b"].wait(timeout=90) == -signal.SIGKILL
    job.start("c", "--timeout", "3")
    codes = job.wait(only=["a", "c"])
    assert codes == {"a": 0, "c": 0}, job.stderr("a") + job.stderr("c")
    _assert_same_training(job)
    assert "a worker failed while the worker set formed" in job.stderr("a")
    assert max(line["workers"] for line in job.steps("a")) == 2


# ---- joiners cannot take the job down (Note [Refusing newcomers]) ---------------------


def test_joiners_that_differ_are_refused_and_the_job_goes_on(job: Job) -> None:
    """Three joiners knock at once, each with one setting unlike the members': another
    seed, another V and a wider model. Each is refused naming what differs; the job
    trains on alone, bitwise."""
    differs = {
        "seed": ("--seed", "6", "settings (seed)"),
        "vns": ("--virtual-nodes", "4", "virtual_nodes=4"),
        "wider": ("--hidden", "16", "model layout"),
    }
    job.start("a", *job.held, steps=HELD_STEPS)  # held until the three are refused
    job.wait_steps("a", 2)
    for name, (flag, value, _) in differs.items():
        job.start(name, flag, value, steps=HELD_STEPS)
    for name, (_, _, named) in differs.items():
        assert job.procs[name].wait(timeout=90) == 1, job.stderr(name)
        said = job.stderr(name)
        assert "JoinRefused" in said and "refused by the members" in said and named in said, said
    job.release()
    codes = job.wait(only=["a"])
    assert codes["a"] == 0, job.stderr("a")
    _assert_same_training(job, steps=HELD_STEPS)
    assert any("were refused" in line for line in _logged(job, "a", "WARNING"))
    assert _reasons(job, "a") == ["start", "finish"], job.events("a")
    assert max(line["workers"] for line in job.steps("a")) == 1


def test_a_joiner_past_the_join_deadline_is_dropped_and_the_job_goes_on(job: Job) -> None:
    # b takes 6 s to load the state it receives, past the 3 s collective timeout that
    # bounds joining.
    job.start("a", "--timeout", "3", *job.held, steps=HELD_STEPS)  # held until b is dropped
    job.wait_steps("a", 2)
    job.start("b", "--timeout", "3", "--slow-load", "6", steps=HELD_STEPS)
    assert job.procs["b"].wait(timeout=90) == 1
    job.release()
    codes = job.wait(only=["a"])
    assert codes["a"] == 0, job.stderr("a")
    _assert_same_training(job, steps=HELD_STEPS)
    assert "within the join deadline" in job.stderr("b"), job.stderr("b")
    assert max(line["workers"] for line in job.steps("a")) == 1


def test_a_joiner_slow_to_build_its_executor_does_not_stall_the_job(job: Job) -> None:
    # Note [Joining ahead]: b builds its executor (6 s here, twice the timeout) before
    # it asks to join, so the round never waits for it.
    job.start("a", "--timeout", "3")
    job.wait_steps("a", 2)
    job.start("b", "--timeout", "3", "--slow-build", "6")
    codes = job.wait()
    assert codes == {"a": 0, "b": 0}, job.stderr("a") + job.stderr("b")
    _assert_same_training(job)
    assert _reasons(job, "a")[:2] == ["start", "grow"], job.events("a")
    assert not [line for line in _logged(job, "a", "WARNING") if "round" in line]


def test_a_crash_with_four_workers_is_recovered_within_the_round(job: Job) -> None:
    """The survivors drop the broken group at once (a survivor blocked on another one
    fails as soon as that one drops it) and agree on who is left through the round's
    store (Note [Recovering within the round]): no survivor waits for the 10 s timeout,
    and no new round forms."""
    job.workers = 4
    job.start("a", "--timeout", "10")
    job.wait_steps("a", 1)
    job.start("b", "--timeout", "10")
    job.start("c", "--timeout", "10")
    job.start("d", "--timeout", "10", "--fault", "allreduce", "--fault-step", "3")
    codes = job.wait()
    assert codes["d"] == -signal.SIGKILL
    assert {w: codes[w] for w in "abc"} == {"a": 0, "b": 0, "c": 0}, job.stderr("a")
    _assert_same_training(job)
    failed = [line["failed"] for w in "abc" for line in job.lines(w) if "failed" in line]
    assert len(failed) == 3 and max(failed) - min(failed) < 5.0, failed
    for worker in "abc":
        events = job.events(worker)
        crash = next(e for e in events if e["reason"] == "crash")
        before = events[events.index(crash) - 1]
        assert (crash["round"], crash["workers"]) == (before["round"], 3), events
        assert crash["seconds"] < 5.0, events
        # The agreement is part of the recovery; other events have none.
        assert 0 < crash["agreed_s"] < crash["seconds"], events
        assert all(e["agreed_s"] is None for e in events if e is not crash), events


def test_the_store_lost_trains_on_then_a_recovery_saves_the_state_and_says_so(
    tmp_path: Path,
) -> None:
    """Note [The store during a round]: with the store process killed the worker set
    trains on; a crash then needs the store, so the survivor writes its checkpoint and
    exits with an error naming the store, without waiting for any timeout."""
    ckpt = tmp_path / "a.pt"
    with store_process() as (store, endpoint):
        job = Job(endpoint, tmp_path, f"storelost{os.getpid()}")
        try:
            job.start("a", "--checkpoint", str(ckpt), "--timeout", "30")
            job.wait_steps("a", 1)
            job.start("b", "--timeout", "30")
            deadline = time.monotonic() + 90
            while not any(line["workers"] == 2 for line in job.steps("a")):
                assert time.monotonic() < deadline, job.stderr("a")
                time.sleep(0.05)
            store.kill()
            store.wait(timeout=30)
            job.wait_steps("a", len(job.steps("a")) + 3)  # no store needed to train
            job.procs["b"].kill()
            killed = time.monotonic()
            assert job.procs["a"].wait(timeout=60) == 1
            assert time.monotonic() - killed < 30  # well inside the 30 s timeouts
        finally:
            job.kill()
    said = job.stderr("a")
    assert f"the rendezvous store at {endpoint} cannot be reached" in said, said
    assert str(ckpt) in said
    saved = torch.load(ckpt, weights_only=True)
    assert saved["executor"]["step_count"] == len(job.steps("a"))


def test_below_min_workers_the_job_stops_with_a_checkpoint(job: Job, tmp_path: Path) -> None:
    ckpt = tmp_path / "left.pt"
    common = ["--min-workers", "2", "--join-timeout", "4", "--checkpoint", str(ckpt)]
    job.start("a", *common)
    job.start("b", *common, "--fault", "start", "--fault-step", "3")
    codes = job.wait()
    assert codes["b"] == -signal.SIGKILL
    assert codes["a"] == 1
    assert "fewer than min_workers=2" in job.stderr("a")
    saved = torch.load(ckpt, weights_only=True)
    committed = len(job.steps("a"))
    assert saved["executor"]["step_count"] == committed


def test_a_worker_arriving_after_the_job_finished_returns_none(job: Job) -> None:
    job.workers = 1
    job.start("a", steps=3)
    assert job.procs["a"].wait(timeout=90) == 0
    late = job.start("late", steps=3)
    assert late.wait(timeout=60) == 0, job.stderr("late")
    assert job.lines("late")[-1] == {"events": [], "step": None}


def test_a_worker_knocking_at_a_full_job_gives_up_after_the_join_timeout(job: Job) -> None:
    """V=2 and two workers: a third one waits for a place (Note [Joining a running
    job]) for --join-timeout, then leaves with JoinRefused; the job never notices."""
    common = ("--virtual-nodes", "2", *job.held)
    # a and b are held until c gave up, however long c takes to start (in CI, c once
    # took over 12 s to start and found a 60-step job over).
    job.start("a", *common, steps=HELD_STEPS)
    job.wait_steps("a", 1)
    job.start("b", *common, steps=HELD_STEPS)
    job.wait_steps("b", 1)
    job.start("c", *common, "--join-timeout", "3", steps=HELD_STEPS)
    assert job.procs["c"].wait(timeout=60) == 1
    job.release()
    said = job.stderr("c")
    assert "JoinRefused" in said and "did not take this worker in within join_timeout_s=3" in said
    codes = job.wait()
    assert codes["a"] == 0 and codes["b"] == 0, job.stderr("a")
    _assert_same_training(job, steps=HELD_STEPS, virtual_nodes=2)
    assert max(line["workers"] for line in job.steps("a")) == 2


def _knocks(job: Job) -> int:
    """How many tickets workers have taken to join ``job`` (Note [Joining a running job])."""
    host, port = job.endpoint.rsplit(":", 1)
    store = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=10))
    return int(store.add(f"vflow/{job.name}/knocks", 0))


def test_a_knocker_that_died_waiting_for_a_place_costs_the_members_nothing(job: Job) -> None:
    """Note [Knockers acknowledge]: c knocks at a full job (V=2, two workers) and is
    killed while it waits. When b leaves, a has room and offers c's ticket a place,
    which nobody acknowledges: a goes on alone after ACK_S instead of waiting for c's
    connection until the 10 s timeout; d, knocking later, is let in at once."""
    common = ("--virtual-nodes", "2", "--timeout", "10")
    # a and b are held until d is in, however long d takes to start.
    job.start("a", *common, *job.held, steps=HELD_STEPS)
    job.wait_steps("a", 1)
    job.start("b", *common, *job.held, steps=HELD_STEPS)
    deadline = time.monotonic() + 60
    while _knocks(job) < 1 or max(line["workers"] for line in job.steps("a")) < 2:
        assert time.monotonic() < deadline, job.stderr("a")
        time.sleep(0.05)
    job.start("c", *common, steps=HELD_STEPS)
    while _knocks(job) < 2:
        assert time.monotonic() < deadline and job.procs["c"].poll() is None, job.stderr("c")
        time.sleep(0.05)
    job.procs["c"].kill()
    job.procs["b"].send_signal(signal.SIGTERM)
    assert job.procs["b"].wait(timeout=60) == 0, job.stderr("b")
    alone = len(job.steps("a"))
    job.wait_steps("a", alone + 3)
    job.start("d", *common, steps=HELD_STEPS)
    deadline = time.monotonic() + 90
    while all(line["workers"] == 1 for line in job.steps("a")[alone:]):
        assert time.monotonic() < deadline and job.procs["a"].poll() is None, job.stderr("d")
        time.sleep(0.05)
    job.release()
    codes = job.wait(only=["a", "d"])
    assert codes == {"a": 0, "d": 0}, job.stderr("a") + job.stderr("d")
    _assert_same_training(job, steps=HELD_STEPS, virtual_nodes=2)
    assert _reasons(job, "a") == ["start", "grow", "leave", "grow", "finish"], job.events("a")
    last_grow = [e for e in job.events("a") if e["reason"] == "grow"][-1]
    assert last_grow["seconds"] < 3.0, job.events("a")
    assert not [w for w in _logged(job, "a", "WARNING") if "failed" in w], job.stderr("a")
    # Nothing waited for c: no gap between a's steps near the 10 s timeout.
    times = [line["t"] for line in job.steps("a")]
    assert max(b - a for a, b in itertools.pairwise(times)) < 5.0


def test_workers_beyond_v_in_the_first_round_are_refused_and_the_job_goes_on(job: Job) -> None:
    # Three workers for V=2 started together, within one last call: the job's first
    # round has three, and the one beyond V is refused.
    common = ("--virtual-nodes", "2", "--last-call", "3")
    job.workers = 2
    for worker in "abc":
        job.start(worker, *common, steps=40)
    codes = job.wait()
    refused = [w for w, code in codes.items() if code == 1]
    assert len(refused) == 1 and sorted(codes.values()) == [0, 0, 1], codes
    assert "this worker is not needed" in job.stderr(refused[0])
    _assert_same_training(job, steps=40, virtual_nodes=2)


def test_a_worker_waiting_for_a_place_when_the_job_ends_returns_none(job: Job) -> None:
    job.workers = 1
    job.start("a", "--max-workers", "1", "--sleep", "0.1", "--workers", "99")
    job.wait_steps("a", 1)
    job.start("waiting", "--max-workers", "1")
    codes = job.wait()
    assert codes == {"a": 0, "waiting": 0}, job.stderr("waiting")
    assert job.lines("waiting")[-1] == {"events": [], "step": None}


# ---- bad input -------------------------------------------------------------------------


def test_an_unreachable_rendezvous_is_a_clear_error() -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again below: nobody listens there
    job = ElasticJob(f"127.0.0.1:{port}", "nobody", store_timeout_s=1.0)
    with pytest.raises(
        RuntimeError, match=f"cannot reach the rendezvous store at 127.0.0.1:{port}"
    ):
        job.run(lambda g, t: None, lambda ex, s: None, 1)  # type: ignore[arg-type, return-value]


# Where an NCCL job whose store is unreachable stops: without a GPU, at the GPU.
_NCCL_STOPS_AT = (
    "cannot reach the rendezvous store"
    if torch.cuda.is_available()
    else "no GPU is visible to this process"
)


@pytest.mark.parametrize("chosen", [None, "3"])
def test_an_nccl_job_keeps_the_watchdog_from_killing_survivors_and_says_it_is_untested(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, chosen: str | None
) -> None:
    """Note [NCCL rounds], up to what runs without GPUs: the setting and the warning,
    said once per process; then the worker looks for its GPU (Note [A worker's GPU]),
    and without one stops there, before it connects."""
    from vflow.elastic import groups

    variable = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
    monkeypatch.setattr(groups, "_nccl_said", False)
    if chosen is None:
        monkeypatch.delenv(variable, raising=False)
    else:
        monkeypatch.setenv(variable, chosen)
    job = ElasticJob("127.0.0.1:1", "nccl", store_timeout_s=1.0, backend="nccl")
    with caplog.at_level(logging.WARNING, logger="vflow"):
        for _ in range(2):
            with pytest.raises(RuntimeError, match=_NCCL_STOPS_AT):
                job.run(lambda g, t: None, lambda ex, s: None, 1)  # type: ignore[arg-type, return-value]
    said = [r.getMessage() for r in caplog.records if "NCCL" in r.getMessage()]
    assert len(said) == 1 and "untested on several GPUs" in said[0], said
    assert os.environ[variable] == (chosen or "2")
    assert ("set it to 2" in said[0]) == (chosen == "3")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"rendezvous": "localhost"}, "rendezvous must be 'HOST:PORT'"),
        ({"rendezvous": "h:99999"}, "rendezvous must be 'HOST:PORT'"),
        ({"job_id": ""}, "job_id must be a non-empty string"),
        ({"min_workers": 0}, "min_workers must be an int >= 1"),
        ({"min_workers": 3, "max_workers": 2}, "max_workers must be >= min_workers"),
        ({"max_workers": 0}, "max_workers must be an int >= 1"),
        ({"timeout_s": 0}, "timeout_s must be a finite number > 0"),
        ({"group_timeout_s": 0}, "group_timeout_s must be a finite number > 0"),
        ({"join_deadline_s": -1.0}, "join_deadline_s must be a finite number > 0"),
        ({"gone_after_s": float("inf")}, "gone_after_s must be a finite number > 0"),
        ({"keep_alive_s": float("nan")}, "keep_alive_s must be a finite number > 0"),
        ({"last_call_s": -1}, "last_call_s must be a finite number >= 0"),
        ({"keep_alive_s": 0.25}, r"keep_alive_s \* keep_alive_attempts must be >= 2 s"),
        ({"backend": "mpi"}, "backend must be 'gloo' or 'nccl'"),
        ({"backend": "nccl", "gpu": -1}, "gpu must be an int >= 0 or None"),
        ({"backend": "nccl", "gpu": True}, "gpu must be an int >= 0 or None"),
        ({"gpu": 0}, "gpu=0 needs backend='nccl'"),
    ],
)
def test_bad_arguments_name_the_argument(kwargs: dict[str, Any], message: str) -> None:
    args = {"rendezvous": "127.0.0.1:1", "job_id": "j", **kwargs}
    with pytest.raises((ValueError, TypeError), match=message):
        ElasticJob(args.pop("rendezvous"), args.pop("job_id"), **args)


def test_a_gpu_the_worker_does_not_see_is_refused_before_it_connects() -> None:
    gpu = torch.cuda.device_count()
    job = ElasticJob("127.0.0.1:1", "nccl", store_timeout_s=1.0, backend="nccl", gpu=gpu)
    with pytest.raises(ValueError, match=f"gpu={gpu}: this process sees {gpu} GPU"):
        job.run(lambda g, t: None, lambda ex, s: None, 1)  # type: ignore[arg-type, return-value]


def test_max_workers_defaults_to_v_and_is_checked_before_joining(rendezvous: str) -> None:
    """max_workers=None is the executor's V, known once make_executor has run: below
    min_workers it is an error naming both, before the worker asks to join."""
    job = ElasticJob(rendezvous, f"v{os.getpid()}", min_workers=5, store_timeout_s=5.0)

    def make_executor(group: dist.ProcessGroup, timeout_s: float) -> Executor:
        model = torch.nn.Linear(2, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        return Executor(
            model, optimizer, lambda m, b: m(b).sum(), 4, process_group=group, timeout=timeout_s
        )

    with pytest.raises(ValueError, match="max_workers defaults to V=4, below min_workers=5"):
        job.run(make_executor, lambda ex, s: ex.step(torch.ones(4, 2)), 1)


def test_run_checks_its_arguments_before_connecting() -> None:
    job = ElasticJob("127.0.0.1:1", "j", store_timeout_s=1.0)
    with pytest.raises(ValueError, match="steps must be an int >= 0"):
        job.run(lambda g, t: None, lambda ex, s: None, -1)  # type: ignore[arg-type, return-value]
    with pytest.raises(TypeError, match="train_step must be callable"):
        job.run(lambda g, t: None, None, 1)  # type: ignore[arg-type, return-value]
