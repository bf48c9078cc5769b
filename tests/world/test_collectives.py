"""vflow._C's collectives (csrc/collectives.cpp) and the Executor's World collectives that
use them: results against a pure-PyTorch reference, bad input, and the reason they
exist: no backend thread is left holding a tensor that Python can see (Note
[Collectives on tensors Python cannot see])."""

from __future__ import annotations

import os
import re
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from tests.support.reducers import make_reducer
from vflow._extension import _C
from vflow.world.group import CollectiveError, World
from vflow.world.launch import run_ranks

_SIZES = (0, 1, 97, 1025)
_TIMEOUT_S = 30.0


def _rank_values(rank: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 + rank)
    return (torch.randn(n, generator=gen, dtype=torch.float64) * 100).to(dtype)


def _three_collectives(rank: int, world_size: int) -> dict[str, list[torch.Tensor]]:
    group = dist.group.WORLD
    out: dict[str, list[torch.Tensor]] = {"sum": [], "broadcast": [], "gather": []}
    for dtype in (torch.float32, torch.float64, torch.int64):
        for n in _SIZES:
            # A non-contiguous view: the collective works on a private contiguous copy
            # and writes the result back through the view.
            base = torch.zeros(n, 2, dtype=dtype)
            view = base[:, 0]
            view.copy_(_rank_values(rank, n, dtype))
            # Coalesced with a second tensor of another shape; each gets its own sums.
            other = torch.full((2, 3), float(rank + 1)).to(dtype)
            _C.all_reduce_sum_(group, [view, other], None, _TIMEOUT_S)
            assert torch.equal(base[:, 1], torch.zeros(n, dtype=dtype))
            assert torch.equal(
                other, torch.full((2, 3), world_size * (world_size + 1) / 2).to(dtype)
            )
            out["sum"].append(view.clone())

            t = _rank_values(rank, n, dtype)
            _C.broadcast_(group, [t], torch.device("cpu"), world_size - 1, _TIMEOUT_S)
            out["broadcast"].append(t)

            mine = _rank_values(rank, n, dtype)
            gathered = [torch.full_like(mine, -1) for _ in range(world_size)]
            _C.all_gather_into(group, mine, gathered, _TIMEOUT_S)
            assert torch.equal(mine, _rank_values(rank, n, dtype))  # input untouched
            out["gather"].append(torch.cat(gathered))
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_collectives_match_a_reference(world_size: int) -> None:
    results = run_ranks(world_size, _three_collectives)
    i = 0
    for dtype in (torch.float32, torch.float64, torch.int64):
        for n in _SIZES:
            values = [_rank_values(r, n, dtype) for r in range(world_size)]
            for r in range(world_size):
                got = results[r].value
                # The backend picks the order of the additions, so a float sum may be off
                # the float64 sum by one rounding per addition; integer sums are exact.
                stacked = torch.stack([v.double() for v in values])
                error = (got["sum"][i].double() - stacked.sum(0)).abs()
                eps = torch.finfo(dtype).eps if dtype.is_floating_point else 0.0
                bound = (world_size - 1) * eps * stacked.abs().sum(0)
                assert bool((error <= bound).all()), (dtype, n, (error - bound).max())
                assert torch.equal(got["broadcast"][i], values[-1])
                assert torch.equal(got["gather"][i], torch.cat(values))
            i += 1


def _bad_input(rank: int, world_size: int) -> list[str]:
    group = dist.group.WORLD
    t = torch.arange(4.0)
    before = t.clone()
    errors = []
    calls = [
        lambda: _C.all_reduce_sum_(group, [t], None, 0.0),
        lambda: _C.broadcast_(group, [t], None, world_size, _TIMEOUT_S),
        lambda: _C.broadcast_(group, [t], None, -1, _TIMEOUT_S),
        lambda: _C.all_reduce_sum_(group, [], None, _TIMEOUT_S),
        lambda: _C.all_reduce_sum_(group, [t, torch.ones(2, dtype=torch.int64)], None, _TIMEOUT_S),
        lambda: _C.all_gather_into(group, t, [t.clone()], _TIMEOUT_S),
        lambda: _C.all_gather_into(group, t, [torch.zeros(3), torch.zeros(4)], _TIMEOUT_S),
        lambda: _C.all_gather_into(group, t, [torch.zeros(4, dtype=torch.int64)] * 2, _TIMEOUT_S),
    ]
    for call in calls:
        with pytest.raises(RuntimeError) as info:
            call()
        errors.append(str(info.value).splitlines()[0])
        assert torch.equal(t, before)
    # Every rank raised before starting anything, so the group still works, on a
    # parameter too (updated without recording autograd history).
    param = torch.nn.Parameter(t.clone())
    _C.all_reduce_sum_(group, [param], None, _TIMEOUT_S)
    assert torch.equal(param.detach(), before * world_size) and param.grad_fn is None
    return errors


def test_bad_input_raises_naming_the_argument_and_changes_nothing() -> None:
    errors = run_ranks(2, _bad_input)[0].value
    assert "timeout_seconds must be > 0" in errors[0]
    assert "root must be a rank of the group (0 to 1), got 2" in errors[1]
    assert "got -1" in errors[2]
    assert "tensors must hold at least one tensor" in errors[3]
    assert "tensors must share one dtype and device" in errors[4] and "tensors[1]" in errors[4]
    assert "outputs must hold one tensor per rank (2), got 1" in errors[5]
    assert "outputs[0] must match input" in errors[6]
    assert "outputs[0] must match input" in errors[7]


