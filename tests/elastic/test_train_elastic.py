"""examples/train_elastic.py as a user runs it: the README's lines ("### Elastic jobs"),
as written but for the port and the ``--out`` path, start the store and a worker; the
same line started again adds a worker, which then dies of SIGKILL, and once more adds
another; or the same line with another ``--seed`` or ``--virtual-nodes``, or the
example with one more layer or loading the state too slowly
(tests/support/altered_example.py), which the job refuses. The job ends with an
``--out`` file bitwise equal to the same line run alone under another job id. The store
and every worker are subprocesses; every wait is bounded and every process is killed at
the end."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import vflow
from tests.support import REPO_ROOT
from tests.support.elastic_lines import (
    README_PORT,
    WAIT_S,
    Workers,
    readme_store,
    reasons,
    worker_env,
)
from tests.support.rendezvous import store_process
from tests.support.several_hosts import assert_bitwise_equal, readme_lines
from vflow.demo import load_digits_split

pytest.importorskip("sklearn", reason="the example trains on scikit-learn's digits")
if not (dist.is_available() and dist.is_gloo_available()):
    pytest.skip("needs torch.distributed with Gloo", allow_module_level=True)

SCRIPT = REPO_ROOT / "examples" / "train_elastic.py"
README = REPO_ROOT / "README.md"
REQUIRED = ("--rdzv", "--job", "--steps", "--virtual-nodes", "--seed", "--deterministic", "--out")


def _readme_lines() -> tuple[list[str], list[str]]:
    """The store's and the worker's command lines of README.md's "### Elastic jobs", as
    words."""
    return readme_lines("### Elastic jobs")


def test_help_lists_the_required_flags() -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--help"],
        env=worker_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    for flag in REQUIRED:
        assert flag in done.stdout, f"--help does not list {flag}"
    assert "python -m vflow rendezvous" in done.stdout


@contextmanager
def _running(
    words: list[str], port: int, tmp_path: Path, extra: Sequence[str] = (), **alone: str
) -> Iterator[tuple[Workers, Path, Path]]:
    """``words`` (plus ``extra`` flags, for every worker) on the store at ``port``,
    started twice: alone under another job id (the reference, which writes the second
    path; ``alone``: its flags' other values) and as worker "a" of the job (which writes
    the first), once it trains. Every worker is killed on the way out."""
    out, alone_out = tmp_path / "final.pt", tmp_path / "alone.pt"
    workers = Workers(words, port, tmp_path, extra)
    try:
        workers.start("alone", job="alone", out=str(alone_out), **alone)
        workers.start("a", out=str(out))
        workers.wait_for("a", "A training", lambda e: "start" in reasons(e))
        yield workers, out, alone_out
    finally:
        workers.kill_all()


@contextmanager
def _readme_job(tmp_path: Path, extra: Sequence[str] = ()) -> Iterator[tuple[Workers, Path, Path]]:
    """The README's store and its worker line, _running."""
    store, worker = _readme_lines()
    with readme_store(store, tmp_path) as port, _running(worker, port, tmp_path, extra) as job:
        yield job


@pytest.mark.slow
def test_the_readme_lines_grow_crash_and_grow_again_bitwise_as_one_worker(tmp_path: Path) -> None:
    _, worker = _readme_lines()
    steps = int(worker[worker.index("--steps") + 1])
    with _readme_job(tmp_path) as (workers, out, alone):
        workers.start("b", out=str(out))
        workers.wait_for("a", "B joining", lambda e: "grow" in reasons(e))
        workers.procs["b"].kill()
        assert workers.procs["b"].wait(timeout=30) == -signal.SIGKILL
        # C starts once A trains alone again, so that it joins a running job rather than
        # the survivors' recovery.
        workers.wait_for("a", "A going on without B", lambda e: "crash" in reasons(e))
        workers.start("c", out=str(out))
        codes = workers.wait(["a", "c", "alone"], timeout=120)
        assert codes == {"a": 0, "c": 0, "alone": 0}, workers.stderr("a")[-4000:]

    a = workers.events("a")
    assert reasons(a) == ["start", "grow", "crash", "grow", "finish"], a
    assert [n for _, n, _ in a] == [1, 2, 1, 2, 2], a
    assert a[-1][0] == steps
    assert workers.events("c") == [(a[3][0], 2, "start"), (steps, 2, "finish")]
    assert workers.events("alone") == [(0, 1, "start"), (steps, 1, "finish")]
    # A says what happened to B and what the job did, calmly, without the raw error.
    crashed_at = a[2][0]
    log = workers.stderr("a")
    assert f"vflow elastic: worker lost during step {crashed_at}; re-forming the worker set" in log
    assert f"vflow elastic: redoing step {crashed_at} with 1 worker (1 lost)" in log
    assert "vflow step" not in log and "Connection" not in log and "timeout" not in log
    assert_bitwise_equal(torch.load(out, weights_only=True), torch.load(alone, weights_only=True))
    assert torch.load(out, weights_only=True)["step"] == steps


