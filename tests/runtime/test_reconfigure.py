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
from vflow.planning.emulation import SlowDown
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


# ---- plan="auto" keeps what it learned across worker sets ------------------------------

AUTO_V, AUTO_B, PAIR_STEPS, TRIO_STEPS, AGAIN_STEPS = 12, 192, 7, 3, 3


def _auto_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(128, 768), torch.nn.Tanh(), torch.nn.Linear(768, 10))


def _auto_loss(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return torch.nn.functional.cross_entropy(model(x), y)


def _decisions(ex: vflow.Executor) -> list[tuple[int, str, tuple[int, ...], bool, float, float]]:
    return [
        (d.step, d.reason, d.proposed.counts, d.taken, d.predicted_current_s, d.noise_band_s)
        for d in ex.plan_decisions
    ]


def _auto_across_sets(rank: int, world_size: int) -> dict[str, Any]:
    """Ranks 0 and 1 (rank 1 emulated 10x slower: so much that the cores' contention,
    which slows a computing worker and not a sleeping one, cannot hide it) train with
    plan="auto"; rank 2 joins them (a grow); then rank 2 is gone and the others drop the
    group (abort_group, as after a crash) and form a pair again (a shrink)."""
    torch.set_num_threads(1)
    pair, trio, again = (dist.new_group(r) for r in ([0, 1], [0, 1, 2], [0, 1]))
    gen = torch.Generator().manual_seed(3)
    batches = [
        (torch.randn(AUTO_B, 128, generator=gen), torch.randint(0, 10, (AUTO_B,), generator=gen))
        for _ in range(PAIR_STEPS + TRIO_STEPS + AGAIN_STEPS)
    ]
    loss = SlowDown(_auto_loss, 10.0) if rank == 1 else _auto_loss
    model = _auto_model()

    def executor(group: Any) -> vflow.Executor:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        return vflow.Executor(
            model, optimizer, loss, AUTO_V, plan="auto", process_group=group, timeout=60
        )

    out: dict[str, Any] = {}
    if rank < 2:
        ex = executor(pair)
        for batch in batches[:PAIR_STEPS]:
            ex.step(batch)
        out["pair"] = _decisions(ex)
        out["pair history"] = list(ex.plan_history)
        ex.reconfigure(trio)
    else:
        ex = executor(trio)  # a newcomer: its planner has seen nothing
    trio_plans = []
    for batch in batches[PAIR_STEPS : PAIR_STEPS + TRIO_STEPS]:
        ex.step(batch)
        trio_plans.append(ex.plan.counts)
    out["trio"] = _decisions(ex)
    out["trio plans"] = trio_plans
    if rank == 2:
        ex.close()
        return out
    ex.abort_group()
    ex.reconfigure(again)
    for batch in batches[PAIR_STEPS + TRIO_STEPS :]:
        ex.step(batch)
    out["again"] = _decisions(ex)
    out["history"] = list(ex.plan_history)
    ex.close()
    return out


@pytest.mark.alone  # the planner's models read step times
def test_an_automatic_plan_keeps_what_it_learned_across_a_grow_and_a_shrink() -> None:
    results = [r.value for r in run_ranks(3, _auto_across_sets, timeout=240)]
    stayers = results[:2]
    before = len(stayers[0]["pair"])
    # The grow: on the trio's first step every rank, the newcomer included, weighs the
    # plan from the pair's models (the newcomer assumed as fast as the faster of them):
    # the same decision everywhere, to the bit of its predicted step and noise band, and
    # the slow rank 1 gets the fewest VNs (the fast ones may tie: the step is the
    # slowest worker's).
    trio = [r["trio"][before:] for r in stayers] + [results[2]["trio"]]
    assert trio[0] == trio[1] == trio[2]
    step, reason, proposed, taken, _, _ = trio[0][0]
    assert (step, reason) == (PAIR_STEPS + 1, "carried")
    assert proposed[1] == min(proposed) < AUTO_V // 3, proposed  # below its even share
    if taken:  # from the trio's second step on
        assert all(r["trio plans"] == [proposed] * TRIO_STEPS for r in results)
    # The planner's record goes on across the change of worker set.
    for result in stayers:
        assert result["trio"][:before] == result["pair"]
        assert result["history"][: len(result["pair history"])] == result["pair history"]
    # The shrink, after the trio ran too few steps to learn anything of its own: the
    # stayers bring what they brought to it, and plan at once, without a warm-up.
    first_again = PAIR_STEPS + TRIO_STEPS + 1
    again = [r["again"][len(r["trio"]) :] for r in stayers]
    assert again[0] == again[1]
    step, reason, proposed, _, _, _ = again[0][0]
    assert (step, reason) == (first_again, "carried")
    assert proposed[1] < proposed[0], proposed
    assert all(d[1] != "profiled" for d in again[0])
