"""Interrupting a process group's waits (Note [Interrupting a wait], csrc/interrupt.cpp):
``World.interrupt`` ends a wait blocked on a live peer at once, the collective runs out
on Gloo's thread while ``retire`` keeps its group, and an Executor whose step was
interrupted moves off the group without waiting for that collective and on to new
gradient buffers. Two real Gloo ranks; the second is the live peer that never comes,
or comes late."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import vflow
from tests.support import models
from vflow._extension import _C
from vflow.world.group import CollectiveError, World, retire
from vflow.world.launch import current_store, run_ranks

_TIMEOUT_S = 60.0
_INTERRUPT_AFTER_S = 0.3


def _failed_gather(world: World, value: int, what: str) -> tuple[str, float] | None:
    """The error of ``world``'s gather of ``value`` and how long it took; None if none."""
    started = time.monotonic()
    try:
        world.gather_ints([value], what, None)
    except CollectiveError as e:
        return str(e), time.monotonic() - started
    return None


def _interrupted_gather(rank: int, world_size: int) -> dict:
    store = current_store()
    group = dist.group.WORLD
    world = World(group, timedelta(seconds=_TIMEOUT_S))
    if rank == 1:  # the peer that comes only once rank 0 gave up on it
        store.wait(["t/gave_up"])
        late = world.gather_ints([7], "the late peer's gather", None)
        store.set("t/late_done", "1")
        return {"gathered": late, "interrupted": _C.group_interrupted(group)}
    threading.Timer(_INTERRUPT_AFTER_S, world.interrupt).start()
    first = _failed_gather(world, 1, "a gather the peer never joins")
    second = _failed_gather(world, 2, "a gather after the interrupt")
    busy_then = _C.group_busy(group)
    store.set("t/gave_up", "1")
    store.wait(["t/late_done"])
    deadline = time.monotonic() + 20.0
    while _C.group_busy(group) and time.monotonic() < deadline:
        time.sleep(0.05)
    return {
        "first": first,
        "second": second,
        "busy_then": busy_then,
        "busy_after": _C.group_busy(group),
        "interrupted": _C.group_interrupted(group),
    }


def test_an_interrupted_wait_ends_at_once_and_its_collective_runs_out() -> None:
    zero, one = (r.value for r in run_ranks(2, _interrupted_gather, timeout=120))
    message, waited = zero["first"]
    assert "interrupted" in message and "a gather the peer never joins" in message
    assert "timed out" not in message  # a crash must not read as a hang
    assert waited < _TIMEOUT_S / 2  # not the timeout: the interrupt ended it
    # The group stays interrupted: a later wait ends at once.
    message, waited = zero["second"]
    assert "interrupted" in message and waited < _TIMEOUT_S / 2
    # The first gather was left to Gloo's thread, which finished it when the peer came.
    assert zero["busy_then"] and not zero["busy_after"] and zero["interrupted"]
    assert one["gathered"] == [[1], [7]]
    assert not one["interrupted"]  # an interrupt is this process's only


def _interrupted_step(rank: int, world_size: int) -> dict:
    store = current_store()
    model = models.mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batch = models.classification_data(16)
    ex = vflow.Executor(model, opt, models.mean_ce, 4, timeout=_TIMEOUT_S)
    if rank == 1:  # alive, but never steps: rank 0's collectives wait on it
        store.wait(["t/done"])
        return {}
    before = [p.detach().clone() for p in model.parameters()]
    buffers = [b.data.data_ptr() for b in ex.grad_buffers]
    threading.Timer(_INTERRUPT_AFTER_S, ex.world.interrupt).start()
    started = time.monotonic()
    try:
        ex.step(batch)
        error = None
    except vflow.CollectiveError as e:
        error = str(e)
    failed_after = time.monotonic() - started
    unchanged = all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
    grads_cleared = all(p.grad is None for p in model.parameters())
    started = time.monotonic()
    ex.abort_group()
    aborted_after = time.monotonic() - started
    renewed = all(b.data.data_ptr() != old for b, old in zip(ex.grad_buffers, buffers, strict=True))
    ex.step(batch)  # alone, on the new buffers
    alone = [p.detach().clone() for p in model.parameters()]
    store.set("t/done", "1")
    return {
        "error": error,
        "failed_after": failed_after,
        "unchanged": unchanged and grads_cleared and ex.step_count == 1,
        "aborted_after": aborted_after,
        "renewed": renewed,
        "alone": alone,
    }


