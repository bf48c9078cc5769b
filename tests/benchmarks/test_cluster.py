"""benchmarks/cluster.py: its pure parts on hand-made inputs (the workload's load and
las threshold, V cut to the demand, the sweep's break-even, the real run's comparison),
its simulated results pinned, and its quick run end to end: the JSON's rows, verdicts
and headline records."""

from __future__ import annotations

import json
import math
import os
import statistics
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

# The quick run's simulated results, pinned: the workload generator (random.Random(seed)),
# the simulator and the policies are deterministic, so two runs agree to the last bit
# and any change to one of them fails here. rel=1e-9 leaves room for a libm that rounds
# a last bit differently, nothing more. When a change is meant, take the new values from
# `python benchmarks/cluster.py --quick --json PATH` and say why they moved.
PINNED = 1e-9
QUICK_SEEDS = 5
# Per seed 0..4 of VIRTUALFLOW, vflow's measured costs: the policy's average JCT over
# priority's. (las moved by < 0.1 % when a preempted job came to keep its step in flight,
# Note [The simulator's model].)
VS_PRIORITY = {
    "las": [
        0.8898317079580996,
        0.9704226480931847,
        0.5125967062646771,
        0.5643734606375052,
        1.1426184080499202,
    ],
    "wfs": [
        0.41836023018784624,
        0.5648456056043407,
        0.34421302451907365,
        0.2736503168238247,
        0.6149080948577743,
    ],
    "wfs-any": [
        0.4505932541742472,
        0.568876106654995,
        0.35757168390556265,
        0.27941825076452764,
        0.6684593096889025,
    ],
}
# The headline ratios, the medians of those above (seed 0's for both): wfs cuts the
# average JCT by 58 % and wfs-any by 55 %, both past the paper's 48 % (TARGET_RATIO 0.52).
HEADLINE = {"wfs": 0.41836023018784624, "wfs-any": 0.4505932541742472}
# The median over the seeds of each trace's average JCT, seconds.
MEDIAN_AVG_JCT_S = {
    "priority": 5317.312670286049,
    "las": 3402.9691891759394,
    "wfs": 1830.2882765527527,
    "wfs-any": 1901.3204453665664,
}
# Median ratios: VirtualFlow's cap (V cut to the demand) against priority, and wfs-any
# against wfs (its uneven counts cost 4 % here).
CAPPED_VS_PRIORITY = {"wfs": 0.5095397930632356, "wfs-any": 0.5140508411244404}
WFS_ANY_VS_WFS = 1.038809279239661
# The sweep's grow = shrink costs (measured, the planned ones, then doubled while an
# elastic policy still pays) and the cost where each stops paying.
SWEEP_COSTS_S = [MEASURED.grow_s, 5.0, 30.0, 100.0, 250.0, 500.0, 1000.0, 2000.0]
BREAK_EVEN_S = {"wfs": 1728.4508674471358, "wfs-any": 1636.9091336872798}
# The 1,000-job run (seed 0 of SCALE_SHAPE): average JCT and makespan in seconds,
# resizes. Its wall time is real time, not pinned.
SCALE = {
    "priority": (12595.446811510343, 60845.34820288833, 0),
    "las": (11587.080076116015, 58422.62473069936, 2004),
    "wfs": (4333.569909578891, 42529.61762750691, 1211),
    "wfs-any": (4379.402466489994, 42637.185789073446, 1418),
}


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


def test_the_study_and_the_sweep_give_the_pinned_results() -> None:
    # In process, so that the pins hold in the fast suite too (about 0.3 s).
    study = cluster.study(VIRTUALFLOW, QUICK_SEEDS)
    for name, ratios in VS_PRIORITY.items():
        assert study["vs_priority"][name]["ratios"] == pytest.approx(ratios, rel=PINNED)
        assert study["vs_priority"][name]["median"] == pytest.approx(
            statistics.median(ratios), rel=PINNED
        )
    medians = {name: m["avg_jct_s"] for name, m in study["medians"].items()}
    assert medians == pytest.approx(MEDIAN_AVG_JCT_S, rel=PINNED)
    capped = {name: c["vs_priority"]["median"] for name, c in study["capped_at_demand"].items()}
    assert capped == pytest.approx(CAPPED_VS_PRIORITY, rel=PINNED)
    assert study["wfs_any_vs_wfs"]["median"] == pytest.approx(WFS_ANY_VS_WFS, rel=PINNED)
    rows = [evaluate(r) for r in cluster.headline_records({"study": study, "scale": {}})]
    assert {row.key: row.ratio for row in rows} == pytest.approx(
        {f"cluster/{name}-vs-priority/avg-jct": ratio for name, ratio in HEADLINE.items()},
        rel=PINNED,
    )
    assert [row.result for row in rows] == ["met", "met"]
    sweep = cluster.sweep(VIRTUALFLOW, QUICK_SEEDS)
    assert [point["grow_s"] for point in sweep["points"]] == SWEEP_COSTS_S
    assert sweep["break_even_s"] == pytest.approx(BREAK_EVEN_S, rel=PINNED)


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
    assert study["seeds"] == list(range(QUICK_SEEDS))
    assert set(study["medians"]) == {"priority", "las", "wfs", "wfs-any"}
    for name, ratios in VS_PRIORITY.items():
        stats = study["vs_priority"][name]
        assert stats["ratios"] == pytest.approx(ratios, rel=PINNED)
        assert (stats["min"], stats["max"]) == pytest.approx((min(ratios), max(ratios)), rel=PINNED)
    sweep = detail["sweep"]
    assert [point["grow_s"] for point in sweep["points"]] == SWEEP_COSTS_S
    assert sweep["break_even_s"] == pytest.approx(BREAK_EVEN_S, rel=PINNED)
    assert set(detail["scale"]) == set(SCALE)
    for name, row in detail["scale"].items():
        assert len(row["wall_s"]) == 1 and row["met"] == (row["median_wall_s"] < 10.0)
        simulated = (row["avg_jct_s"], row["makespan_s"], row["resizes"])
        assert simulated == pytest.approx(SCALE[name], rel=PINNED)
    assert "real" not in detail
    rows = {row.key: row for row in (evaluate(r) for r in records[1:])}
    assert set(rows) == {
        "cluster/wfs-vs-priority/avg-jct",
        "cluster/wfs-any-vs-priority/avg-jct",
        *(f"cluster/scale-1000/{name}" for name in ("priority", "las", "wfs", "wfs-any")),
    }
    for name, ratio in HEADLINE.items():
        row = rows[f"cluster/{name}-vs-priority/avg-jct"]
        assert row.ratio == pytest.approx(ratio, rel=PINNED)
        assert (row.result, row.target) == ("met", "<= 0.52")
    # The scale rows judge simulate()'s wall time, real time on a shared machine (wfs and
    # wfs-any take about 7 s of the 10 s on 2 cores): their verdict is not pinned, only
    # that it follows the time measured.
    for name, row in detail["scale"].items():
        timed = rows[f"cluster/scale-1000/{name}"]
        assert timed.ratio == pytest.approx(row["median_wall_s"] / 10.0)
        assert timed.result == ("met" if timed.ratio <= 1.0 else "MISSED")
    assert "results (targets printed, not asserted)" in proc.stdout


def test_the_suite_runs_it() -> None:
    runner = load_script("run")
    bench = runner.BENCHMARKS["cluster"]
    assert bench.script == "cluster.py" and bench.in_suite and not bench.takes_device
    assert "cluster" in runner.suite_names()
