"""Executor.reconfigure: moving a training job to another worker set between steps.

Shrinking (3 -> 2 workers) and growing (2 -> 3, the third a process that has never
trained, whose model starts from other weights) mid-training must end where a single
process with the same V ends: bitwise in deterministic mode, within 1e-6 relative by
default. A reconfigure that cannot succeed (bad plan, ranks that disagree, a newcomer
with other settings) raises before anything changes, and the old worker set still
trains afterwards. "Within 1e-6 relative" is the relative 2-norm error of every
parameter, buffer and optimizer state tensor (AdamW divides by the square root of a
gradient moment, which stretches single elements' rounding differences). Scenarios of
one world size share one spawn of its processes, since starting processes dominates
the cost.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

import vflow
from tests.support import models
from vflow.world.launch import run_ranks

V = 6
B = 24
STEPS_BEFORE = 3
STEPS_AFTER = 3
KINDS: list[Any] = [False, "ordered", "exact"]


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    out = []
    for step in range(STEPS_BEFORE + STEPS_AFTER):
        g = torch.Generator().manual_seed(100 + step)
        out.append((torch.randn(B, 2, 5, 5, generator=g), torch.randint(0, 4, (B,), generator=g)))
    return out


def _executor(
    kind: Any,
    process_group: Any,
    plan: vflow.Plan | None,
    model_seed: int = 0,
    seed: int = 5,
    **kwargs: Any,
) -> vflow.Executor:
    model = models.bn_net(model_seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    return vflow.Executor(
        model,
        optimizer,
        models.mean_ce,
        V,
        seed=seed,
        buffer_rule="mean",
        deterministic=kind,
        process_group=process_group,
        plan=plan,
        timeout=60,
        **kwargs,
    )


def _state(ex: vflow.Executor) -> dict[str, Any]:
    optimizer = ex.optimizer.state_dict()["state"]
    return {
        "model": {k: v.clone() for k, v in ex.model.state_dict().items()},
        "optimizer": {
            k: {name: t.clone() if isinstance(t, torch.Tensor) else t for name, t in v.items()}
            for k, v in optimizer.items()
        },
        "step_count": ex.step_count,
    }


def _single(kind: Any, steps: int = STEPS_BEFORE + STEPS_AFTER) -> dict[str, Any]:
    """The reference: one process, one intra-op thread like the ranks (the thread count
    is one of deterministic mode's conditions)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with _executor(kind, None, None) as ex:
            for batch in _batches()[:steps]:
                ex.step(batch)
            return _state(ex)
    finally:
        torch.set_num_threads(threads)


def _assert_matches(got: dict[str, Any], want: dict[str, Any], exact: bool, where: str) -> None:
    assert got["step_count"] == want["step_count"], where
    pairs = [(f"model[{k}]", got["model"][k], v) for k, v in want["model"].items()]
    for key, entries in want["optimizer"].items():
        pairs += [
            (f"optimizer[{key}][{name}]", got["optimizer"][key][name], value)
            for name, value in entries.items()
        ]
    for name, a, b in pairs:
        if not isinstance(b, torch.Tensor):
            assert a == b, f"{where}: {name}"
        elif exact or not b.is_floating_point():
            assert torch.equal(a, b), f"{where}: {name} differs"
        else:
            error = float((a.double() - b.double()).norm() / max(float(b.double().norm()), 1e-30))
            assert error <= 1e-6, f"{where}: {name} differs by {error:.2e} (relative 2-norm)"


# ---- shrink: 3 workers, then ranks 0 and 1 go on ---------------------------------------


def _shrink(rank: int, world_size: int, kind: Any) -> dict[str, Any] | None:
    batches = _batches()
    ex = _executor(kind, dist.group.WORLD, vflow.Plan.even(V, 3))
    grads_before = [p.grad for p in ex.model.parameters()]
    for batch in batches[:STEPS_BEFORE]:
        ex.step(batch)
    views = [p.grad.data_ptr() for p in ex.model.parameters()]
    survivors = dist.new_group([0, 1])  # every rank of the world takes part in new_group
    if rank == 2:
        ex.close()
        return None
    ex.reconfigure(survivors, vflow.Plan(counts=[4, 2]))
    assert (ex.rank, ex.world_size, ex.plan) == (rank, 2, vflow.Plan(counts=[4, 2]))
    for batch in batches[STEPS_BEFORE:]:
        ex.step(batch)
    # The buffers stayed: param.grad are views into the same memory as before.
    assert [p.grad.data_ptr() for p in ex.model.parameters()] == views
    assert grads_before == [None] * len(grads_before)
    state = _state(ex)
    ex.close()
    return state


# ---- grow: ranks 0 and 1 train, then rank 2 joins -------------------------------------


def _grow(rank: int, world_size: int, kind: Any) -> dict[str, Any]:
    batches = _batches()
    pair = dist.new_group([0, 1])
    if rank < 2:
        ex = _executor(kind, pair, vflow.Plan(counts=[2, 4]))
        for batch in batches[:STEPS_BEFORE]:
            ex.step(batch)
        ex.reconfigure(dist.group.WORLD, vflow.Plan(counts=[1, 2, 3]))
    else:
        # A process new to the job: its model starts from other weights and its
        # optimizer has no state; constructing on the group the members move to makes
        # it a member, with their state.
        ex = _executor(kind, dist.group.WORLD, vflow.Plan(counts=[1, 2, 3]), model_seed=99)
        assert ex.step_count == STEPS_BEFORE
    for batch in batches[STEPS_BEFORE:]:
        ex.step(batch)
    state = _state(ex)
    ex.close()
    return state


def _shrink_and_grow(rank: int, world_size: int) -> dict[str, Any]:
    return {
        (kind, scenario): fn(rank, world_size, kind)
        for kind in KINDS
        for scenario, fn in (("shrink", _shrink), ("grow", _grow))
    }


@pytest.fixture(scope="module")
def reconfigured() -> list[dict[str, Any]]:
    return [r.value for r in run_ranks(3, _shrink_and_grow, timeout=300)]


@pytest.mark.parametrize("scenario", ["shrink", "grow"])
@pytest.mark.parametrize("kind", KINDS)
def test_reconfigured_training_matches_one_process(reconfigured, kind, scenario) -> None:
    want = _single(kind)
    ranks = [0, 1] if scenario == "shrink" else [0, 1, 2]
    for rank in ranks:
        got = reconfigured[rank][(kind, scenario)]
        _assert_matches(got, want, exact=bool(kind), where=f"{kind} {scenario}, rank {rank}")


# ---- failures leave the old worker set training ----------------------------------------


def test_a_failed_reconfigure_changes_nothing_and_the_old_group_trains_on() -> None:
    results = [r.value for r in run_ranks(3, _failures_in_three, timeout=200)]
    want = _single("ordered", steps=4)
    for rank, result in enumerate(results):
        errors = result["errors"]
        assert "settings (seed)" in errors["newcomer settings"], rank
        if rank == 2:
            continue
        assert "is for 1 workers but the process group has 2" in errors["local plan"]
        assert "process_group must be a torch.distributed.ProcessGroup" in errors["group type"]
        assert "ranks disagree on the plan" in errors["plan disagreement"]
        _assert_matches(result["state"], want, exact=True, where=f"rank {rank}")


def _failures_in_three(rank: int, world_size: int) -> dict[str, Any]:
    """The failure scenarios on ranks 0 and 1 (their own group), rank 2 the newcomer."""
    pair = dist.new_group([0, 1])
    trio = dist.new_group([0, 1, 2])
    batches = _batches()
    errors: dict[str, str] = {}
    if rank == 2:
        try:
            _executor("ordered", trio, vflow.Plan.even(V, 3), seed=6)
        except ValueError as e:
            errors["newcomer settings"] = str(e)
        return {"errors": errors, "state": {}}
    ex = _executor("ordered", pair, vflow.Plan.even(V, 2))
    ex.step(batches[0])
    try:
        ex.reconfigure(pair, vflow.Plan(counts=[6]))  # one entry for two ranks
    except ValueError as e:
        errors["local plan"] = str(e)
    try:
        ex.reconfigure("not a group")  # type: ignore[arg-type]
    except TypeError as e:
        errors["group type"] = str(e)
    try:
        ex.reconfigure(pair, vflow.Plan(counts=[2, 4] if rank == 0 else [4, 2]))
    except ValueError as e:
        errors["plan disagreement"] = str(e)
    ex.step(batches[1])
    try:
        ex.reconfigure(trio, vflow.Plan.even(V, 3))
    except ValueError as e:
        errors["newcomer settings"] = str(e)
    assert ex.world_size == 2 and ex.plan == vflow.Plan.even(V, 2)
    for batch in batches[2:4]:
        ex.step(batch)
    state = _state(ex)
    ex.close()
    return {"errors": errors, "state": state}


def test_members_behind_catch_up_only_when_every_member_asks() -> None:
    results = [r.value for r in run_ranks(2, _one_member_ahead, timeout=200)]
    want = _single("ordered", steps=3)
    for rank, result in enumerate(results):
        assert "different points of training" in result["errors"]["no catch_up"], rank
        assert "disagree on catch_up" in result["errors"]["mixed catch_up"], rank
        assert result["step_count"] == 3
        _assert_matches(result["state"], want, exact=True, where=f"rank {rank}")


def _one_member_ahead(rank: int, world_size: int) -> dict[str, Any]:
    """Both ranks train 2 steps together; rank 0 takes a third alone (as when a worker
    set breaks after some members committed a step); then they meet again."""
    batches = _batches()
    ex = _executor("ordered", dist.group.WORLD, None)
    for batch in batches[:2]:
        ex.step(batch)
    if rank == 0:
        ex.reconfigure(dist.new_group([0]), vflow.Plan.even(V, 1))
        ex.step(batches[2])
    else:
        dist.new_group([0])  # every rank takes part in new_group
    errors: dict[str, str] = {}
    try:
        ex.reconfigure(dist.group.WORLD, vflow.Plan.even(V, 2))
    except ValueError as e:
        errors["no catch_up"] = str(e)
    try:
        ex.reconfigure(dist.group.WORLD, vflow.Plan.even(V, 2), catch_up=rank == 0)
    except ValueError as e:
        errors["mixed catch_up"] = str(e)
    ex.reconfigure(dist.group.WORLD, vflow.Plan.even(V, 2), catch_up=True)
    state = _state(ex)
    step_count = ex.step_count
    ex.close()
    return {"errors": errors, "state": state, "step_count": step_count}
