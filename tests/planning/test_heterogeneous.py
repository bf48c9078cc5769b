"""plan="auto" on two Gloo ranks, one of them emulated slower (vflow.planning.emulation): the
executor finds the plan the speeds imply, re-plans when the speeds change, and in
deterministic mode trains bitwise as one process does, through every plan change."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import vflow
from vflow.planning.emulation import SlowDown
from vflow.world.launch import run_ranks

V, B, STEPS, SLOW_FROM = 12, 192, 20, 7


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(128, 768),
        torch.nn.Tanh(),
        torch.nn.Linear(768, 768),
        torch.nn.Tanh(),
        torch.nn.Linear(768, 10),
    )


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(3)
    return [
        (torch.randn(B, 128, generator=gen), torch.randint(0, 10, (B,), generator=gen))
        for _ in range(STEPS)
    ]


def _loss(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return torch.nn.functional.cross_entropy(model(x), y)


def _factor(rank: int, step: int, straggle: bool) -> float:
    """Rank 1 is 3x slower; in the straggler run, from SLOW_FROM on, rank 0 is instead.
    The straggler's plan must move VNs the other way than any plan made before it, so
    a plan that noise moved early cannot stand in for the re-plan."""
    slow_rank = 0 if straggle and step >= SLOW_FROM else 1
    return 3.0 if rank == slow_rank else 1.0


def _train(process_group: Any, loss_fn: Any, slow: SlowDown | None, straggle: bool) -> dict:
    model = _model()
    ex = vflow.Executor(
        model,
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
        loss_fn,
        V,
        seed=1,
        deterministic=True,
        plan="auto" if process_group is not None else None,
        process_group=process_group,
        timeout=60,
    )
    plans = []
    for step, batch in enumerate(_batches()):
        if slow is not None:
            slow.factor = _factor(torch.distributed.get_rank(), step, straggle)
        ex.step(batch)
        plans.append(ex.plan.counts)
    return {
        "params": [p.detach().clone() for p in model.parameters()],
        "plans": plans,
        "history": [(c.step, c.reason, c.new.counts) for c in ex.plan_history],
        "taken": [(d.step, d.reason, d.proposed.counts) for d in ex.plan_decisions if d.taken],
    }


def _rank(rank: int, world_size: int) -> dict:
    torch.set_num_threads(1)
    results = {}
    for straggle in (False, True):
        slow = SlowDown(_loss, 1.0)
        results[straggle] = _train(torch.distributed.group.WORLD, slow, slow, straggle)
    return results


@pytest.mark.alone  # its planner's decisions read step times
def test_auto_plans_follow_emulated_speeds_and_keep_the_bits() -> None:
    torch.set_num_threads(1)
    want = _train(None, _loss, None, False)["params"]
    ranks = [r.value for r in run_ranks(2, _rank, timeout=300)]
    for rank, result in enumerate(ranks):
        for straggle, run in result.items():
            for got, expected in zip(run["params"], want, strict=True):
                assert torch.equal(got, expected), (rank, straggle)  # bitwise, any plan
            assert run["history"] == ranks[0][straggle]["history"]  # the same on every rank
            assert run["taken"] == run["history"]  # every change is a decision taken
    steady = ranks[0][False]
    assert steady["history"], steady["taken"]
    first = steady["history"][0]
    # The first step's profile is skipped, 4 more (one step late): planned for step 6.
    # 3:1 halves the step, outside the noise band on a quiet machine; beside other
    # tests' processes the band can be wider, and the looks on 8 and 16 profiles (or
    # the drift rule) take it later.
    assert first[1] in ("profiled", "drift") and first[0] <= STEPS - 1
    assert steady["plans"][-1][0] >= 8  # 3:1 implies 9:3
    straggler = ranks[0][True]
    # Re-planned after the slowdown of rank 0 (by the drift rule, or by the look that
    # settles or makes a change): VNs move to rank 1, which no plan before it did. How
    # many steps that takes is a timing claim, measured by `python
    # benchmarks/heterogeneous.py` (its straggler row: <= 5 steps).
    replans = [h for h in straggler["history"] if h[0] > SLOW_FROM and h[2][0] < h[2][1]]
    assert replans, straggler["history"]
    assert straggler["plans"][-1][1] >= 8, straggler["history"]  # 1:3 implies 3:9
