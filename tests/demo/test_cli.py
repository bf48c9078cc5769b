"""``python -m vflow demo`` (vflow/demo/cli.py): argument handling, the help text, and
how the job puts its parts together (the elastic scenario last, the exit status)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from vflow.demo import cli, elastic_scenario, mappings, pipeline_row


def test_bad_arguments_are_reported_by_name(capsys) -> None:
    for argv, message in (
        (["--epochs", "0"], "--epochs must be >= 1"),
        (["--batch-size", "4", "--virtual-nodes", "8"], "--batch-size (4) must be >= --virtual"),
        (["--mappings", "3,3"], "--mappings: mapping '3,3'"),
        (["--lr", "0"], "--lr must be > 0"),
    ):
        with pytest.raises(SystemExit) as info:
            cli.main(argv)
        assert info.value.code == 2
        assert message in capsys.readouterr().err


def test_help_describes_every_option_once(capsys) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    description = " ".join(out.split("options:")[0].split("\n\n", 1)[1].split())
    assert description == " ".join(cli.DESCRIPTION.split())
    assert description.endswith(".")
    for action in cli.build_parser()._actions:
        assert action.help, f"{action.option_strings} has no help"
        # A default is stated once, by the help text itself.
        assert action.help.count("default") <= 1, action.option_strings


def _fake_outcome(name: str, workers: int) -> mappings.Outcome:
    run = mappings.Run(name, workers, 64, (8 // workers,) * workers)
    outcome = mappings.Outcome(run, losses=[2.0, 1.0], steps_per_epoch=2)
    outcome.trajectory = np.zeros((2, 3), dtype=np.float32)
    outcome.test_accuracy, outcome.seconds, outcome.wall_seconds = 0.5, 1.0, 2.0
    return outcome


def _fake_pipeline(settings: dict[str, Any], offset: float = 0.0) -> list[pipeline_row.Outcome]:
    """The row's three runs; the last one's parameter is off by ``offset``."""
    last = len(pipeline_row.GRIDS) - 1
    return [
        pipeline_row.Outcome(
            stages, replicas, 0.01, 0.001, 10.0, [1.0],
            {"w": torch.zeros(2) + (offset if k == last else 0.0)},
        )
        for k, (stages, replicas) in enumerate(pipeline_row.GRIDS)
    ]  # fmt: skip


@pytest.mark.parametrize(("elastic_ok", "status"), [(True, 0), (False, 1), (None, 0)])
def test_the_demo_runs_the_scenario_last_and_fails_with_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, elastic_ok: bool | None, status: int
) -> None:
    calls: list[dict[str, Any]] = []
    monkeypatch.setattr(
        cli, "run_together", lambda runs, *_: [_fake_outcome(r.name, r.workers) for r in runs]
    )
    monkeypatch.setattr(pipeline_row, "run", _fake_pipeline)

    def fake_run(settings: dict[str, Any], data: Any, out: Path) -> bool:
        assert (out / "results.json").exists()  # the other runs are written first
        calls.append(settings)
        return bool(elastic_ok)

    monkeypatch.setattr(elastic_scenario, "run", fake_run)
    argv = ["--epochs", "1", "--mappings", "1", "2", "--no-baseline", "--out", str(tmp_path)]
    assert cli.main(argv + (["--no-elastic"] if elastic_ok is None else [])) == status
    if elastic_ok is None:
        assert calls == []
    else:
        assert calls == [
            {"epochs": 1, "virtual_nodes": 12, "lr": 0.05, "seed": 0, "timeout": 600.0,
             "batch_size": 64}
        ]  # fmt: skip


def test_the_scenario_needs_three_virtual_nodes(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(["--virtual-nodes", "2", "--batch-size", "8"])
    assert info.value.code == 2
    assert "needs --virtual-nodes >= 3 (or --no-elastic)" in capsys.readouterr().err


def test_pipeline_runs_that_differ_fail_the_demo(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(
        cli, "run_together", lambda runs, *_: [_fake_outcome(r.name, r.workers) for r in runs]
    )
    monkeypatch.setattr(pipeline_row, "run", lambda settings: _fake_pipeline(settings, 1.0))
    argv = [
        "--epochs",
        "1",
        "--mappings",
        "1",
        "--no-baseline",
        "--no-elastic",
        "--out",
        str(tmp_path),
    ]
    assert cli.main(argv) == 1
    assert "pipeline: the runs DIFFER" in capsys.readouterr().out


def test_the_pipeline_row_needs_a_v_that_divides_b(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(["--virtual-nodes", "3", "--batch-size", "9", "--no-elastic"])
    assert info.value.code == 2
    assert "the pipeline row needs a V >= 4 that divides B=9" in capsys.readouterr().err
