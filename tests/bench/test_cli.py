"""``python -m vflow bench`` (vflow/bench/cli.py): what it says it runs, its argument
errors, --check, and a short run from a folder outside the source tree.

The suite runner of a source checkout has its tests in test_benchmarks_run.py, the
record evaluation in test_bench_records.py and the summary in test_bench_summary.py.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.support import REPO_ROOT
from vflow.__main__ import main as cli_main
from vflow.bench import cli, kernels
from vflow.bench.records import headline, measurement, target


def test_cli_lists_bench(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "bench" in out
    assert "demo" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--quick", "--full"], "not allowed with argument"),
        (["--numel", "10"], "--numel must be >= 10240, got 10"),
        (["--threads", "0"], "--threads must be >= 1, got 0"),
    ],
)
def test_bad_arguments(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_quick_is_the_default() -> None:
    assert not cli.parse_args([]).full
    assert not cli.parse_args(["--quick"]).full
    assert cli.parse_args(["--full"]).full


def test_compare_file_checked_before_running(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_measuring(*args: Any) -> None:
        raise AssertionError("measured although --compare names no file")

    monkeypatch.setattr(kernels, "run", no_measuring)
    assert cli.main(["--compare", str(tmp_path / "nope.json"), "--out", str(tmp_path)]) == 2
    assert "--compare: cannot read" in capsys.readouterr().err
    assert not (tmp_path / "summary.json").exists()


def test_bad_device_is_reported_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--device", "mps"]) == 2
    assert "--device mps: only cpu and cuda are supported" in capsys.readouterr().err


def test_says_where_the_full_suite_is(monkeypatch: pytest.MonkeyPatch) -> None:
    # From this checkout (an editable install): the runner beside the package.
    assert cli.suite_location().startswith(str(REPO_ROOT / "benchmarks" / "run.py"))
    # From a wheel, whose site-packages has no benchmarks/: where to find it.
    monkeypatch.setattr(cli, "__file__", "/site-packages/vflow/bench/cli.py")
    assert cli.suite_location() == (
        "benchmarks/run.py in a source checkout of vflow (make bench there)"
    )


def _missed_records(device: Any, settings: Any) -> tuple[list[dict[str, Any]], str]:
    record = headline(
        "kernels",
        "kernels/test",
        "a missed target",
        vflow=measurement([0.002]),
        baseline=measurement([0.001]),
        target=target("<=", 1.05),
    )
    return [record], "detail table"


@pytest.mark.parametrize(("argv", "status"), [([], 0), (["--check"], 1)])
def test_check_exits_1_when_a_target_is_missed(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    argv: list[str],
    status: int,
) -> None:
    monkeypatch.setattr(kernels, "run", _missed_records)
    assert cli.main([*argv, "--device", "cpu", "--out", str(tmp_path)]) == status
    captured = capsys.readouterr()
    assert "targets: 0 met, 1 missed, 0 n/a here; 1 in all" in captured.out
    summary = json.loads((tmp_path / "summary.json").read_text(encoding="utf-8"))
    assert summary["targets"]["missed"] == 1
    assert summary["headlines"][0]["env"]["device"] == "cpu"


def test_runs_from_another_folder(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "vflow", "bench", "--numel", "40000", "--device", "cpu"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "the kernel-throughput microbenchmarks of the installed vflow" in proc.stdout
    assert "The full suite (accumulate, step, distributed, prefetch) is" in proc.stdout
    (summary_path,) = (tmp_path / "vflow_out").glob("bench-*/summary.json")
    summary = json.loads(summary_path.read_text(encoding="utf-8"))
    rows = {row["key"]: row for row in summary["rows"]}
    assert set(rows) == {
        "kernels/accumulate/fp32",
        "kernels/accumulate/bf16",
        "kernels/scale_check",
        "kernels/exact_add",
    }
    # The fp32 ratio is the fused throughput over the copy's, from the raw times.
    (fp32,) = (h for h in summary["headlines"] if h["key"] == "kernels/accumulate/fp32")
    fused = fp32["vflow"]["bytes"] / statistics.median(fp32["vflow"]["seconds"])
    copy = fp32["limit"]["bytes"] / statistics.median(fp32["limit"]["seconds"])
    assert rows["kernels/accumulate/fp32"]["ratio"] == pytest.approx(fused / copy)
    assert "write-allocate" in rows["kernels/accumulate/fp32"]["limit_note"]
