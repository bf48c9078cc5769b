"""benchmarks/cluster.py: its pure parts on hand-made inputs (the workload's load and
las threshold, V cut to the demand, the sweep's break-even, the real run's comparison),
and its quick run end to end: the JSON's rows, verdicts and headline records."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.support import REPO_ROOT
from tests.support.benchmark_scripts import load_script
from vflow.bench.records import evaluate
from vflow.cluster import MEASURED, VIRTUALFLOW, generate

cluster = load_script("cluster")


def test_the_workloads_load_and_las_threshold() -> None:
    # Log-uniform run times in [300, 2400] s: mean 2100 / ln 8 = 1010 s; demand 3.75.
    load = 12 / 3600 * (2100 / math.log(8)) * 3.75 / 8
    assert cluster.offered_load(VIRTUALFLOW) == pytest.approx(load)
    # Eight times the slots and the arrivals: the same load per slot.
    assert cluster.offered_load(cluster.SCALE_SHAPE) == pytest.approx(load)
    (limit,) = cluster.las_thresholds_s(VIRTUALFLOW)
    assert limit == pytest.approx(math.sqrt(300 * 2400) * 3.75)
    (scaled,) = cluster.las_thresholds_s(VIRTUALFLOW.scaled(time_scale=30.0))
    assert scaled == pytest.approx(limit / 30)


def test_cutting_v_to_the_demand_caps_every_job_there() -> None:
    trace = generate(VIRTUALFLOW, 0)
    capped = cluster.capped_at_demand(trace)
    assert [job.max_workers for job in capped.jobs] == [job.demand for job in trace.jobs]
    assert any(job.max_workers > job.demand for job in trace.jobs)
    assert [job.steps for job in capped.jobs] == [job.steps for job in trace.jobs]


def _point(cost_s: float, wfs: float, wfs_any: float) -> dict[str, Any]:
    return {
        "grow_s": cost_s,
        "shrink_s": cost_s,
        "wfs": {"median": wfs},
        "wfs-any": {"median": wfs_any},
    }


def test_the_break_even_is_interpolated_on_log_cost() -> None:
    points = [_point(10.0, 0.5, 0.6), _point(100.0, 0.8, 1.2), _point(1000.0, 1.4, 1.5)]
    # wfs: 0.8 at 100 s, 1.4 at 1000 s: a third of the way, on log c.
    assert cluster.break_even_s(points, "wfs") == pytest.approx(10 ** (2 + 1 / 3))
    assert cluster.break_even_s(points, "wfs-any") == pytest.approx(10 ** (1 + 0.4 / 0.6))
    assert cluster.break_even_s(points[:2], "wfs") is None  # pays at every point
    assert cluster.break_even_s([_point(1.0, 1.1, 1.0)], "wfs") == 1.0


def _run(jcts: dict[str, float]) -> dict[str, Any]:
    return {
        "avg_jct_s": sum(jcts.values()) / len(jcts),
        "jobs": [{"name": name, "jct_s": jct} for name, jct in jcts.items()],
    }


def test_the_real_run_against_the_prediction() -> None:
    real = _run({"j1": 100.0, "j2": 200.0, "j3": 300.0})
    predicted = _run({"j1": 130.0, "j2": 190.0, "j3": 310.0})
    c = cluster.compare_real(real, predicted)
    assert c["avg_error"] == pytest.approx(630 / 600 - 1) and c["avg_met"]
    assert (c["worst_job"], c["jobs_within"], c["jobs_met"]) == ("j1", 2, False)
    assert c["worst_error"] == pytest.approx(0.3)


@pytest.mark.slow
def test_quick_run_writes_every_row_and_verdict(tmp_path: Path) -> None:
    out, plot = tmp_path / "cluster.json", tmp_path / "cdf.png"
    proc = subprocess.run(
        [
            sys.executable,
            "benchmarks/cluster.py",
            "--quick",
            "--json",
            str(out),
            "--plot",
            str(plot),
        ],
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert plot.stat().st_size > 0
    records = json.loads(out.read_text(encoding="utf-8"))
    detail = records[0]
    assert detail["benchmark"] == "cluster" and detail["shape"]["jobs"] == 20
    study = detail["study"]
    assert study["seeds"] == [0, 1, 2, 3, 4]
    assert set(study["medians"]) == {"priority", "las", "wfs", "wfs-any"}
    for name in ("wfs", "wfs-any"):
        stats = study["vs_priority"][name]
        assert len(stats["ratios"]) == 5 and stats["min"] <= stats["median"] <= stats["max"]
    sweep = detail["sweep"]
    costs = [point["grow_s"] for point in sweep["points"]]
    assert costs[:7] == [MEASURED.grow_s, 5.0, 30.0, 100.0, 250.0, 500.0, 1000.0]
    assert set(sweep["break_even_s"]) == {"wfs", "wfs-any"}
    assert set(detail["scale"]) == {"priority", "las", "wfs", "wfs-any"}
    for row in detail["scale"].values():
        assert len(row["wall_s"]) == 1 and row["met"] == (row["median_wall_s"] < 10.0)
    assert "real" not in detail
    rows = {row.key: row for row in (evaluate(r) for r in records[1:])}
    assert set(rows) == {
        "cluster/wfs-vs-priority/avg-jct",
        "cluster/wfs-any-vs-priority/avg-jct",
        *(f"cluster/scale-1000/{name}" for name in ("priority", "las", "wfs", "wfs-any")),
    }
    wfs = rows["cluster/wfs-vs-priority/avg-jct"]
    assert wfs.ratio == pytest.approx(study["vs_priority"]["wfs"]["median"])
    assert wfs.result in ("met", "MISSED") and wfs.target == "<= 0.52"
    assert all(rows[f"cluster/scale-1000/{n}"].result in ("met", "MISSED") for n in ("wfs", "las"))
    assert "results (targets printed, not asserted)" in proc.stdout


def test_the_suite_runs_it() -> None:
    runner = load_script("run")
    bench = runner.BENCHMARKS["cluster"]
    assert bench.script == "cluster.py" and bench.in_suite and not bench.takes_device
    assert "cluster" in runner.suite_names()
