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
from typing import Any, cast

import pytest
import torch.distributed as dist

from vflow.cluster import runner
from vflow.cluster.launchers import LocalLauncher
from vflow.cluster.policies import get_policy
from vflow.cluster.runner import (
    DEFAULT_COMMAND,
    RunError,
    _Job,
    _medians,
    _resize_costs,
    _Worker,
    check_runnable,
    main,
    measured_costs,
    run_trace,
)
from vflow.cluster.simulator import MEASURED, Costs
from vflow.cluster.trace import parse_trace
from vflow.elastic.server import serve

pytest.importorskip("sklearn", reason="the workers train on scikit-learn's digits")
if not (dist.is_available() and dist.is_gloo_available()):
    pytest.skip("needs torch.distributed with Gloo", allow_module_level=True)

RUNNER = "import sys; from vflow.cluster.runner import main; sys.exit(main(sys.argv[1:]))"
RUN_TIMEOUT_S = 150.0  # the runner's own bound; the test waits a little longer
STEP_S = {"1": 0.4, "2": 0.22, "4": 0.12}
# A knock waits until no other came for a last call (1 s), at most 5 of them, then the
# members agree and build the new set (Note [A window for joiners],
# vflow/elastic/rendezvous.py): a worker ready this long before its job's end was late.
JOIN_S = 10.0
STARTUP_S = 20.0


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


