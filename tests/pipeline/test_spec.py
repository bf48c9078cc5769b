"""vflow.Pipeline and the cut of a Sequential into stages (Note [Segments and stages])."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import vflow
from vflow.pipeline.spec import segments, stage_bounds

NAMES = ["embed", "block0", "block1", "block2", "head"]


def test_an_even_cut_deals_out_the_segments_first_stages_first() -> None:
    assert stage_bounds(NAMES, vflow.Pipeline(1)) == [(0, 5)]
    assert stage_bounds(NAMES, vflow.Pipeline(2)) == [(0, 3), (3, 5)]
    assert stage_bounds(NAMES, vflow.Pipeline(3)) == [(0, 2), (2, 4), (4, 5)]
    assert stage_bounds(NAMES, vflow.Pipeline(5)) == [(k, k + 1) for k in range(5)]


def test_split_names_where_the_stages_begin() -> None:
    pipeline = vflow.Pipeline(3, split=["block1", "head"])
    assert pipeline.split == ("block1", "head")
    assert stage_bounds(NAMES, pipeline) == [(0, 2), (2, 4), (4, 5)]
    assert pipeline.cut(NAMES) == [["embed", "block0"], ["block1", "block2"], ["head"]]


@pytest.mark.parametrize(
    ("split", "message"),
    [
        (["block9"], r"split\[0\]='block9' is not a child of model; its children are"),
        (["embed"], r"split\[0\]='embed' does not come after the first child"),
    ],
)
def test_a_split_that_does_not_cut_the_model_is_refused(split: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        stage_bounds(NAMES, vflow.Pipeline(2, split=split))


def test_cuts_out_of_order_are_refused() -> None:
    with pytest.raises(ValueError, match=r"split\[1\]='block0' does not come after split\[0\]"):
        stage_bounds(NAMES, vflow.Pipeline(3, split=["block1", "block0"]))


def test_more_stages_than_segments_is_refused() -> None:
    with pytest.raises(ValueError, match="stages=6 exceeds the model's 5 segments"):
        stage_bounds(NAMES, vflow.Pipeline(6))


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"stages": 0}, ValueError, "stages must be an int >= 1, got 0"),
        ({"stages": True}, ValueError, "stages must be an int >= 1"),
        (
            {"stages": 2, "schedule": "zb"},
            ValueError,
            r"schedule must be one of \['1F1B', 'GPipe'\]",
        ),
        ({"stages": 2, "split": "block1"}, TypeError, "split must be a sequence of child names"),
        ({"stages": 2, "split": [1]}, TypeError, r"split must hold child names \(str\)"),
        ({"stages": 3, "split": ["block1"]}, ValueError, "split must name stages - 1 = 2 children"),
    ],
)
def test_bad_pipelines_name_the_argument(kwargs: dict, error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        vflow.Pipeline(**kwargs)


def test_1f1b_needs_as_many_vns_per_replica_as_stages() -> None:
    vflow.Pipeline(2, schedule="1F1B").check_microbatches([2, 3])
    vflow.Pipeline(4, schedule="GPipe").check_microbatches([1, 1])
    with pytest.raises(ValueError, match=r'schedule="1F1B" needs at least stages=3 VNs'):
        vflow.Pipeline(3).check_microbatches([4, 2])


def test_only_a_sequential_can_be_cut() -> None:
    with pytest.raises(TypeError, match="model must be a torch.nn.Sequential"):
        segments(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="empty"):
        segments(nn.Sequential())
    model = nn.Sequential(nn.Linear(2, 3), nn.ReLU())
    assert [name for name, _ in segments(model)] == ["0", "1"]
    assert isinstance(segments(model)[0][1], torch.nn.Linear)