@pytest.mark.slow
def test_joiners_with_other_settings_are_refused_and_the_job_finishes_bitwise(
    tmp_path: Path,
) -> None:
    """The README's worker line joined by the same line with another --seed, then
    another --virtual-nodes, then with an LR schedule (a registered state the members do
    not have): each newcomer exits with status 1 naming what differs, and
    the running job never notices beyond a warning (Note [Refusing newcomers])."""
    with _readme_job(tmp_path) as (workers, out, alone):
        for name, flag, value, named in (
            ("seed", "seed", "1", "seed=1"),
            ("vns", "virtual-nodes", "4", "virtual_nodes=4"),
            ("schedule", "lr-schedule", "onecycle", "register_state names ['lr_scheduler']"),
        ):
            if f"--{flag}" in workers.words:
                workers.start(name, **{flag: value})
            else:
                workers.start(name, more=[f"--{flag}", value])
            assert workers.procs[name].wait(timeout=WAIT_S) == 1, workers.stderr(name)
            said = workers.stderr(name)
            assert "refused by the members" in said and named in said, said[-4000:]
        codes = workers.wait(["a", "alone"], timeout=120)
        assert codes == {"a": 0, "alone": 0}, workers.stderr("a")[-4000:]
    assert reasons(workers.events("a")) == ["start", "finish"], workers.events("a")
    assert "were refused" in workers.stderr("a")
    assert_bitwise_equal(torch.load(out, weights_only=True), torch.load(alone, weights_only=True))


@pytest.mark.slow
def test_a_joiner_with_another_model_or_too_slow_is_refused_and_the_job_finishes_bitwise(
    tmp_path: Path,
) -> None:
    """The README's worker line (with a 5 s --timeout for all) joined by the example
    with one more layer, then by the example loading the state 8 s too slowly (past the
    join deadline, timeout_s): each exits with status 1 saying why, and the job goes on
    to an --out bitwise equal to the one-worker run."""
    with _readme_job(tmp_path, extra=["--timeout", "5"]) as (workers, out, alone):
        workers.start("wider", change="wider-model")
        assert workers.procs["wider"].wait(timeout=WAIT_S) == 1, workers.stderr("wider")
        said = workers.stderr("wider")
        assert "refused by the members" in said and "model layout" in said, said[-4000:]
        workers.start("slow", change="slow-load=8")
        assert workers.procs["slow"].wait(timeout=WAIT_S) == 1, workers.stderr("slow")
        said = workers.stderr("slow")
        assert "did not join the worker set within the join deadline" in said, said[-4000:]
        codes = workers.wait(["a", "alone"], timeout=120)
        assert codes == {"a": 0, "alone": 0}, workers.stderr("a")[-4000:]
    assert reasons(workers.events("a")) == ["start", "finish"], workers.events("a")
    assert "were refused" in workers.stderr("a")
    assert_bitwise_equal(torch.load(out, weights_only=True), torch.load(alone, weights_only=True))


def _job_lines(log: Path, pids: set[int]) -> list[dict[str, Any]]:
    lines = [json.loads(line) for line in log.read_text(encoding="utf-8").splitlines()]
    return [line for line in lines if line.get("pid") in pids]


def _scheduled_line(job: str, steps: int, *extra: str) -> list[str]:
    """The example's line with a OneCycleLR schedule and 2 DataLoader worker processes,
    sleeping 0.2 s before each step until the worker set changed 4 times (the
    scenarios have at most 4 changes: the first worker holds their pace until their
    last event, however long the others take to start), plus ``extra``."""
    return [
        str(REPO_ROOT / ".venv" / "bin" / "python"),
        str(SCRIPT),
        "--rdzv",
        f"127.0.0.1:{README_PORT}",
        "--job",
        job,
        "--steps",
        str(steps),
        "--virtual-nodes",
        "8",
        "--seed",
        "0",
        "--deterministic",
        "--out",
        "final.pt",
        "--sleep",
        "0.2",
        "--sleep-until-changes",
        "4",
        "--lr-schedule",
        "onecycle",
        "--loader-workers",
        "2",
        *extra,
    ]


