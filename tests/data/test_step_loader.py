"""vflow.data.StepLoader (Note [Loading ahead of an elastic job]): batches loaded ahead
by a DataLoader's worker processes, each the part of its step's global batch that the
executor's plan and rank give this worker; a step asked for out of turn (a redo), a
plan or rank that changed, or another executor make it load anew from that step, in the
same worker processes; bad arguments raise before anything starts."""

from __future__ import annotations

import gc
import os
import signal
import time
from typing import Any

import pytest
import torch
from torch.utils.data import Dataset

import vflow
from vflow.data import StepLoader, VNBatchSampler

N = 100
B = 12
V = 4


class _Samples(Dataset[tuple[torch.Tensor, int]]):
    """Sample i is (i as a tensor, the pid of the process that loaded it)."""

    def __len__(self) -> int:
        return N

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return torch.tensor(index), os.getpid()


class _Follower:
    """A PlanFollower whose plan and rank the test sets, as an elastic round would."""

    def __init__(self, plan: vflow.Plan, rank: int) -> None:
        self.step_count = 0
        self.rank = rank
        self.plan = plan
        self.drawn: list[int] = []
        self.forgotten = 0

    def plan_for_step(self, step: int) -> vflow.Plan:
        assert step >= self.step_count
        return self.plan

    def record_draw(self, step: int, plan: vflow.Plan, rank: int) -> None:
        self.drawn.append(step)

    def forget_draws(self) -> None:
        self.forgotten += 1


def _expected(sampler_seed: int, step: int, plan: vflow.Plan, rank: int) -> list[int]:
    reference = VNBatchSampler(N, B, plan, rank, seed=sampler_seed)
    return reference.step_indices(step)[0]


def _take(loader: StepLoader, follower: _Follower, step: int) -> tuple[list[int], set[int], int]:
    (indices, pids), size = loader.batch(follower, step)
    assert loader.last_indices == indices.tolist()
    return indices.tolist(), set(pids.tolist()), size


def test_batches_follow_the_step_count_plan_and_rank_in_the_same_workers() -> None:
    follower = _Follower(vflow.Plan.even(V, 2), rank=0)
    sampler = VNBatchSampler(N, B, seed=7)
    with StepLoader(_Samples(), sampler, num_workers=2) as loader:
        pids: set[int] = set()
        # Steps in turn: 9 steps cross the epoch boundary (8 global batches of 12 in 100).
        for step in range(9):
            indices, got_pids, size = _take(loader, follower, step)
            assert indices == _expected(7, step, follower.plan, 0), step
            assert size == B
            pids |= got_pids
            follower.step_count += 1
        assert loader.restarts == 0
        assert len(pids) == 2 and os.getpid() not in pids
        assert max(follower.drawn) > follower.step_count  # the loader drew ahead

        # A step redone (the worker set broke during step 9): the same batch again.
        first, _, _ = _take(loader, follower, 9)
        again, got_pids, _ = _take(loader, follower, 9)
        assert first == again == _expected(7, 9, follower.plan, 0)
        assert loader.restarts == 1
        follower.step_count += 1

        # A grow at step 10: another plan, another rank.
        follower.plan, follower.rank = vflow.Plan(counts=[1, 1, 2]), 2
        indices, got_pids, _ = _take(loader, follower, 10)
        assert indices == _expected(7, 10, follower.plan, 2)
        assert loader.restarts == 2
        pids |= got_pids
        follower.step_count += 1

        # Caught up to step 20 (another worker's state at a higher step count).
        follower.step_count = 20
        indices, got_pids, _ = _take(loader, follower, 20)
        assert indices == _expected(7, 20, follower.plan, 2)
        pids |= got_pids
        # The loader's worker processes stayed the same two throughout.
        assert len(pids) == 2
        # Another executor (a newcomer's): the sampler follows it.
        other = _Follower(vflow.Plan.even(V, 1), rank=0)
        other.step_count = 21
        indices, _, _ = _take(loader, other, 21)
        assert indices == _expected(7, 21, other.plan, 0)
        assert sampler.executor is other
        assert other.forgotten == 1


