"""Executor.register_state (Note [Registered state]): an LR scheduler registered with the
executor goes into its state, its checkpoints and the state a joining worker receives
(reconfigure with newcomer=True, a newcomer constructed on the members' group, a
pipeline replica), so that training with a schedule ends bitwise where one worker
alone ends, learning rates included; bad registrations and states that do not fit
raise, changing nothing, and a newcomer that registered other names is refused while
the members train on."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist

import vflow
from tests.support import models
from tests.support.states import assert_same
from vflow.pipeline import ProcessGrid
from vflow.world.launch import run_ranks

V = 8
B = 32
STEPS = 20
CHECKPOINT_AT = 10


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    out = []
    for step in range(STEPS):
        g = torch.Generator().manual_seed(300 + step)
        out.append((torch.randn(B, 2, 5, 5, generator=g), torch.randint(0, 4, (B,), generator=g)))
    return out


def _scheduler(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.OneCycleLR:
    return torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.2, total_steps=STEPS)


def _executor(
    model_seed: int = 0,
    *,
    register: bool = True,
    process_group: Any = None,
    at_construction: bool = False,
) -> tuple[vflow.Executor, torch.optim.lr_scheduler.OneCycleLR]:
    """A deterministic executor with a OneCycleLR registered as "lr" (at construction,
    or afterwards with register_state)."""
    model = models.bn_net(model_seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    scheduler = _scheduler(optimizer)
    ex = vflow.Executor(
        model,
        optimizer,
        models.mean_ce,
        V,
        seed=3,
        deterministic=True,
        timeout=60,
        process_group=process_group,
        registered_state={"lr": scheduler} if register and at_construction else None,
    )
    if register and not at_construction:
        ex.register_state("lr", scheduler)
    return ex, scheduler


def _train(
    ex: vflow.Executor, scheduler: torch.optim.lr_scheduler.LRScheduler, steps: range
) -> list[float]:
    """Steps ``steps`` of the batches; the learning rate each step used."""
    batches = _batches()
    used = []
    for step in steps:
        assert ex.step_count == step
        used.append(ex.optimizer.param_groups[0]["lr"])
        ex.step(batches[step])
        scheduler.step()
    return used


def _state(ex: vflow.Executor, scheduler: torch.optim.lr_scheduler.LRScheduler) -> dict[str, Any]:
    return {
        "model": {k: v.clone() for k, v in ex.model.state_dict().items()},
        "optimizer": copy.deepcopy(ex.optimizer.state_dict()),
        "scheduler": copy.deepcopy(scheduler.state_dict()),
        "step_count": ex.step_count,
    }


def _one_worker(steps: int = STEPS) -> tuple[dict[str, Any], list[float]]:
    """The reference: one process, one intra-op thread like the ranks."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ex, scheduler = _executor()
        with ex:
            used = _train(ex, scheduler, range(steps))
            return _state(ex, scheduler), used
    finally:
        torch.set_num_threads(threads)


# ---- a checkpoint of 2 workers resumed on 1 -------------------------------------------------


def _first_steps_then_save(rank: int, world_size: int, path: str) -> list[float]:
    ex, scheduler = _executor()
    with ex:
        used = _train(ex, scheduler, range(CHECKPOINT_AT))
        vflow.save(path, ex)
    return used


def test_a_schedule_checkpointed_on_two_workers_resumes_on_one_bitwise(tmp_path) -> None:
    path = str(tmp_path / "step10.pt")
    first = [r.value for r in run_ranks(2, _first_steps_then_save, path, timeout=180)]
    written = torch.load(path, weights_only=True)["executor"]
    assert written["written_by"]["world_size"] == 2
    assert written["registered"]["lr"]["last_epoch"] == CHECKPOINT_AT

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        # Another model's weights and a scheduler at step 0: the checkpoint replaces both.
        ex, scheduler = _executor(model_seed=9)
        with ex:
            vflow.load(path, ex)
            assert ex.step_count == CHECKPOINT_AT
            assert scheduler.last_epoch == CHECKPOINT_AT
            used = _train(ex, scheduler, range(CHECKPOINT_AT, STEPS))
            got = _state(ex, scheduler)
    finally:
        torch.set_num_threads(threads)
    want, want_used = _one_worker()
    assert first[0] == first[1] == want_used[:CHECKPOINT_AT]
    assert used == want_used[CHECKPOINT_AT:]
    assert len(set(want_used)) > STEPS // 2  # the schedule moves the LR at every step
    assert_same(got, want)


# ---- joining: reconfigure(newcomer=True), a newcomer's constructor, refusals ----------------


