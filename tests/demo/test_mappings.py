"""The main job's runs (vflow/demo/mappings.py): mapping specs, parameter differences
at the same point of the data, and a short run end to end with real Gloo workers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from vflow.demo import mappings


def test_mapping_specs() -> None:
    assert mappings.plan_counts("1", 8) == (8,)
    assert mappings.plan_counts("4", 8) == (2, 2, 2, 2)
    assert mappings.plan_counts("3", 8) == (3, 3, 2)
    assert mappings.plan_counts("5,2,1", 8) == (5, 2, 1)
    assert mappings.default_mappings(8) == ["1", "2", "4", "5,2,1"]
    assert mappings.default_mappings(2) == ["1", "2"]
    with pytest.raises(ValueError, match="add up to V=8"):
        mappings.plan_counts("5,2", 8)
    with pytest.raises(ValueError, match=r"must be in \[1, V=8\]"):
        mappings.plan_counts("9", 8)


def test_short_run_gives_identical_vflow_mappings_and_writes_the_plot(tmp_path: Path) -> None:
    """The demo's mapping runs end to end with real Gloo workers. CI runs the main job
    (``make demo``) before the tests and passes its output folder in VFLOW_DEMO_OUT:
    this test then checks what that run wrote instead of running a short demo of its
    own (its printed lines are checked only on its own run)."""
    given = os.environ.get("VFLOW_DEMO_OUT")
    out = Path(given) if given else tmp_path / "demo"
    if not given:
        result = subprocess.run(
            [sys.executable, "-m", "vflow", "demo", "--epochs", "2", "--mappings", "1", "2",
             "3,2,1", "--virtual-nodes", "6", "--batch-size", "128", "--out", str(out),
             "--no-elastic", "--no-pipeline"],
            capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        assert result.returncode == 0, result.stdout + result.stderr
        assert "bitwise-identical parameters (max parameter difference 0)" in result.stdout
        assert "heterogeneous workers, EMULATED" in result.stdout
        assert not (out / "elastic.json").exists()  # --no-elastic
    record = json.loads((out / "results.json").read_text())
    settings = record["settings"]
    v, batch = settings["virtual_nodes"], settings["batch_size"]
    assert record["vflow_identical"] is True
    runs = {r["name"]: r for r in record["runs"]}
    vflow_runs = [r for r in runs.values() if r["counts"] is not None]
    baselines = [r for r in runs.values() if r["counts"] is None]
    mapped = [r for r in vflow_runs if r["slowdown"] is None]
    # The mappings, then the 2 heterogeneous runs (2:1, emulated): same bits as well.
    assert len(vflow_runs) == len(mapped) + 2 and len(mapped) >= 3
    assert all(r["max_param_diff"] == 0.0 for r in vflow_runs)
    assert all(sum(r["counts"]) == v and r["global_batch"] == batch for r in vflow_runs)
    even, auto = (r for r in vflow_runs if r["slowdown"] is not None)
    assert even["slowdown"] == auto["slowdown"] == [1.0, 2.0]
    assert (even["auto_plan"], even["plan_changes"]) == (False, [])
    # plan="auto" weighs moving VNs to the fast worker after the warm-up (the first
    # step's profile dropped, 4 profiled, one step late). Which plan it picks there rests
    # on the step times the other tests running beside this one skew: CI has seen [4, 2]
    # (4 units against the even plan's 6), [5, 1] (a 3x slowdown measured) and "no better
    # plan" (the slowdown hidden). That it finds [4, 2] is the demo's claim, measured
    # where nothing runs beside it (make demo, README). Checked here: every decision
    # falls at or after the warm-up, every change moves VNs off the slow worker (rank 1)
    # for a predicted gain, and by the end the slow worker holds fewer VNs.
    decisions, changes = auto["plan_decisions"], auto["plan_changes"]
    assert auto["auto_plan"] and decisions[0].startswith("step 6: "), decisions
    assert all(int(d.split()[1].rstrip(":")) >= 6 for d in decisions), decisions
    assert changes, decisions
    assert all(c["counts"][1] < c["counts"][0] for c in changes), (changes, decisions)
    assert all(sum(c["counts"]) == v and c["predicted_gain"] > 1 for c in changes), changes
    assert len(auto["step_seconds"]) == len(auto["losses"])
    # The baseline's global batch follows the worker count: W x the per-device batch,
    # for each even mapping's W.
    even_workers = sorted(len(r["counts"]) for r in mapped if len(set(r["counts"])) == 1)
    per_device = settings["baseline_batch"]
    assert sorted(r["global_batch"] for r in baselines) == [w * per_device for w in even_workers]
    assert any(r["max_param_diff"] > 0 for r in baselines)
    # Per step, against the first run after the same samples: exactly 0 for every vflow
    # mapping at every step; a baseline of the first's global batch matches it at every
    # step, one of a k-th of it first at step k, and trains a different model.
    for r in vflow_runs:
        assert r["param_diff_per_step"] == [0.0] * len(r["losses"])
    for r in baselines:
        diffs, k = r["param_diff_per_step"], batch // r["global_batch"]
        assert diffs[: k - 1] == [None] * (k - 1) and diffs[k - 1] is not None, r["name"]
        if k == 1:
            assert all(d is not None for d in diffs), r["name"]
        else:
            assert max(d for d in diffs if d is not None) > 0, r["name"]
    png = (out / "loss_curves.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000


def _outcome(name: str, global_batch: int, steps_per_epoch: int, values: list[float]):
    run = mappings.Run(name, 1, global_batch, (1,))
    outcome = mappings.Outcome(run, losses=[0.0] * len(values), steps_per_epoch=steps_per_epoch)
    outcome.trajectory = np.array([[v, -v] for v in values], dtype=np.float32)
    return outcome


def test_parameter_differences_are_taken_at_the_same_point_of_the_data() -> None:
    # Batch 4, 2 steps per epoch; the other run's batch 2 reaches the same samples on
    # every second step, the third run's batch 3 never does.
    first = _outcome("first", 4, 2, [1.0, 2.0, 3.0, 4.0])
    same = _outcome("same", 4, 2, [1.0, 2.0, 3.0, 4.0])
    half = _outcome("half", 2, 4, [0.0, 1.5, 0.0, 2.0, 0.0, 3.0, 0.0, 4.5])
    odd = _outcome("odd", 3, 2, [5.0, 5.0, 5.0, 5.0])
    mappings.compare_with_first([first, same, half, odd])
    assert same.param_diff_per_step == [0.0] * 4 and same.max_param_diff == 0.0
    assert half.param_diff_per_step == [None, 0.5, None, 0.0, None, 0.0, None, 0.5]
    assert half.max_param_diff == 0.5
    assert odd.param_diff_per_step == [None] * 4
    assert odd.max_param_diff == 1.0
