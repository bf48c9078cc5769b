"""Per-step profiles (Note [Profiles], vflow/planning/profile.py) and vflow's ranges in a
torch.profiler trace."""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import vflow
from tests.support import models
from vflow.world.launch import run_ranks

V = 4


class Sleepy(nn.Module):
    """A linear model whose forward takes at least ``delay`` seconds per sample, so
    that profile times have a known lower bound."""

    def __init__(self, delay: float) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear = nn.Linear(6, 4)
        self.delay = delay

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.delay * x.shape[0])
        return self.linear(x)


def test_a_step_reports_every_vn_of_this_worker() -> None:
    model = Sleepy(0.002)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batch = models.classification_data(10)
    with vflow.Executor(model, opt, models.mean_ce, V) as ex:
        assert ex.last_profile is None
        for step in range(2):
            result = ex.step(batch)
            profile = result.profile
            assert (profile.rank, profile.step) == (0, step)
            assert [(v.vn, v.size) for v in profile.vns] == [(0, 3), (1, 3), (2, 2), (3, 2)]
            for v in profile.vns:
                assert v.forward_s >= 0.002 * v.size * 0.9  # the sleep, minus clock slack
                assert 0 <= v.backward_s < 1.0
            assert profile.compute_s == sum(v.forward_s + v.backward_s for v in profile.vns)
            assert profile.compute_s <= profile.step_s
            assert profile.exposed_comm_s >= 0 and profile.optimizer_s >= 0
            assert profile.samples == 10
            # One process: the latest step is known to every rank at once.
            assert ex.last_profile == vflow.StepProfile(step, (profile,))


def _two_workers(rank: int, world_size: int) -> list[Any]:
    # Rank 1 is 4x slower per sample; the plan gives it one VN of 3.
    model = Sleepy(0.001 if rank == 0 else 0.004)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batch = models.classification_data(12)
    seen = []
    with vflow.Executor(
        model,
        opt,
        models.mean_ce,
        V,
        process_group=dist.group.WORLD,
        plan=vflow.Plan(counts=[3, 1]),
    ) as ex:
        for _ in range(3):
            result = ex.step(batch)
            seen.append((result.profile, ex.last_profile))
    return seen


def test_every_rank_holds_every_workers_profile_one_step_later() -> None:
    results = [r.value for r in run_ranks(2, _two_workers)]
    for rank, seen in enumerate(results):
        assert seen[0][1] is None  # nothing gathered before the first step's numbers exist
        for step in (1, 2):
            gathered = seen[step][1]
            assert gathered is not None and gathered.step == step - 1
            # Exactly what each worker reported for that step (float64 sums of one
            # non-zero term: exact).
            assert gathered.workers == (results[0][step - 1][0], results[1][step - 1][0]), rank
    profile_0, profile_1 = results[0][1][0], results[1][1][0]
    assert [v.vn for v in profile_0.vns] == [0, 1, 2] and [v.vn for v in profile_1.vns] == [3]
    # The slow worker's one VN of 3 samples takes longer than each of the fast one's.
    assert profile_1.vns[0].forward_s > max(v.forward_s for v in profile_0.vns)


def test_profiler_trace_shows_vflows_phases() -> None:
    model = models.mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batch = models.classification_data(16)
    with vflow.Executor(model, opt, models.mean_ce, V) as ex:
        ex.step(batch)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            ex.step(batch)
    names = {event.name for event in prof.events()}
    for expected in ("vflow::step", "vflow::forward", "vflow::backward", "vflow::optimizer"):
        assert expected in names, (expected, sorted(n for n in names if "vflow" in n))
    # The C++ reducer's own ranges, recorded on autograd's thread and in finalize, and
    # the kernels, which the reducer calls through the dispatcher (vflow.ops).
    for expected in (
        "vflow::fold",
        "vflow::finalize",
        "vflow::start_reduction",
        "vflow::multi_accumulate_",
    ):
        assert expected in names, (expected, sorted(n for n in names if "vflow" in n))


def _distributed_trace(rank: int, world_size: int) -> list[str]:
    model = models.mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batch = models.classification_data(16)
    with vflow.Executor(model, opt, models.mean_ce, V, process_group=dist.group.WORLD) as ex:
        ex.step(batch)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            ex.step(batch)
    return sorted({event.name for event in prof.events() if "vflow" in event.name})


def test_profiler_trace_shows_the_reducers_collectives() -> None:
    # The model's one small bucket goes by all-gather, added up by vflow::combine (Note
    # [Small buckets by all-gather], csrc/reduction/all_reduce.cpp).
    for names in (r.value for r in run_ranks(2, _distributed_trace)):
        for expected in ("vflow::all_gather", "vflow::combine", "vflow::wait", "vflow::finalize"):
            assert expected in names, (expected, names)
