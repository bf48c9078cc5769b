"""benchmarks/heterogeneous.py on hand-made measurements (the script itself runs in make
bench's quick suite): the static plans it searches, the best static plan that judges
the auto plan (the fastest median of those and the even plan, independent of the auto
run), the paired ratios, the perfect split (the sum of the workers' calibrated
throughputs plus the even run's overhead, also independent of the auto run), the
account of the auto run's step and the gap to the perfect split, the verdicts of its
table and headline records, its notes and its JSON keys."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from tests.support.benchmark_scripts import load_script
from vflow.bench.records import Row, evaluate
from vflow.planning.profile import StepProfile, VNProfile, WorkerProfile

heterogeneous = load_script("heterogeneous")
# Timed steps around a median of 1: 11 of them, an odd number, so that a median is one
# step's (a full run has 16, a quick one 4).
FACTORS = (0.9, 0.92, 0.94, 0.96, 0.98, 1.0, 1.02, 1.04, 1.06, 1.08, 1.1)
V = 24
VN_SIZE = 16
B = V * VN_SIZE  # 384 samples
# The hand-made machine: a VN takes 2.5 ms x the worker's factor, and a step 4 ms more
# than its slowest worker's compute. Calibrated rates are 6400 / factor samples/s.
VN_S = 0.0025
FIXED_S = 0.004
# The even run's non-compute time of its last worker: what the perfect split adds.
EVEN_OVERHEAD_S = 0.003
SCENARIOS = {"2:1": [1.0, 2.0], "3:2:1": [1.0, 1.5, 3.0]}
# The perfect split of 384 samples: at 2:1 (6400 + 3200 samples/s) 40 ms, at 3:2:1
# (6400 + 4267 + 2133) 30 ms, plus the even run's 3 ms.
SPLIT_S = {"2:1": 0.043, "3:2:1": 0.033}
# The fastest plans of the hand-made machine: whole VNs in proportion to the speeds.
IDEAL = {"2:1": [16, 8], "3:2:1": [12, 8, 4]}


def _plan_s(counts: list[int] | tuple[int, ...], factors: list[float]) -> float:
    """The median step time of a static plan on the hand-made machine."""
    return max(c * f for c, f in zip(counts, factors, strict=True)) * VN_S + FIXED_S


def _worker(rank: int, vns: int, vn_s: float, step_s: float) -> WorkerProfile:
    entries = tuple(VNProfile(k, VN_SIZE, vn_s / 2, vn_s / 2) for k in range(vns))
    return WorkerProfile(rank, 5, entries, vns * vn_s, 0.0, 0.0, step_s)


def test_rates_are_samples_per_second_of_compute_and_overhead_is_the_last_workers() -> None:
    # Worker 1 (2x slower) finishes last: its 0.01 s beyond compute is the overhead;
    # worker 0's 0.09 s beyond compute is mostly waiting for it.
    profile = StepProfile(5, (_worker(0, 6, 0.01, 0.15), _worker(1, 6, 0.02, 0.13)))
    measured = heterogeneous._rates(profile)
    assert measured["rates"] == pytest.approx([16 / 0.01, 16 / 0.02])
    assert measured["overhead_s"] == pytest.approx(0.01)


# ---- searched_plans: which static plans the best plan is searched among ----


def test_searched_plans_at_2_1_are_within_4_vns_of_the_perfect_split_but_the_even_plan() -> None:
    # Speeds 1 : 1/2 split 24 VNs 16:8; 12..20 VNs for worker 0 less the even 12:12.
    assert heterogeneous.searched_plans([1.0, 2.0], 24) == [
        (13, 11),
        (14, 10),
        (15, 9),
        (16, 8),
        (17, 7),
        (18, 6),
        (19, 5),
        (20, 4),
    ]


def test_searched_plans_at_3_2_1_are_within_2_vns_of_the_perfect_split() -> None:
    plans = heterogeneous.searched_plans([1.0, 1.5, 3.0], 24)
    # 5 x 5 choices for the first two workers around 12 and 8; the last takes the rest,
    # and 14 + 10 leaves it none.
    assert len(plans) == 24 == len(set(plans))
    assert (12, 8, 4) in plans  # the perfect split itself
    assert (14, 10, 0) not in plans
    assert (14, 9, 1) in plans  # one VN is enough
    assert (8, 8, 8) not in plans  # the even plan is measured anyway
    for counts in plans:
        assert sum(counts) == 24 and min(counts) >= 1
        assert abs(counts[0] - 12) <= 2 and abs(counts[1] - 8) <= 2
    assert (9, 8, 7) not in plans and (15, 6, 3) not in plans  # 3 VNs off for worker 0


def test_searched_plans_leave_out_the_even_plan_and_workers_without_a_vn() -> None:
    # Equal speeds: the perfect split is the even plan, which is not searched again.
    equal = heterogeneous.searched_plans([1.0, 1.0], 24)
    assert (12, 12) not in equal and len(equal) == 8
    assert (8, 16) in equal and (16, 8) in equal
    # 4:1 of 10 VNs: 8:2 is the perfect split; 10:0, 11:-1 and 12:-2 are no plans, and
    # 5:5 is the even plan.
    assert heterogeneous.searched_plans([1.0, 4.0], 10) == [(4, 6), (6, 4), (7, 3), (8, 2), (9, 1)]


def test_searched_plans_depend_only_on_the_speeds_ratios_and_v() -> None:
    # Factors are relative speeds: scaling them all changes nothing, V does.
    assert heterogeneous.searched_plans([2.0, 4.0], 24) == heterogeneous.searched_plans(
        [1.0, 2.0], 24
    )
    assert (32, 16) in heterogeneous.searched_plans([1.0, 2.0], 48)


# ---- summarize_speeds on hand-made rank-0 results ----


def _account(vns: list[int], compute_ms: list[float], wait_ms: list[float]) -> list[dict]:
    return [
        {
            "vns": float(n),
            "samples": float(VN_SIZE * n),
            "compute_s": c / 1e3,
            "waiting_s": w / 1e3,
            "optimizer_s": 0.002,
            "other_s": 0.001,
            "step_s": (c + w) / 1e3 + 0.003,
        }
        for n, c, w in zip(vns, compute_ms, wait_ms, strict=True)
    ]


def _rank0(
    name: str,
    auto_s: float,
    *,
    plan_s: dict[tuple[int, ...], float] | None = None,
    auto_plan: list[int] | None = None,
    auto_rates: list[float] | None = None,
    auto_overhead: float | None = None,
    even_overhead: float | None = EVEN_OVERHEAD_S,
    steps: tuple[float, ...] = FACTORS,
) -> dict[str, Any]:
    """Rank 0's result of scenario ``name`` with every rank's calibration (as
    ``_with_calibration`` makes it), on the hand-made machine: every searched plan and
    the even plan at ``_plan_s`` unless ``plan_s`` says otherwise, the auto plan at
    ``auto_s``, each step scaled by ``steps`` (the auto run's in reverse order, so that
    a paired ratio differs from step to step); the auto run's own speeds 5 % lower than
    calibrated unless given."""
    factors = SCENARIOS[name]
    rates = [VN_SIZE / (VN_S * f) for f in factors]
    plan = auto_plan if auto_plan is not None else IDEAL[name]
    medians = {
        counts: _plan_s(counts, factors) for counts in heterogeneous.searched_plans(factors, V)
    } | (plan_s or {})
    compute_ms = [n * f * VN_S * 1e3 for n, f in zip(plan, factors, strict=True)]
    return {
        "even_times_s": [_plan_s([V // len(factors)] * len(factors), factors) * k for k in steps],
        "auto_times_s": [auto_s * k for k in reversed(steps)],
        "plan_times_s": [[list(c), [s * k for k in steps]] for c, s in medians.items()],
        "auto_plan": plan,
        "planned_at": 3,
        "even_run": {
            "rates": None if even_overhead is None else [r * 1.1 for r in rates],
            "overhead_s": even_overhead,
        },
        "auto_run": {
            "rates": auto_rates if auto_rates is not None else [r * 0.95 for r in rates],
            "overhead_s": EVEN_OVERHEAD_S if auto_overhead is None else auto_overhead,
        },
        "auto_account": _account(plan, compute_ms, [max(compute_ms) - c + 1.0 for c in compute_ms]),
        "calibration": {
            "rate": rates,
            "vn_s": [VN_SIZE / r for r in rates],
            "vns": [100] * len(rates),
        },
        "history": [],
        "decisions": [f"step 6: moved to {plan} gains 1.40x (20 ms), beats the noise band (3 ms)"],
    }


def _summary(name: str, auto_s: float, **kwargs: Any) -> dict[str, Any]:
    return heterogeneous.summarize_speeds(B, SCENARIOS[name], _rank0(name, auto_s, **kwargs))


def test_the_best_plan_is_the_fastest_median_of_the_searched_plans_and_the_even_plan() -> None:
    r = _summary("2:1", 0.045)
    # 16:8 balances the hand-made 2:1 machine: 16 VNs x 2.5 ms + 4 ms.
    assert r["best_plan"] == [16, 8]
    assert r["best_plan_times_s"] == [0.044 * k for k in FACTORS]
    assert r["best_plan_samples_per_s"] == pytest.approx(B / 0.044)
    # Every plan measured, the even one first: 12:12 waits for worker 1's 24 VN-units.
    medians = {tuple(c): s for c, s in r["plan_medians_s"]}
    assert len(r["plan_medians_s"]) == 9
    assert r["plan_medians_s"][0] == [[12, 12], pytest.approx(0.064)]
    assert medians[(17, 7)] == pytest.approx(0.0465)
    assert min(medians, key=medians.__getitem__) == (16, 8)
    # A plan that measured faster than the model says wins: the search trusts the clock.
    faster = _summary("2:1", 0.045, plan_s={(17, 7): 0.042})
    assert faster["best_plan"] == [17, 7]
    assert faster["best_plan_samples_per_s"] == pytest.approx(B / 0.042)
    assert _summary("3:2:1", 0.037)["best_plan"] == [12, 8, 4]


def test_the_even_plan_is_the_best_when_no_searched_plan_beats_it() -> None:
    slower = dict.fromkeys(heterogeneous.searched_plans([1.0, 2.0], V), 0.070)
    r = _summary("2:1", 0.045, plan_s=slower)
    assert r["best_plan"] == [12, 12]
    assert r["best_plan_times_s"] == r["even_times_s"]
    assert r["auto_over_best_plan"] == pytest.approx(r["auto_over_even"])


@pytest.mark.parametrize(
    "auto_run",
    [
        {"auto_s": 0.030},  # faster than every static plan: it is not one of them
        {"auto_s": 0.2},  # far slower
        {"auto_rates": [1000.0, 500.0]},  # the auto run slowed everyone down
        {"auto_rates": [9000.0, 7000.0], "auto_overhead": 0.05},
        {"auto_plan": [17, 7]},  # another plan of the same V
    ],
)
def test_the_best_plan_and_the_perfect_split_do_not_depend_on_the_auto_run(
    auto_run: dict,
) -> None:
    base = _summary("2:1", 0.045)
    changed = _summary("2:1", **{"auto_s": 0.045, **auto_run})
    for key in (
        "best_plan",
        "best_plan_times_s",
        "best_plan_samples_per_s",
        "plan_medians_s",
        "perfect_split_s",
        "perfect_split_samples_per_s",
    ):
        assert changed[key] == base[key], key
    records = heterogeneous.headline_records({"speeds": {"2:1": changed}, "straggler": {}})
    by_key = {r["key"]: r for r in records}
    best = by_key["heterogeneous/2-1/auto-vs-best-plan"]
    assert best["baseline"]["seconds"] == pytest.approx(base["best_plan_times_s"])
    assert "independent of the auto run" in best["baseline"]["note"]
    split = by_key["heterogeneous/2-1/auto-vs-perfect-split"]
    assert split["limit"]["seconds"] == [pytest.approx(SPLIT_S["2:1"])]


def test_auto_over_best_plan_and_over_even_are_paired_ratios() -> None:
    first = _rank0("2:1", 0.045)
    first["auto_times_s"] = [0.050, 0.040, 0.060]
    first["even_times_s"] = [0.070, 0.060, 0.065]
    first["plan_times_s"] = [
        [counts, [0.040, 0.048, 0.044] if counts == [16, 8] else [0.1] * 3]
        for counts, _ in first["plan_times_s"]
    ]
    r = heterogeneous.summarize_speeds(B, [1.0, 2.0], first)
    assert r["best_plan"] == [16, 8]
    # Per round best / auto: 0.8, 1.2, 0.73 (ratio of medians 0.88); even / auto: 1.4,
    # 1.5, 1.08 (ratio of medians 1.3).
    assert r["auto_over_best_plan"] == pytest.approx(0.8)
    assert r["auto_over_even"] == pytest.approx(1.4)
    # The records' paired ratio is auto / baseline per round: the inverse here (an odd
    # number of rounds).
    rows = _rows({"speeds": {"2:1": r}, "straggler": {}})
    assert rows["heterogeneous/2-1/auto-vs-best-plan"].ratio == pytest.approx(1 / 0.8)
    assert rows["heterogeneous/2-1/auto-vs-even"].ratio == pytest.approx(1 / 1.4)


def test_the_perfect_split_splits_the_calibrated_compute_perfectly() -> None:
    r = _summary("2:1", 0.045)
    # 6400 and 3200 samples/s: 384 samples take 40 ms split perfectly, plus the even
    # run's 3 ms.
    assert r["calibrated_rates"] == pytest.approx([6400, 3200])
    assert r["overhead_s"] == EVEN_OVERHEAD_S
    assert r["perfect_split_s"] == pytest.approx(0.043)
    assert r["perfect_split_samples_per_s"] == pytest.approx(B / 0.043)
    assert "even run" in r["perfect_split_source"]
    assert r["auto_over_perfect_split"] == pytest.approx(0.043 / 0.045)
    # No whole-VN plan reaches it: the best plan's 44 ms is 98 % of it.
    assert r["best_plan_over_perfect_split"] == pytest.approx(0.043 / 0.044)
    # At the auto run's own (5 % lower) speeds and its own overhead, for comparison only.
    assert r["auto_speeds_split_s"] == pytest.approx(B / 9120 + 0.003)
    assert r["auto_speeds_split_samples_per_s"] == pytest.approx(B / (B / 9120 + 0.003))
    assert r["auto_over_auto_speeds_split"] == pytest.approx((B / 9120 + 0.003) / 0.045)
    three = _summary("3:2:1", 0.037)
    assert three["perfect_split_s"] == pytest.approx(SPLIT_S["3:2:1"])


def test_the_perfect_split_takes_its_overhead_from_the_even_run_not_the_auto_run() -> None:
    r = _summary("2:1", 0.045, auto_overhead=0.030)
    assert r["perfect_split_s"] == pytest.approx(0.040 + EVEN_OVERHEAD_S)
    assert r["auto_speeds_split_s"] == pytest.approx(B / 9120 + 0.030)
    assert _summary("2:1", 0.045, even_overhead=0.005)["perfect_split_s"] == pytest.approx(0.045)


def test_without_the_even_runs_profiles_there_is_no_perfect_split_but_a_best_plan(
    capsys: pytest.CaptureFixture[str],
) -> None:
    r = _summary("2:1", 0.045, even_overhead=None)
    for key in (
        "perfect_split_s",
        "perfect_split_samples_per_s",
        "auto_over_perfect_split",
        "best_plan_over_perfect_split",
        "gap_to_perfect_split",
    ):
        assert r[key] is None, key
    assert r["auto_over_best_plan"] == pytest.approx(0.044 / 0.045)
    results = _results(0.045)
    results["speeds"]["2:1"] = r
    rows = _rows(results)
    assert "heterogeneous/2-1/auto-vs-perfect-split" not in rows
    assert rows["heterogeneous/2-1/auto-vs-best-plan"].result == "met"
    heterogeneous.print_results(results)
    out = capsys.readouterr().out
    cells = _table_row(out, "2:1")
    assert cells["perfect split s/s"] == "n/a" and cells["best/split"] == "n/a"
    assert cells["auto/best"] == "98%"
    # No account note without a split; 3:2:1 still has its own.
    notes = [line for line in out.splitlines() if " the auto step is " in line]
    assert len(notes) == 1 and notes[0].startswith("3:2:1: the auto step is")


def test_every_ranks_calibration_is_gathered_in_rank_order() -> None:
    results = [
        {
            **_rank0("2:1", 0.045),
            "calibration": {"rate": r, "vn_s": 16 / r, "vns": n},
        }
        for r, n in ((2000.0, 90), (1000.0, 45))
    ]
    first = heterogeneous._with_calibration(results)
    assert first["calibration"] == {
        "rate": [2000.0, 1000.0],
        "vn_s": [0.008, 0.016],
        "vns": [90, 45],
    }
    assert first["even_times_s"] == results[0]["even_times_s"]
    assert first["plan_times_s"] == results[0]["plan_times_s"]


def test_account_gives_the_ideal_split_and_the_wait_whole_vns_imply() -> None:
    # Calibrated 3:2:1 but the plan is 13:7:4 of V=24: worker 0 computes 208 samples at
    # 3000/s (69.3 ms) against worker 2's 64 at 1000/s (64 ms) and worker 1's 112 at
    # 2000/s (56 ms): the others wait for worker 0.
    rows = heterogeneous.account(_account([13, 7, 4], [70, 57, 65], [1, 14, 6]), [3000, 2000, 1000])
    assert [row["ideal_vns"] for row in rows] == pytest.approx([12, 8, 4])
    assert [row["predicted_compute_s"] for row in rows] == pytest.approx(
        [208 / 3000, 112 / 2000, 64 / 1000]
    )
    assert [row["split_wait_s"] for row in rows] == pytest.approx(
        [0, 208 / 3000 - 0.056, 208 / 3000 - 0.064]
    )
    assert rows[1]["waiting_s"] == pytest.approx(0.014)  # the measured medians stay
    assert heterogeneous.account(None, [1.0]) is None


def test_the_gap_to_the_perfect_split_is_whole_vns_slower_compute_and_the_rest() -> None:
    # Plan 17:7 at calibrated 6400 and 3200 samples/s: worker 0's 272 samples take
    # 42.5 ms, 2.5 ms more than the perfect split's 40 ms; it computes 44 ms (1.5 ms
    # slower than calibrated) and its step is 44 + 1 + 3 ms, 1 ms of non-compute beyond
    # the even run's 3 ms. Worker 1 computes less (36 ms) and is not the one that counts.
    first = _rank0("2:1", 0.048, auto_plan=[17, 7])
    first["auto_account"] = _account([17, 7], [44.0, 36.0], [1.0, 9.0])
    r = heterogeneous.summarize_speeds(B, [1.0, 2.0], first)
    gap = r["gap_to_perfect_split"]
    assert gap == heterogeneous.gap_to_perfect_split(B, r)
    assert gap["gap_s"] == pytest.approx(0.048 - 0.043)
    assert gap["whole_vns_s"] == pytest.approx(0.0025)
    assert gap["slower_than_calibrated_s"] == pytest.approx(0.0015)
    assert gap["non_compute_s"] == pytest.approx(0.001)
    # Here the medians agree, so the parts add up to the gap.
    assert sum(gap[k] for k in ("whole_vns_s", "slower_than_calibrated_s", "non_compute_s")) == (
        pytest.approx(gap["gap_s"])
    )
    r["account"] = None
    assert heterogeneous.gap_to_perfect_split(B, r) is None


# ---- the table, the notes and the headline records ----


def _results(
    auto_2_s: float,
    auto_3_s: float = 0.037,
    plan_2_s: dict[tuple[int, ...], float] | None = None,
    steps: tuple[float, ...] = FACTORS,
) -> dict[str, Any]:
    speeds = {
        "2:1": _summary("2:1", auto_2_s, plan_s=plan_2_s, steps=steps),
        "3:2:1": _summary("3:2:1", auto_3_s, steps=steps),
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
    return {"config": {"batch_size": B}, "speeds": speeds, "straggler": straggler}


# The main table's column of verdicts: gain over even (2:1 only) / share of the best plan.
TARGETS = "targets (2:1 >=1.4x / >=95%; 3:2:1 >=90%)"


def _rows(results: dict[str, Any]) -> dict[str, Row]:
    return {row.key: row for row in map(evaluate, heterogeneous.headline_records(results))}


def _table_row(out: str, name: str) -> dict[str, str]:
    """The cells of scenario ``name``'s row of the main table, by header (columns are
    two or more spaces apart; no cell holds two spaces)."""
    lines = out.splitlines()
    header = next(line for line in lines if line.startswith("workers "))
    row = next(line for line in lines if line.startswith(f"{name} (emulated)"))
    headers, cells = (re.split(r" {2,}", line.strip()) for line in (header, row))
    assert len(headers) == len(cells), (headers, cells)
    return dict(zip(headers, cells, strict=True))


@pytest.mark.parametrize(
    ("name", "auto_s", "plan_2_s", "gain", "best"),
    [
        # 2:1, even 64 ms, best 16:8 at 44 ms: 1.42x and 98 %.
        ("2:1", 0.045, None, "met", "met"),
        # 1.39x misses 1.4x; 96 % meets 95 %.
        ("2:1", 0.046, None, "MISSED", "met"),
        ("2:1", 0.047, None, "MISSED", "MISSED"),  # 1.36x, 94 %
        # 17:7 measured at 42 ms is the best plan: 93 % of it, for all the 1.42x.
        ("2:1", 0.045, {(17, 7): 0.042}, "met", "MISSED"),
        # 3:2:1, best 12:8:4 at 34 ms: 92 % meets 90 % (not 95 %), 89 % does not.
        ("3:2:1", 0.037, None, "-", "met"),
        ("3:2:1", 0.038, None, "-", "MISSED"),
    ],
)
def test_table_and_records_give_the_same_verdicts(
    capsys: pytest.CaptureFixture[str],
    name: str,
    auto_s: float,
    plan_2_s: dict[tuple[int, ...], float] | None,
    gain: str,
    best: str,
) -> None:
    results = (
        _results(auto_s, plan_2_s=plan_2_s) if name == "2:1" else _results(0.045, auto_3_s=auto_s)
    )
    heterogeneous.print_results(results)
    assert _table_row(capsys.readouterr().out, name)[TARGETS] == f"{gain} / {best}"
    rows = _rows(results)
    scenario = name.replace(":", "-")
    assert rows[f"heterogeneous/{scenario}/auto-vs-best-plan"].result == best
    even = rows[f"heterogeneous/{scenario}/auto-vs-even"]
    assert even.result == gain  # "-" for 3:2:1, which has no gain target
    assert (even.target == "") == (name == "3:2:1")


# The records' paired ratio is the median of auto / baseline per round; the table takes
# the same median and inverts it (the mean of the two middle rounds of an even count is
# not the reciprocal of the mean of their inverses). Here the middle rounds of best /
# auto are 0.85 and 1.06: the median of best / auto would be 95.5 % (met), while the
# records' median of auto / best is 1.060 > 1 / 0.95 = 1.053 (MISSED); both say MISSED.
def test_table_and_records_agree_with_an_even_number_of_rounds(
    capsys: pytest.CaptureFixture[str],
) -> None:
    first = _rank0("2:1", 0.045, steps=(1.0,) * 12)
    first["plan_times_s"] = [
        [counts, [0.045 * 0.85] * 6 + [0.045 * 1.06] * 6 if counts == [16, 8] else [0.1] * 12]
        for counts, _ in first["plan_times_s"]
    ]
    results = _results(0.045)
    results["speeds"]["2:1"] = heterogeneous.summarize_speeds(B, [1.0, 2.0], first)
    heterogeneous.print_results(results)
    table = _table_row(capsys.readouterr().out, "2:1")[TARGETS]
    record = _rows(results)["heterogeneous/2-1/auto-vs-best-plan"].result
    assert table.endswith(f"/ {record}")


def test_headline_records_per_scenario() -> None:
    results = _results(0.045)
    records = {r["key"]: r for r in heterogeneous.headline_records(results)}
    assert set(records) == {
        f"heterogeneous/{s}/{what}"
        for s in ("2-1", "3-2-1")
        for what in ("auto-vs-even", "auto-vs-best-plan", "auto-vs-perfect-split")
    }
    for name, scenario in (("2:1", "2-1"), ("3:2:1", "3-2-1")):
        r = results["speeds"][name]
        best = records[f"heterogeneous/{scenario}/auto-vs-best-plan"]
        assert best["paired"] is True
        assert best["vflow"]["seconds"] == pytest.approx(r["auto_times_s"])
        assert best["baseline"]["seconds"] == pytest.approx(r["best_plan_times_s"])
        assert best["baseline"]["label"] == f"best static plan {IDEAL[name]}"
        assert best["target"]["op"] == "<="
        assert best["target"]["value"] == pytest.approx(1 / heterogeneous.TARGET_OF_BEST_PLAN[name])
        assert best["target"]["requires"] == {"min_samples": 10}
        even = records[f"heterogeneous/{scenario}/auto-vs-even"]
        assert even["paired"] is True
        assert even["baseline"]["seconds"] == pytest.approx(r["even_times_s"])
        # The perfect split is shown, not judged: no plan reaches it on shared cores.
        split = records[f"heterogeneous/{scenario}/auto-vs-perfect-split"]
        assert split["compare"] == "vflow/limit"
        assert split["limit"]["seconds"] == [pytest.approx(SPLIT_S[name])]
        assert "target" not in split
    assert heterogeneous.TARGET_OF_BEST_PLAN == {"2:1": 0.95, "3:2:1": 0.90}
    assert records["heterogeneous/2-1/auto-vs-even"]["target"]["value"] == pytest.approx(1 / 1.4)
    assert "target" not in records["heterogeneous/3-2-1/auto-vs-even"]
    rows = _rows(results)
    # Paired samples: the median of the per-round ratios, here the middle round's.
    assert rows["heterogeneous/2-1/auto-vs-best-plan"].ratio == pytest.approx(0.045 / 0.044)
    assert rows["heterogeneous/2-1/auto-vs-even"].ratio == pytest.approx(0.045 / 0.064)
    assert rows["heterogeneous/3-2-1/auto-vs-best-plan"].ratio == pytest.approx(0.037 / 0.034)
    assert rows["heterogeneous/2-1/auto-vs-perfect-split"].ratio == pytest.approx(0.045 / 0.043)
    assert rows["heterogeneous/2-1/auto-vs-perfect-split"].target == ""


def test_a_quick_runs_targets_are_not_judged() -> None:
    # 4 timed steps (--quick): the auto run's times and every plan's are that short.
    rows = _rows(_results(0.045, steps=FACTORS[:4]))
    judged = [row for row in rows.values() if row.target]
    # Gain over even at 2:1 and the best plan in both scenarios have targets...
    assert len(judged) == 3
    for row in judged:  # ...that a quick run does not resolve.
        assert row.result == "n/a here", row
        assert "needs >= 10 timed samples, this run has 4" in row.result_note


def test_table_gives_throughputs_plans_ratios_and_speeds(
    capsys: pytest.CaptureFixture[str],
) -> None:
    heterogeneous.print_results(_results(0.045))
    out = capsys.readouterr().out
    cells = _table_row(out, "2:1")
    # 384 samples: even 64 ms, auto 45 ms, best 44 ms, perfect split 43 ms, the split at
    # the auto run's speeds (9120 samples/s) 45.1 ms.
    assert cells == {
        "workers": "2:1 (emulated)",
        "even s/s": "6000",
        "auto s/s": "8533",
        "auto plan": "[16, 8]",
        "best plan": "[16, 8]",
        "best s/s": "8727",
        "auto/even": "1.42x",
        "auto/best": "98%",
        TARGETS: "met / met",
        "speeds (calibrated)": "2.00:1.00",
        "perfect split s/s": "8930",
        "auto/split": "96%",
        "best/split": "98%",
        "auto run: speeds": "2.00:1.00",
        "split s/s": "8513",
        "auto/that": "100%",
    }
    three = _table_row(out, "3:2:1")
    assert three["speeds (calibrated)"] == "3.00:2.00:1.00"
    assert three["auto/best"] == "92%" and three["best plan"] == "[12, 8, 4]"
    assert "3 (target <= 5: met)" in out
    assert "EMULATED" in out


def test_plans_note_lists_every_static_plan_fastest_first(
    capsys: pytest.CaptureFixture[str],
) -> None:
    r = _summary("2:1", 0.045, plan_s={(17, 7): 0.042})
    note = heterogeneous.plans_note("2:1", r)
    assert note.startswith("2:1: static plans by median step: [17, 7] 42.0 ms, [16, 8] 44.0 ms")
    listed = re.findall(r"\[([\d, ]+)\] ([\d.]+) ms", note)
    times = [float(ms) for _, ms in listed]
    assert times == sorted(times)
    assert {tuple(map(int, c.split(", "))) for c, _ in listed} == {
        (12, 12),
        *heterogeneous.searched_plans([1.0, 2.0], V),
    }
    assert listed[-1] == ("12, 12", "64.0")  # the even plan waits for the slow worker
    results = _results(0.045, plan_2_s={(17, 7): 0.042})
    heterogeneous.print_results(results)
    assert note in capsys.readouterr().out.splitlines()


def test_account_table_and_note_per_scenario(capsys: pytest.CaptureFixture[str]) -> None:
    heterogeneous.print_results(_results(0.045))
    out = capsys.readouterr().out
    assert "2:1 auto run, worker" in out and "3:2:1 auto run, worker" in out
    # Worker 0 of 3:2:1: plan 12:8:4, calibrated 6400:4267:2133 -> ideal 12.0; it
    # computes 30 ms and waits 1 ms (all workers compute 30 ms).
    row = next(line for line in out.splitlines() if line.startswith("0 ") and "12 (12.0)" in line)
    assert "30.0" in row and "1.0" in row
    assert "2:1: the auto step is 2.0 ms over the perfect split" in out
    assert "(16:8, ideal 16.0:8.0 at the calibrated speeds)" in out
    assert "3:2:1: the auto step is 4.0 ms over the perfect split" in out
    assert "(12:8:4, ideal 12.0:8.0:4.0 at the calibrated speeds)" in out
    assert '3:2:1: plan="auto" decisions: step 6: moved to [12, 8, 4]' in out


def test_json_keys() -> None:
    results = _results(0.045)
    r = json.loads(json.dumps(results))["speeds"]["3:2:1"]
    assert {
        "best_plan",
        "best_plan_times_s",
        "best_plan_samples_per_s",
        "auto_over_best_plan",
        "plan_medians_s",
        "best_plan_over_perfect_split",
        "perfect_split_s",
        "perfect_split_samples_per_s",
        "perfect_split_source",
        "auto_over_perfect_split",
        "auto_speeds_split_s",
        "auto_speeds_split_samples_per_s",
        "auto_over_auto_speeds_split",
        "gap_to_perfect_split",
        "calibrated_rates",
        "calibration",
        "overhead_s",
        "auto_run_rates",
        "even_run_rates",
        "auto_over_even",
        "even_times_s",
        "auto_times_s",
        "account",
    } <= set(r)
    # The old names are gone, not left beside the new ones for a reader to pick up.
    assert not {key for key in r if "limit" in key}
    assert r["best_plan"] == [12, 8, 4]
    assert [[12, 8, 4], pytest.approx(0.034)] in r["plan_medians_s"]
    assert set(r["gap_to_perfect_split"]) == {
        "gap_s",
        "whole_vns_s",
        "slower_than_calibrated_s",
        "non_compute_s",
    }
    assert set(r["calibration"]) == {"rate", "vn_s", "vns"}
    assert len(r["account"]) == 3
    assert {
        "vns",
        "ideal_vns",
        "compute_s",
        "waiting_s",
        "optimizer_s",
        "other_s",
        "step_s",
        "split_wait_s",
    } <= set(r["account"][0])
