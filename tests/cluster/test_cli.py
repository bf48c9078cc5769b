"""``python -m vflow cluster simulate|generate``: the command-line contract of the issue
(flags, TRACE.json in, RESULT.json out), and refused input that writes nothing."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cluster.test_trace import job
from tests.support import REPO_ROOT
from vflow.cluster import cli

TRACE = {"slots": 8, "jobs": [job()]}


def _write(path: Path, data: object) -> Path:
    path.write_text(json.dumps(data))
    return path


def test_simulate_writes_the_contracts_result(tmp_path: Path) -> None:
    trace = _write(tmp_path / "trace.json", TRACE)
    out = tmp_path / "result.json"
    done = subprocess.run(
        [sys.executable, "-m", "vflow", "cluster", "simulate", "--trace", str(trace),
         "--policy", "wfs", "--out", str(out), "--grow-s", "0", "--shrink-s", "0",
         "--start-s", "0"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    result = json.loads(out.read_text())
    assert result["policy"] == "wfs"
    # alone on 8 slots with V = 8: 1000 steps x 0.13 s
    assert result["avg_jct_s"] == pytest.approx(130.0)
    assert result["makespan_s"] == pytest.approx(130.0)
    (record,) = result["jobs"]
    assert {"name", "arrival_s", "start_s", "end_s", "jct_s"} <= set(record)
    assert record["jct_s"] == pytest.approx(record["end_s"] - record["arrival_s"])


def test_the_costs_default_to_vflows_measured_ones(tmp_path: Path) -> None:
    trace = _write(tmp_path / "trace.json", TRACE)
    out = tmp_path / "result.json"
    assert (
        cli.main(["simulate", "--trace", str(trace), "--policy", "priority", "--out", str(out)])
        == 0
    )
    result = json.loads(out.read_text())
    assert result["costs"] == {
        "start_s": 2.6,
        "grow_s": 0.85,
        "shrink_s": 0.2,
        "restart_s": 2.6,
        "start_per_worker_s": 0.0,
        "release_s": 0.0,
    }
    assert result["avg_jct_s"] == pytest.approx(2.6 + 420.0)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"demand": 9}, "job 'j1': demand 9 is more than the cluster's 8 slots"),
        ({"step_s": {"16": 0.1}}, "job 'j1': step_s has no usable worker count"),
        ({"arrival_s": -5}, "job 'j1': arrival_s must be a finite number >= 0"),
    ],
)
def test_a_bad_trace_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], change: dict, message: str
) -> None:
    bad = {"slots": 8, "jobs": [{**TRACE["jobs"][0], **change}]}
    trace = _write(tmp_path / "trace.json", bad)
    out = tmp_path / "result.json"
    assert cli.main(["simulate", "--trace", str(trace), "--policy", "wfs", "--out", str(out)]) == 2
    assert message in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["trace.json"]


def test_bad_flags_are_refused_naming_the_flag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = _write(tmp_path / "trace.json", TRACE)
    base = ["simulate", "--trace", str(trace), "--out", str(tmp_path / "r.json")]
    for argv, message in [
        ([*base, "--policy", "fifo"], "argument --policy: invalid choice: 'fifo'"),
        (
            [*base, "--policy", "wfs", "--grow-s", "-1"],
            "argument --grow-s: must be a number of seconds >= 0",
        ),
        (
            [
                "simulate",
                "--trace",
                str(trace),
                "--policy",
                "wfs",
                "--out",
                str(tmp_path / "no" / "r.json"),
            ],
            "does not exist",
        ),
    ]:
        with pytest.raises(SystemExit) as stop:
            cli.main(argv)
        assert stop.value.code == 2
        assert message in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["trace.json"]


def test_generate_writes_a_trace_that_simulates(tmp_path: Path) -> None:
    trace = tmp_path / "trace.json"
    assert cli.main(["generate", "--seed", "3", "--jobs", "12", "--out", str(trace)]) == 0
    data = json.loads(trace.read_text())
    assert data["slots"] == 8 and len(data["jobs"]) == 12
    out = tmp_path / "result.json"
    assert (
        cli.main(["simulate", "--trace", str(trace), "--policy", "wfs-any", "--out", str(out)]) == 0
    )
    assert len(json.loads(out.read_text())["jobs"]) == 12
    # the same seed draws the same trace
    again = tmp_path / "again.json"
    assert cli.main(["generate", "--seed", "3", "--jobs", "12", "--out", str(again)]) == 0
    assert again.read_text() == trace.read_text()
    with pytest.raises(SystemExit):
        cli.main(["generate", "--out", str(tmp_path / "x.json"), "--slots", "0"])


def test_the_readmes_cluster_commands_run_as_written(tmp_path: Path) -> None:
    readme = (REPO_ROOT / "README.md").read_text()
    lines = [
        line.strip()
        for line in readme.splitlines()
        if line.strip().startswith(".venv/bin/python -m vflow cluster ")
    ]
    assert len(lines) >= 3
    for line in lines:
        argv = shlex.split(line)[3:]  # after ".venv/bin/python -m vflow"
        done = subprocess.run(
            [sys.executable, "-m", "vflow", *argv],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, f"{line}\n{done.stderr}"
    priority = json.loads((tmp_path / "priority.json").read_text())
    wfs = json.loads((tmp_path / "wfs.json").read_text())
    assert wfs["avg_jct_s"] < priority["avg_jct_s"]
