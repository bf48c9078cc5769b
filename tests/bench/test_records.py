"""vflow/bench/records.py: headline records are evaluated from their measurements alone —
values, ratios (plain, paired, gap closed), verdicts, targets that are n/a here — and a
record that is malformed or states a ratio its measurements do not give is rejected.

The accumulate, step, distributed and prefetch cases mirror what those scripts write.
"""

from __future__ import annotations

import math
from typing import Any

import pytest

from vflow.bench.records import (
    SummaryError,
    copy_limit_note,
    evaluate,
    headline,
    measurement,
    paired_ratio,
    target,
)

ENV_2CPU = {"device": "cpu", "cpu_affinity": 2, "cpu_count": 2}


def _rate(gbps: float, nbytes: int = 180_000_000, **kwargs: Any) -> dict[str, Any]:
    """A throughput measurement of ``gbps``: ``nbytes`` moved in the time that takes."""
    return measurement([nbytes / (gbps * 1e9)], nbytes=nbytes, **kwargs)


def _ms(*values: float, **kwargs: Any) -> dict[str, Any]:
    return measurement([v / 1e3 for v in values], **kwargs)


def test_accumulate_fp32_ratio_is_against_the_copy_limit() -> None:
    row = evaluate(
        headline(
            "accumulate",
            "accumulate/resnet50/fp32",
            "resnet50 fp32: fused / copy GB/s",
            vflow=_rate(18.0),
            baseline=_rate(5.0, label="per-tensor add_"),
            limit=_rate(20.0, nbytes=2**28, label="copy", note=copy_limit_note("256 MB fp32")),
            compare="vflow/limit",
            target=target(">=", 0.8),
        )
    )
    assert row.unit == "GB/s"
    assert (row.vflow, row.baseline, row.limit) == (
        pytest.approx(18.0),
        pytest.approx(5.0),
        pytest.approx(20.0),
    )
    assert row.ratio == pytest.approx(0.9)
    assert (row.target, row.result) == (">= 0.8", "met")
    # The footnote says what the limit is and why it can be exceeded.
    assert "write-allocate" in row.limit_note and "can exceed" in row.limit_note
    assert row.labels == {"baseline": "per-tensor add_", "limit": "copy"}


def test_accumulate_bf16_speedup_over_the_loop_missed() -> None:
    row = evaluate(
        headline(
            "accumulate",
            "accumulate/resnet50/bf16",
            "resnet50 bf16: fused / loop GB/s",
            vflow=_rate(5.0),
            baseline=_rate(4.0),
            target=target(">=", 1.5),
        )
    )
    assert row.ratio == pytest.approx(1.25)
    assert (row.target, row.result) == (">= 1.5", "MISSED")


def test_exact_add_in_ms_with_a_limit_in_time_at_copy_bandwidth() -> None:
    # Copy: 15 GB/s (300 MB in 20 ms); the exact add's 30 MB take 2 ms at that rate.
    copy = measurement([0.02], nbytes=300_000_000, for_bytes=30_000_000)
    row = evaluate(
        headline(
            "accumulate",
            "exact/mlp/avx2",
            "exact add: time / float fold",
            vflow=_ms(20.0),
            baseline=_ms(5.0),
            limit=copy,
        )
    )
    assert row.unit == "ms"
    assert (row.vflow, row.baseline, row.ratio) == (
        pytest.approx(20.0),
        pytest.approx(5.0),
        pytest.approx(4.0),
    )
    assert row.limit == pytest.approx(30e6 / 15e9 * 1e3)
    assert (row.target, row.result) == ("", "-")


def test_a_value_is_the_median_of_the_samples() -> None:
    row = evaluate(headline("step", "k", "t", vflow=_ms(1.0, 9.0, 2.0), compare=None))
    assert row.vflow == pytest.approx(2.0)
    assert row.ratio is None


