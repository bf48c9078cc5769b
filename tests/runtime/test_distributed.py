"""vflow.Executor over Gloo process groups of 2, 3 and 4 ranks on localhost.

Each scenario trains a few steps; every rank returns its parameters (and buffers),
and the parent compares them with a single-process run of the same V VNs — the
result must not depend on how the VNs are mapped onto workers. Scenarios that share
a world size run in one spawn of that world, because starting processes dominates
the cost.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import vflow
from tests.support import models
from tests.support.models import max_relative_error
from vflow.mapping.batching import slice_batch, split_sizes
from vflow.world.launch import run_ranks

STEPS = 3
TOLERANCE = 1e-5


class Branchy(nn.Module):
    """Two heads chosen per VN by the data, and a parameter no VN ever uses: some
    parameters get no gradient in some VNs (or any), on some workers."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.trunk = nn.Linear(6, 32)
        self.head_a = nn.Linear(32, 4)
        self.head_b = nn.Linear(32, 4)
        self.never_used = nn.Parameter(torch.randn(5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.trunk(x))
        return self.head_a(h) if x[0, 0] > 0 else self.head_b(h)


@dataclass
class Scenario:
    model: Callable[[], nn.Module]
    loss_fn: Callable
    batches: list
    virtual_nodes: int
    plans: dict[int, vflow.Plan]  # world size -> plan
    optimizer: Callable = lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9)
    kwargs: dict = field(default_factory=dict)
    local_batches: bool = False  # ranks pass only their share, with global_batch_size
    infer: bool = False

    def single_plan(self) -> vflow.Plan:
        sizes = next(iter(self.plans.values())).sizes
        if sizes is None:
            return vflow.Plan(counts=[self.virtual_nodes])
        return vflow.Plan(sizes=[[s for worker in sizes for s in worker]])


def _classification(b: int) -> list:
    return [models.classification_data(b, seed=10 + s) for s in range(STEPS)]


def _images(b: int) -> list:
    out = []
    for s in range(STEPS):
        g = torch.Generator().manual_seed(20 + s)
        out.append((torch.randn(b, 2, 5, 5, generator=g), torch.randint(0, 4, (b,), generator=g)))
    return out


TINY_BUCKETS = {"first_bucket_mb": 0.001, "bucket_cap_mb": 0.004}


def _scenarios() -> dict[str, Scenario]:
    counts = {
        2: vflow.Plan(counts=[5, 3]),
        3: vflow.Plan(counts=[1, 1, 6]),
        4: vflow.Plan.even(8, 4),
    }
    even = {w: vflow.Plan.even(8, w) for w in (2, 3, 4)}
    return {
        "even_mean": Scenario(models.mlp, models.mean_ce, _classification(37), 8, even),
        "uneven_counts_mean": Scenario(
            models.mlp, models.mean_ce, _classification(40), 8, counts, kwargs=TINY_BUCKETS
        ),
        "uneven_sizes_mean": Scenario(
            models.mlp,
            models.mean_ce,
            _classification(36),
            5,
            {
                2: vflow.Plan(sizes=[[12, 12], [4, 4, 4]]),
                3: vflow.Plan(sizes=[[12], [8, 8], [4, 4]]),
                4: vflow.Plan(sizes=[[9], [9], [9], [5, 4]]),
            },
        ),
        "sum_loss": Scenario(
            models.TokenModel,
            models.token_sum_loss,
            [models.padded_tokens(24, seed=30 + s) for s in range(STEPS)],
            8,
            counts,
            kwargs=TINY_BUCKETS,
        ),
        "unused_parameters": Scenario(
            Branchy, models.mean_ce, _classification(32), 8, counts, kwargs=TINY_BUCKETS
        ),
        "batchnorm_dropout_vn0": Scenario(models.bn_net, models.mean_ce, _images(32), 8, counts),
        "batchnorm_mean_adam_clip": Scenario(
            models.bn_net,
            models.mean_ce,
            _images(32),
            8,
            even,
            optimizer=lambda params: torch.optim.Adam(params, lr=1e-2),
            kwargs={"buffer_rule": "mean", "max_grad_norm": 0.5},
        ),
        "local_batches_and_infer": Scenario(
            models.mlp,
            models.mean_ce,
            _classification(37),
            8,
            counts,
            local_batches=True,
            infer=True,
        ),
    }


