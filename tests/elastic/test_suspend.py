"""Whole jobs suspended and resumed (Note [Suspending a job], vflow/elastic/job.py):
worker processes (tests/support/elastic_worker.py) on a real store with a journal;
three workers suspend at one step (SIGUSR1 to one of them, or ``job.suspend()``), and
workers started later from the checkpoint, fewer than before, finish the job bitwise
as one process alone would have; the job's record, read from the store, goes running,
suspended, running (a new lineage), finished."""

from __future__ import annotations

import datetime
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import vflow
from tests.elastic.test_job import Job, _assert_same_training
from tests.support import elastic_worker
from tests.support.rendezvous import store_process, until, worker_rendezvous
from vflow.elastic import ElasticJob
from vflow.elastic import record as records

pytestmark = pytest.mark.slow

STEPS = 120


@pytest.fixture(scope="module")
def journal(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("store") / "journal.json"


@pytest.fixture(scope="module")
def rendezvous(journal: Path) -> Iterator[str]:
    command = [sys.executable, "-m", "vflow", "rendezvous", "--port", "0"]
    with store_process([*command, "--journal", str(journal)], stderr=subprocess.DEVNULL) as (
        _,
        endpoint,
    ):
        assert endpoint.startswith("127.0.0.1:"), endpoint
        yield endpoint


@pytest.fixture
def job(rendezvous: str, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Job]:
    name = "s" + str(abs(hash(request.node.nodeid)))[:12] + str(os.getpid())
    running = Job(rendezvous, tmp_path, name, workers=3)
    yield running
    running.kill()


def _client(endpoint: str) -> dist.TCPStore:
    host, port = endpoint.rsplit(":", 1)
    return dist.TCPStore(host, int(port), is_master=False, timeout=datetime.timedelta(seconds=10))


class Records:
    """The job's record as the store holds it, and every state it was seen in."""

    def __init__(self, job: Job) -> None:
        self.store, self.name = _client(job.endpoint), job.name
        self.seen: list[dict[str, Any]] = []

    def now(self) -> dict[str, Any] | None:
        record = records.read(self.store, self.name)[1]
        if record is not None and (not self.seen or self.seen[-1] != record):
            self.seen.append(record)
        return record

    def until(self, what: str, done: Any, timeout: float = 120.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            record = self.now()
            if record is not None and done(record):
                return record
            assert time.monotonic() < deadline, f"no {what} within {timeout:g} s: {self.seen}"
            time.sleep(0.02)


def _end(job: Job, worker: str) -> dict[str, Any]:
    ends = [line for line in job.lines(worker) if "events" in line]
    assert ends, f"{worker} wrote no end line:\n{job.stderr(worker)}"
    return ends[-1]


def _knocks(job: Job) -> int:
    return int(_client(job.endpoint).add(f"vflow/{job.name}/knocks", 0))


def _assert_suspended_together(job: Job, workers: str, ckpt: Path) -> int:
    """Every one of ``workers`` returned suspended at the same step k, its last event
    "suspend"; the checkpoint holds step k and loads. Returns k."""
    ends = {w: _end(job, w) for w in workers}
    steps = {w: (end["step"], end.get("suspended")) for w, end in ends.items()}
    k = ends[workers[0]]["step"]
    assert 0 < k < STEPS and steps == dict.fromkeys(workers, (k, k)), steps
    for worker, end in ends.items():
        assert end["events"][-1]["reason"] == "suspend", (worker, end["events"])
        assert end["events"][-1]["step"] == k and end["events"][-1]["workers"] == 3
        # No worker trained past the suspension.
        assert max(line["step"] for line in job.steps(worker)) == k - 1
    model, optimizer = elastic_worker.build()
    ex = vflow.Executor(
        model,
        optimizer,
        lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1]),
        elastic_worker.V,
        seed=elastic_worker.SEED,
        deterministic=True,
    )
    vflow.load(ckpt, ex)
    assert ex.step_count == k
    return k


def _wait_phase(job: Job, workers: str, timeout: float = 150.0) -> None:
    deadline = time.monotonic() + timeout
    for worker in workers:
        proc = job.procs[worker]
        code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        assert code == 0, f"{worker} exited with {code}:\n{job.stderr(worker)}"