def _start_runner(
    tmp_path: Path, trace: Path, policy: str, extra: list[str] | None = None,
    env: dict[str, str] | None = None,
) -> subprocess.Popen[bytes]:  # fmt: skip
    """``python -m vflow cluster run`` as a subprocess, its result to tmp_path/result.json."""
    argv = [sys.executable, "-c", RUNNER, "--trace", str(trace), "--policy", policy]
    argv += ["--out", str(tmp_path / "result.json"), "--workdir", str(tmp_path / "work")]
    argv += ["--timeout", str(RUN_TIMEOUT_S), *(extra or [])]
    env = dict(env or os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    return subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def _finish_runner(tmp_path: Path, runner: subprocess.Popen[bytes]) -> dict[str, Any]:
    """Waits for the runner (SIGTERM, then SIGKILL, if it outlives its own timeout)."""
    try:
        output, _ = runner.communicate(timeout=RUN_TIMEOUT_S + 30)
    except subprocess.TimeoutExpired:
        runner.send_signal(signal.SIGTERM)  # the runner kills its workers on the way out
        try:
            output, _ = runner.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            runner.kill()
            output, _ = runner.communicate()
        pytest.fail(f"the runner did not finish in time:\n{output.decode(errors='replace')}")
    text = output.decode(errors="replace")
    assert runner.returncode == 0, text
    return json.loads((tmp_path / "result.json").read_text())


def _run_runner(tmp_path: Path, trace: Path, policy: str) -> dict[str, Any]:
    return _finish_runner(tmp_path, _start_runner(tmp_path, trace, policy))


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


def _check_every_worker_got_in(job: dict[str, Any]) -> None:
    """A worker the runner launched and never asked to leave trained at least one step
    of the job (logged a step), unless the job ended before it could have: a grow the
    runner recorded but no worker took part in fails here.

    A worker that was ready (it knocks next) had until JOIN_S before the job's end to
    get in; one that never got ready, STARTUP_S from its launch (a Slurm job's start
    and the interpreter's imports, slow on a busy machine)."""
    for worker in job["workers"]:
        log = Path(worker["log"])
        lines = log.read_text().splitlines() if log.exists() else []
        trained = any("workers" in json.loads(line) for line in lines)
        if trained or worker["terminated_s"] is not None:
            continue
        if worker["ready_s"] is not None:
            assert worker["ready_s"] > job["end_s"] - JOIN_S, (job["name"], worker)
        else:
            assert worker["launched_s"] > job["end_s"] - STARTUP_S, (job["name"], worker)


def _one_worker_digest(tmp_path: Path, name: str, steps: int, seed: int) -> str:
    """The job trained by one worker alone, without the emulated device time: the
    digest of its final parameters."""
    store = serve("127.0.0.1", 0)
    log = tmp_path / f"{name}-alone.jsonl"
    argv = [sys.executable, "-m", "vflow.demo.cluster_worker", "--rdzv", f"127.0.0.1:{store.port}"]
    argv += ["--job", name, "--steps", str(steps), "--virtual-nodes", "4", "--seed", str(seed)]
    argv += ["--step-s", json.dumps({"1": 0.001}), "--log", str(log)]
    subprocess.run(argv, check=True, capture_output=True, timeout=300)
    del store
    return json.loads(log.read_text().splitlines()[-1])["params_sha256"]


def _digests(job: dict[str, Any]) -> set[str]:
    """The final digests the job's workers logged (those there at its last step)."""
    found = set()
    for worker in job["workers"]:
        for line in Path(worker["log"]).read_text().splitlines() if worker["ready_s"] else []:
            record = json.loads(line)
            if record.get("step") == job["steps"] and "params_sha256" in record:
                found.add(record["params_sha256"])
    return found


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
    _check_every_worker_got_in(j1)
    _check_every_worker_got_in(j2)
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
    _check_every_worker_got_in(big)
    _check_every_worker_got_in(small)


# las with a queue limit of 5 worker-seconds and no interval: when b arrives, a has had
# its 2 workers for 10 s and sits in the lower queue, so b preempts it (a is suspended
# whole, its state in its checkpoint); when b is done, a resumes.
LAS_JOBS = [_job("a", 0.0, 2, 70), _job("b", 10.0, 2, 15)]
LAS_FLAGS = ["--las-threshold-s", "5", "--interval-s", "10000"]


def _check_las_run(tmp_path: Path, result: dict[str, Any]) -> None:
    """The las trace (LAS_JOBS) preempted a for b and resumed it, bitwise."""
    _check_fixed_fields(result, "las")
    assert [d["allocation"] for d in result["decisions"]] == [
        {"a": 2},
        {"a": 0, "b": 2},
        {"a": 2},
    ]
    a, b = result["jobs"]
    assert [(r["kind"], r["to"]) for r in a["resizes"]] == [
        ("start", 2),
        ("preempt", 0),
        ("restart", 2),
    ]
    suspended = {w["suspended_step"] for w in a["workers"] if w["suspended_step"] is not None}
    assert len(suspended) == 1  # every worker of the set stopped at the same step
    (step,) = suspended
    _check_steps_exactly_once(a, 70)
    after = _step_times(a, range(step, 70), result["config"]["started_at"])
    assert 0 < step < 70 and min(after) > b["end_s"] - 1.0  # nothing ran while b did
    _check_every_worker_got_in(a)
    _check_every_worker_got_in(b)
    assert _digests(a) == {_one_worker_digest(tmp_path, "a", 70, 0)}
    assert result["measured"]["restart_s"] is not None


def test_las_preempts_a_job_and_resumes_it_from_its_checkpoint_bitwise(tmp_path: Path) -> None:
    trace = _write_trace(tmp_path / "trace.json", 2, LAS_JOBS)
    result = _finish_runner(tmp_path, _start_runner(tmp_path, trace, "las", LAS_FLAGS))
    _check_las_run(tmp_path, result)


def _step_times(job: dict[str, Any], steps: range, t0: float) -> list[float]:
    """When each of ``steps`` was logged (seconds from the run's start), by any worker."""
    times = []
    for worker in job["workers"]:
        log = Path(worker["log"])
        for line in log.read_text().splitlines() if log.exists() else []:
            record = json.loads(line)
            if record.get("step") in steps and "workers" in record:
                times.append(record["t"] - t0)
    return times


# ---- refused input: exit status 2, nothing written --------------------------------------


def _refused(tmp_path: Path, argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    assert main(argv) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["trace.json"]
    return capsys.readouterr().err


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"policy": "fifo"}, "policy must be one of"),
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


def test_check_runnable_accepts_the_default_command_and_every_policy() -> None:
    trace = parse_trace({"slots": 2, "jobs": [_job("a", 0.0, 1, 5)]})
    for name in ("priority", "las", "wfs", "wfs-any"):
        check_runnable(trace, get_policy(name))
        check_runnable(trace, get_policy(name), DEFAULT_COMMAND)
    # A preempted job resumes from its checkpoint: under las, a template must pass it.
    no_checkpoint = "{python} worker.py {log}"
    check_runnable(trace, get_policy("wfs"), no_checkpoint)
    with pytest.raises(ValueError, match=r"job 'a': policy 'las' preempts .* \{checkpoint\}"):
        check_runnable(trace, get_policy("las"), no_checkpoint)


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