SCENARIOS = _scenarios()


def _state(model: nn.Module) -> list[torch.Tensor]:
    return [t.detach().clone() for t in (*model.parameters(), *model.buffers())]


def _train(scenario: Scenario, plan: vflow.Plan, process_group=None) -> dict:
    model = scenario.model()
    if process_group is not None and process_group.rank() != 0:
        # Rank 0's parameters are broadcast at construction; start elsewhere from junk.
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
    opt = scenario.optimizer(model.parameters())
    ex = vflow.Executor(
        model,
        opt,
        scenario.loss_fn,
        scenario.virtual_nodes,
        seed=3,
        plan=plan,
        process_group=process_group,
        timeout=60,
        **scenario.kwargs,
    )
    rank = ex.rank
    losses = []
    with ex:
        for batch in scenario.batches:
            if scenario.local_batches:
                b = batch[0].shape[0]
                start, stop = plan.worker_range(rank, b)
                result = ex.step(slice_batch(batch, start, stop), global_batch_size=b)
            else:
                result = ex.step(batch)
            losses.append((result.loss, result.num_items))
        outputs = None
        if scenario.infer:
            model.eval()
            outputs = ex.infer(scenario.batches[0][0])
        reducer = ex.reducer
        overlap = (reducer.early_launches, reducer.num_buckets)
    return {"state": _state(model), "losses": losses, "outputs": outputs, "overlap": overlap}


def _run_scenarios(rank: int, world_size: int, names: list[str]) -> dict:
    return {
        name: _train(SCENARIOS[name], SCENARIOS[name].plans[world_size], dist.group.WORLD)
        for name in names
    }


@pytest.fixture(scope="module")
def single_results() -> dict:
    return {name: _train(s, s.single_plan()) for name, s in SCENARIOS.items()}


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_workers_match_single_process(world_size, single_results):
    names = list(SCENARIOS)
    results = run_ranks(world_size, _run_scenarios, names, timeout=300)
    for name in names:
        want = single_results[name]
        for r in results:
            got = r.value[name]
            error = max_relative_error(got["state"], want["state"])
            assert error <= TOLERANCE, f"{name}: rank {r.rank} of {world_size}: {error:.2e}"
            for (loss, items), (want_loss, want_items) in zip(got["losses"], want["losses"]):
                assert loss == pytest.approx(want_loss, rel=1e-6), name
                assert items == want_items, name
            if want["outputs"] is not None:
                torch.testing.assert_close(got["outputs"], want["outputs"], rtol=1e-5, atol=1e-6)
        if name == "uneven_counts_mean":
            # Every parameter is used, so every bucket completes, and its all-reduce
            # starts, while the last VN's backward is still running.
            for r in results:
                early, buckets = r.value[name]["overlap"]
                assert early == buckets > 1, (r.rank, early, buckets)
        # Every rank holds the same parameters bit for bit: they stepped on the same
        # reduced gradient.
        for r in results[1:]:
            for a, b in zip(r.value[name]["state"], results[0].value[name]["state"]):
                assert torch.equal(a, b), f"{name}: rank {r.rank} differs from rank 0"


# ---- the reference implementation: DDP with one rank per VN ---------------------------


def _ddp_vn(rank: int, world_size: int, batches: list) -> list[torch.Tensor]:
    model = models.mlp()
    ddp = nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=True)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    for x, y in batches:
        sizes = split_sizes(x.shape[0], world_size)
        start = sum(sizes[:rank])
        opt.zero_grad()
        F.cross_entropy(
            ddp(x[start : start + sizes[rank]]), y[start : start + sizes[rank]]
        ).backward()
        opt.step()
    return _state(model)


def _vflow_even(rank: int, world_size: int, batches: list, v: int) -> list[torch.Tensor]:
    model = models.mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with vflow.Executor(model, opt, models.mean_ce, v, timeout=60) as ex:
        for batch in batches:
            ex.step(batch)
    return _state(model)


def test_ddp_with_v_ranks_equals_vflow_on_one_and_two_processes():
    v = 4
    batches = _classification(32)  # B divisible by V: DDP's average is then the global mean
    ddp = run_ranks(v, _ddp_vn, batches, timeout=180)[0].value
    one = _vflow_even(0, 1, batches, v)
    two = run_ranks(2, _vflow_even, batches, v, timeout=180)
    for got in (one, two[0].value, two[1].value):
        for a, b in zip(got, ddp):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


