"""The main job's heterogeneous row (vflow/demo/heterogeneous.py): its bounds."""

from __future__ import annotations

import pytest

from vflow.demo import heterogeneous


def test_heterogeneous_bounds() -> None:
    assert heterogeneous.speeds_label() == "2:1"
    # Even 4+4 VNs: the slow worker takes 8 units; 5+3 or 6+2 take 6.
    assert heterogeneous.best_whole_vn_gain(8, (1.0, 2.0)) == pytest.approx(8 / 6)
    assert heterogeneous.best_whole_vn_gain(4, (1.0, 2.0)) == pytest.approx(4 / 3)
    assert heterogeneous.best_whole_vn_gain(2, (1.0, 2.0)) == 1.0  # one VN each, nothing to move
    assert heterogeneous.best_whole_vn_gain(6, (1.0, 1.5, 3.0)) == pytest.approx(6 / 3)
    # A perfect split of the compute at 2:1: 1.5x the even plan, whatever V.
    assert heterogeneous.compute_bound_gain(8, (1.0, 2.0)) == pytest.approx(1.5)
    assert heterogeneous.compute_bound_gain(6, (1.0, 1.5, 3.0)) == pytest.approx(2.0)
