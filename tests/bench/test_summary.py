"""vflow/bench/summary.py: the summary table and its footnotes, the target counts,
--compare and summary.json."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from vflow.bench import summary
from vflow.bench.records import Row, headline, measurement, target
from vflow.bench.summary import (
    SUMMARY_FORMAT,
    BenchError,
    apply_compare,
    count_targets,
    load_old_summary,
    rows_of,
    summary_table,
    write_summary,
)


def _summary(rows: list[Row]) -> dict[str, Any]:
    return {"format": SUMMARY_FORMAT, "rows": [vars(r) for r in rows]}


def test_compare_sets_old_and_new_over_old() -> None:
    old = _summary(
        [
            Row("step", "step/a", "a", ratio=1.25),
            Row("distributed", "d/hidden", "h", vflow=40.0),  # no ratio: on vflow
            Row("prefetch", "p/1", "p", ratio=-0.1),  # negative: no new/old
            Row("step", "step/gone", "g", ratio=1.0),
        ]
    )
    new = [
        Row("step", "step/a", "a", ratio=1.0),
        Row("distributed", "d/hidden", "h", vflow=50.0),
        Row("prefetch", "p/1", "p", ratio=0.5),
        Row("step", "step/new", "n", ratio=1.0),
    ]
    assert apply_compare(new, old) == 3
    assert (new[0].old, new[0].change) == (1.25, pytest.approx(0.8))
    assert (new[1].old, new[1].change) == (40.0, pytest.approx(1.25))
    assert (new[2].old, new[2].change) == (-0.1, None)
    assert (new[3].old, new[3].change) == (None, None)
    table = summary_table(new, compared=True)
    assert "new/old" in table.splitlines()[0]
    assert "0.800" in table


def test_load_old_summary_errors(tmp_path: Path) -> None:
    with pytest.raises(BenchError, match="cannot read"):
        load_old_summary(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{", encoding="utf-8")
    with pytest.raises(BenchError, match="not JSON"):
        load_old_summary(bad)
    records = tmp_path / "step.json"  # a script's JSON, not a summary
    records.write_text(json.dumps([{"benchmark": "step"}]), encoding="utf-8")
    with pytest.raises(BenchError, match="rows"):
        load_old_summary(records)
    older = tmp_path / "format1.json"
    older.write_text(json.dumps({"format": 1, "rows": []}), encoding="utf-8")
    with pytest.raises(BenchError, match="summary format 1, this version reads format 2"):
        load_old_summary(older)
    good = tmp_path / "summary.json"
    good.write_text(json.dumps(_summary([])), encoding="utf-8")
    assert load_old_summary(good)["rows"] == []


def test_table_shows_missing_values_as_dash() -> None:
    row = Row("step", "k", "failed run", result="FAILED")
    line = summary_table([row], compared=False).splitlines()[-1]
    assert "None" not in line
    # vflow, baseline, limit, ratio and target absent; the unit is blank.
    assert line.split()[-6:] == ["-"] * 5 + ["FAILED"]


def test_notes_explain_limits_and_n_a_targets_below_the_table() -> None:
    copy_note = "limit = copy bandwidth, which accumulate can exceed"
    rows = [
        Row("kernels", "a", "fp32", "GB/s", 40.0, 20.0, 25.0, 1.6, limit_note=copy_note),
        Row("kernels", "b", "bf16", "GB/s", 40.0, 20.0, 30.0, 2.0, limit_note=copy_note),
        Row(
            "step",
            "c",
            "V=4",
            "ms",
            ratio=1.1,
            target="<= 1.05",
            result="n/a here",
            result_note="<= 1.05 needs >= 20 timed samples, this run has 3",
        ),
    ]
    lines = summary_table(rows, compared=False).splitlines()
    # One number per distinct note, on the cell it explains.
    assert lines[2].split()[5:7] == ["25.00", "[1]"]
    assert lines[3].split()[5:7] == ["30.00", "[1]"]
    assert lines[4].endswith("n/a here [2]")
    assert lines[-2:] == [f"[1] {copy_note}", f"[2] {rows[2].result_note}"]


def test_count_targets_and_its_line() -> None:
    rows = [
        Row("a", "1", "", result="met"),
        Row("a", "2", "", result="MISSED"),
        Row("a", "3", "", result="n/a here"),
        Row("a", "4", "", result="n/a here"),
        Row("a", "5", "", result="-"),
    ]
    counts = count_targets(rows)
    assert (counts.met, counts.missed, counts.not_here, counts.judged) == (1, 1, 2, 2)
    assert counts.line().startswith("targets: 1 met, 1 missed, 2 n/a here")


def _records() -> list[dict[str, Any]]:
    met = headline(
        "step",
        "step/a",
        "a",
        vflow=measurement([0.001]),
        baseline=measurement([0.001]),
        target=target("<=", 1.05),
    )
    return [{"benchmark": "step", "ratio": 99.0}, {**met, "env": {"device": "cpu"}}]


def test_rows_of_evaluates_only_the_headlines() -> None:
    rows = rows_of(_records())
    assert [(r.key, r.ratio, r.result) for r in rows] == [("step/a", 1.0, "met")]


def test_write_summary_round_trips_through_compare(tmp_path: Path) -> None:
    records = _records()
    rows = rows_of(records)
    path = tmp_path / "out" / "summary.json"
    write_summary(
        path,
        argv=["python", "-m", "vflow", "bench"],
        seconds=1.5,
        environment=summary.run_environment(records, mode="quick"),
        rows=rows,
        records=records,
        compared_with=None,
    )
    saved = load_old_summary(path)
    assert saved["environment"]["device"] == "cpu"
    assert saved["environment"]["mode"] == "quick"
    assert saved["targets"] == {"met": 1, "missed": 0, "not_here": 0, "no_ratio": 0}
    # The headlines are kept, so the rows can be recomputed from the measurements.
    assert rows_of(saved["headlines"])[0].ratio == rows[0].ratio
    fresh = rows_of(records)
    assert apply_compare(fresh, saved) == 1
    assert fresh[0].change == pytest.approx(1.0)