# ---- failures --------------------------------------------------------------------------


def _train_until_a_rank_fails(rank: int, world_size: int, how: str, timeout: float) -> dict:
    model = models.mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ex = vflow.Executor(model, opt, models.mean_ce, 6, timeout=timeout)
    batches = _classification(24)
    for step in range(STEPS):
        if step == 2 and rank == world_size - 1:
            if how == "dies":
                os._exit(17)
            # Hangs through the whole window in which the others must give up.
            time.sleep(timeout + 5.0)
            return {"hung": True}
        before = _state(model)
        started = time.monotonic()
        try:
            ex.step(batches[step])
        except vflow.CollectiveError as e:
            unchanged = all(torch.equal(a, b) for a, b in zip(before, _state(model)))
            grads_cleared = all(p.grad is None for p in model.parameters())
            return {
                "error": str(e),
                "seconds": time.monotonic() - started,
                "unchanged": unchanged and grads_cleared and ex.step_count == 2,
            }
    return {"error": None}


@pytest.mark.parametrize("how", ["dies", "hangs"])
def test_a_failed_rank_makes_the_others_raise_within_the_timeout(how):
    timeout = 4.0
    results = run_ranks(3, _train_until_a_rank_fails, how, timeout, timeout=90, expect_failure=True)
    failed = results[-1]
    if how == "dies":
        assert "exit code 17" in failed.error
    else:
        assert failed.value == {"hung": True}
    for r in results[:-1]:
        assert r.error is None, r.error
        assert r.value["error"] is not None, f"rank {r.rank} did not notice"
        message = r.value["error"]
        assert "vflow step 2" in message
        assert "process group" in message and "gloo" in message and f"rank {r.rank} of 3" in message
        assert r.value["seconds"] < timeout + 5.0
        assert r.value["unchanged"], "a failed step must leave parameters, grads and step count"
        # The timeout is named only when it expired (Note [Saying what failed]).
        if how == "hangs":
            assert f"timed out (timeout {timeout:g} s): " in message, message
        else:
            assert re.search(r" failed after \d+\.\d s: ", message), message
            assert "timeout" not in message.split(": ", 2)[1], message


# ---- bad plans and mismatched ranks ------------------------------------------------------


def _summed_ce(model: nn.Module, batch) -> tuple[torch.Tensor, int]:
    x, y = batch
    return F.cross_entropy(model(x), y, reduction="sum"), y.shape[0]


