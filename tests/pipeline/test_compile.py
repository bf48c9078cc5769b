"""torch.compile under vflow.PipelineExecutor (docs/guide.md, "torch.compile").

A pipeline's segments are the children of its Sequential, so they are what gets
compiled, each on its own. Dropout in a compiled segment draws from the segment's
stream (Note [Segment streams], vflow/pipeline/streams.py): vflow reseeds the default
generator before the segment runs, and inductor draws its kernels' seeds from it. In
deterministic mode every grid of 1 to 3 Gloo processes (replicas, stages or both)
trains the model bitwise as one process does; compiled autograd is refused.
"""

from __future__ import annotations

import collections
import re
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import vflow
from tests.support.compiled import batches, shared_inductor_cache
from vflow.pipeline import ProcessGrid
from vflow.world.launch import run_ranks

pytestmark = pytest.mark.slow

V = 6
B = 24
STEPS = 3

# name -> (the default group's ranks in the grid, stages)
GRIDS: dict[str, tuple[list[int], int]] = {
    "1 process": ([0], 1),
    "2 stages": ([0, 1], 2),
    "2 replicas": ([0, 1], 1),
    "3 replicas": ([0, 1, 2], 1),
}


def _model(compiled: bool) -> nn.Sequential:
    torch.manual_seed(0)
    segments = collections.OrderedDict(
        hidden=nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.5)),
        head=nn.Linear(16, 3),
    )
    if compiled:
        segments = collections.OrderedDict(
            (name, torch.compile(segment)) for name, segment in segments.items()
        )
    return nn.Sequential(segments)


def _mean_ce(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output, target)


def _executor(grid: ProcessGrid | None, stages: int, compiled: bool) -> vflow.PipelineExecutor:
    return vflow.PipelineExecutor(
        _model(compiled),
        lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
        _mean_ce,
        V,
        seed=3,
        pipeline=vflow.Pipeline(stages),
        grid=grid,
        deterministic=True,
        timeout=120,
    )


def _train(grid: ProcessGrid | None, stages: int, compiled: bool) -> dict[str, Any]:
    ex = _executor(grid, stages, compiled)
    losses = [ex.step(x, y).loss for x, y in batches(STEPS, B)]
    state = ex.full_state_dict()
    ex.close()
    return {"losses": losses, "state": state}


def _run_grids(rank: int, world_size: int) -> dict[str, Any]:
    """Every grid of GRIDS on its ranks, one process first: the others wait for it so
    that they find its graphs compiled."""
    grids = {name: ProcessGrid.of(stages, ranks) for name, (ranks, stages) in GRIDS.items()}
    out: dict[str, Any] = {}
    for name, (ranks, stages) in GRIDS.items():
        if rank in ranks:
            out[name] = _train(grids[name], stages, compiled=True)
        if name == "1 process" and rank == 0:
            out["eager"] = _train(grids[name], 1, compiled=False)
        dist.barrier()
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    with shared_inductor_cache(tmp_path_factory):
        return [r.value for r in run_ranks(3, _run_grids, timeout=400)]


def _tensors(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    out = dict(state["model"])
    for name, entries in state["optimizer"]["state"].items():
        out.update({f"optimizer {name} {k}": v for k, v in entries.items()})
    return out


def test_compiled_dropout_draws_other_masks_than_eager(results: list[dict[str, Any]]) -> None:
    assert results[0]["1 process"]["losses"][0] != results[0]["eager"]["losses"][0]


@pytest.mark.parametrize("name", [name for name in GRIDS if name != "1 process"])
def test_every_grid_trains_the_one_process_model_bitwise(
    name: str, results: list[dict[str, Any]]
) -> None:
    want = results[0]["1 process"]
    expected = _tensors(want["state"])
    for rank in GRIDS[name][0]:
        got = results[rank][name]
        assert got["losses"] == want["losses"], f"rank {rank}: losses differ"
        tensors = _tensors(got["state"])
        assert tensors.keys() == expected.keys()
        differ = [k for k, v in expected.items() if not torch.equal(tensors[k], v)]
        assert not differ, f"rank {rank}: {differ} differ"


def test_compiled_autograd_is_refused_before_anything_changes() -> None:
    from torch._dynamo import compiled_autograd

    ex = _executor(None, 1, compiled=False)
    before = {k: v.clone() for k, v in ex.stage_module.state_dict().items()}
    ((x, y),) = batches(1, B)
    with compiled_autograd._enable(torch.compile):
        with pytest.raises(
            RuntimeError,
            match=re.escape(
                "vflow.PipelineExecutor.step: torch's compiled autograd is enabled, and vflow "
                "does not support it"
            ),
        ):
            ex.step(x, y)
    assert ex.step_count == 0
    after = ex.stage_module.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())
    ex.step(x, y)
    assert ex.step_count == 1
    ex.close()
