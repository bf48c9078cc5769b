"""Per-VN random streams (Note [VN randomness], vflow/mapping/rng.py), checked against
expectations derived here rather than with vflow.mapping.rng itself.

The contract: VN i at step s draws from generators seeded with splitmix64 folded over
(seed, s, i, stream), so its dropout masks differ from every other VN's and every other
step's, do not depend on the caller's RNG state, and are the same whichever worker runs
the VN.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import vflow
from tests.support.seeds import expected_seed, splitmix64
from vflow.mapping import rng
from vflow.world.launch import run_ranks


def test_splitmix64_known_answer() -> None:
    # The first output of a splitmix64 generator seeded with 0.
    assert splitmix64(0) == 0xE220A8397B1DCDAF
    assert rng._splitmix64(0) == 0xE220A8397B1DCDAF


@pytest.mark.parametrize(
    ("seed", "step", "vn", "stream"), [(0, 0, 0, 0), (7, 3, 11, 1), (2**40, 5, 2, 2)]
)
def test_vn_seeds_follow_the_documented_fold(seed: int, step: int, vn: int, stream: int) -> None:
    assert rng.vn_seed(seed, step, vn, stream) == expected_seed(seed, step, vn, stream)
    assert rng.vn_seeds(seed, step, [vn, vn + 1], stream) == [
        expected_seed(seed, step, vn, stream),
        expected_seed(seed, step, vn + 1, stream),
    ]


V = 4
B = 8
WIDTH = 64


class Recorder(nn.Module):
    """A linear model whose forward draws a dropout mask and records it with the
    indices of the samples it saw (the first input column), so a mask is traced to its
    VN by content, not by trusting the executor's bookkeeping."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(2, 1)
        self.masks: list[tuple[tuple[int, ...], torch.Tensor]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = F.dropout(torch.ones(WIDTH), p=0.5, training=True)
        self.masks.append((tuple(int(i) for i in x[:, 0]), mask))
        return self.linear(x).sum() * mask.mean()


def _loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return model(batch)


def _batch() -> torch.Tensor:
    return torch.stack([torch.arange(B, dtype=torch.float32), torch.ones(B)], dim=1)


def _record(process_group: Any = None, plan: vflow.Plan | None = None, seed: int = 7) -> dict:
    """(step, first sample of the VN) -> the mask that VN drew."""
    model = Recorder()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    masks = {}
    with vflow.Executor(
        model, opt, _loss, V, seed=seed, process_group=process_group, plan=plan
    ) as ex:
        for step in range(3):
            model.masks.clear()
            torch.manual_seed(1000 + step)  # the caller's own RNG state must not matter
            ex.step(_batch())
            for samples, mask in model.masks:
                masks[(step, samples[0])] = mask
    return masks


def test_dropout_masks_are_those_of_the_vn_seeds() -> None:
    masks = _record()
    size = B // V
    assert len(masks) == 3 * V
    for (step, first), mask in masks.items():
        vn = first // size
        torch.manual_seed(expected_seed(7, step, vn))
        want = F.dropout(torch.ones(WIDTH), p=0.5, training=True)
        assert torch.equal(mask, want), (step, vn)
    # Every (step, VN) drew its own mask: one seed for all would repeat them.
    distinct = {tuple(mask.tolist()) for mask in masks.values()}
    assert len(distinct) == len(masks)


def test_another_seed_draws_other_masks() -> None:
    a, b = _record(seed=7), _record(seed=8)
    assert all(not torch.equal(a[key], b[key]) for key in a)


def _record_on_two_ranks(rank: int, world_size: int) -> dict:
    return _record(dist.group.WORLD, vflow.Plan(counts=[3, 1]))


def test_dropout_masks_do_not_depend_on_the_worker_that_runs_the_vn() -> None:
    single = _record()
    results = [r.value for r in run_ranks(2, _record_on_two_ranks)]
    merged = {**results[0], **results[1]}
    assert set(merged) == set(single)
    for key, mask in single.items():
        assert torch.equal(merged[key], mask), key
