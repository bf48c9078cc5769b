"""``python -m vflow bench``: the summary rows read from each script's JSON, --compare,
argument and folder errors, and one short end-to-end run.

The records below are hand-written in the shape benchmarks/*.py write them (only the
fields the summary reads, plus a few it must ignore), so no benchmark runs except in
the one end-to-end test, which asserts nothing about timings.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from vflow import bench
from vflow.__main__ import main as cli_main

REPO_ROOT = Path(__file__).resolve().parents[1]


def _accumulate_records() -> list[dict[str, Any]]:
    def acc(lst: str, dtype: str, method: str, gbps: float, speedup: float) -> dict[str, Any]:
        return {
            "benchmark": "accumulate",
            "list": lst,
            "grad_dtype": dtype,
            "method": method,
            "copy_gbps": 20.0,
            "target_fp32_copy_fraction": 0.8,
            "target_bf16_speedup_vs_loop": 1.5,
            "status": "ok",
            "gbps": gbps,
            "speedup_vs_loop": speedup,
            "times_s": [0.1, 0.2],
        }

    def exact(kernel: str, path: str | None, median_s: float, vs_fold: float | None):
        return {
            "benchmark": "exact",
            "size": "mlp 12x1024",
            "kernel": kernel,
            "path": path,
            "bytes": 30_000_000,
            "median_s": median_s,
            "copy_gbps": 15.0,
            "time_vs_float_fold": vs_fold,
        }

    return [
        {"benchmark": "copy", "gbps": 20.0, "median_s": 0.05},
        acc("resnet50", "fp32", "per-tensor add_", 5.0, 1.0),
        {
            "benchmark": "accumulate",
            "list": "resnet50",
            "grad_dtype": "fp32",
            "method": "torch._foreach_add_",
            "status": "n/a",
            "error": "RuntimeError: unsupported",
        },
        acc("resnet50", "fp32", "vflow accumulate_", 18.0, 3.6),
        acc("resnet50", "bf16", "per-tensor add_", 4.0, 1.0),
        acc("resnet50", "bf16", "vflow accumulate_", 5.0, 1.25),
        exact("copy (dst.copy_(src))", None, 0.004, None),
        exact("vflow float fold", "avx2", 0.005, None),
        exact("exact accumulate_ add", "avx2", 0.02, 4.0),
    ]


STEP_RECORDS = [
    {
        "benchmark": "step",
        "model": "mlp 4x1024",
        "virtual_nodes": v,
        "vflow_median_s": 0.1 * ratio,
        "hand_median_s": 0.1,
        "ratio": ratio,
        "target_ratio": 1.05,
        "vflow_phases_s": {"forward_backward": 0.05},
    }
    for v, ratio in ((1, 1.01), (4, 1.2))
]

DISTRIBUTED_RECORD = {
    "benchmark": "distributed",
    "model": "mlp 4x512",
    "virtual_nodes": 4,
    "bytes_per_step": {
        "vflow": 4 * 2**20,
        "deterministic": 4 * 2**20,
        "exact": 9 * 2**20,
        "ddp": 2**22,
    },
    "vflow_median_s": 0.030,
    "ddp_median_s": 0.025,
    "ratio": 1.2,
    "target_ratio": 1.0,
    "deterministic_median_s": 0.033,
    "deterministic_ratio": 1.1,
    "deterministic_target_ratio": 1.3,
    "deterministic_target_met": True,
    "exact_median_s": 0.060,
    "exact_ratio": 2.0,
    "vflow_hidden": 0.5,
    "ddp_hidden": None,
}


def _prefetch_record(kind: str, load_s: float, hidden: float, met: bool | None) -> dict[str, Any]:
    return {
        "benchmark": "prefetch",
        "load_kind": kind,
        "virtual_nodes": 8,
        "load_s": load_s,
        "compute_per_vn_s": 0.002,
        "compute_only_s": 0.016,
        "no_prefetch_s": 0.030,
        "prefetch_s": 0.020,
        "ideal_s": 0.018,
        "hidden_fraction": hidden,
        "target_hidden": 0.9,
        "target_met": met,
    }


PREFETCH_RECORDS = [
    _prefetch_record("sleep", 0.001, 0.95, True),
    _prefetch_record("sleep", 0.003, float("nan"), None),
    _prefetch_record("compute", 0.001, 0.5, False),
]


def _by_key(rows: list[bench.Row]) -> dict[str, bench.Row]:
    return {row.key: row for row in rows}


def test_accumulate_rows() -> None:
    rows = _by_key(bench.summarise("accumulate", _accumulate_records()))
    assert set(rows) == {
        "accumulate/resnet50/fp32",
        "accumulate/resnet50/bf16",
        "exact/mlp 12x1024/avx2",
    }
    fp32 = rows["accumulate/resnet50/fp32"]
    # fp32: the fused GB/s against the per-tensor loop and the copy bandwidth; the
    # ratio is the fraction of copy the target is on.
    assert (fp32.vflow, fp32.baseline, fp32.limit) == (18.0, 5.0, 20.0)
    assert fp32.ratio == pytest.approx(0.9)
    assert (fp32.target, fp32.result) == (">= 0.8", "met")
    bf16 = rows["accumulate/resnet50/bf16"]
    assert bf16.ratio == 1.25  # the speedup over the loop
    assert (bf16.target, bf16.result) == (">= 1.5", "MISSED")
    ex = rows["exact/mlp 12x1024/avx2"]
    assert (ex.unit, ex.vflow, ex.baseline, ex.ratio) == ("ms", 20.0, 5.0, 4.0)
    assert ex.limit == pytest.approx(30e6 / 15e9 * 1e3)  # its bytes at copy bandwidth
    assert (ex.target, ex.result) == ("", "-")


def test_step_rows() -> None:
    rows = bench.summarise("step", STEP_RECORDS)
    assert [r.key for r in rows] == ["step/mlp 4x1024/V=1", "step/mlp 4x1024/V=4"]
    assert rows[0].vflow == pytest.approx(101.0)
    assert rows[0].baseline == pytest.approx(100.0)
    assert [r.ratio for r in rows] == [1.01, 1.2]
    assert [r.result for r in rows] == ["met", "MISSED"]
    assert rows[0].target == "<= 1.05"


def test_a_record_without_its_target_is_not_judged() -> None:
    """The targets come from the scripts' records; an older record has none."""
    old = {k: v for k, v in STEP_RECORDS[1].items() if k != "target_ratio"}
    (row,) = bench.summarise("step", [old])
    assert row.ratio == 1.2 and (row.target, row.result) == ("", "-")


