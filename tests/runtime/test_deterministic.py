"""Deterministic mode: training is bitwise identical for a given V and seed, whatever
the number of workers and the plan, with either way of summing gradients ("ordered",
the default of deterministic=True, and "exact").

Two models are trained for 10 steps with V = 12 under every mapping the acceptance
asks for — 1 process; 2 processes; 3 processes as [4, 4, 4] and [6, 3, 3]; 4 processes;
and a plan changed mid-run — and their parameters, buffers and optimizer state must be
``torch.equal`` to the 1-process run. Ranks use one intra-op thread each (set by the
harness), which is one of the documented conditions. Mappings of one world size run
in one spawn, since starting processes dominates the cost.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import vflow
from vflow.world.launch import run_ranks

V = 12
B = 48
STEPS = 10
KINDS = ["ordered", "exact"]

# world size -> {mapping name: plan counts per step range}
MAPPINGS: dict[int, dict[str, list[tuple[int, list[int]]]]] = {
    1: {"1 process": [(0, [12])]},
    2: {"2 processes even": [(0, [6, 6])]},
    3: {
        "3 processes [4,4,4]": [(0, [4, 4, 4])],
        "3 processes [6,3,3]": [(0, [6, 3, 3])],
        "3 processes, plan [4,4,4] -> [1,4,7] at step 5": [(0, [4, 4, 4]), (5, [1, 4, 7])],
    },
    4: {"4 processes": [(0, [3, 3, 3, 3])]},
}


class SmallCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.features = nn.Sequential(
            nn.Conv2d(1, 8, 3, padding=1),
            nn.BatchNorm2d(8),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(8, 16, 3, padding=1),
            nn.BatchNorm2d(16),
            nn.ReLU(),
        )
        self.head = nn.Sequential(nn.Flatten(), nn.Dropout(0.25), nn.Linear(16 * 4 * 4, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


class TinyTransformer(nn.Module):
    """Token embedding, one pre-norm encoder block (LayerNorm, attention, MLP, dropout)
    and a per-token classifier."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(32, 32)
        self.position = nn.Parameter(torch.randn(10, 32) * 0.02)
        self.block = nn.TransformerEncoderLayer(
            32, 4, dim_feedforward=64, dropout=0.1, batch_first=True, norm_first=True
        )
        self.norm = nn.LayerNorm(32)
        self.out = nn.Linear(32, 32)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(self.block(self.embed(tokens) + self.position)))


def cnn_loss(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)


def token_loss(model: nn.Module, batch):
    tokens, targets = batch
    logits = model(tokens)
    return F.cross_entropy(
        logits.flatten(0, 1), targets.flatten(), reduction="sum"
    ), targets.numel()


def cnn_batches() -> list:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(STEPS):
        x = torch.randn(B, 1, 8, 8, generator=g)
        out.append((x, x[:, 0, 0, :].argmax(1) + x[:, 0, 1, :2].argmax(1)))  # learnable labels
    return out


def token_batches() -> list:
    g = torch.Generator().manual_seed(2)
    out = []
    for _ in range(STEPS):
        tokens = torch.randint(0, 32, (B, 10), generator=g)
        out.append((tokens, tokens.roll(1, dims=1)))
    return out


