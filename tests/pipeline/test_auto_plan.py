"""plan="auto" across pipeline replicas (Note [Automatic plans for replicas]): with one
replica of 2 stages emulated slower (its stages wait after every microbatch's
forward), the plan moves VNs to the other replica, never below 1F1B's minimum of one
VN per stage, and the model ends bitwise where the single-process run ends."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

import vflow
from tests.pipeline.test_grids import _executor, _finish, _reference_of
from vflow.pipeline import ProcessGrid
from vflow.world.launch import run_ranks

if not (dist.is_available() and dist.is_gloo_available()):
    pytest.skip("needs torch.distributed with Gloo", allow_module_level=True)

STEPS = 24
V = 8
SLOW_S = 0.004  # per microbatch forward on each stage of replica 1


def _slow(module: torch.nn.Module, args: Any, output: Any) -> None:
    time.sleep(SLOW_S)


def _auto(rank: int, world_size: int) -> dict[str, Any]:
    ex = _executor(ProcessGrid.of(2), 2, deterministic=True, plan="auto", virtual_nodes=V)
    if ex.grid.replica == 1:
        ex.stage_module.register_forward_hook(_slow)
    batches = _batches()
    for step in range(STEPS):
        ex.step(*batches[step])
    history = [(change.step, change.new.counts) for change in ex.plan_history]
    return {"history": history, "plan": ex.plan.counts, "state": _finish(ex)}


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    out = []
    for step in range(STEPS):
        g = torch.Generator().manual_seed(300 + step)
        out.append((torch.randn(24, 6, generator=g), torch.randint(0, 3, (24,), generator=g)))
    return out


@pytest.mark.alone  # its planner's decisions read step times
def test_a_slow_replica_gets_fewer_vns_and_the_bits_stay() -> None:
    results = [r.value for r in run_ranks(4, _auto, timeout=300)]
    assert all(r["history"] == results[0]["history"] for r in results)  # one decision
    assert results[0]["history"], "the plan never changed"
    counts = results[0]["plan"]
    assert counts[0] > counts[1] >= 2, counts
    want = _reference_of(_batches(), virtual_nodes=V)
    for rank, result in enumerate(results):
        got, reference = result["state"], want
        assert got["step_count"] == STEPS == reference["step_count"]
        for key, value in reference["model"].items():
            assert torch.equal(got["model"][key], value), f"rank {rank}: {key} differs"
    assert vflow.Plan(counts).virtual_nodes == V
