"""The main job's heterogeneous row (vflow/demo/heterogeneous.py): its bounds."""

from __future__ import annotations

import pytest

from vflow.demo import heterogeneous
from vflow.demo.mappings import Outcome


def test_heterogeneous_bounds() -> None:
    assert heterogeneous.speeds_label() == "2:1"
    # Even 4+4 VNs: the slow worker takes 8 units; 5+3 or 6+2 take 6.
    assert heterogeneous.best_whole_vn_gain(8, (1.0, 2.0)) == pytest.approx(8 / 6)
    assert heterogeneous.best_whole_vn_gain(4, (1.0, 2.0)) == pytest.approx(4 / 3)
    assert heterogeneous.best_whole_vn_gain(12, (1.0, 2.0)) == pytest.approx(1.5)  # 8 + 4
    assert heterogeneous.best_whole_vn_gain(2, (1.0, 2.0)) == 1.0  # one VN each, nothing to move
    assert heterogeneous.best_whole_vn_gain(6, (1.0, 1.5, 3.0)) == pytest.approx(6 / 3)
    # A perfect split of the compute at 2:1: 1.5x the even plan, whatever V.
    assert heterogeneous.compute_bound_gain(8, (1.0, 2.0)) == pytest.approx(1.5)
    assert heterogeneous.compute_bound_gain(6, (1.0, 1.5, 3.0)) == pytest.approx(2.0)


def _outcome(
    auto: bool, changes: list[dict], decisions: list[str], step_seconds: list[float] | None = None
) -> Outcome:
    run = heterogeneous.runs(12, 64)[1 if auto else 0]
    outcome = Outcome(run, losses=[1.0] * 8, steps_per_epoch=8)
    if step_seconds is None:
        step_seconds = [0.020] * 8 if not auto else [0.020] * 4 + [0.014] * 4
    outcome.step_seconds = step_seconds
    outcome.vn_seconds = [0.001, 0.002]
    outcome.max_param_diff = 0.0
    outcome.plan_changes = changes
    outcome.plan_decisions = decisions
    return outcome


def test_the_table_counts_changes_after_the_warmup_and_gives_the_decisions() -> None:
    changes = [
        {"step": 6, "counts": [8, 4], "reason": "profiled", "predicted_gain": 1.4},
        {"step": 30, "counts": [9, 3], "reason": "drift", "predicted_gain": 1.1},
    ]
    decided = ["step 6: moved to [8, 4] gains 1.40x (5 ms), beats the noise band (1 ms)"]
    # 40 steps: 14 ms under [8, 4], 12.5 ms under [9, 3] from step 30 (whose own step,
    # the first under it, pays for the change).
    auto_s = [0.020] * 6 + [0.014] * 24 + [0.030] + [0.0125] * 9
    auto = _outcome(True, changes, decided, auto_s)
    assert heterogeneous.changes_after_warmup(auto) == 1
    even = _outcome(False, [], [], [0.020] * 40)
    assert heterogeneous.steady_start([even, auto]) == 31
    text = heterogeneous.table([even, auto], 12)
    assert "[6, 6] -(6)-> [8, 4] -(30)-> [9, 3]" in text
    assert 'plan="auto" decisions: step 6: moved to [8, 4]' in text
    assert "steady = from step 31 on" in text
    assert "1.60x" in text and "12.5" in text  # 20 ms / 12.5 ms from step 31 on


def test_the_gain_is_the_median_of_the_per_step_ratios() -> None:
    """The runs' steps interleave: a slow spell slows both runs' steps alike, and each
    step's ratio cancels it."""
    even_s = [0.020, 0.020, 0.040, 0.040, 0.040, 0.020]
    auto_s = [0.015, 0.015, 0.030, 0.030, 0.030, 0.015]  # 0.75 of every even step
    even, auto = _outcome(False, [], [], even_s), _outcome(True, [], [], auto_s)
    assert heterogeneous.gain_over(even, auto, 1) == pytest.approx(4 / 3)
    assert heterogeneous.gain_over(even, even, 0) == 1.0
    assert heterogeneous.steady_start([even, auto]) == 1  # no change: all but the first


def test_the_table_says_when_auto_stays_on_the_even_plan() -> None:
    kept = ["step 6: kept [6, 6]: [7, 5] would gain 1.03x (0.4 ms), within the noise band (1 ms)"]
    auto = _outcome(True, [], kept)
    assert heterogeneous.changes_after_warmup(auto) == 0
    text = heterogeneous.table([_outcome(False, [], []), auto], 12)
    assert 'plan="auto" stayed on the even plan (step 6: kept [6, 6]' in text
    assert "not larger than the step time's noise" in text
