"""The main job's pipeline row (vflow/demo/pipeline_row.py): 2 stages on 2 replicas
and on 1 end bitwise where one process ends; the bubble formula's prediction; the
row's V."""

from __future__ import annotations

import pytest
import torch

from vflow.demo import pipeline_row

pytestmark = pytest.mark.slow


def test_the_three_runs_end_with_the_same_bits() -> None:
    settings = {"batch_size": 16, "virtual_nodes": 4, "seed": 2, "steps": 3, "timeout": 120.0}
    outcomes = pipeline_row.run(settings)
    assert [(o.stages, o.replicas) for o in outcomes] == list(pipeline_row.GRIDS)
    assert pipeline_row.identical(outcomes)
    assert all(len(o.losses) == 3 and o.step_seconds > 0 for o in outcomes)
    text = pipeline_row.table(outcomes, 4)
    assert "2 stages x 1 replica" in text and "NO" not in text


def _outcome(stages: int, replicas: int, vn_seconds: float = 0.004) -> pipeline_row.Outcome:
    return pipeline_row.Outcome(stages, replicas, 0.1, vn_seconds, 1.0, [1.0], {"w": torch.ones(1)})


def test_the_prediction_is_m_plus_s_minus_1_slots_of_the_reference() -> None:
    reference = _outcome(1, 1, vn_seconds=0.004)
    # V = 8: 2 replicas hold 4 microbatches each, 1 replica all 8; a slot is 4 ms / 2.
    assert pipeline_row.predicted_step_seconds(_outcome(2, 2), reference, 8) == pytest.approx(0.010)
    assert pipeline_row.predicted_step_seconds(_outcome(2, 1), reference, 8) == pytest.approx(0.018)
    assert pipeline_row.predicted_step_seconds(reference, reference, 8) == pytest.approx(0.032)


def test_a_differing_run_is_caught() -> None:
    runs = [_outcome(1, 1), _outcome(2, 2), _outcome(2, 1)]
    assert pipeline_row.identical(runs)
    runs[2] = pipeline_row.Outcome(2, 1, 0.1, 0.004, 1.0, [1.0], {"w": torch.zeros(1)})
    assert not pipeline_row.identical(runs)


def test_the_rows_v_divides_b() -> None:
    assert pipeline_row.virtual_nodes_for(64, 12) == 8
    assert pipeline_row.virtual_nodes_for(64, 8) == 8
    assert pipeline_row.virtual_nodes_for(9, 12) == 9
    with pytest.raises(ValueError, match="needs a V >= 4 that divides B=10"):
        pipeline_row.virtual_nodes_for(10, 3)