# A stand-in that suspends as an elastic job does (Note [Preemption]): on SIGUSR1 it saves
# the next step to its checkpoint after the step under way, logs it and exits; started
# again, it goes on from there.
SUSPENDING_WORKER = """
import json, os, signal, sys, time
log, steps, checkpoint = sys.argv[1], int(sys.argv[2]), sys.argv[3]
asked = []
signal.signal(signal.SIGUSR1, lambda *_: asked.append(True))
first = int(open(checkpoint).read()) if os.path.exists(checkpoint) else 0
with open(log, "a") as f:
    def say(**record):
        f.write(json.dumps({"t": time.time(), **record}) + "\\n")
        f.flush()
    say(ready=True)
    for step in range(first, steps):
        time.sleep(0.05)
        say(step=step, workers=1, rank=0)
        if asked:
            with open(checkpoint + ".tmp", "w") as c:
                c.write(str(step + 1))
            os.replace(checkpoint + ".tmp", checkpoint)
            say(suspended=True, step=step + 1)
            sys.exit(0)
"""


def test_a_preemptive_policy_suspends_a_job_and_restarts_it_from_its_checkpoint(
    tmp_path: Path,
) -> None:
    script = tmp_path / "suspending_worker.py"
    script.write_text(SUSPENDING_WORKER)
    command = f"{{python}} {script} {{log}} {{steps}} {{checkpoint}}"
    # las, a queue limit of 0.5 worker-seconds: when b arrives, a (1 worker for 0.8 s) is
    # in the lower queue and b is not, so b preempts it; when b is done, a restarts.
    trace = parse_trace({"slots": 1, "jobs": [_job("a", 0.0, 1, 40), _job("b", 0.8, 1, 10)]})
    policy = get_policy("las", las_thresholds_s=[0.5], interval_s=1000.0)
    result = run_trace(trace, policy, tmp_path / "work", command=command, timeout_s=60)
    assert [d["allocation"] for d in result["decisions"]] == [
        {"a": 1},
        {"a": 0, "b": 1},
        {"a": 1},
    ]
    a, b = result["jobs"]
    assert [(r["kind"], r["from"], r["to"]) for r in a["resizes"]] == [
        ("start", 0, 1),
        ("preempt", 1, 0),
        ("restart", 0, 1),
    ]
    first, second = a["workers"]
    assert first["suspended_step"] is not None and first["cause"] == "exited"
    assert second["launched_s"] >= b["end_s"] - 0.5  # b ran alone on the slot
    assert _check_steps_exactly_once(a, 40) == dict.fromkeys(range(40), 1)
    restart = next(c for c in result["measured"]["costs"] if c["kind"] == "restart")
    assert restart["job"] == "a" and restart["cost_s"] > 0
    assert result["measured"]["restart_s"] is not None
    assert measured_costs(result).restart_s == result["measured"]["restart_s"]


# ---- failures: events, RunError when a job is lost, and no process left -------------------


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


# The first worker to start fails (status 3); every later one runs the steps.
FIRST_FAILS = (
    """
import os, sys
marker = sys.argv.pop()
try:
    os.close(os.open(marker, os.O_CREAT | os.O_EXCL))
except FileExistsError:
    pass
else:
    sys.exit(3)
"""
    + FAKE_WORKER
)


def test_a_worker_that_fails_is_an_event_and_its_job_gets_another(tmp_path: Path) -> None:
    script = tmp_path / "first_fails.py"
    script.write_text(FIRST_FAILS)
    command = f"{{python}} {script} {{log}} {{steps}} {tmp_path / 'failed-once'}"
    trace = parse_trace({"slots": 2, "jobs": [_job("a", 0.0, 2, 20, command=command)]})
    result = run_trace(trace, get_policy("wfs"), tmp_path / "work", timeout_s=60)
    (job,) = result["jobs"]
    (failure,) = job["failures"]
    assert (failure["cause"], failure["returncode"]) == ("failed", 3)
    lost = failure["worker"]
    decisions = result["decisions"]
    assert decisions[0]["allocation"] == {"a": 2}
    # The failure is a decision of its own: the slot is free, the policy gives it back.
    assert decisions[1]["why"] == [f"a lost worker {lost} (failed)"]
    assert decisions[1]["allocation"] == {"a": 2}
    assert [(r["kind"], r["from"], r["to"]) for r in job["resizes"]] == [
        ("start", 0, 2),
        ("failure", 2, 1),
        ("grow", 1, 2),
    ]
    assert len(job["workers"]) == 3 and job["steps"] == 20
    causes = [w["cause"] for w in job["workers"]]
    assert causes.count("failed") == 1 and causes.count("exited") == 2


