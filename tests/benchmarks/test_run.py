"""benchmarks/run.py, the suite runner of a source checkout (``make bench``): argument
and folder errors, failing, hung and inconsistent scripts, --check, and one short
end-to-end run.

The scripts are stand-ins with the same command line that write hand-made records, so
no benchmark runs except in the one end-to-end test, which asserts nothing about
timings.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests.support import REPO_ROOT
from vflow.bench.records import headline, measurement, target
from vflow.bench.summary import SUMMARY_FORMAT


def _load_runner() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_run", REPO_ROOT / "benchmarks" / "run.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    # Registered first: its dataclasses look their module up while being defined.
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


run = _load_runner()


def _prefetch_records(hidden_ms: float) -> list[dict[str, Any]]:
    """A detailed record and its headline, as prefetch.py writes them: prefetching cuts
    ``hidden_ms`` of a 10 ms gap between no prefetching and the ideal."""
    record = {"benchmark": "prefetch", "load_kind": "sleep", "target_met": False}
    return [
        record,
        headline(
            "prefetch",
            "prefetch/sleep/1of1",
            "sleep load: gap to ideal closed",
            vflow=measurement([(30 - hidden_ms) / 1e3] * 3),
            baseline=measurement([0.030] * 3),
            limit=measurement([0.020]),
            compare="gap closed",
            paired=True,
            target=target(">=", 0.9),
        ),
    ]


def _fake_script(body: str) -> str:
    # Stands in for a benchmark script: the same command line, none of the measuring.
    return (
        "import json, sys, time\n"
        "json_path = sys.argv[sys.argv.index('--json') + 1]\n"
        "assert '--quick' in sys.argv\n" + body
    )


def _folder(tmp_path: Path, scripts: dict[str, str]) -> Path:
    folder = tmp_path / "benchmarks"
    folder.mkdir()
    (folder / "_common.py").write_text("", encoding="utf-8")
    for name, body in scripts.items():
        (folder / f"{name}.py").write_text(_fake_script(body), encoding="utf-8")
    return folder


def _writes(records: list[dict[str, Any]]) -> str:
    return f"open(json_path, 'w').write({json.dumps(records)!r})\n"


def test_failing_and_hung_scripts_do_not_stop_the_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = _folder(
        tmp_path,
        {
            "step": "sys.exit(3)\n",
            "accumulate": "time.sleep(60)\n",
            "prefetch": _writes(_prefetch_records(9.5)),
        },
    )
    out = tmp_path / "out"
    out.mkdir()
    # A stale result of an earlier run into the same folder must not count for step.
    (out / "step.json").write_text(json.dumps(_prefetch_records(9.5)), encoding="utf-8")
    argv = ["--benchmarks-dir", str(folder), "--out", str(out), "--timeout", "2"]
    assert run.main([*argv, "--only", "step", "accumulate", "prefetch"]) == 1
    captured = capsys.readouterr()
    assert "failed: step, accumulate" in captured.err
    summary = json.loads((out / "summary.json").read_text(encoding="utf-8"))
    runs = {r["name"]: r for r in summary["runs"]}
    assert (runs["step"]["status"], runs["step"]["returncode"]) == ("failed", 3)
    assert runs["accumulate"]["status"] == "timeout"
    assert runs["prefetch"]["status"] == "ok"
    results = {row["key"]: row["result"] for row in summary["rows"]}
    assert results == {
        "step/run": "FAILED",
        "accumulate/run": "TIMEOUT",
        "prefetch/sleep/1of1": "met",
    }


def test_a_script_whose_stated_ratio_disagrees_fails_its_summary(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    records = _prefetch_records(9.5)
    records[1]["ratio"] = 0.5  # the measurements give 0.95
    folder = _folder(tmp_path, {"prefetch": _writes(records)})
    out = tmp_path / "out"
    assert run.main(["--benchmarks-dir", str(folder), "--out", str(out), "--only", "prefetch"]) == 1
    assert "states ratio 0.5 but its measurements give 0.95" in capsys.readouterr().err
    summary = json.loads((out / "summary.json").read_text(encoding="utf-8"))
    assert summary["runs"][0]["status"] == "summary failed"


def test_a_script_without_headlines_fails_its_summary(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = _folder(tmp_path, {"prefetch": _writes(_prefetch_records(9.5)[:1])})
    argv = ["--benchmarks-dir", str(folder), "--out", str(tmp_path / "out"), "--only", "prefetch"]
    assert run.main(argv) == 1
    assert "prefetch wrote no headline records among its 1 results" in capsys.readouterr().err


@pytest.mark.parametrize(("hidden_ms", "check", "status"), [(5.0, True, 1), (5.0, False, 0)])
def test_check_makes_a_missed_target_fail_the_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], hidden_ms: float, check: bool, status: int
) -> None:
    folder = _folder(tmp_path, {"prefetch": _writes(_prefetch_records(hidden_ms))})
    argv = ["--benchmarks-dir", str(folder), "--out", str(tmp_path / "out"), "--only", "prefetch"]
    assert run.main(argv + ["--check"] * check) == status
    captured = capsys.readouterr()
    assert "targets: 0 met, 1 missed, 0 n/a here" in captured.out
    assert ("--check: 1 target(s) missed" in captured.err) == check


def test_elastic_runs_only_when_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ok = _writes(_prefetch_records(9.5))
    scripts = {name: ok for name in run.suite_names()}
    folder = _folder(tmp_path, {**scripts, "elastic": "sys.exit(3)\n"})
    assert "elastic" not in run.suite_names() and "elastic" in run.BENCHMARKS
    assert "elastic_scale" not in run.suite_names() and "elastic_scale" in run.BENCHMARKS
    argv = ["--benchmarks-dir", str(folder)]
    assert run.main([*argv, "--out", str(tmp_path / "suite")]) == 0
    summary = json.loads((tmp_path / "suite" / "summary.json").read_text(encoding="utf-8"))
    assert [r["name"] for r in summary["runs"]] == run.suite_names()
    assert run.main([*argv, "--out", str(tmp_path / "named"), "--only", "elastic"]) == 1
    assert "failed: elastic" in capsys.readouterr().err


def test_compare_file_checked_before_running(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run.main(["--compare", str(tmp_path / "nope.json"), "--out", str(tmp_path)]) == 2
    assert "--compare: cannot read" in capsys.readouterr().err
    assert not (tmp_path / "summary.json").exists()


def test_unknown_only_name_lists_choices(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        run.main(["--only", "prefetch", "bogus"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'bogus'" in err
    for name in run.BENCHMARKS:
        assert name in err


@pytest.mark.parametrize("argv", [["--quick", "--full"], ["--timeout", "0"]])
def test_bad_arguments(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        run.main(argv)
    assert exc.value.code == 2


def test_quick_is_the_default() -> None:
    assert not run.parse_args([]).full
    assert not run.parse_args(["--quick"]).full
    assert run.parse_args(["--full"]).full


def test_benchmarks_dir_must_hold_the_scripts(tmp_path: Path) -> None:
    (tmp_path / "_common.py").write_text("", encoding="utf-8")
    (tmp_path / "step.py").write_text("", encoding="utf-8")
    assert run.locate_benchmarks(tmp_path, ["step"]) == tmp_path
    with pytest.raises(run.BenchError, match=r"prefetch\.py"):
        run.locate_benchmarks(tmp_path, ["step", "prefetch"])
    # By default the scripts beside the runner: every one of them is there.
    assert run.locate_benchmarks(None, list(run.BENCHMARKS)) == REPO_ROOT / "benchmarks"


@pytest.mark.slow
def test_end_to_end_prefetch(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(
        [sys.executable, "benchmarks/run.py", "--only", "prefetch", "--out", str(tmp_path)],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (tmp_path / "prefetch.json").is_file()
    summary = json.loads((tmp_path / "summary.json").read_text(encoding="utf-8"))
    assert summary["format"] == SUMMARY_FORMAT
    assert summary["environment"]["mode"] == "quick"
    assert [r["name"] for r in summary["runs"]] == ["prefetch"]
    assert summary["runs"][0]["status"] == "ok"
    assert any(row["benchmark"] == "prefetch" for row in summary["rows"])
    assert "=== summary" in proc.stdout