def test_distributed_rows() -> None:
    rows = _by_key(bench.summarise("distributed", [DISTRIBUTED_RECORD]))
    prefix = "distributed/mlp 4x512 V=4"
    step = rows[f"{prefix}/step"]
    assert (step.vflow, step.baseline, step.ratio) == (
        pytest.approx(30.0),
        pytest.approx(25.0),
        1.2,
    )
    assert (step.target, step.result) == ("<= 1", "MISSED")
    ordered = rows[f"{prefix}/ordered"]
    assert ordered.baseline == pytest.approx(30.0)  # the default vflow step
    assert (ordered.ratio, ordered.target, ordered.result) == (1.1, "<= 1.3", "met")
    exact = rows[f"{prefix}/exact"]
    assert (exact.ratio, exact.target, exact.result) == (2.0, "", "-")
    assert rows[f"{prefix}/bytes/vflow"].ratio == 1.0
    assert rows[f"{prefix}/bytes/vflow"].vflow == 4.0  # MiB
    assert rows[f"{prefix}/bytes/exact"].ratio == 2.25
    hidden = rows[f"{prefix}/hidden"]
    assert (hidden.vflow, hidden.baseline, hidden.ratio) == (50.0, None, None)


def test_prefetch_rows() -> None:
    rows = bench.summarise("prefetch", PREFETCH_RECORDS)
    # Keys number the loads per kind: the loads themselves change from run to run.
    assert [r.key for r in rows] == [
        "prefetch/sleep/1of2",
        "prefetch/sleep/2of2",
        "prefetch/compute/1of1",
    ]
    first = rows[0]
    assert (first.vflow, first.baseline, first.limit) == (
        pytest.approx(20.0),
        pytest.approx(30.0),
        pytest.approx(18.0),
    )
    assert (first.ratio, first.target, first.result) == (0.95, ">= 0.9", "met")
    assert "L=0.50C" in first.compared
    # NaN (nothing hideable) becomes None; no target applies when L > C.
    assert (rows[1].ratio, rows[1].target, rows[1].result) == (None, "", "n/a (L > C)")
    assert rows[2].result == "MISSED"