def test_paired_ratio_is_the_median_of_per_pair_ratios() -> None:
    # Per-pair ratios 1.0, 2.0, 1.1: median 1.1, while the medians' ratio is 3.0 / 1.5.
    record = headline(
        "step",
        "step/mlp/V=4",
        "vflow / hand loop",
        vflow=_ms(1.0, 3.0, 3.3),
        baseline=_ms(1.0, 1.5, 3.0),
        paired=True,
        target=target("<=", 1.05),
    )
    row = evaluate(record)
    assert row.ratio == pytest.approx(1.1)
    assert (row.vflow, row.baseline) == (pytest.approx(3.0), pytest.approx(1.5))
    assert row.result == "MISSED"
    unpaired = evaluate({**record, "paired": False})
    assert unpaired.ratio == pytest.approx(2.0)


def test_paired_ratio_helper_is_the_median_of_the_per_pair_ratios() -> None:
    # Per pair 0.8, 1.2 and 0.73: median 0.8, where the ratio of the medians is 0.88.
    a, b = [0.040, 0.048, 0.044], [0.050, 0.040, 0.060]
    assert paired_ratio(a, b) == pytest.approx(0.8)
    # Samples taken back to back: pairs that do not match up are a bug, not noise.
    with pytest.raises(ValueError, match="paired samples differ in number"):
        paired_ratio(a, b[:2])


def test_a_stated_ratio_that_disagrees_with_the_times_is_caught() -> None:
    fields: dict[str, Any] = {
        "vflow": _ms(1.0, 3.0, 3.3),
        "baseline": _ms(1.0, 1.5, 3.0),
        "paired": True,
    }
    # The script's own number, when it agrees, passes the check ...
    headline("step", "step/a", "a", **fields, stated_ratio=1.1 * (1 + 1e-12))
    # ... a ratio of medians stated for a paired comparison does not.
    with pytest.raises(SummaryError, match=r"states ratio 2\.0 but its measurements give 1\.1"):
        headline("step", "step/a", "a", **fields, stated_ratio=2.0)
    # Nor does a record edited after it was written.
    record = headline("step", "step/a", "a", **fields, stated_ratio=1.1)
    record["baseline"] = _ms(1.0, 1.0, 1.0)
    with pytest.raises(SummaryError, match="states ratio"):
        evaluate(record)


def test_fields_other_than_measurements_never_change_the_verdict() -> None:
    record = headline(
        "step", "k", "t", vflow=_ms(2.0), baseline=_ms(1.0), target=target("<=", 1.05)
    )
    # A script's own fields (a verdict, a ratio of another kind) are not read.
    row = evaluate({**record, "target_met": True, "ratio_of_medians": 1.0, "speedup": 9.0})
    assert (row.ratio, row.result) == (pytest.approx(2.0), "MISSED")


def test_a_record_without_a_target_is_not_judged() -> None:
    row = evaluate(headline("step", "k", "t", vflow=_ms(1.2), baseline=_ms(1.0)))
    assert row.ratio == pytest.approx(1.2) and (row.target, row.result) == ("", "-")


def test_distributed_bytes_are_shown_in_mib() -> None:
    row = evaluate(
        headline(
            "distributed",
            "distributed/mlp/bytes/exact",
            "exact / vflow bytes",
            vflow=measurement(nbytes=9 * 2**20),
            baseline=measurement(nbytes=4 * 2**20),
        )
    )
    assert (row.unit, row.vflow, row.baseline, row.ratio) == ("MiB", 9.0, 4.0, 2.25)


def _prefetch(load_ms: float, compute_ms: float, **kwargs: Any) -> dict[str, Any]:
    return headline(
        "prefetch",
        "prefetch/sleep/1of1",
        "gap closed",
        vflow=_ms(20.0, 21.0, 19.0),
        baseline=_ms(30.0, 30.0, 30.0),
        limit=_ms(18.0, note="limit = the ideal step"),
        compare="gap closed",
        paired=True,
        context={"load": _ms(load_ms), "compute": _ms(compute_ms)},
        target=target(
            ">=", 0.9, when=[["load", "<=", "compute", "a longer load cannot be hidden"]], **kwargs
        ),
    )


def test_gap_closed_is_the_share_of_baseline_to_limit() -> None:
    row = evaluate({**_prefetch(1.0, 2.0), "env": ENV_2CPU})
    # Paired: median(30 - 20, 30 - 21, 30 - 19) = 10 over 30 - 18 = 12.
    assert row.ratio == pytest.approx(10 / 12)
    assert (row.vflow, row.baseline, row.limit) == (
        pytest.approx(20.0),
        pytest.approx(30.0),
        pytest.approx(18.0),
    )
    assert (row.target, row.result) == (">= 0.9", "MISSED")


