"""vflow/cluster/runner.py: real runs of small traces (an elastic policy that grows and
shrinks a running job, a static one that queues a job), checked against the workers'
own step logs; input refused before anything starts; worker failures and the run's
timeout, with every process gone afterwards; the measurements on made-up step logs.

The real runs use a runner subprocess, stopped with SIGTERM (which makes it kill its
workers) and then SIGKILL if it outlives its time, so that no failure hangs the suite."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from vflow.cluster import runner
from vflow.cluster.policies import get_policy
from vflow.cluster.runner import (
    DEFAULT_COMMAND,
    RunError,
    _Job,
    _medians,
    _resize_costs,
    check_runnable,
    main,
    run_trace,
)
from vflow.cluster.simulator import MEASURED, Costs
from vflow.cluster.trace import parse_trace

pytest.importorskip("sklearn", reason="the workers train on scikit-learn's digits")
if not (dist.is_available() and dist.is_gloo_available()):
    pytest.skip("needs torch.distributed with Gloo", allow_module_level=True)

RUNNER = "import sys; from vflow.cluster.runner import main; sys.exit(main(sys.argv[1:]))"
RUN_TIMEOUT_S = 150.0  # the runner's own bound; the test waits a little longer
STEP_S = {"1": 0.4, "2": 0.22, "4": 0.12}


def _job(name: str, arrival_s: float, demand: int, steps: int, **extra: Any) -> dict[str, Any]:
    return {
        "name": name,
        "arrival_s": arrival_s,
        "demand": demand,
        "priority": 1,
        "virtual_nodes": 4,
        "steps": steps,
        "step_s": STEP_S,
        **extra,
    }


def _write_trace(path: Path, slots: int, jobs: list[dict[str, Any]]) -> Path:
    path.write_text(json.dumps({"slots": slots, "jobs": jobs}))
    return path


def _run_runner(tmp_path: Path, trace: Path, policy: str) -> dict[str, Any]:
    out = tmp_path / "result.json"
    argv = [sys.executable, "-c", RUNNER, "--trace", str(trace), "--policy", policy]
    argv += ["--out", str(out), "--workdir", str(tmp_path / "work")]
    argv += ["--timeout", str(RUN_TIMEOUT_S)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    runner = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        output, _ = runner.communicate(timeout=RUN_TIMEOUT_S + 30)
    except subprocess.TimeoutExpired:
        runner.send_signal(signal.SIGTERM)  # the runner kills its workers on the way out
        try:
            output, _ = runner.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            runner.kill()
            output, _ = runner.communicate()
        pytest.fail(f"the runner did not finish in time:\n{output.decode(errors='replace')}")
    text = output.decode(errors="replace")
    assert runner.returncode == 0, text
    return json.loads(out.read_text())


def _check_steps_exactly_once(job: dict[str, Any], steps: int) -> dict[int, int]:
    """Every step of the job logged once by each of its workers, ranks 0..w-1; returns
    the worker count of each step."""
    lines: dict[int, list[dict[str, Any]]] = {}
    for worker in job["workers"]:
        log = Path(worker["log"])
        if not log.exists():  # a worker stopped before it had imported anything
            continue
        for line in log.read_text().splitlines():
            record = json.loads(line)
            if "step" in record and "workers" in record:
                lines.setdefault(record["step"], []).append(record)
    assert sorted(lines) == list(range(steps)), job["name"]
    sizes = {}
    for step, records in lines.items():
        size = records[0]["workers"]
        assert sorted(r["rank"] for r in records) == list(range(size)), (job["name"], step)
        assert all(r["workers"] == size for r in records)
        sizes[step] = size
    return sizes


def _check_fixed_fields(result: dict[str, Any], policy: str) -> None:
    assert result["policy"] == policy
    for job in result["jobs"]:
        assert job["jct_s"] == pytest.approx(job["end_s"] - job["arrival_s"])
        assert job["arrival_s"] <= job["start_s"] < job["end_s"]
    jcts = [job["jct_s"] for job in result["jobs"]]
    assert result["avg_jct_s"] == pytest.approx(sum(jcts) / len(jcts))
    assert result["makespan_s"] == pytest.approx(max(job["end_s"] for job in result["jobs"]))
    for worker in (w for job in result["jobs"] for w in job["workers"]):
        assert worker["exited_s"] is not None
        assert worker["returncode"] in (0, -signal.SIGTERM)


def test_an_elastic_policy_grows_a_job_alone_and_shrinks_it_for_a_newcomer(
    tmp_path: Path,
) -> None:
    # wfs: j1 (demand 1, V 4) alone takes the whole cluster; j2 arriving takes its share
    # (2), and j1 shrinks to the rest. j1 is long enough to be running then, and most
    # likely to outlive j2; either way, the one left takes the whole cluster again. Which
    # one that is depends on how long j2's start takes on a busy machine (3 to 20 s).
    trace = _write_trace(
        tmp_path / "trace.json", 4, [_job("j1", 0.0, 1, 200), _job("j2", 10.0, 2, 25)]
    )
    result = _run_runner(tmp_path, trace, "wfs")
    _check_fixed_fields(result, "wfs")
    decisions = result["decisions"]
    assert decisions[0]["why"] == ["j1 arrived"] and decisions[0]["allocation"] == {"j1": 4}
    assert decisions[1]["why"] == ["j2 arrived"]
    assert decisions[1]["allocation"] == {"j1": 2, "j2": 2}
    assert decisions[1]["t"] == pytest.approx(10.0, abs=1.0)
    assert all(sum(d["allocation"].values()) <= 4 for d in decisions)
    j1, j2 = result["jobs"]
    assert [(r["kind"], r["from"], r["to"]) for r in j1["resizes"][:2]] == [
        ("start", 0, 4),
        ("shrink", 4, 2),
    ]
    assert [(r["kind"], r["to"]) for r in j2["resizes"][:1]] == [("start", 2)]
    first, last = sorted((j1, j2), key=lambda job: job["end_s"])
    if len(decisions) == 2:  # both ended within one poll of the runner: nothing to hand over
        assert last["end_s"] - first["end_s"] < 1.0
        grown: list[dict[str, Any]] = []
    else:
        assert len(decisions) == 3
        assert decisions[2]["why"] == [f"{first['name']} finished"]
        assert decisions[2]["allocation"] == {last["name"]: 4}
        grown = [{"kind": "grow", "from": 2, "to": 4}]
    resizes_before = {"j1": 2, "j2": 1}
    assert len(first["resizes"]) == resizes_before[first["name"]]
    handed_over = last["resizes"][resizes_before[last["name"]] :]
    assert [{k: r[k] for k in ("kind", "from", "to")} for r in handed_over] == grown
    assert all(r["t"] >= first["end_s"] for r in handed_over)
    assert 2 in _check_steps_exactly_once(j1, 200).values()
    # A start may form its first round without a worker that is slower to get ready (the
    # last call is 1 s), which then joins as a grow; a grow from 2 to 4 may pass through 3.
    j2_sizes = set(_check_steps_exactly_once(j2, 25).values())
    assert j2_sizes <= {1, 2, 3, 4} and (max(j2_sizes) <= 2 or last is j2)
    measured = result["measured"]
    # The emulated device time is what the trace says, within the noise of a busy machine.
    assert measured["step_s"]["j1"]["2"] == pytest.approx(0.22, rel=0.25)
    if 2 in j2_sizes:
        assert measured["step_s"]["j2"]["2"] == pytest.approx(0.22, rel=0.25)
    assert measured["start_s"] is not None and measured["start_s"] > 0
    trace_jobs = {job["name"]: job for job in result["measured_trace"]["jobs"]}
    assert trace_jobs["j1"]["step_s"]["2"] == measured["step_s"]["j1"]["2"]
    if "1" in measured["step_s"]["j2"]:  # a start without its slower worker: measured
        assert 1 in j2_sizes
        assert trace_jobs["j2"]["step_s"]["1"] == measured["step_s"]["j2"]["1"]
    else:  # never run on 1: the trace's value is kept
        assert trace_jobs["j2"]["step_s"]["1"] == STEP_S["1"]
    parse_trace(result["measured_trace"])


def test_a_static_policy_queues_a_job_until_the_cluster_is_free(tmp_path: Path) -> None:
    trace = _write_trace(
        tmp_path / "trace.json", 2, [_job("big", 0.0, 2, 15), _job("small", 1.0, 1, 10)]
    )
    result = _run_runner(tmp_path, trace, "priority")
    _check_fixed_fields(result, "priority")
    big, small = result["jobs"]
    assert [d["allocation"] for d in result["decisions"]] == [
        {"big": 2},
        {"big": 2, "small": 0},
        {"small": 1},
    ]
    assert small["start_s"] >= big["end_s"]
    assert [(r["kind"], r["to"]) for r in big["resizes"]] == [("start", 2)]
    assert [(r["kind"], r["to"]) for r in small["resizes"]] == [("start", 1)]
    big_sizes = set(_check_steps_exactly_once(big, 15).values())
    assert big_sizes in ({2}, {1, 2})  # a slow worker may join the first round's job later
    assert set(_check_steps_exactly_once(small, 10).values()) == {1}


# ---- refused input: exit status 2, nothing written --------------------------------------


def _refused(tmp_path: Path, argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    assert main(argv) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["trace.json"]
    return capsys.readouterr().err


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"policy": "fifo"}, "policy must be one of"),
        ({"policy": "las"}, "preempts jobs"),
        ({"trace": "missing.json"}, "cannot read the trace"),
        ({"out": "nowhere/result.json"}, "does not exist"),
        ({"timeout": "0"}, "--timeout"),
        ({"workdir": "trace.json"}, "--workdir"),
    ],
)
def test_refuses_bad_input_before_starting_anything(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], change: dict[str, str], message: str
) -> None:
    _write_trace(tmp_path / "trace.json", 2, [_job("a", 0.0, 1, 5)])
    flags = {"trace": "trace.json", "policy": "wfs", "out": "result.json", "timeout": "60"}
    flags.update(change)
    flags = {k: v if k in ("policy", "timeout") else str(tmp_path / v) for k, v in flags.items()}
    argv = [word for key, value in flags.items() for word in (f"--{key}", value)]
    assert message in _refused(tmp_path, argv, capsys)


def test_refuses_a_bad_trace_and_a_bad_command_template(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "trace.json"
    argv = ["--trace", str(trace), "--policy", "wfs", "--out", str(tmp_path / "result.json")]
    trace.write_text(json.dumps({"slots": 2, "jobs": [_job("a", 0.0, 3, 5)]}))
    assert "more than the cluster's 2 slots" in _refused(tmp_path, argv, capsys)
    trace.write_text(json.dumps({"slots": 2, "jobs": [_job("a", 0.0, 1, 5, command="x {nope}")]}))
    assert "unknown placeholder" in _refused(tmp_path, argv, capsys)
    trace.write_text(json.dumps({"slots": 2, "jobs": [_job("a", 0.0, 1, 5, command="true")]}))
    assert "must pass {log}" in _refused(tmp_path, argv, capsys)


def test_check_runnable_accepts_the_default_command_and_every_policy_but_las() -> None:
    trace = parse_trace({"slots": 2, "jobs": [_job("a", 0.0, 1, 5)]})
    for name in ("priority", "wfs", "wfs-any"):
        check_runnable(trace, get_policy(name))
        check_runnable(trace, get_policy(name), DEFAULT_COMMAND)
    with pytest.raises(ValueError, match="preempts"):
        check_runnable(trace, get_policy("las"))


# A stand-in worker for the event loop's own tests: logs its steps and exits, no torch.
FAKE_WORKER = """
import json, sys, time
log, steps = sys.argv[1], int(sys.argv[2])
with open(log, "a") as f:
    f.write(json.dumps({"t": time.time(), "ready": True}) + "\\n")
    for step in range(steps):
        time.sleep(0.05)
        f.write(json.dumps({"t": time.time(), "step": step, "workers": 1, "rank": 0}) + "\\n")
        f.flush()