def _join(rank: int, world_size: int) -> dict[str, Any]:
    """Ranks 0 and 1 train 5 steps; rank 2, without the "lr" name, is refused and they
    train on; at step 8 rank 2, with it, joins with reconfigure(newcomer=True); at step
    12 it leaves, and at step 14 comes back as a new executor constructed on the
    members' group, with the scheduler given at construction."""
    pair = dist.new_group([0, 1])
    solo = dist.new_group([2])  # rank 2's group of its own, before it joins
    out: dict[str, Any] = {}
    if rank < 2:
        ex, scheduler = _executor(process_group=pair, model_seed=rank)
        _train(ex, scheduler, range(5))
        with pytest.raises(vflow.RefusedNewcomers) as refused:
            ex.reconfigure(dist.group.WORLD, newcomer=False)
        out["refused"] = str(refused.value)
        assert ex.world_size == 2  # still on the pair
        _train(ex, scheduler, range(5, 8))
        ex.reconfigure(dist.group.WORLD)
    else:
        ex, scheduler = _executor(register=False, model_seed=7, process_group=solo)
        with pytest.raises(vflow.RefusedNewcomers) as refused:
            ex.reconfigure(dist.group.WORLD, newcomer=True)
        out["refused"] = str(refused.value)
        ex.close()
        ex, scheduler = _executor(model_seed=7, process_group=solo)
        ex.reconfigure(dist.group.WORLD, newcomer=True)
        out["received_at"] = (ex.step_count, scheduler.last_epoch)
    _train(ex, scheduler, range(8, 12))
    # Rank 2 leaves; a new process (here: a new executor of rank 2) joins by constructing
    # its executor on the group the members move to, its scheduler given at construction.
    if rank < 2:
        ex.reconfigure(pair)
        _train(ex, scheduler, range(12, 14))
        ex.reconfigure(dist.group.WORLD)
    else:
        ex.close()
        ex, scheduler = _executor(
            model_seed=8, process_group=dist.group.WORLD, at_construction=True
        )
        out["constructed_at"] = (ex.step_count, scheduler.last_epoch)
    _train(ex, scheduler, range(14, STEPS))
    out["state"] = _state(ex, scheduler)
    ex.close()
    return out


def test_newcomers_receive_the_schedule_and_one_without_it_is_refused() -> None:
    results = [r.value for r in run_ranks(3, _join, timeout=240)]
    want, _ = _one_worker()
    for rank, result in enumerate(results):
        assert_same(result["state"], want, f"rank {rank}")
    assert results[2]["received_at"] == (8, 8)
    assert results[2]["constructed_at"] == (14, 14)
    assert (
        results[2]["refused"].startswith("this worker was refused by the members of")
        and "the registered state (this worker has register_state names [])"
        in (results[2]["refused"])
    )
    for rank in (0, 1):
        assert (
            "differ from the members on the registered state and were refused"
            in (results[rank]["refused"])
        )


# ---- a pipeline replica --------------------------------------------------------------------

PIPELINE_STEPS = 6