def _children() -> list[int]:
    me = str(os.getpid())
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[1] == me and fields[0] != "Z":
                found.append(int(entry))
    return found


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc for the loader's workers")
def test_the_loaders_workers_outlive_a_leave_or_suspend_signal_to_every_process() -> None:
    # Note [A leave is the worker's, not its loader's]: scancel --full --signal=TERM
    # reaches them too; the worker leaves after its step, which needs its batches.
    follower = _Follower(vflow.Plan.even(V, 1), rank=0)
    sampler = VNBatchSampler(N, B, seed=7)
    # This process may have other children already (multiprocessing's resource
    # tracker or forkserver, another test's helpers).
    before = set(_children())
    with StepLoader(_Samples(), sampler, num_workers=2) as loader:
        _take(loader, follower, 0)
        follower.step_count = 1
        workers = set(_children()) - before  # the loader's two worker processes
        assert len(workers) == 2
        for pid in workers:
            os.kill(pid, signal.SIGTERM)
            os.kill(pid, signal.SIGUSR1)
        time.sleep(0.5)
        for step in range(1, 5):
            indices, got_pids, _ = _take(loader, follower, step)
            assert indices == _expected(7, step, follower.plan, 0)
            assert got_pids <= workers
            follower.step_count += 1


def test_in_process_loading_and_an_executor(tmp_path: Any) -> None:
    """num_workers=0 loads in this process; with a real Executor the batches train."""
    model = torch.nn.Linear(1, 1)
    ex = vflow.Executor(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        lambda m, batch: m(batch[0].float().unsqueeze(1)).pow(2).mean(),
        V,
    )
    sampler = VNBatchSampler(N, B, seed=1)
    with ex, StepLoader(_Samples(), sampler, num_workers=0) as loader:
        for step in range(3):
            (indices, pids), size = loader.batch(ex, step)
            assert set(pids.tolist()) == {os.getpid()}
            assert indices.tolist() == _expected(1, step, ex.plan, 0)
            ex.step((indices, pids), global_batch_size=size)
        assert ex.step_count == 3


def test_closing_stops_the_worker_processes() -> None:
    follower = _Follower(vflow.Plan.even(V, 1), rank=0)
    loader = StepLoader(_Samples(), VNBatchSampler(N, B), num_workers=2)
    _, pids, _ = _take(loader, follower, 0)
    loader.close()
    gc.collect()
    deadline = time.monotonic() + 30
    alive = set(pids)
    while alive and time.monotonic() < deadline:
        alive = {pid for pid in alive if _running(pid)}
        time.sleep(0.05)
    assert not alive, f"loader workers {alive} still run after close()"
    with pytest.raises(RuntimeError, match="this StepLoader is closed"):
        loader.batch(follower, 0)


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_bad_arguments_raise() -> None:
    sampler = VNBatchSampler(N, B)
    with pytest.raises(TypeError, match="sampler must be a vflow.VNBatchSampler, got list"):
        StepLoader(_Samples(), [1, 2])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="num_workers must be >= 0"):
        StepLoader(_Samples(), sampler, num_workers=-1)
    with pytest.raises(ValueError, match="prefetch_factor needs num_workers > 0"):
        StepLoader(_Samples(), sampler, num_workers=0, prefetch_factor=2)
    with pytest.raises(TypeError, match="pin_memory must be a bool, got str"):
        StepLoader(_Samples(), sampler, pin_memory="yes")  # type: ignore[arg-type]
    follower = _Follower(vflow.Plan.even(V, 1), rank=0)
    with StepLoader(_Samples(), sampler, num_workers=0) as loader:
        with pytest.raises(
            ValueError, match=r"step must be the executor's next step \(step_count=0\), got 3"
        ):
            loader.batch(follower, 3)
        with pytest.raises(TypeError, match="executor must be a vflow.Executor"):
            loader.batch(object(), 0)  # type: ignore[arg-type]
        assert follower.drawn == []  # nothing was drawn