def _rank_1_is_missing(rank: int, world_size: int, how: str) -> str:
    collectives = World(dist.group.WORLD, timedelta(seconds=3))
    if rank == 1:
        if how == "dies":
            os._exit(0)  # its connections close at once, as when a process is killed
        time.sleep(6)  # hangs past the timeout
        return "hung"
    with pytest.raises(CollectiveError) as info:
        collectives.gather_rows(torch.ones(2, 3), [2, 2], step=7)
    return str(info.value)


@pytest.mark.parametrize("how", ["dies", "hangs"])
def test_a_missing_rank_gives_a_collective_error_naming_the_step_and_the_collective(
    how: str,
) -> None:
    results = run_ranks(2, _rank_1_is_missing, how, expect_failure=how == "dies")
    message = results[0].value
    assert message.startswith("vflow step 7: all-gather of inference outputs on ")
    if how == "hangs":
        assert "timed out (timeout 3 s): " in message
    else:  # a timeout that did not expire is not named
        assert re.search(r" failed after [0-2]\.\d s: ", message), message
        assert "timeout" not in message.split(": ", 2)[1]


def _use_counts(rank: int, world_size: int) -> dict[str, list[int]]:
    """How many references to the caller's tensors remain once each collective has
    returned; 1 is the caller's own."""
    group = dist.group.WORLD
    counts: dict[str, list[int]] = {}
    t = torch.ones(5)
    _C.all_reduce_sum_(group, [t], None, _TIMEOUT_S)
    _C.broadcast_(group, [t], None, 0, _TIMEOUT_S)
    counts["all_reduce_sum_, broadcast_"] = [t._use_count()]
    outputs = [torch.empty(5) for _ in range(world_size)]
    _C.all_gather_into(group, t, outputs, _TIMEOUT_S)
    counts["all_gather_into"] = [t._use_count(), *(o._use_count() for o in outputs)]
    collectives = World(group, timedelta(seconds=_TIMEOUT_S))
    params = [torch.ones(3), torch.ones(2, 2, dtype=torch.float64)]
    collectives.broadcast_from(0, params, "broadcast", None)
    collectives.sum(params, "sum", 0)
    rows = torch.ones(4, 2)
    gathered = collectives.gather_rows(rows, [4] * world_size, 0)
    counts["World"] = [p._use_count() for p in (*params, rows, gathered)]

    # The step's statistics: the Reducer reduces a copy, so the caller's tensor is
    # free as soon as start_stats returns, while the all-reduce may still be running.
    param = torch.nn.Parameter(torch.ones(4))
    reducer = make_reducer([[param]], [torch.float32], 1 << 20, 1 << 20, group)
    reducer.begin_step(1)
    reducer.begin_vn(1.0, True)
    stats = torch.full((3,), float(rank + 1), dtype=torch.float64)
    reducer.start_stats(stats)
    counts["Reducer.start_stats"] = [stats._use_count()]
    sums = reducer.wait_stats()
    assert torch.equal(sums, torch.full((3,), world_size * (world_size + 1) / 2.0).double())
    reducer.add_grad(0, 0, torch.ones(4))
    reducer.end_vn()
    reducer.finalize(1.0, [])

    # The control: torch's own collective keeps the caller's tensors while its Work
    # lives, which is what the count above would show for a Work holding them.
    work = dist.all_gather(outputs, t, async_op=True)
    work.wait()
    counts["control: dist.all_gather"] = [t._use_count()]
    del work
    return counts


def test_no_backend_thread_keeps_a_tensor_python_can_see() -> None:
    """Note [Collectives on tensors Python cannot see]: a Work that holds a tensor with
    a Python object makes its backend thread take the GIL when it drops the Work, which
    aborts the process if the interpreter is exiting by then."""
    for counts in (r.value for r in run_ranks(2, _use_counts)):
        control = counts.pop("control: dist.all_gather")
        assert control[0] > 1, "the control should see torch's Work holding the tensor"
        for what, values in counts.items():
            assert values == [1] * len(values), (what, values)


def _started_sum(rank: int, world_size: int) -> str:
    world = World(dist.group.WORLD, timedelta(seconds=3))
    row = torch.full((5,), float(rank + 1), dtype=torch.float64)
    pending = world.start_sum(row, "all-reduce of the rows", 3)
    pending.wait()
    assert torch.equal(row, torch.full((5,), 3.0, dtype=torch.float64))
    with pytest.raises(ValueError, match="must be contiguous"):
        world.start_sum(torch.zeros(4, 2)[:, 0], "all-reduce of a view", 3)
    if rank == 1:
        time.sleep(6)  # hangs past the timeout
        return "hung"
    pending = world.start_sum(row, "all-reduce of the rows", 4)  # returns at once
    with pytest.raises(CollectiveError) as info:
        pending.wait()
    return str(info.value)


def test_a_started_sum_ends_in_wait_and_a_missing_rank_is_a_collective_error() -> None:
    message = run_ranks(2, _started_sum)[0].value
    assert message.startswith("vflow step 4: all-reduce of the rows on "), message
    assert "timed out (timeout 3 s): " in message