def test_an_interrupted_step_fails_and_its_executor_moves_on_to_new_buffers() -> None:
    zero = run_ranks(2, _interrupted_step, timeout=120)[0].value
    assert zero["error"] is not None and "interrupted" in zero["error"]
    assert "vflow step 0" in zero["error"]
    assert zero["failed_after"] < _TIMEOUT_S / 2
    assert zero["unchanged"], "a failed step must leave parameters, grads and step count"
    # Gloo's destructor would wait for the collective left running: abort_group hands
    # the group to a thread of its own instead (vflow.world.group.retire).
    assert zero["aborted_after"] < _TIMEOUT_S / 2
    assert zero["renewed"]
    # Its next step, alone, is a lone worker's (this process has no default group).
    reference = models.mlp()
    with vflow.Executor(
        reference, torch.optim.SGD(reference.parameters(), lr=0.1), models.mean_ce, 4
    ) as ex:
        ex.step(models.classification_data(16))
    for a, p in zip(zero["alone"], reference.parameters(), strict=True):
        assert torch.equal(a, p)


def _idle_retire(rank: int, world_size: int) -> tuple[bool, bool]:
    world = World(dist.group.WORLD, timedelta(seconds=_TIMEOUT_S))
    world.gather_ints([rank], "a gather that completes", None)
    world.interrupt()  # after the fact: nothing was left running
    return retire(dist.group.WORLD), _C.group_busy(dist.group.WORLD)


def test_a_group_with_nothing_left_running_is_not_retired() -> None:
    for value in (r.value for r in run_ranks(2, _idle_retire)):
        assert value == (False, False)


def _told_while_computing(rank: int, world_size: int) -> dict:
    store = current_store()
    model = models.mlp()
    ex = vflow.Executor(model, torch.optim.SGD(model.parameters(), lr=0.1), models.mean_ce, 8)
    if rank == 1:  # alive, but never steps
        store.wait(["t/done"])
        return {}
    forwards: list[int] = []

    def told_in_the_first_forward(m: torch.nn.Module, batch) -> torch.Tensor:
        forwards.append(len(forwards))
        if len(forwards) == 1:
            ex.world.interrupt()  # as the probe's thread does when told the set broke
        return models.mean_ce(m, batch)

    before = [p.detach().clone() for p in model.parameters()]
    ex.loss_fn = told_in_the_first_forward
    try:
        ex.step(models.classification_data(32))
        error = None
    except vflow.CollectiveError as e:
        error = str(e)
    unchanged = all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
    # Interrupted before the step: not even its first VN runs.
    del forwards[:]
    try:
        ex.step(models.classification_data(32))
        again = None
    except vflow.CollectiveError as e:
        again = str(e)
    ex.abort_group()
    store.set("t/done", "1")
    return {
        "error": error,
        "again": again,
        "forwards_again": len(forwards),
        "unchanged": unchanged and ex.step_count == 0,
    }


def test_a_worker_told_while_computing_stops_before_its_next_vn() -> None:
    """Note [Told while computing] (vflow/runtime/step_run.py): rank 0 holds 4 of the 8
    VNs; interrupted during the first one's forward, it runs no other VN and fails the
    step as an interrupted collective would, changing nothing. Rank 1 never steps: a
    collective would have waited on it."""
    zero = run_ranks(2, _told_while_computing, timeout=120)[0].value
    assert zero["error"] is not None and "interrupted before VN 1's forward" in zero["error"]
    assert "vflow step 0" in zero["error"] and "broke elsewhere" in zero["error"]
    assert zero["again"] is not None and "interrupted before VN 0's forward" in zero["again"]
    assert zero["forwards_again"] == 0
    assert zero["unchanged"]