@pytest.mark.slow
def test_a_schedule_and_a_dataloader_through_join_crash_and_leave_bitwise(tmp_path: Path) -> None:
    """The example with a OneCycleLR schedule and 2 DataLoader worker processes: B joins
    mid-schedule, C joins and is killed (SIGKILL), B leaves (SIGTERM); the job ends
    bitwise where the same flags end on one worker, scheduler included, and the batch
    log shows every step's global batch trained exactly once, by a complete worker
    set. A sleeps before each step until B has left (its fourth change), so that the
    scenario fits in the schedule however long B and C take to start."""
    steps, batch = 200, 64
    log = tmp_path / "steps.jsonl"
    words = _scheduled_line("scheduled", steps, "--batch-size", str(batch), "--log", str(log))
    with (
        store_process() as (_, endpoint),
        _running(words, int(endpoint.rsplit(":", 1)[1]), tmp_path, sleep="0") as running,
    ):
        workers, out, alone = running
        a_pid = workers.procs["a"].pid
        # B starts a tenth into the schedule; with its start-up it joins near 30 %.
        _wait_for_step(log, a_pid, steps // 10, workers)
        workers.start("b", out=str(out))
        workers.wait_for("a", "B joining", lambda e: reasons(e).count("grow") == 1)
        workers.start("c", out=str(out))
        workers.wait_for("a", "C joining", lambda e: reasons(e).count("grow") == 2)
        workers.procs["c"].kill()
        assert workers.procs["c"].wait(timeout=30) == -signal.SIGKILL
        workers.wait_for("a", "A going on without C", lambda e: "crash" in reasons(e))
        workers.procs["b"].terminate()
        codes = workers.wait(["a", "b", "alone"], timeout=120)
        assert codes == {"a": 0, "b": 0, "alone": 0}, workers.stderr("a")[-4000:]

    events = workers.events("a")
    assert reasons(events) == ["start", "grow", "grow", "crash", "leave", "finish"], events
    assert [n for _, n, _ in events] == [1, 2, 3, 2, 1, 1], events
    assert 0 < events[1][0] <= events[4][0] < steps, events  # all mid-schedule
    got, want = torch.load(out, weights_only=True), torch.load(alone, weights_only=True)
    assert_bitwise_equal(got, want)
    assert got["scheduler"] == want["scheduler"] and got["scheduler"]["last_epoch"] == steps

    # Every step's global batch, trained once by a complete worker set.
    # The whole global batch of each step: one worker's part under the one-worker plan.
    whole = vflow.VNBatchSampler(
        len(load_digits_split(0)[1]), batch, vflow.Plan.even(8, 1), 0, seed=0
    )
    lines = _job_lines(log, {workers.procs[name].pid for name in ("a", "b", "c")})
    alone_lines = _job_lines(log, {workers.procs["alone"].pid})
    assert [line["step"] for line in alone_lines if "step" in line][:steps] == list(range(steps))
    lr_of = {line["step"]: line["lr"] for line in alone_lines if "lr" in line}
    assert len(set(lr_of.values())) > steps // 2  # the schedule moved the LR
    by_step: dict[int, list[dict[str, Any]]] = {}
    for line in lines:
        if "step" in line and "samples" in line:
            by_step.setdefault(line["step"], []).append(line)
    assert sorted(by_step) == list(range(steps))
    for step, at in by_step.items():
        assert len({line["pid"] for line in at}) == len(at), f"step {step} ran twice: {at}"
        workers_of_step = {line["workers"] for line in at}
        assert len(workers_of_step) == 1 and len(at) == workers_of_step.pop(), at
        trained = [i for line in sorted(at, key=lambda x: x["rank"]) for i in line["samples"]]
        assert trained == whole.step_indices(step)[0], f"step {step}"
        assert all(line["lr"] == lr_of[step] for line in at), f"step {step}: {at}"


def _wait_for_step(log: Path, pid: int, step: int, workers: Workers) -> None:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        if log.exists() and any(line.get("step", -1) >= step for line in _job_lines(log, {pid})):
            return
        time.sleep(0.05)
    raise AssertionError(f"A did not reach step {step}:\n{workers.stderr('a')[-4000:]}")


@pytest.mark.slow
def test_a_suspended_job_resumes_with_its_schedule_and_dataloader_bitwise(tmp_path: Path) -> None:
    """The example with a OneCycleLR schedule and 2 DataLoader worker processes, on two
    workers: SIGUSR1 to one suspends both at one step (exit status 0, the state in
    --checkpoint); the same line started again, once, resumes from that step and ends
    bitwise where the flags end on one worker without a stop, scheduler included
    (Note [Suspending a job])."""
    steps = 100
    ckpt = tmp_path / "job.pt"
    words = _scheduled_line("suspended", steps, "--checkpoint", str(ckpt))
    with (
        store_process() as (_, endpoint),
        _running(words, int(endpoint.rsplit(":", 1)[1]), tmp_path, sleep="0") as running,
    ):
        workers, out, alone = running
        workers.start("b", out=str(out))
        workers.wait_for("a", "B joining", lambda e: "grow" in reasons(e))
        workers.procs["b"].send_signal(signal.SIGUSR1)
        codes = workers.wait(["a", "b"], timeout=120)
        assert codes == {"a": 0, "b": 0}, workers.stderr("a")[-4000:]
        assert not out.exists()
        suspended = workers.events("a")[-1]
        assert suspended[2] == "suspend" and workers.events("b")[-1] == suspended
        assert f"job 'suspended' suspended at step {suspended[0]}" in workers.stderr("b")
        workers.start("c", out=str(out), sleep="0")
        codes = workers.wait(["c", "alone"], timeout=120)
        assert codes == {"c": 0, "alone": 0}, workers.stderr("c")[-4000:]
    assert workers.events("c") == [(suspended[0], 1, "resume"), (steps, 1, "finish")]
    got, want = torch.load(out, weights_only=True), torch.load(alone, weights_only=True)
    assert_bitwise_equal(got, want)
    assert got["scheduler"] == want["scheduler"] and got["scheduler"]["last_epoch"] == steps