@pytest.mark.parametrize(
    ("name", "records"),
    [
        ("step", [{"benchmark": "step", "model": "mlp"}]),
        ("distributed", [{**DISTRIBUTED_RECORD, "bytes_per_step": 5}]),
        ("prefetch", [{"benchmark": "other"}]),
    ],
)
def test_malformed_records_raise_summary_error(name: str, records: list[dict[str, Any]]) -> None:
    with pytest.raises(bench.SummaryError):
        bench.summarise(name, records)


def _summary(rows: list[bench.Row]) -> dict[str, Any]:
    return {"format": bench.SUMMARY_FORMAT, "rows": [vars(r) for r in rows]}


def test_compare_sets_old_and_new_over_old() -> None:
    old = _summary(
        [
            bench.Row("step", "step/a", "a", ratio=1.25),
            bench.Row("distributed", "d/hidden", "h", vflow=40.0),  # no ratio: on vflow
            bench.Row("prefetch", "p/1", "p", ratio=-0.1),  # negative: no new/old
            bench.Row("step", "step/gone", "g", ratio=1.0),
        ]
    )
    new = [
        bench.Row("step", "step/a", "a", ratio=1.0),
        bench.Row("distributed", "d/hidden", "h", vflow=50.0),
        bench.Row("prefetch", "p/1", "p", ratio=0.5),
        bench.Row("step", "step/new", "n", ratio=1.0),
    ]
    assert bench.apply_compare(new, old) == 3
    assert (new[0].old, new[0].change) == (1.25, pytest.approx(0.8))
    assert (new[1].old, new[1].change) == (40.0, pytest.approx(1.25))
    assert (new[2].old, new[2].change) == (-0.1, None)
    assert (new[3].old, new[3].change) == (None, None)
    table = bench.summary_table(new, compared=True)
    assert "new/old" in table.splitlines()[0]
    assert "0.800" in table