"""


def test_a_policy_with_an_interval_is_consulted_between_events(tmp_path: Path) -> None:
    script = tmp_path / "fake_worker.py"
    script.write_text(FAKE_WORKER)
    command = f"{{python}} {script} {{log}} {{steps}}"
    trace = parse_trace({"slots": 2, "jobs": [_job("a", 0.0, 1, 20), _job("b", 0.3, 1, 20)]})
    policy = get_policy("priority", interval_s=0.25)
    result = run_trace(trace, policy, tmp_path / "work", command=command, timeout_s=60)
    whys = [why for decision in result["decisions"] for why in decision["why"]]
    assert whys[0] == "a arrived"
    assert {"b arrived", "a finished"} <= set(whys)  # no decision after the last job
    assert whys.count("interval") >= 2  # the jobs run about 1 s
    assert [job["steps"] for job in result["jobs"]] == [20, 20]
    assert result["measured"]["step_s"]["a"]["1"] == pytest.approx(0.05, abs=0.04)


# ---- failures: RunError, and no process left ---------------------------------------------


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_a_failing_worker_stops_the_run(tmp_path: Path) -> None:
    command = "{python} -c 'import sys; sys.exit(3)' {log}"
    trace = parse_trace({"slots": 2, "jobs": [_job("a", 0.0, 1, 5, command=command)]})
    with pytest.raises(RunError, match="job 'a': worker 0 exited with status 3"):
        run_trace(trace, get_policy("wfs"), tmp_path / "work", timeout_s=60)


def test_the_run_timeout_kills_every_worker(tmp_path: Path) -> None:
    command = "{python} -c 'import os, time; print(os.getpid(), flush=True); time.sleep(60)' {log}"
    trace = parse_trace({"slots": 2, "jobs": [_job("a", 0.0, 2, 5, command=command)]})
    began = time.monotonic()
    with pytest.raises(RunError, match="did not finish within"):
        run_trace(trace, get_policy("priority"), tmp_path / "work", timeout_s=2.0)
    assert time.monotonic() - began < 20
    for output in sorted((tmp_path / "work" / "a").glob("worker-*.out")):
        text = output.read_text().split()
        assert text and _gone(int(text[0])), output


# ---- measurements on made-up step logs ----------------------------------------------------


def test_measures_step_times_and_resize_costs(tmp_path: Path) -> None:
    trace = parse_trace({"slots": 4, "jobs": [_job("a", 0.0, 1, 12)]})
    job = _Job(trace.jobs[0], ["true", "{log}"], tmp_path)
    job.resizes = [
        {"t": 0.0, "from": 0, "to": 1, "kind": "start", "at_new_size_s": None},
        {"t": 5.0, "from": 1, "to": 2, "kind": "grow", "at_new_size_s": None},
    ]
    # Start: first step at 3.0, then 1 s per step on one worker; the grow's joiner takes
    # until after step 6 (at 7.0), the first step on two workers ends at 7.8, then 0.5 s.
    steps = [(k, 3.0 + k, 1) for k in range(5)] + [(5, 8.0, 1)]
    steps += [(6, 8.8, 2)] + [(k, 8.8 + 0.5 * (k - 6), 2) for k in range(7, 12)]
    medians = _medians(steps)
    assert medians == pytest.approx({1: 1.0, 2: 0.5})
    costs = _resize_costs(job, steps, medians)
    assert [r["at_new_size_s"] for r in job.resizes] == [3.0, 8.8]
    start, grow = costs
    assert (start["kind"], start["steps"]) == ("start", 1)
    assert start["cost_s"] == pytest.approx(3.0 - 1.0)
    # Steps 3 to 6 end in (5.0, 8.8]: the job lost 3.8 s less four steps at 0.5 s.
    assert (grow["kind"], grow["steps"]) == ("grow", 4)
    assert grow["cost_s"] == pytest.approx(3.8 - 4 * 0.5)


def test_the_simulators_costs_come_from_the_samples() -> None:
    samples = [
        {"kind": "start", "to": 1, "cost_s": 4.0},
        {"kind": "start", "to": 2, "cost_s": 5.5},
        {"kind": "start", "to": 8, "cost_s": 14.5},
        {"kind": "grow", "to": 4, "cost_s": 1.0},
        {"kind": "grow", "to": 8, "cost_s": 3.0},
        {"kind": "grow", "to": 2, "cost_s": 1.2},
        {"kind": "shrink", "to": 1, "cost_s": -0.4},
    ]
    costs = runner._simulator_costs(samples)
    # starts on a line: 2.5 s + 1.5 s per worker; a shrink below 0 is free
    assert costs["start_s"] == pytest.approx(2.5)
    assert costs["start_per_worker_s"] == pytest.approx(1.5)
    assert costs["grow_s"] == pytest.approx(1.2) and costs["shrink_s"] == 0.0
    simulator = runner.measured_costs({"measured": costs})
    expected = Costs(2.5, 1.2, 0.0, 2.5, 1.5)
    assert dataclasses.astuple(simulator) == pytest.approx(dataclasses.astuple(expected))
    # starts of one size only: their median, nothing per worker; no grow seen: vflow's
    one_size = runner._simulator_costs([{"kind": "start", "to": 2, "cost_s": c} for c in (3, 5, 4)])
    assert one_size["start_s"] == 4 and one_size["start_per_worker_s"] == 0.0
    assert one_size["grow_s"] is None
    assert runner.measured_costs({"measured": one_size}).grow_s == MEASURED.grow_s
