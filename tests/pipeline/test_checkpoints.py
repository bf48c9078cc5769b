"""Checkpoints of the example's model (vflow.demo.make_pipeline_model) between
stages=1 on one process and 2 stages on 2 processes, both ways: training resumed from
either ends bitwise where the uninterrupted single-process run ends."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import vflow
from vflow.demo import make_pipeline_model
from vflow.pipeline import ProcessGrid
from vflow.world.launch import run_ranks

if not (dist.is_available() and dist.is_gloo_available()):
    pytest.skip("needs torch.distributed with Gloo", allow_module_level=True)

pytestmark = pytest.mark.slow

V = 4
B = 16
STEPS = 4
SAVED_AT = 2


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    return [
        (torch.rand(B, 1, 8, 8, generator=g), torch.randint(0, 10, (B,), generator=g))
        for _ in range(STEPS)
    ]


def _executor(stages: int, grid: ProcessGrid | None, model_seed: int) -> vflow.PipelineExecutor:
    return vflow.PipelineExecutor(
        make_pipeline_model(model_seed, width=32),
        lambda params: torch.optim.AdamW(params, lr=1e-2),
        lambda output, target: F.cross_entropy(output, target),
        V,
        seed=4,
        pipeline=vflow.Pipeline(stages),
        grid=grid,
        deterministic=True,
        timeout=60,
    )


def _train(ex: vflow.PipelineExecutor, steps: range) -> None:
    batches = _batches()
    for step in steps:
        ex.step(*batches[step])


def _alone(fn: Any, *args: Any) -> Any:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # like the ranks
    try:
        return fn(*args)
    finally:
        torch.set_num_threads(threads)


def _two_stages(rank: int, world_size: int, resume_from: str, save_to: str) -> dict[str, Any]:
    grid = ProcessGrid.of(2)
    resumed = _executor(2, grid, model_seed=8)
    vflow.pipeline.load(resume_from, resumed)
    _train(resumed, range(SAVED_AT, STEPS))
    state = resumed.state_dict()
    resumed.close()
    fresh = _executor(2, ProcessGrid.of(2), model_seed=0)
    _train(fresh, range(SAVED_AT))
    vflow.pipeline.save(save_to, fresh)
    fresh.close()
    return state


def _one_stage_until_saved(path: str) -> dict[str, Any]:
    ex = _executor(1, None, model_seed=0)
    _train(ex, range(SAVED_AT))
    vflow.pipeline.save(path, ex)
    _train(ex, range(SAVED_AT, STEPS))
    state = ex.state_dict()
    ex.close()
    return state


def _one_stage_resumed(path: str) -> dict[str, Any]:
    ex = _executor(1, None, model_seed=9)
    vflow.pipeline.load(path, ex)
    _train(ex, range(SAVED_AT, STEPS))
    state = ex.state_dict()
    ex.close()
    return state


def _assert_equal(got: dict[str, Any], want: dict[str, Any], where: str) -> None:
    assert got["step_count"] == want["step_count"] == STEPS, where
    for key, value in want["model"].items():
        assert torch.equal(got["model"][key], value), f"{where}: model[{key}]"
    for name, entries in want["optimizer"]["state"].items():
        for key, value in entries.items():
            assert torch.equal(got["optimizer"]["state"][name][key], value), f"{where}: {name}"


def test_checkpoints_move_between_one_and_two_stages(tmp_path: Path) -> None:
    one_stage, two_stages = str(tmp_path / "one.pt"), str(tmp_path / "two.pt")
    want = _alone(_one_stage_until_saved, one_stage)
    results = [r.value for r in run_ranks(2, _two_stages, one_stage, two_stages, timeout=180)]
    for rank, got in enumerate(results):
        _assert_equal(got, want, f"1 stage -> 2 stages, rank {rank}")
    _assert_equal(_alone(_one_stage_resumed, two_stages), want, "2 stages -> 1 stage")