def test_load_old_summary_errors(tmp_path: Path) -> None:
    with pytest.raises(bench.BenchError, match="cannot read"):
        bench.load_old_summary(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{", encoding="utf-8")
    with pytest.raises(bench.BenchError, match="not JSON"):
        bench.load_old_summary(bad)
    records = tmp_path / "step.json"  # a script's JSON, not a summary
    records.write_text(json.dumps(STEP_RECORDS), encoding="utf-8")
    with pytest.raises(bench.BenchError, match="rows"):
        bench.load_old_summary(records)
    good = tmp_path / "summary.json"
    good.write_text(json.dumps(_summary([])), encoding="utf-8")
    assert bench.load_old_summary(good)["rows"] == []


def test_compare_file_checked_before_running(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert bench.main(["--compare", str(tmp_path / "nope.json"), "--out", str(tmp_path)]) == 2
    assert "--compare: cannot read" in capsys.readouterr().err
    assert not (tmp_path / "summary.json").exists()


def test_unknown_only_name_lists_choices(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        bench.main(["--only", "prefetch", "bogus"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'bogus'" in err
    for name in bench.BENCHMARKS:
        assert name in err


@pytest.mark.parametrize("argv", [["--quick", "--full"], ["--timeout", "0"]])
def test_bad_arguments(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        bench.main(argv)
    assert exc.value.code == 2


def test_quick_is_the_default() -> None:
    assert not bench.parse_args([]).full
    assert not bench.parse_args(["--quick"]).full
    assert bench.parse_args(["--full"]).full


def test_missing_benchmarks_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # As from a wheel: the package's parent (site-packages) has no benchmarks/.
    monkeypatch.setattr(bench, "source_root", lambda: tmp_path)
    assert bench.main(["--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert str(tmp_path / "benchmarks") in err
    assert "source tree" in err
    assert not (tmp_path / "out").exists()


def test_benchmarks_dir_must_hold_the_scripts(tmp_path: Path) -> None:
    (tmp_path / "_common.py").write_text("", encoding="utf-8")
    (tmp_path / "step.py").write_text("", encoding="utf-8")
    assert bench.locate_benchmarks(tmp_path, ["step"]) == tmp_path
    with pytest.raises(bench.BenchError, match=r"prefetch\.py"):
        bench.locate_benchmarks(tmp_path, ["step", "prefetch"])


def test_cli_lists_bench(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "bench" in out
    assert "demo" in out


def test_table_shows_missing_values_as_dash() -> None:
    row = bench.Row("step", "k", "failed run", result="FAILED")
    line = bench.summary_table([row], compared=False).splitlines()[-1]
    assert "None" not in line
    # vflow, baseline, limit, ratio and target absent; the unit is blank.
    assert line.split()[-6:] == ["-"] * 5 + ["FAILED"]


def _fake_script(body: str) -> str:
    # Stands in for a benchmark script: the same command line, none of the measuring.
    return (
        "import json, sys, time\n"
        "json_path = sys.argv[sys.argv.index('--json') + 1]\n"
        "assert '--quick' in sys.argv\n" + body
    )


def test_failing_and_hung_scripts_do_not_stop_the_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "benchmarks"
    folder.mkdir()
    (folder / "_common.py").write_text("", encoding="utf-8")
    (folder / "step.py").write_text(_fake_script("sys.exit(3)\n"), encoding="utf-8")
    (folder / "accumulate.py").write_text(_fake_script("time.sleep(60)\n"), encoding="utf-8")
    records = json.dumps(PREFETCH_RECORDS[:1])
    (folder / "prefetch.py").write_text(
        _fake_script(f"open(json_path, 'w').write({records!r})\n"), encoding="utf-8"
    )
    out = tmp_path / "out"
    out.mkdir()
    # A stale result of an earlier run into the same folder must not count for step.
    (out / "step.json").write_text(json.dumps(STEP_RECORDS), encoding="utf-8")
    argv = ["--benchmarks-dir", str(folder), "--out", str(out), "--timeout", "2"]
    assert bench.main([*argv, "--only", "step", "accumulate", "prefetch"]) == 1
    captured = capsys.readouterr()
    assert "failed: step, accumulate" in captured.err
    summary = json.loads((out / "summary.json").read_text(encoding="utf-8"))
    runs = {run["name"]: run for run in summary["runs"]}
    assert (runs["step"]["status"], runs["step"]["returncode"]) == ("failed", 3)
    assert runs["accumulate"]["status"] == "timeout"
    assert runs["prefetch"]["status"] == "ok"
    results = {row["key"]: row["result"] for row in summary["rows"]}
    assert results == {
        "step/run": "FAILED",
        "accumulate/run": "TIMEOUT",
        "prefetch/sleep/1of1": "met",
    }


@pytest.mark.slow
def test_end_to_end_prefetch(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "vflow", "bench", "--only", "prefetch", "--out", str(tmp_path)],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (tmp_path / "prefetch.json").is_file()
    summary = json.loads((tmp_path / "summary.json").read_text(encoding="utf-8"))
    assert summary["format"] == bench.SUMMARY_FORMAT
    assert summary["environment"]["mode"] == "quick"
    assert [run["name"] for run in summary["runs"]] == ["prefetch"]
    assert summary["runs"][0]["status"] == "ok"
    assert any(row["benchmark"] == "prefetch" for row in summary["rows"])
    assert "=== summary" in proc.stdout