def test_a_job_suspended_by_sigusr1_resumes_on_two_workers_bitwise(
    job: Job, tmp_path: Path, journal: Path
) -> None:
    """SIGUSR1 to one of three workers suspends the whole job at one step; a worker
    waiting for a place is told; two workers started later from the checkpoint finish
    it bitwise as one process would have."""
    ckpt = tmp_path / "job.pt"
    seen = Records(job)
    # --workers 99: never reached, so every step sleeps and the job outlasts the events.
    common = ("--checkpoint", str(ckpt), "--max-workers", "3", "--workers", "99")
    job.start("a", *common, steps=STEPS)
    job.wait_steps("a", 1)
    started = seen.until("record", lambda r: r["state"] == "running")
    job.start("b", *common, steps=STEPS)
    job.start("c", *common, steps=STEPS)
    deadline = time.monotonic() + 90
    while not any(line["workers"] == 3 for line in job.steps("a")):
        assert time.monotonic() < deadline, job.stderr("a")
        time.sleep(0.05)
    knocked = _knocks(job)
    job.start("w", *common, steps=STEPS)  # the set is full: it knocks and waits
    while _knocks(job) <= knocked:
        assert time.monotonic() < deadline and job.procs["w"].poll() is None, job.stderr("w")
        time.sleep(0.05)
    job.procs["c"].send_signal(signal.SIGUSR1)
    _wait_phase(job, "abcw")
    assert not list(tmp_path.glob(".job.pt.tmp-*"))  # written once, atomically
    k = _assert_suspended_together(job, "abc", ckpt)
    assert _end(job, "w") == {"events": [], "step": None, "suspended": k}, job.stderr("w")
    assert "was suspended at step" in job.stderr("w")
    suspended = seen.now()
    assert suspended == records.suspended(started, k), seen.seen
    assert json.loads(journal.read_text())["jobs"][job.name] == suspended

    job.workers = 2
    resume = ("--checkpoint", str(ckpt), "--workers", "2")
    job.start("d", *resume, steps=STEPS)
    job.start("e", *resume, steps=STEPS)
    resumed = seen.until("resumed record", lambda r: r["state"] != "suspended")
    _wait_phase(job, "de")
    assert seen.now() == dict(resumed, state="finished")
    assert resumed["state"] == "running" and resumed["resumes"] == 1, seen.seen
    assert resumed["lineage"] != started["lineage"] and "/resume1/" in resumed["lineage"]
    assert [r["state"] for r in seen.seen] == ["running", "suspended", "running", "finished"]
    _assert_same_training(job, STEPS)
    for worker in "de":
        reasons = [e["reason"] for e in _end(job, worker)["events"]]
        assert reasons[-1] == "finish" and reasons.count("suspend") == 0, reasons
        assert min(line["step"] for line in job.steps(worker)) == k
    assert "resume" in [e["reason"] for e in _end(job, "d")["events"] + _end(job, "e")["events"]]


def test_a_job_suspended_by_one_worker_resumes_alone_and_refuses_workers_without_it(
    job: Job, tmp_path: Path
) -> None:
    """``job.suspend()`` on one of three workers; workers without the checkpoint (no
    path, or a path with no file) are refused naming the job, the step and the path,
    and change nothing; one worker started from it finishes the job bitwise."""
    ckpt = tmp_path / "job.pt"
    seen = Records(job)
    job.start("a", "--checkpoint", str(ckpt), steps=STEPS)
    job.wait_steps("a", 1)
    started = seen.until("record", lambda r: r["state"] == "running")
    job.start("b", "--checkpoint", str(ckpt), steps=STEPS)
    job.start("c", "--checkpoint", str(ckpt), "--suspend-step", "2", steps=STEPS)
    _wait_phase(job, "abc")
    k = _assert_suspended_together(job, "abc", ckpt)
    suspended = seen.now()
    assert suspended == records.suspended(started, k)

    job.start("x", steps=STEPS)
    missing = tmp_path / "elsewhere.pt"
    job.start("y", "--checkpoint", str(missing), steps=STEPS)
    for worker in "xy":
        assert job.procs[worker].wait(timeout=90) == 1, job.stderr(worker)
        said = job.stderr(worker)
        assert f"job {job.name!r} on the store at {job.endpoint} was suspended at step {k}" in said
        assert not job.steps(worker)
    assert "pass checkpoint= (--checkpoint)" in job.stderr("x")
    assert f"its checkpoint is expected at {str(missing)!r}" in job.stderr("y")
    assert seen.now() == suspended

    job.workers = 1
    # --workers 2, never reached: the resumed job runs long enough to be seen running.
    job.start("d", "--checkpoint", str(ckpt), "--workers", "2", "--sleep", "0.05", steps=STEPS)
    resumed = seen.until("resumed record", lambda r: r["state"] != "suspended")
    _wait_phase(job, "d")
    assert resumed["state"] == "running" and resumed["resumes"] == 1, seen.seen
    assert seen.now() == dict(resumed, state="finished")
    _assert_same_training(job, STEPS)
    events = _end(job, "d")["events"]
    assert [e["reason"] for e in events] == ["resume", "finish"], events
    assert events[0]["step"] == k and events[0]["workers"] == 1


