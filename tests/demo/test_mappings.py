"""The main job's runs (vflow/demo/mappings.py): mapping specs, parameter differences
at the same point of the data, and a short run end to end with real Gloo workers."""

from __future__ import annotations

import json
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
    out = tmp_path / "demo"
    result = subprocess.run(
        [sys.executable, "-m", "vflow", "demo", "--epochs", "2", "--mappings", "1", "2", "3,2,1",
         "--virtual-nodes", "6", "--batch-size", "128", "--out", str(out), "--no-elastic"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "bitwise-identical parameters (max parameter difference 0)" in result.stdout
    record = json.loads((out / "results.json").read_text())
    assert record["vflow_identical"] is True
    runs = {r["name"]: r for r in record["runs"]}
    vflow_runs = [r for r in runs.values() if r["counts"] is not None]
    baselines = [r for r in runs.values() if r["counts"] is None]
    # The 3 mappings, then the 2 heterogeneous runs (2:1, emulated): same bits as well.
    assert len(vflow_runs) == 5 and all(r["max_param_diff"] == 0.0 for r in vflow_runs)
    even, auto = (r for r in vflow_runs if r["slowdown"] is not None)
    assert even["slowdown"] == auto["slowdown"] == [1.0, 2.0]
    assert (even["auto_plan"], even["plan_changes"]) == (False, [])
    # plan="auto" weighs moving a VN to the fast worker after the warm-up (the first
    # step's profile dropped, 4 profiled, one step late): [4, 2] takes 4 units against
    # the even plan's 6. Whether it moves depends on the step time's noise, which the
    # other tests running beside this one set (the gain itself: make demo, README);
    # if it moves on the warm-up's profiles, [4, 2] is the only better plan. Later
    # changes follow the speeds measured since ("settled", "drift"), which the tests
    # beside this one skew: only their shape is checked.
    assert auto["auto_plan"] and auto["plan_decisions"][0].startswith("step 6: ")
    # Under that noise the warm-up's profiles may even hide the slow worker (CI saw
    # "no better plan under the model" at step 6); the speeds measured later must not.
    first = auto["plan_decisions"][0]
    assert "[4, 2]" in first or "no better plan" in first, auto["plan_decisions"]
    assert any("[4, 2]" in d for d in auto["plan_decisions"]), auto["plan_decisions"]
    changes = auto["plan_changes"]
    assert all(c["counts"] == [4, 2] for c in changes if c["reason"] == "profiled"), changes
    assert all(sum(c["counts"]) == 6 and c["predicted_gain"] > 1 for c in changes), changes
    assert "heterogeneous workers, EMULATED" in result.stdout
    assert len(auto["step_seconds"]) == len(auto["losses"])
    # The baseline's global batch follows the worker count: 1 x 64 and 2 x 64.
    assert sorted(r["global_batch"] for r in baselines) == [64, 128]
    assert any(r["max_param_diff"] > 0 for r in baselines)
    # Per step, against the first run after the same samples: exactly 0 for every vflow
    # mapping at every step; the baseline run with the first's global batch matches it
    # at every step, the other one at every second.
    for r in vflow_runs:
        assert r["param_diff_per_step"] == [0.0] * len(r["losses"])
    same_batch, half_batch = sorted(baselines, key=lambda r: -r["global_batch"])
    assert all(d is not None for d in same_batch["param_diff_per_step"])
    assert half_batch["param_diff_per_step"][1::2] != [None] * (len(half_batch["losses"]) // 2)
    assert half_batch["param_diff_per_step"][0] is None
    assert max(d for d in half_batch["param_diff_per_step"] if d is not None) > 0
    png = (out / "loss_curves.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000
    assert not (out / "elastic.json").exists()  # --no-elastic (tests/demo/test_elastic_scenario.py)


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