def test_a_job_that_loses_every_worker_stops_the_run(tmp_path: Path) -> None:
    command = "{python} -c 'import sys; print(\"out of memory\"); sys.exit(3)' {log}"
    trace = parse_trace({"slots": 2, "jobs": [_job("a", 0.0, 1, 5, command=command)]})
    with pytest.raises(RunError, match="(?s)job 'a': every worker ended.*status 3.*out of memory"):
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
    job = _Job(trace.jobs[0], ["true", "{log}"], tmp_path, LocalLauncher())
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


def test_a_start_after_a_release_measures_the_release_and_its_start_apart(tmp_path: Path) -> None:
    # Note [Slots released late]: a is preempted at 10 (running since its first step at
    # 3) and b, started at the same decision, needed its slots; c is preempted at 30 while
    # still starting (its first step at 34), and d waited for them.
    specs = parse_trace({"slots": 2, "jobs": [_job(n, 0.0, 2, 50) for n in "abcd"]}).jobs
    jobs = {spec.name: _Job(spec, ["true", "{log}"], tmp_path, LocalLauncher()) for spec in specs}

    def history(
        name: str,
        resizes: list[tuple[float, str, int, bool]],
        workers: list[tuple[float, float, float]],
    ) -> None:
        job = jobs[name]
        for t, kind, to, after_release in resizes:
            job.resizes.append({"t": t, "from": 0, "to": to, "kind": kind, "at_new_size_s": None})
            if kind in ("start", "restart"):
                job.resizes[-1]["after_release"] = after_release
        for index, (launched, placed, first_step) in enumerate(workers):
            # The measurements read no handle: none is made.
            worker = _Worker(index, cast(Any, None), tmp_path, tmp_path, launched, placed)
            worker.steps = [
                {"step": k, "t": first_step + k, "workers": len(workers), "rank": index}
                for k in range(5)
            ]
            job.workers.append(worker)

    history("a", [(0.0, "start", 2, False), (10.0, "preempt", 0, False)], [(0.0, 0.0, 3.0)] * 2)
    history("b", [(10.0, "start", 2, True)], [(10.0, 14.5, 18.0), (10.0, 15.0, 18.0)])
    history("c", [(25.0, "start", 2, False), (30.0, "preempt", 0, False)], [(25.0, 25.0, 34.0)] * 2)
    history("d", [(30.0, "start", 2, True)], [(30.0, 37.0, 40.0)] * 2)
    steps = {name: job.steps() for name, job in jobs.items()}
    releases = runner._release_costs(list(jobs.values()), steps)
    # b: its last worker placed 5 s after a could stop; d: 3 s after c's first step.
    assert [(r["job"], r["t"], r["cost_s"]) for r in releases] == [
        ("b", 10.0, 5.0),
        ("d", 30.0, 3.0),
    ]
    b = jobs["b"]
    (start,) = _resize_costs(b, b.steps(), _medians(b.steps()))
    # b's start, from its placement at 15: first step at 18, less that step's 1 s.
    assert start["cost_s"] == pytest.approx(18.0 - 15.0 - 1.0)
    assert runner._simulator_costs(releases)["release_s"] == pytest.approx(4.0)


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
    expected = Costs(2.5, 1.2, 0.0, 2.5, 1.5, MEASURED.release_s)
    assert dataclasses.astuple(simulator) == pytest.approx(dataclasses.astuple(expected))
    # starts of one size only: their median, nothing per worker; no grow seen: vflow's
    one_size = runner._simulator_costs([{"kind": "start", "to": 2, "cost_s": c} for c in (3, 5, 4)])
    assert one_size["start_s"] == 4 and one_size["start_per_worker_s"] == 0.0
    assert one_size["grow_s"] is None
    assert runner.measured_costs({"measured": one_size}).grow_s == MEASURED.grow_s