def test_sigusr1_without_a_checkpoint_is_logged_and_ignored(job: Job) -> None:
    job.workers = 1
    job.start("a", "--sigusr1-step", "3", steps=30)
    assert job.procs["a"].wait(timeout=90) == 0, job.stderr("a")
    assert "ERROR vflow: vflow elastic: SIGUSR1 ignored: job" in job.stderr("a")
    assert "cannot be suspended without a checkpoint" in job.stderr("a")
    assert "suspended" not in _end(job, "a")
    _assert_same_training(job, 30)


def test_a_programs_own_sigusr1_handler_stays_and_the_job_is_not_suspended(
    job: Job, tmp_path: Path
) -> None:
    # The elastic benchmark's workers arm a crash on SIGUSR1 before the job runs.
    job.workers = 1
    ckpt = tmp_path / "own.pt"
    job.start("a", "--checkpoint", str(ckpt), "--own-sigusr1", "--sigusr1-step", "3", steps=30)
    assert job.procs["a"].wait(timeout=90) == 0, job.stderr("a")
    assert {"own_sigusr1": 1} in job.lines("a")
    assert "suspended" not in _end(job, "a") and not ckpt.exists()
    _assert_same_training(job, 30)


def test_suspend_without_a_checkpoint_is_refused_before_anything_happens(
    tmp_path: Path,
) -> None:
    job = ElasticJob("127.0.0.1:1", "j", store_timeout_s=1.0)
    with pytest.raises(ValueError, match=r"cannot be suspended without a checkpoint: pass ch"):
        job.suspend()
    away = tmp_path / "no" / "such" / "dir.pt"
    job = ElasticJob("127.0.0.1:1", "j", store_timeout_s=1.0, checkpoint=str(away))
    with pytest.raises(ValueError, match="directory .* of its checkpoint=.* does not exist"):
        job.suspend()
    # Nothing was asked: the job's first run would not suspend.
    assert not job._suspend.is_set() and not job.suspended


