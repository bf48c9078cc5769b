"""``python -m vflow cluster run --backend slurm`` on a real Slurm (tests/support/slurm.py):
a trace played to the end with one Slurm job per worker, each job's final model bitwise
its one-worker run; a node lost mid-run costs its jobs workers, not the run; bad input
refused before anything is submitted."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.cluster.test_runner import (
    LAS_FLAGS,
    LAS_JOBS,
    _check_every_worker_got_in,
    _check_las_run,
    _check_steps_exactly_once,
    _digests,
    _finish_runner,
    _job,
    _one_worker_digest,
    _start_runner,
    _write_trace,
)
from tests.support import slurm

pytestmark = [
    pytest.mark.alone,  # five daemons and a job's workers beside the tests would starve them
    pytest.mark.skipif(bool(slurm.missing()), reason=f"Slurm tests: {slurm.missing()}"),
]
pytest.importorskip("sklearn", reason="the workers train on scikit-learn's digits")


def _check_workers(job: dict[str, Any], completed: dict[str, dict[str, str]]) -> None:
    """One Slurm job per worker, named <job>.<n>; each worker on a GPU Slurm gave it,
    which it would make its own (Note [A worker's GPU]);
    every worker not asked to leave got in."""
    for index, worker in enumerate(job["workers"]):
        record = completed[worker["id"]]
        assert record["JobName"] == f"{job['name']}.{index}"
        if worker["ready_s"] is not None:
            assert worker["host"] == worker["where"] == record["NodeList"]
            assert worker["device"] in ("0", "1")
            assert worker["gpu"] == 0  # its own GPU, the first of what Slurm bound it
    _check_every_worker_got_in(job)


def test_a_trace_runs_on_slurm_one_job_per_worker_and_ends_bitwise(tmp_path: Path) -> None:
    # wfs on 4 GPUs: a alone takes them all, b's arrival shrinks a to 2 and starts b on
    # 2; whichever ends first hands its GPUs to the other.
    trace = _write_trace(
        tmp_path / "trace.json", 4, [_job("a", 0.0, 1, 120), _job("b", 12.0, 2, 30)]
    )
    with slurm.LocalSlurm(nodes=2, gpus=2) as cluster:
        runner = _start_runner(tmp_path, trace, "wfs", ["--backend", "slurm"], cluster.env)
        result = _finish_runner(tmp_path, runner)
        completed = cluster.completed()
    a, b = result["jobs"]
    assert result["config"]["launcher"]["backend"] == "slurm"
    assert result["config"]["launcher"]["partition"] == "main"
    workers = [w for job in (a, b) for w in job["workers"]]
    assert sorted(w["id"] for w in workers) == sorted(completed)  # sacct: one Slurm job per worker
    for job in (a, b):
        _check_workers(job, completed)
        assert job["failures"] == []
    assert result["decisions"][0]["allocation"] == {"a": 4}
    assert result["decisions"][1]["allocation"] == {"a": 2, "b": 2}
    a_sizes = _check_steps_exactly_once(a, 120)
    assert {4, 2} <= set(a_sizes.values())  # the grow and the shrink, in its steps
    b_sizes = _check_steps_exactly_once(b, 30)
    assert max(b_sizes.values()) >= 2
    assert _digests(a) == {_one_worker_digest(tmp_path, "a", 120, 0)}
    assert _digests(b) == {_one_worker_digest(tmp_path, "b", 30, 1)}


def test_a_lost_node_costs_its_jobs_workers_not_the_run(tmp_path: Path) -> None:
    trace = _write_trace(tmp_path / "trace.json", 4, [_job("a", 0.0, 4, 260)])
    logs = tmp_path / "work" / "a"

    def steps_at(size: int) -> int:
        count = 0
        for log in logs.glob("worker-*.jsonl"):
            for line in log.read_text().splitlines():
                count += json.loads(line).get("workers") == size
        return count

    def until(what: str, ready: Any) -> None:
        deadline = time.monotonic() + 120
        while not ready():
            assert runner.poll() is None, runner.communicate()[0].decode(errors="replace")
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            time.sleep(0.2)

    with slurm.LocalSlurm(nodes=2, gpus=2) as cluster:
        runner = _start_runner(tmp_path, trace, "wfs", ["--backend", "slurm"], cluster.env)
        until("steps on 4 workers", lambda: steps_at(4) >= 4 * 10)
        losing_at = time.time()  # nothing ends, so nothing is decided, until n2 is down
        cluster.lose_node("n2")
        until("steps on 2 workers", lambda: steps_at(2) >= 2 * 10)
        # The runner may see n2 back before restore_node returns (it waits for idle).
        restoring_at = time.time()
        cluster.restore_node("n2")
        result = _finish_runner(tmp_path, runner)
    (job,) = result["jobs"]
    t0 = result["config"]["started_at"]
    # Both workers on n2 lost, as failures of the job; the run went on.
    assert [f["cause"] for f in job["failures"]] == ["node_fail", "node_fail"]
    assert {f["where"] for f in job["failures"]} == {"n2"}
    # While n2 was down the policy had 2 GPUs to give, and gave no more.
    between = [d for d in result["decisions"] if losing_at - t0 < d["t"] < restoring_at - t0]
    assert between and all(d["slots"] == 2 and sum(d["allocation"].values()) <= 2 for d in between)
    after = [d for d in result["decisions"] if d["t"] > restoring_at - t0]
    assert after and after[0]["slots"] == 4 and after[-1]["allocation"] == {"a": 4}
    sizes = list(_check_steps_exactly_once(job, 260).values())
    # 4 workers, then 2 after the loss, then 4 again once n2 returned.
    first_two = sizes.index(2)
    assert 4 in sizes[:first_two] and 4 in sizes[first_two:]
    assert _digests(job) == {_one_worker_digest(tmp_path, "a", 260, 0)}


def test_las_on_slurm_suspends_a_job_and_resumes_it_bitwise(tmp_path: Path) -> None:
    trace = _write_trace(tmp_path / "trace.json", 2, LAS_JOBS)
    with slurm.LocalSlurm(nodes=1, gpus=2) as cluster:
        flags = ["--backend", "slurm", *LAS_FLAGS]
        runner = _start_runner(tmp_path, trace, "las", flags, cluster.env)
        result = _finish_runner(tmp_path, runner)
        completed = cluster.completed()
    _check_las_run(tmp_path, result)
    for job in result["jobs"]:
        _check_workers(job, completed)


def test_refuses_what_slurm_cannot_run_before_submitting(tmp_path: Path) -> None:
    trace = _write_trace(tmp_path / "trace.json", 8, [_job("a", 0.0, 1, 5)])
    out = tmp_path / "result.json"
    with slurm.LocalSlurm(nodes=2, gpus=2) as cluster:
        for extra, message in [
            ([], "the trace's slots (8) exceed partition 'main''s 4 (gres gpu:1 each)"),
            (["--partition", "gpu"], "--partition: no partition 'gpu' on this cluster"),
        ]:
            argv = [sys.executable, "-m", "vflow", "cluster", "run", "--backend", "slurm"]
            argv += ["--trace", str(trace), "--policy", "wfs", "--out", str(out), *extra]
            done = subprocess.run(argv, env=cluster.env, capture_output=True, text=True)
            assert done.returncode == 2, done.stderr
            assert message in done.stderr and len(done.stderr.strip().splitlines()) == 1
        assert cluster.squeue() == {} and cluster.completed() == {}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["trace.json"]
