"""Plan changes wait for the data (Note [Plan changes wait for the data],
vflow/runtime/executor.py): a sampler bound to the executor splits every batch under the
plan its step runs with; ``set_plan`` and automatic changes take effect only after the
batches a DataLoader has drawn ahead; ``reconfigure`` cannot wait, and a batch drawn
under the old plan is refused before anything changes. The loops run on two Gloo ranks
(tests/support/plan_follow.py) and are compared with one process, bit for bit."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils.data import default_collate

import vflow
from tests.support import plan_follow
from tests.support.models import classification_data, mean_ce, mlp
from vflow.mapping.plan import Plan
from vflow.world.launch import run_ranks

V, B = plan_follow.V, plan_follow.B
STEPS = 2 * plan_follow.SAMPLES // B


def _alone(scenario: dict[str, Any]) -> dict[str, Any]:
    return run_ranks(1, plan_follow.loop_rank, scenario, timeout=90)[0].value


def _parts(ranks: list[dict[str, Any]]) -> list[dict[int, list[int]]]:
    return [{step: indices for step, (_, indices) in r["steps"].items()} for r in ranks]


def _assert_bitwise(ranks: list[dict[str, Any]], alone: dict[str, Any]) -> None:
    for rank in ranks:
        for got, want in zip(rank["params"], alone["params"], strict=True):
            assert torch.equal(got, want)


# ---- one process ----------------------------------------------------------------------


def _executor() -> vflow.Executor:
    model = mlp()
    return vflow.Executor(model, torch.optim.SGD(model.parameters(), lr=0.1), mean_ce, V)


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    return classification_data(4 * B)


def test_set_plan_waits_for_the_batches_drawn_ahead() -> None:
    ex = _executor()
    x, y = _data()
    sampler = vflow.VNBatchSampler(len(y), B, executor=ex, seed=0)
    draws = iter(sampler)
    drawn = [next(draws) for _ in range(3)]  # steps 0, 1, 2, as a DataLoader drawing ahead
    old, new = ex.plan, Plan(sizes=[[B // V] * V])  # the same split, another plan
    ex.set_plan(new)
    assert ex.plan == old
    assert [ex.plan_for_step(k) for k in range(5)] == [old, old, old, new, new]
    assert sampler.plan == old  # the plan of the executor's next step
    for step, indices in enumerate(drawn):
        assert ex.plan == old
        ex.step((x[indices], y[indices]), global_batch_size=B)
        assert ex.step_count == step + 1
    assert ex.plan == new  # in force from step 3, the first step nobody had drawn
    with pytest.raises(ValueError, match="step must be >= step_count=3"):
        ex.plan_for_step(2)
    indices = next(draws)  # step 3, drawn under the new plan
    ex.step((x[indices], y[indices]), global_batch_size=B)


def test_set_plan_without_batches_drawn_ahead_takes_effect_at_once() -> None:
    ex = _executor()
    x, y = _data()
    sampler = vflow.VNBatchSampler(len(y), B, executor=ex, seed=0)
    for indices in sampler:  # lazy: each batch drawn just before its step
        ex.step((x[indices], y[indices]), global_batch_size=B)
        new = Plan(sizes=[[B // V] * V]) if ex.step_count % 2 else Plan.even(V, 1)
        ex.set_plan(new)
        assert ex.plan == new and ex.plan_for_step(ex.step_count) == new


def test_a_new_iteration_forgets_the_draws_of_an_abandoned_one() -> None:
    ex = _executor()
    x, y = _data()
    sampler = vflow.VNBatchSampler(len(y), B, executor=ex, seed=0)
    abandoned = iter(sampler)
    next(abandoned), next(abandoned), next(abandoned)
    again = iter(sampler)  # starts at step_count again: nothing drawn ahead any more
    new = Plan(sizes=[[B // V] * V])
    ex.set_plan(new)
    assert ex.plan == new
    indices = next(again)
    ex.step((x[indices], y[indices]), global_batch_size=B)


# ---- two ranks: the README loop with a set_plan, with a DataLoader drawing ahead -------

_SET_PLAN = {"deterministic": True, "set_plan": (5, [6, 2])}  # mid-epoch (16 per epoch)


def test_set_plan_mid_epoch_in_the_readme_loop_uses_every_sample_once_bitwise() -> None:
    ranks = [r.value for r in run_ranks(2, plan_follow.loop_rank, _SET_PLAN, timeout=90)]
    plan_follow.assert_each_sample_once(_parts(ranks), STEPS)
    for rank in ranks:
        assert rank["set_plan"] == {"called": 5, "first": 5}  # nothing drawn ahead
        assert [rank["steps"][k][0] for k in (4, 5)] == [(4, 4), (6, 2)]
    _assert_bitwise(ranks, _alone(_SET_PLAN))


_LOOKAHEAD = {
    "set_plan": {"deterministic": True, "num_workers": 2, "set_plan": (5, [6, 2])},
    "auto": {"deterministic": True, "num_workers": 2, "plan": "auto", "slow": 2.0},
}


@pytest.mark.alone  # its planner's decisions read step times
def test_plan_changes_wait_for_the_batches_a_dataloader_drew_ahead() -> None:
    results = [r.value for r in run_ranks(2, plan_follow.scenarios_rank, _LOOKAHEAD, timeout=120)]
    alone = _alone({"deterministic": True})  # one process, no plan change, nothing ahead
    for name in _LOOKAHEAD:
        ranks = [r[name] for r in results]
        plan_follow.assert_each_sample_once(_parts(ranks), STEPS)
        _assert_bitwise(ranks, alone)
    for rank in (r["set_plan"] for r in results):
        # Two DataLoader workers hold 2 batches each: the steps drawn by then keep the
        # old plan, and the change comes right after them.
        waited = rank["set_plan"]
        assert waited["first"] > waited["called"], waited
        counts = [rank["steps"][k][0] for k in range(waited["called"], waited["first"] + 1)]
        assert counts == [(4, 4)] * (len(counts) - 1) + [(6, 2)], counts
    auto = [r["auto"] for r in results]
    assert auto[0]["history"], "the automatic planner never re-planned"
    assert auto[1]["history"] == auto[0]["history"]
    for step, counts in auto[0]["history"]:
        assert step <= STEPS
        if step == STEPS:  # decided with every batch drawn (seen in CI): no step ran it
            continue
        assert auto[0]["steps"][step][0] == tuple(counts)
        assert auto[0]["steps"][step - 1][0] != tuple(counts)


# ---- reconfigure cannot wait ----------------------------------------------------------


def _reconfigure_with_a_batch_drawn_ahead(rank: int, world_size: int) -> dict[str, Any]:
    model = plan_follow.DeepNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ex = vflow.Executor(model, optimizer, plan_follow.loss_fn, V)
    data = plan_follow.RecordingData()
    sampler = vflow.VNBatchSampler(len(data), B, executor=ex, seed=0)

    def load(indices: list[int]) -> Any:
        return default_collate([data[i] for i in indices])

    draws = iter(sampler)
    first, ahead = next(draws), next(draws)  # steps 0 and 1, under Plan.even(8, 2)
    ex.step(load(first), global_batch_size=B)
    alone = torch.distributed.new_group([0])  # every rank of the old group takes part
    if rank == 1:
        return {}  # leaves the job
    ex.reconfigure(alone)  # rank 0 goes on alone, at once, under Plan.even(8, 1)
    params = [p.detach().clone() for p in model.parameters()]
    momentum = [optimizer.state[p]["momentum_buffer"].clone() for p in model.parameters()]
    grads = [p.grad.clone() for p in model.parameters()]
    try:
        ex.step(load(ahead), global_batch_size=B)
        message = ""
    except ValueError as error:
        message = str(error)
    unchanged = ex.step_count == 1 and all(
        torch.equal(p, q) for p, q in zip(model.parameters(), params, strict=True)
    )
    unchanged = unchanged and all(
        torch.equal(optimizer.state[p]["momentum_buffer"], m)
        for p, m in zip(model.parameters(), momentum, strict=True)
    )
    unchanged = unchanged and all(
        torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads, strict=True)
    )
    fresh = next(iter(sampler))  # a new iteration: step 1 under the new plan
    ex.step(load(fresh), global_batch_size=B)
    return {"message": message, "unchanged": unchanged, "fresh": len(fresh), "len": len(ahead)}


def test_a_batch_drawn_before_reconfigure_is_refused_before_anything_changes() -> None:
    result = run_ranks(2, _reconfigure_with_a_batch_drawn_ahead, timeout=90)[0].value
    assert result["len"] == B // 2 and result["fresh"] == B
    assert result["message"] == (
        "the batch of step 1 was drawn under Plan(counts=[4, 4]) as rank 0, but step 1 "
        "runs under Plan(counts=[8]) as rank 0: a DataLoader drew it ahead before the "
        "worker set changed (reconfigure). Start a new DataLoader iterator after a change "
        "of worker set (a bound VNBatchSampler then splits the batches under the new plan)"
    )
    assert result["unchanged"]