def test_the_record_suspends_once_and_exactly_one_round_resumes_it(tmp_path: Path) -> None:
    """Note [Fencing a job] with suspension, on a journaled store: the suspended record
    is in the journal when ``suspend`` returns and survives a restart of the store;
    only a worker of the next generation claims it, one claim wins, and a released
    claim puts the suspended record back."""
    journal = tmp_path / "journal.json"
    command = [sys.executable, "-m", "vflow", "rendezvous", "--port", "0"]
    handles = []
    with store_process([*command, "--journal", str(journal)], stderr=subprocess.DEVNULL) as (
        _,
        endpoint,
    ):
        first, second = (worker_rendezvous(endpoint, "j") for _ in range(2))
        handles += [first, second]
        won = first.claim("vflow/j/boot/round0")
        second.joined(won)
        assert first.suspend(7) == second.suspend(7) == records.suspended(won, 7)
        stored = records.parse(_client(endpoint).get(records.record_key("j")))
        assert stored == {
            "lineage": "vflow/j/boot/round0",
            "epoch": 1,
            "state": "suspended",
            "step": 7,
        }
        assert json.loads(journal.read_text())["jobs"] == {"j": stored}
    port = endpoint.rsplit(":", 1)[1]
    again = [sys.executable, "-m", "vflow", "rendezvous", "--port", port]
    try:
        with store_process([*again, "--journal", str(journal)], stderr=subprocess.DEVNULL):
            third, fourth, late = (worker_rendezvous(endpoint, "j") for _ in range(3))
            handles += [third, fourth, late]
            restored = records.parse(_client(endpoint).get(records.record_key("j")))
            assert restored == dict(stored, restored=True)
            # Generation 0 (a worker that did not see the suspension) never claims it.
            assert late.claim("vflow/j/boot2/round0") == restored
            assert third.use_resumes(1) and fourth.use_resumes(1)
            won = third.claim("vflow/j/boot2/resume1/round0")
            assert won == records.running("vflow/j/boot2/resume1/round0", 1, 1)
            assert fourth.claim("vflow/j/boot2/resume1/round1") == won
            # A member of the winning round that claims second holds the job too, and
            # leaves the putting back of the suspended record to the claimer.
            member = worker_rendezvous(endpoint, "j")
            handles.append(member)
            assert member.use_resumes(1)
            assert member.claim("vflow/j/boot2/resume1/round0") == won and member.lineage == won
            member.release(won["lineage"])
            assert records.parse(_client(endpoint).get(records.record_key("j"))) == won
            third.release(won["lineage"])
            assert records.parse(_client(endpoint).get(records.record_key("j"))) == restored
            won = fourth.claim("vflow/j/boot2/resume1/round1")
            assert won["lineage"] == "vflow/j/boot2/resume1/round1" and won["resumes"] == 1
            assert json.loads(journal.read_text())["jobs"] == {"j": won}
            fourth.finish_record()
            until("the job out of the journal", lambda: not json.loads(journal.read_text())["jobs"])
    finally:
        for handle in handles:
            handle.close()


def _cluster_worker(endpoint: str, name: str, log: Path, *extra: str) -> list[str]:
    argv = [sys.executable, "-m", "vflow.demo.cluster_worker", "--rdzv", endpoint, "--job", name]
    argv += ["--steps", "40", "--virtual-nodes", "4", "--log", str(log), *extra]
    return argv


def _lines(log: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def test_cluster_workers_log_the_suspension_and_resume_from_the_checkpoint(
    rendezvous: str, tmp_path: Path
) -> None:
    """vflow/demo/cluster_worker.py: SIGUSR1 to one of two workers; both log
    ``{"suspended": true, "step": k}`` last and exit 0; one worker started later with
    the same --job and --checkpoint ends with the digest of an uninterrupted run."""
    name, ckpt = f"cw{os.getpid()}", tmp_path / "cw.pt"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    slow = ("--step-s", json.dumps({"1": 0.2, "2": 0.1}), "--checkpoint", str(ckpt))
    logs = [tmp_path / f"{w}.jsonl" for w in "ab"]
    procs = [
        subprocess.Popen(_cluster_worker(rendezvous, name, log, *slow), env=env, stderr=err)
        for log, err in ((log, open(log.with_suffix(".err"), "w")) for log in logs)
    ]
    try:
        until(
            "two workers training together",
            lambda: any(line.get("workers") == 2 for line in _lines(logs[0])),
            timeout=90,
        )
        procs[0].send_signal(signal.SIGUSR1)
        assert [proc.wait(timeout=90) for proc in procs] == [0, 0]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    lasts = [_lines(log)[-1] for log in logs]
    k = lasts[0]["step"]
    assert [{key: v for key, v in last.items() if key != "t"} for last in lasts] == [
        {"suspended": True, "step": k}
    ] * 2, lasts
    assert 0 < k < 40
    fast = ("--step-s", json.dumps({"1": 0.001}))
    resumed, alone = tmp_path / "c.jsonl", tmp_path / "alone.jsonl"
    for argv in (
        _cluster_worker(rendezvous, name, resumed, *fast, "--checkpoint", str(ckpt)),
        _cluster_worker(rendezvous, f"{name}alone", alone, *fast),
    ):
        subprocess.run(argv, env=env, check=True, capture_output=True, timeout=120)
    end = _lines(resumed)[-1]
    assert end["step"] == 40 and [e["reason"] for e in end["events"]] == ["resume", "finish"]
    assert end["params_sha256"] == _lines(alone)[-1]["params_sha256"]
    assert min(line["step"] for line in _lines(resumed) if "workers" in line) == k