def snapshot(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out = {f"param {k}": v.detach().clone() for k, v in model.named_parameters()}
    out.update({f"buffer {k}": v.detach().clone() for k, v in model.named_buffers()})
    for index, state in optimizer.state_dict()["state"].items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                out[f"optimizer {index} {key}"] = value.clone()
    return out


def train(mapping: list[tuple[int, list[int]]], which: str, kind: str) -> dict:
    if which == "cnn":
        model, batches, loss_fn = SmallCNN(), cnn_batches(), cnn_loss
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        kwargs = {"buffer_rule": "mean"}
    else:
        model, batches, loss_fn = TinyTransformer(), token_batches(), token_loss
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
        kwargs = {"max_grad_norm": 1.0}
    plans = dict(mapping)
    losses = []
    with vflow.Executor(
        model,
        optimizer,
        loss_fn,
        V,
        seed=5,
        plan=vflow.Plan(counts=plans[0]),
        deterministic=kind,
        timeout=60,
        **kwargs,
    ) as ex:
        for step, batch in enumerate(batches):
            if step in plans and step > 0:
                ex.set_plan(vflow.Plan(counts=plans[step]))
            losses.append(ex.step(batch).loss)
    return {"state": snapshot(model, optimizer), "losses": losses}


def _run_mappings(rank: int, world_size: int, names: list[str], kind: str) -> dict:
    return {
        name: {
            which: train(MAPPINGS[world_size][name], which, kind)
            for which in ("cnn", "transformer")
        }
        for name in names
    }


@pytest.fixture(scope="module", params=KINDS)
def kind(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def reference(kind: str) -> dict:
    name = "1 process"
    return run_ranks(1, _run_mappings, [name], kind, timeout=240)[0].value[name]


def assert_identical(got: dict, want: dict, where: str) -> None:
    assert got["losses"] == want["losses"], f"{where}: losses differ"
    assert got["state"].keys() == want["state"].keys()
    differ = [
        key for key in want["state"] if not torch.equal(got["state"][key], want["state"][key])
    ]
    assert not differ, f"{where}: {len(differ)} tensors differ, first {differ[0]}"


def test_the_reference_run_trains(reference: dict) -> None:
    for which in ("cnn", "transformer"):
        losses = reference[which]["losses"]
        assert all(math.isfinite(x) for x in losses)
        assert losses[-1] < losses[0], f"{which} did not learn: {losses}"


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_every_mapping_is_bitwise_identical_to_one_process(
    world_size: int, kind: str, reference: dict
) -> None:
    names = list(MAPPINGS[world_size])
    results = run_ranks(world_size, _run_mappings, names, kind, timeout=300)
    for name in names:
        for r in results:
            for which in ("cnn", "transformer"):
                assert_identical(r.value[name][which], reference[which], f"{name}, rank {r.rank}")


# ---- one process: accuracy, inf/NaN, arguments ------------------------------------------


def _reduced_gradient(
    deterministic: bool | str, model: nn.Module, batch, v: int
) -> list[torch.Tensor]:
    """The global-batch gradient the executor hands to the optimizer (SGD with lr=0)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    with vflow.Executor(model, optimizer, cnn_loss, v, deterministic=deterministic) as ex:
        ex.step(batch)
    return [p.grad.detach().clone() for p in model.parameters()]


def test_deterministic_reduction_is_at_least_as_accurate_as_float32() -> None:
    """Against float64 references, the deterministic gradients' error is no larger
    than the default float32 path's. All share the VNs' float32 gradients; they
    differ in how the V = 256 VN gradients are added: one after the other (default),
    in a balanced tree ("ordered"), exactly ("exact")."""
    v, b = 256, 1024
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 10))
    x = torch.randn(b, 32)
    batch = (x, x[:, :10].argmax(1))
    sizes = vflow.split_sizes(b, v)
    # Reference 1: the float64 sum of the same float32 VN gradients (accumulation only).
    # Reference 2: the whole computation in float64.
    vn_sum = [torch.zeros_like(p, dtype=torch.float64) for p in model.parameters()]
    wide = [p.detach().double().requires_grad_() for p in model.parameters()]
    full64 = [torch.zeros_like(p) for p in wide]
    start = 0
    for size in sizes:
        xs, ys = x[start : start + size], batch[1][start : start + size]
        grads = torch.autograd.grad(F.cross_entropy(model(xs), ys), list(model.parameters()))
        out = F.linear(torch.tanh(F.linear(xs.double(), wide[0], wide[1])), wide[2], wide[3])
        grads64 = torch.autograd.grad(F.cross_entropy(out, ys), wide)
        for acc, g, acc64, g64 in zip(vn_sum, grads, full64, grads64, strict=True):
            acc += g.double() * (size / b)
            acc64 += g64 * (size / b)
        start += size
    got = {kind: _reduced_gradient(kind, model, batch, v) for kind in (*KINDS, False)}

    def error(got: list[torch.Tensor], want: list[torch.Tensor]) -> tuple[float, float]:
        diff = torch.cat([(g.double() - w).flatten() for g, w in zip(got, want, strict=True)])
        norm = torch.cat([w.flatten() for w in want]).norm()
        return (diff.norm() / norm).item(), diff.abs().max().item()

    rows = {
        (reference, kind or "default"): error(got[kind], want)
        for reference, want in (("sum of VN grads", vn_sum), ("float64 model", full64))
        for kind in got
    }
    table = "reduced-gradient error, V=256 (relative 2-norm, max abs):\n" + "\n".join(
        f"  vs {reference:16s} {mode:14s} {rel:.3e} {worst:.3e}"
        for (reference, mode), (rel, worst) in rows.items()
    )
    for reference in ("sum of VN grads", "float64 model"):
        dflt = rows[(reference, "default")]
        for kind in KINDS:
            det = rows[(reference, kind)]
            assert det[0] <= dflt[0] and det[1] <= dflt[1], table
    # Accumulation alone: one float32 rounding of the exact sum, nothing more.
    assert rows[("sum of VN grads", "exact")][0] < 2.0**-23, table


def _poisoned_batch(value: float):
    """A CNN batch whose VN 3 (of 8) has a sample that makes its gradient non-finite."""
    x, y = cnn_batches()[0]
    x = x[:32].clone()
    x[13, 0, 0, 0] = value
    return x, y[:32]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("value", [math.inf, math.nan], ids=["inf", "nan"])
def test_a_nonfinite_vn_gradient_raises_and_changes_nothing(value: float, kind: str) -> None:
    model = SmallCNN()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with vflow.Executor(model, optimizer, cnn_loss, 8, deterministic=kind) as ex:
        ex.step(cnn_batch(32))
        before = snapshot(model, optimizer)
        with pytest.raises(FloatingPointError, match="vflow step 1: a gradient .* inf or NaN"):
            ex.step(_poisoned_batch(value))
        assert ex.step_count == 1 and ex.skipped_steps == 0
        assert all(p.grad is None for p in model.parameters())
        after = snapshot(model, optimizer)
        assert all(torch.equal(after[k], before[k]) for k in before)
        ex.step(cnn_batch(32))  # the executor is still usable
        assert ex.step_count == 2


@pytest.mark.parametrize("kind", KINDS)
def test_a_nonfinite_vn_gradient_skips_the_step_with_skip_nonfinite(kind: str) -> None:
    model = SmallCNN()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with vflow.Executor(
        model, optimizer, cnn_loss, 8, deterministic=kind, skip_nonfinite=True
    ) as ex:
        before = snapshot(model, optimizer)
        result = ex.step(_poisoned_batch(math.inf))
        assert result.skipped and ex.skipped_steps == 1 and ex.step_count == 1
        after = snapshot(model, optimizer)
        params = [k for k in before if not k.startswith("buffer")]
        assert all(torch.equal(after[k], before[k]) for k in params)


def _overflow_setup() -> tuple[nn.Module, nn.Parameter, Callable, torch.Tensor, float]:
    """Column 0 of a sample is its num_items, the others multiply the parameter, so
    the gradient is sum(samples) / sum(num_items)."""
    weight = nn.Parameter(torch.ones(2))
    holder = nn.Module()
    holder.weight = weight

    def loss_fn(model: nn.Module, batch: torch.Tensor):
        return (model.weight * batch[:, 1:]).sum(), batch[:, 0].sum()

    big = torch.tensor(3.0e38).item()  # as float32 rounds it
    return holder, weight, loss_fn, torch.tensor([[1.0, big, 1.0]] * 4), big


def test_exact_reports_a_sum_beyond_float32_and_normalises_before_rounding() -> None:
    """Every VN's gradient is finite; with "exact" what matters is whether the
    normalised global gradient fits float32."""
    holder, weight, loss_fn, batch, big = _overflow_setup()
    optimizer = torch.optim.SGD([weight], lr=1e-38)
    with vflow.Executor(holder, optimizer, loss_fn, 4, deterministic="exact") as ex:
        overflowing = batch.clone()
        overflowing[1:, 0] = 0.0  # sum(num_items) = 1: the gradient is 4 * 3e38
        with pytest.raises(FloatingPointError, match="does not fit float32"):
            ex.step(overflowing)
        assert torch.equal(weight.detach(), torch.ones(2))
        # sum(num_items) = 4: the gradient is 3e38. The float32 path would overflow on
        # the way (3e38 + 3e38 = inf); the exact sum does not.
        result = ex.step(batch)
        assert not result.skipped
        assert weight.grad[0].item() == big and weight.grad[1].item() == 1.0


def test_ordered_reports_a_raw_sum_beyond_float32() -> None:
    """ "ordered" adds in float32 before normalising: a raw sum that overflows is
    reported (never rounded to a wrong finite value), even where the normalised
    gradient would fit."""
    holder, weight, loss_fn, batch, _ = _overflow_setup()
    optimizer = torch.optim.SGD([weight], lr=1e-38)
    with vflow.Executor(holder, optimizer, loss_fn, 4, deterministic=True) as ex:
        for num_items in (1.0, 4.0):
            overflowing = batch.clone()
            overflowing[:, 0] = num_items / 4
            with pytest.raises(FloatingPointError, match="does not fit float32"):
                ex.step(overflowing)
            assert torch.equal(weight.detach(), torch.ones(2))
        assert ex.step_count == 0


def cnn_batch(size: int):
    x, y = cnn_batches()[1]
    return x[:size], y[:size]


def test_deterministic_arguments_are_checked_before_anything_changes() -> None:
    model = SmallCNN()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match="deterministic must be a bool"):
        vflow.Executor(model, optimizer, cnn_loss, 4, deterministic=1)
    with pytest.raises(ValueError, match='deterministic must be False, True, "ordered" or'):
        vflow.Executor(model, optimizer, cnn_loss, 4, deterministic="tree")
    with pytest.raises(ValueError, match="accumulate_dtype must be torch.float32"):
        vflow.Executor(
            model, optimizer, cnn_loss, 4, deterministic="exact", accumulate_dtype=torch.float64
        )
    with pytest.raises(ValueError, match="at most 32767 virtual nodes"):
        vflow.Executor(model, optimizer, cnn_loss, 40000, deterministic="exact")
    wide = SmallCNN().double()
    with pytest.raises(ValueError, match="float64"):
        vflow.Executor(
            wide, torch.optim.SGD(wide.parameters(), lr=0.1), cnn_loss, 4, deterministic="exact"
        )
    # None of the failed constructions holds the model.
    with vflow.Executor(model, optimizer, cnn_loss, 4, deterministic=True) as ex:
        assert ex.deterministic == "ordered"


def test_ordered_accepts_float64() -> None:
    """The fixed tree adds in the accumulator's dtype, so float64 parameters and
    accumulate_dtype=torch.float64 are fine; the gradient matches the default path."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 4)).double()
    x = torch.randn(24, 8, dtype=torch.float64)
    batch = (x, x[:, :4].argmax(1))
    ordered = _reduced_gradient("ordered", model, batch, 6)
    default = _reduced_gradient(False, model, batch, 6)
    for a, b in zip(ordered, default, strict=True):
        assert a.dtype == torch.float64
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-15)
