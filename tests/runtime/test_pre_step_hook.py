"""Executor.register_pre_step_hook: a user function between the reduction and the
optimizer step (Note [Before the optimizer step], vflow/runtime/step_run.py).

The hook clips every parameter's gradient to its own norm bound (per-layer clipping).
Trained for a few steps in deterministic mode on 1, 2 and 3 Gloo workers, the runs must
be bitwise equal, the hook called once per step on every worker, its view of
``param.grad`` the global gradient (equal on every worker and in every mapping), and its
changes must reach the optimizer (the run differs from one without the hook).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import vflow
from vflow.world.launch import run_ranks

V = 6
B = 24
STEPS = 4
LAYER_MAX_NORM = 0.05


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 3))


def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [
        (torch.randn(B, 6, generator=g), torch.randint(0, 3, (B,), generator=g))
        for _ in range(STEPS)
    ]


class PerLayerClip:
    """Clips each parameter's gradient to a norm of at most ``max_norm`` (the guide's
    example); records how often it ran and the gradients it saw in the first step."""

    def __init__(self, max_norm: float) -> None:
        self.max_norm = max_norm
        self.calls = 0
        self.first_seen: list[torch.Tensor] = []

    def __call__(self, ex: vflow.Executor) -> None:
        params = [p for p in ex.model.parameters() if p.grad is not None]
        if self.calls == 0:
            self.first_seen = [p.grad.clone() for p in params]
        self.calls += 1
        for p in params:
            torch.nn.utils.clip_grad_norm_([p], self.max_norm)  # in place


def train(hook: bool, *, remove: bool = False, **kwargs) -> dict:
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    clip = PerLayerClip(LAYER_MAX_NORM)
    with vflow.Executor(model, optimizer, loss_fn, V, seed=1, timeout=60, **kwargs) as ex:
        if hook:
            handle = ex.register_pre_step_hook(clip)
            if remove:
                handle.remove()
        results = [ex.step(batch) for batch in batches()]
    return {
        "params": [p.detach().clone() for p in model.parameters()],
        "losses": [r.loss for r in results],
        "grad_norms": [r.grad_norm for r in results],
        "calls": clip.calls,
        "first_seen": clip.first_seen,
    }


def _train_rank(rank: int, world_size: int, hook: bool) -> dict:
    return train(hook, deterministic=True)


def _assert_bitwise(got: dict, want: dict, where: str) -> None:
    assert got["losses"] == want["losses"], where
    for a, b in zip(got["params"], want["params"], strict=True):
        assert torch.equal(a, b), f"{where}: parameters differ"
    for a, b in zip(got["first_seen"], want["first_seen"], strict=True):
        assert torch.equal(a, b), f"{where}: the hook saw other gradients"


@pytest.fixture(scope="module")
def one_worker() -> dict:
    return run_ranks(1, _train_rank, True, timeout=120)[0].value


def test_hook_changes_reach_the_optimizer(one_worker: dict) -> None:
    without = run_ranks(1, _train_rank, False, timeout=120)[0].value
    assert one_worker["calls"] == STEPS
    assert all(math.isfinite(x) for x in one_worker["losses"])
    # Per-layer clipping bounds what the hook saw: it had something to clip.
    assert (
        max(float(torch.linalg.vector_norm(g)) for g in one_worker["first_seen"]) > LAYER_MAX_NORM
    )
    assert without["calls"] == 0
    assert not all(
        torch.equal(a, b) for a, b in zip(one_worker["params"], without["params"], strict=True)
    )


@pytest.mark.parametrize("world_size", [2, 3])
def test_several_workers_are_bitwise_equal_to_one(world_size: int, one_worker: dict) -> None:
    results = run_ranks(world_size, _train_rank, True, timeout=180)
    for r in results:
        assert r.value["calls"] == STEPS, f"rank {r.rank} called the hook {r.value['calls']} times"
        _assert_bitwise(r.value, one_worker, f"{world_size} workers, rank {r.rank}")


def test_removed_hook_is_not_called() -> None:
    removed = train(True, remove=True)
    plain = train(False)
    assert removed["calls"] == 0
    for a, b in zip(removed["params"], plain["params"], strict=True):
        assert torch.equal(a, b)


# bfloat16 parameters: param.grad is a bfloat16 copy of the float32 buffer, and what the
# hook does to the copy must be what clipping sees.
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hook_runs_before_max_grad_norm_clipping(dtype: torch.dtype) -> None:
    seen: list[float] = []
    max_norm = 1e-3

    def halve(ex: vflow.Executor) -> None:
        grads = [p.grad for p in ex.model.parameters()]
        norms = [torch.linalg.vector_norm(g.float()) for g in grads]
        seen.append(float(torch.linalg.vector_norm(torch.stack(norms))))
        for g in grads:
            g.mul_(0.5)

    model = make_model().to(dtype)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    taken: list[float] = []

    def record(optimizer: torch.optim.Optimizer, args: object, kwargs: object) -> None:
        norms = [torch.linalg.vector_norm(p.grad.float()) for p in model.parameters()]
        taken.append(float(torch.linalg.vector_norm(torch.stack(norms))))

    optimizer.register_step_pre_hook(record)

    def batch_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(model(x.to(dtype)).float(), y)

    with vflow.Executor(model, optimizer, batch_loss, V, max_grad_norm=max_norm) as ex:
        ex.register_pre_step_hook(halve)
        result = ex.step(batches()[0])
    # grad_norm is the norm clipping found: that of the hook's halved gradient, and the
    # optimizer took the clipped one.
    assert result.grad_norm == pytest.approx(seen[0] / 2, rel=1e-5)
    assert seen[0] / 2 > 10 * max_norm
    assert taken == [pytest.approx(max_norm, rel=1e-2)]


def test_skipped_step_calls_no_hook() -> None:
    calls: list[int] = []
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = batches()[0]
    bad = (x.clone(), y)
    bad[0][0, 0] = float("inf")
    with vflow.Executor(model, optimizer, loss_fn, V, skip_nonfinite=True) as ex:
        ex.register_pre_step_hook(lambda ex: calls.append(ex.step_count))
        assert ex.step(bad).skipped
        assert not ex.step((x, y)).skipped
    assert calls == [1]


def test_hook_that_replaces_grad_fails_the_step_changing_nothing() -> None:
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]

    def replace(ex: vflow.Executor) -> None:
        for p in ex.model.parameters():
            p.grad = p.grad * 0.5

    with vflow.Executor(model, optimizer, loss_fn, V) as ex:
        ex.register_pre_step_hook(replace)
        with pytest.raises(RuntimeError, match=r"a pre-step hook replaced param\.grad of 4 "):
            ex.step(batches()[0])
        assert ex.step_count == 0
    for p, b in zip(model.parameters(), before, strict=True):
        assert torch.equal(p, b) and p.grad is None


def test_not_callable_is_a_type_error() -> None:
    model = make_model()
    with vflow.Executor(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn, V) as ex:
        with pytest.raises(TypeError, match="^fn must be callable, got int$"):
            ex.register_pre_step_hook(3)  # type: ignore[arg-type]