def test_a_condition_on_the_measurements_makes_the_target_n_a() -> None:
    row = evaluate(_prefetch(3.0, 2.0, why="explains requires only"))
    assert row.result == "n/a here"
    assert row.result_note == (
        ">= 0.9 applies when load <= compute; here 3 vs 2 ms: a longer load cannot be hidden"
    )


def test_nothing_to_close_gives_no_ratio() -> None:
    record = _prefetch(1.0, 2.0)
    record["limit"] = _ms(31.0)  # the baseline is already at the limit
    row = evaluate(record)
    assert row.ratio is None and row.result == "n/a"


@pytest.mark.parametrize(
    ("requires", "env", "samples", "result", "reason"),
    [
        ({"min_cpus": 4}, ENV_2CPU, 3, "n/a here", "needs >= 4 usable CPUs, this machine has 2"),
        ({"min_cpus": 4}, {**ENV_2CPU, "cpu_affinity": 8}, 3, "met", ""),
        ({"device": "cuda"}, ENV_2CPU, 3, "n/a here", "needs device cuda, this run used cpu"),
        ({"device": "cuda"}, {"device": "cuda:0"}, 3, "met", ""),
        ({"min_samples": 20}, ENV_2CPU, 3, "n/a here", "needs >= 20 timed samples, this run has 3"),
        ({"min_samples": 20}, ENV_2CPU, 20, "met", ""),
    ],
)
def test_requirements_decide_whether_a_target_means_something_here(
    requires: dict[str, Any], env: dict[str, Any], samples: int, result: str, reason: str
) -> None:
    record = headline(
        "distributed",
        "k",
        "t",
        vflow=_ms(*[1.0] * samples),
        baseline=_ms(*[1.0] * samples),
        paired=True,
        target=target("<=", 1.0, requires=requires, why="the reason"),
    )
    row = evaluate({**record, "env": env})
    assert row.result == result
    assert row.result_note == (f"<= 1 {reason}: the reason" if reason else "")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"vflow": None}, "vflow"),
        ({"key": ""}, "key must be a non-empty string"),
        ({"baseline": {"bytes": 4}}, "different kinds"),
        ({"compare": "vflow/ideal"}, "compare must be one of"),
        ({"compare": "vflow/limit"}, "needs a limit measurement"),
        ({"baseline": {"seconds": [0.001]}}, "paired samples differ in number"),
        ({"vflow": {"seconds": [0.001, math.nan]}}, "non-empty list of times > 0"),
        ({"vflow": {"seconds": []}}, "non-empty list of times > 0"),
        ({"vflow": {"label": "x"}}, "neither seconds nor bytes"),
        ({"target": {"op": "<", "value": 1}}, "target must be"),
        ({"target": {"op": "<=", "value": 1, "requires": {"gpus": 2}}}, "known are device"),
        ({"target": {"op": "<=", "value": 1, "when": [["vflow", "<=", "x"]]}}, "when"),
        ({"compare": None, "target": {"op": "<=", "value": 1}}, "no compare"),
    ],
)
def test_malformed_records_raise_summary_error(change: dict[str, Any], message: str) -> None:
    record = headline("step", "k", "t", vflow=_ms(1.0, 2.0), baseline=_ms(1.0, 2.0), paired=True)
    for name, value in change.items():
        if value is None:
            record.pop(name)
        else:
            record[name] = value
    with pytest.raises(SummaryError, match=message):
        evaluate(record)


def test_evaluate_refuses_a_script_record() -> None:
    with pytest.raises(SummaryError, match="not a headline record"):
        evaluate({"benchmark": "step", "ratio": 1.0})


def test_headline_checks_what_it_writes() -> None:
    with pytest.raises(SummaryError, match="compare must be one of"):
        headline("step", "k", "t", vflow=_ms(1.0), baseline=_ms(1.0), compare="ratio")
    with pytest.raises(ValueError, match="target op must be"):
        target("=", 1.0)
