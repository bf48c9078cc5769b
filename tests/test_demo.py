"""The main job, ``python -m vflow demo`` (vflow/demo.py): its argument handling and a
short end-to-end run with real Gloo workers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from vflow import demo


def test_mapping_specs() -> None:
    assert demo.plan_counts("1", 8) == (8,)
    assert demo.plan_counts("4", 8) == (2, 2, 2, 2)
    assert demo.plan_counts("3", 8) == (3, 3, 2)
    assert demo.plan_counts("5,2,1", 8) == (5, 2, 1)
    assert demo.default_mappings(8) == ["1", "2", "4", "5,2,1"]
    assert demo.default_mappings(2) == ["1", "2"]
    with pytest.raises(ValueError, match="add up to V=8"):
        demo.plan_counts("5,2", 8)
    with pytest.raises(ValueError, match=r"must be in \[1, V=8\]"):
        demo.plan_counts("9", 8)


def test_bad_arguments_are_reported_by_name(capsys) -> None:
    for argv, message in (
        (["--epochs", "0"], "--epochs must be >= 1"),
        (["--batch-size", "4", "--virtual-nodes", "8"], "--batch-size (4) must be >= --virtual"),
        (["--mappings", "3,3"], "--mappings: mapping '3,3'"),
        (["--lr", "0"], "--lr must be > 0"),
    ):
        with pytest.raises(SystemExit) as info:
            demo.main(argv)
        assert info.value.code == 2
        assert message in capsys.readouterr().err


def test_short_run_gives_identical_vflow_mappings_and_writes_the_plot(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    result = subprocess.run(
        [sys.executable, "-m", "vflow", "demo", "--epochs", "1", "--mappings", "1", "2", "2,1,1",
         "--virtual-nodes", "4", "--batch-size", "128", "--out", str(out)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "bitwise-identical parameters (max parameter difference 0)" in result.stdout
    record = json.loads((out / "results.json").read_text())
    assert record["vflow_identical"] is True
    runs = {r["name"]: r for r in record["runs"]}
    vflow_runs = [r for r in runs.values() if r["counts"] is not None]
    baselines = [r for r in runs.values() if r["counts"] is None]
    assert len(vflow_runs) == 3 and all(r["max_param_diff"] == 0.0 for r in vflow_runs)
    # The baseline's global batch follows the worker count: 1 x 64 and 2 x 64.
    assert sorted(r["global_batch"] for r in baselines) == [64, 128]
    assert any(r["max_param_diff"] > 0 for r in baselines)
    png = (out / "loss_curves.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000
