"""benchmarks/heterogeneous.py: its limit (the sum of the workers' throughputs), the
ratios and verdicts of its table and headline records, on hand-made measurements (the
script itself runs in make bench's quick suite)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.support.benchmark_scripts import load_script
from vflow.bench.records import evaluate
from vflow.planning.profile import StepProfile, VNProfile, WorkerProfile

heterogeneous = load_script("heterogeneous")
# Timed steps around a median of 1 (11 of them; a full run has 12).
FACTORS = (0.9, 0.92, 0.94, 0.96, 0.98, 1.0, 1.02, 1.04, 1.06, 1.08, 1.1)


def _worker(rank: int, vns: int, vn_s: float, step_s: float) -> WorkerProfile:
    entries = tuple(VNProfile(k, 16, vn_s / 2, vn_s / 2) for k in range(vns))
    return WorkerProfile(rank, 5, entries, vns * vn_s, 0.0, 0.0, step_s)


def test_rates_are_samples_per_second_of_compute_and_overhead_is_the_last_workers() -> None:
    # Worker 1 (2x slower) finishes last: its 0.01 s beyond compute is the overhead;
    # worker 0's 0.09 s beyond compute is mostly waiting for it.
    profile = StepProfile(5, (_worker(0, 6, 0.01, 0.15), _worker(1, 6, 0.02, 0.13)))
    measured = heterogeneous._rates(profile)
    assert measured["rates"] == pytest.approx([16 / 0.01, 16 / 0.02])
    assert measured["overhead_s"] == pytest.approx(0.01)


def _rank0(even_s: float, auto_s: float, rates: list[float], overhead: float) -> dict[str, Any]:
    return {
        "even_times_s": [even_s * f for f in FACTORS],
        "auto_times_s": [auto_s * f for f in reversed(FACTORS)],
        "auto_plan": [8, 4],
        "planned_at": 3,
        "even_run": {"rates": [r * 1.1 for r in rates], "overhead_s": overhead},
        "auto_run": {"rates": rates, "overhead_s": overhead},
        "history": [],
    }


def test_the_limit_splits_the_measured_compute_perfectly() -> None:
    # Rates 2000 and 1000 samples/s: 192 samples take 64 ms split perfectly, plus 6 ms.
    r = heterogeneous.summarize_speeds(192, [1.0, 2.0], _rank0(0.102, 0.072, [2000, 1000], 0.006))
    assert r["limit_s"] == pytest.approx(0.070)
    assert r["limit_samples_per_s"] == pytest.approx(192 / 0.070)
    assert r["auto_over_even"] == pytest.approx(0.102 / 0.072)
    assert r["auto_over_limit"] == pytest.approx(0.070 / 0.072)
    # At the even run's (10 % higher) speeds the limit is faster.
    assert r["auto_over_even_speeds_limit"] == pytest.approx((192 / 3300 + 0.006) / 0.072)


def _results(auto_s: float) -> dict[str, Any]:
    speeds = {
        "2:1": heterogeneous.summarize_speeds(
            192, [1.0, 2.0], _rank0(0.102, auto_s, [2000, 1000], 0.006)
        ),
        "3:2:1": heterogeneous.summarize_speeds(
            192, [1.0, 1.5, 3.0], _rank0(0.150, 0.080, [2000, 1333, 667], 0.006)
        ),
    }
    straggler = {
        "straggle_at": 20,
        "replanned_at": 23,
        "steps_to_replan": 3,
        "before_samples_per_s": 3000.0,
        "slowed_samples_per_s": 1600.0,
        "after_samples_per_s": 2400.0,
        "history": [],
    }
    return {"speeds": speeds, "straggler": straggler}


@pytest.mark.parametrize(("auto_s", "verdict"), [(0.072, "met"), (0.080, "missed")])
def test_headline_records_carry_both_targets(auto_s: float, verdict: str) -> None:
    rows = {row.key: row for row in map(evaluate, heterogeneous.headline_records(_results(auto_s)))}
    assert set(rows) == {
        "heterogeneous/2-1/auto-vs-even",
        "heterogeneous/2-1/auto-vs-limit",
        "heterogeneous/3-2-1/auto-vs-even",
        "heterogeneous/3-2-1/auto-vs-limit",
    }
    gain = rows["heterogeneous/2-1/auto-vs-even"]
    # Paired samples (stepped alternately): the median of the per-step ratios, here the
    # middle pair's.
    assert gain.ratio == pytest.approx(auto_s / 0.102)
    # 1.42x faster passes the 1.4x target; 1.28x does not. Of the limit: 97 % / 88 %.
    assert gain.result.lower().startswith(verdict)
    assert rows["heterogeneous/2-1/auto-vs-limit"].result.lower().startswith(verdict)
    assert rows["heterogeneous/3-2-1/auto-vs-even"].target == ""  # 3:2:1 has no gain target


def test_a_quick_runs_targets_are_not_judged() -> None:
    results = _results(0.072)
    for r in results["speeds"].values():
        r["auto_times_s"] = r["auto_times_s"][:4]
        r["even_times_s"] = r["even_times_s"][:4]
    for row in map(evaluate, heterogeneous.headline_records(results)):
        assert row.result.startswith("n/a") or row.target == "", row


def test_table_gives_measured_speeds_and_verdicts(capsys: pytest.CaptureFixture[str]) -> None:
    heterogeneous.print_results(_results(0.080))
    out = capsys.readouterr().out
    line = next(row for row in out.splitlines() if row.startswith("2:1 (emulated)"))
    assert "2.00:1.00" in line and "1.27x" in line and "88%" in line
    assert "MISSED / MISSED" in line
    assert "3 (target <= 5: met)" in out
    assert "EMULATED" in out