def _bad_construction(rank: int, world_size: int) -> dict:
    group = dist.group.WORLD
    errors = {}
    model = models.mlp()
    before = _state(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cases = {
        "workers": {"plan": vflow.Plan(counts=[8])},
        "vns": {"plan": vflow.Plan(counts=[2, 2])},
        "type": {"plan": [4, 4]},
        "too_few_vns": {"virtual_nodes": 1},
        "disagree": {"plan": vflow.Plan(counts=[5, 3]) if rank == 0 else vflow.Plan(counts=[4, 4])},
        "group": {"process_group": "world"},
        "seed": {"seed": rank},
    }
    for name, kwargs in cases.items():
        args = {"virtual_nodes": 8, "process_group": group, **kwargs}
        try:
            vflow.Executor(model, opt, models.mean_ce, timeout=30, **args)
        except (TypeError, ValueError) as e:
            errors[name] = f"{type(e).__name__}: {e}"
    other = models.mlp() if rank == 0 else models.TokenModel()
    try:
        vflow.Executor(other, torch.optim.SGD(other.parameters(), lr=0.1), models.mean_ce, 8)
    except ValueError as e:
        errors["layout"] = str(e)
    unchanged = all(torch.equal(a, b) for a, b in zip(before, _state(model)))

    ex = vflow.Executor(model, opt, models.mean_ce, 8, timeout=30)
    batch = models.classification_data(16)
    ex.step(batch)
    plan_errors = {}
    for name, plan in {
        "set_workers": vflow.Plan(counts=[8]),
        "set_disagree": vflow.Plan(counts=[6, 2]) if rank == 0 else vflow.Plan(counts=[2, 6]),
    }.items():
        try:
            ex.set_plan(plan)
        except (TypeError, ValueError) as e:
            plan_errors[name] = f"{type(e).__name__}: {e}"
    kept = ex.plan
    try:
        ex.step(batch[0][:3], global_batch_size=16)
    except ValueError as e:
        plan_errors["local_size"] = str(e)
    ex.loss_fn = models.mean_ce if rank == 0 else _summed_ce
    before_step = _state(model)
    try:
        ex.step(batch)
    except TypeError as e:
        plan_errors["mixed_kinds"] = str(e)
    plan_errors["mixed_kinds_unchanged"] = all(
        torch.equal(a, b) for a, b in zip(before_step, _state(model))
    )
    ex.loss_fn = models.mean_ce
    ex.set_plan(vflow.Plan(counts=[7, 1]))
    ex.step(batch)  # the group still works after the rejected calls
    return {
        "errors": errors,
        "unchanged": unchanged,
        "plan_errors": plan_errors,
        "kept": repr(kept),
        "steps": ex.step_count,
    }


def test_bad_plans_and_mismatched_ranks_raise_clear_errors():
    results = run_ranks(2, _bad_construction, timeout=120)
    for r in results:
        errors = r.value["errors"]
        assert set(errors) == {
            "workers",
            "vns",
            "type",
            "too_few_vns",
            "disagree",
            "group",
            "seed",
            "layout",
        }
        assert "is for 1 workers but the process group has 2" in errors["workers"]
        assert "has 4 virtual nodes but virtual_nodes=8" in errors["vns"]
        assert errors["type"].startswith("TypeError: plan must be a vflow.Plan")
        assert (
            "virtual_nodes=1 is smaller than the process group's 2 workers" in errors["too_few_vns"]
        )
        assert "ranks disagree on the plan" in errors["disagree"]
        assert errors["group"].startswith("TypeError: process_group must be a")
        assert "ranks disagree on the settings" in errors["seed"]
        assert "ranks disagree on the model layout" in errors["layout"]
        assert r.value["unchanged"]
        plan_errors = r.value["plan_errors"]
        assert "is for 1 workers" in plan_errors["set_workers"]
        assert "ranks disagree on the plan" in plan_errors["set_disagree"]
        assert "pass this worker's samples only" in plan_errors["local_size"]
        assert (
            "losses on 1 of 2 workers and mean losses on the others" in plan_errors["mixed_kinds"]
        )
        assert plan_errors["mixed_kinds_unchanged"]
        assert r.value["kept"] == "Plan(counts=[4, 4])"
        assert r.value["steps"] == 2


def _different_scalers(rank: int, world_size: int) -> dict[str, str]:
    """Ranks whose loss scalers have other settings (or other state) must not form one
    worker set: each would scale and skip differently."""
    model = models.mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    errors = {}
    cases = {
        "init_scale": vflow.LossScaler(init_scale=2.0**10 if rank == 0 else 2.0**12),
        "growth_interval": vflow.LossScaler(growth_interval=100 if rank == 0 else 200),
        "on_off": rank == 0,
    }
    for name, loss_scale in cases.items():
        try:
            vflow.Executor(model, opt, models.mean_ce, 8, loss_scale=loss_scale, timeout=30)
        except ValueError as e:
            errors[name] = str(e)
    vflow.Executor(model, opt, models.mean_ce, 8, loss_scale=vflow.LossScaler(), timeout=30).close()
    return errors


def test_ranks_with_different_loss_scaler_settings_raise():
    for r in run_ranks(2, _different_scalers, timeout=120):
        assert set(r.value) == {"init_scale", "growth_interval", "on_off"}, r.value
        for error in r.value.values():
            assert "ranks disagree on the settings (loss_scaling)" in error


def _signals(rank: int, world_size: int) -> list[tuple[int, ...]]:
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    ex = vflow.Executor(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        lambda m, b: m(b).square().mean(),
        4,
        timeout=60,
    )
    batch = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))
    seen = []
    ex.signal(rank + 5)
    seen.append(ex.step(batch).signals)
    seen.append(ex.step(batch).signals)  # reset once a step succeeded
    ex.signal(lambda: 10 * rank)
    seen.append(ex.step(batch).signals)
    return seen


def test_every_rank_reads_every_workers_signal_at_the_same_step():
    for result in run_ranks(3, _signals, timeout=120):
        assert result.value == [(5, 6, 7), (0, 0, 0), (0, 10, 20)]