class _Schedulers:
    """``registered_state`` for a PipelineExecutor that keeps the scheduler it builds, for
    the training loop to step."""

    def __init__(self) -> None:
        self.scheduler: torch.optim.lr_scheduler.OneCycleLR | None = None

    def __call__(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        self.scheduler = torch.optim.lr_scheduler.OneCycleLR(
            optimizer, max_lr=0.2, total_steps=PIPELINE_STEPS
        )
        return {"lr": self.scheduler}


def _pipeline(grid: ProcessGrid | None, model_seed: int, schedulers: _Schedulers | None) -> Any:
    torch.manual_seed(model_seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    return vflow.PipelineExecutor(
        model,
        lambda params: torch.optim.SGD(params, lr=0.2, momentum=0.9),
        lambda out, y: torch.nn.functional.cross_entropy(out, y),
        4,
        seed=5,
        grid=grid,
        deterministic=True,
        timeout=60,
        registered_state=schedulers,
    )


def _pipeline_train(ex: Any, schedulers: _Schedulers, steps: range) -> None:
    g = torch.Generator().manual_seed(5)
    batches = [
        (torch.randn(16, 6, generator=g), torch.randint(0, 3, (16,), generator=g))
        for _ in range(PIPELINE_STEPS)
    ]
    assert schedulers.scheduler is not None
    for step in steps:
        ex.step(*batches[step])
        schedulers.scheduler.step()


def _replica_joins(rank: int, world_size: int) -> dict[str, Any]:
    """Replica 0 trains 3 steps alone; a second replica without the scheduler is
    refused; one with it joins, receiving the schedule's position; both train on."""
    out: dict[str, Any] = {}
    schedulers = _Schedulers()
    alone = ProcessGrid.of(1, [0])
    if rank == 0:
        ex = _pipeline(alone, 0, schedulers)
        _pipeline_train(ex, schedulers, range(3))
    both = ProcessGrid.of(1)
    with pytest.raises(ValueError) as refused:
        if rank == 0:
            ex.reconfigure(both)
        else:
            _pipeline(both, 9, None)
    out["refused"] = str(refused.value)
    both = ProcessGrid.of(1)
    if rank == 0:
        ex.reconfigure(both)
    else:
        ex = _pipeline(both, 9, schedulers)
        assert schedulers.scheduler is not None
        out["received_at"] = (ex.step_count, schedulers.scheduler.last_epoch)
    _pipeline_train(ex, schedulers, range(3, PIPELINE_STEPS))
    out["state"] = ex.state_dict()
    ex.close()
    return out


def test_a_pipeline_replica_receives_the_registered_state() -> None:
    results = [r.value for r in run_ranks(2, _replica_joins, timeout=180)]
    for result in results:
        assert "registered state" in result["refused"], result["refused"]
    assert results[1]["received_at"] == (3, 3)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        schedulers = _Schedulers()
        ex = _pipeline(None, 0, schedulers)
        _pipeline_train(ex, schedulers, range(PIPELINE_STEPS))
        want = ex.state_dict()
        ex.close()
    finally:
        torch.set_num_threads(threads)
    assert want["registered"]["lr"]["last_epoch"] == PIPELINE_STEPS
    del want["written_by"]  # the grid that wrote it: informational
    for rank, result in enumerate(results):
        got = {k: v for k, v in result["state"].items() if k != "written_by"}
        assert_same(got, want, f"rank {rank}")


# ---- bad input -----------------------------------------------------------------------------


def test_bad_registrations_raise_and_register_nothing() -> None:
    ex, scheduler = _executor()
    with ex:
        with pytest.raises(
            ValueError, match=r"name 'lr' is registered already \(to a OneCycleLR\)"
        ):
            ex.register_state("lr", scheduler)
        with pytest.raises(
            TypeError,
            match=r"obj must have state_dict\(\) and load_state_dict\(\).*a list has no "
            r"state_dict and no load_state_dict",
        ):
            ex.register_state("data", [1, 2])
        with pytest.raises(TypeError, match="name must be a str, got int"):
            ex.register_state(3, scheduler)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="name must be a non-empty printable string"):
            ex.register_state("", scheduler)
        assert list(ex.state_dict()["registered"]) == ["lr"]
    with pytest.raises(
        TypeError, match="registered_state must be a dict {name: obj} or None, got list"
    ):
        vflow.Executor(
            models.bn_net(0),
            torch.optim.SGD(models.bn_net(0).parameters(), lr=0.1),
            models.mean_ce,
            V,
            registered_state=[scheduler],  # type: ignore[arg-type]
        )
    with pytest.raises(RuntimeError, match="this Executor is closed"):
        ex.register_state("other", scheduler)


def test_a_state_without_a_registered_name_raises_and_changes_nothing() -> None:
    plain, _ = _executor(register=False)
    with plain:
        plain.step(_batches()[0])
        state = plain.state_dict()
    assert state["registered"] == {}
    ex, scheduler = _executor(model_seed=4)
    with ex:
        before = _state(ex, scheduler)
        with pytest.raises(
            ValueError,
            match=r"state\['registered'\] lacks \['lr'\], which this executor registered; "
            r"register the same names",
        ):
            ex.load_state_dict(state)
        assert_same(_state(ex, scheduler), before)
        # ... and the other way round: a name this executor did not register.
        extra = {**ex.state_dict(), "registered": {"lr": scheduler.state_dict(), "ema": {}}}
        with pytest.raises(ValueError, match=r"has \['ema'\], which this executor did not"):
            ex.load_state_dict(extra)
        # A state written before register_state existed has no entry at all.
        old = {k: v for k, v in ex.state_dict().items() if k != "registered"}
        with pytest.raises(ValueError, match=r"lacks \['lr'\]"):
            ex.load_state_dict(old)
        assert_same(_state(ex, scheduler), before)


class _Failing:
    def __init__(self) -> None:
        self.value = 1

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        raise RuntimeError("cannot load")


def test_an_object_that_fails_to_load_rolls_everything_back() -> None:
    source, _ = _executor(model_seed=1)
    with source:
        source.register_state("other", _Failing())
        source.step(_batches()[0])
        state = copy.deepcopy(source.state_dict())
    ex, scheduler = _executor(model_seed=2)
    with ex:
        ex.register_state("other", _Failing())
        before = _state(ex, scheduler)
        with pytest.raises(RuntimeError, match="cannot load"):
            ex.load_state_dict(state)
        assert_same(_state(ex, scheduler), before)
        assert ex.step_count == 0


def test_loading_copies_the_registered_state() -> None:
    """Two executors loading one state do not share their schedulers' lists."""
    source, source_scheduler = _executor()
    with source:
        _train(source, source_scheduler, range(2))
        state = source.state_dict()
        ex, scheduler = _executor(model_seed=5)
        with ex:
            ex.load_state_dict(state)
            assert scheduler.state_dict() == source_scheduler.state_dict()
            assert scheduler.base_lrs is not source_scheduler.base_lrs
            source_scheduler.base_lrs[0] = 1.0
            assert scheduler.base_lrs[0] != 1.0
