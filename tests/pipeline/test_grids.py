"""PipelineExecutor over grids of replicas x stages (4 Gloo processes): every grid —
2 replicas x 2 stages, 1 x 4, 4 x 1, an uneven plan, GPipe and 1F1B, summed losses —
trains bitwise the model that stages=1 trains on one process in deterministic mode,
and within 1e-6 (relative 2-norm per tensor) by default; a job moved from 2 replicas
to 1 and back to 2 (the newcomer replica starting from other weights) ends the same;
a checkpoint written by one grid resumes on another and on one process; bad grids
are refused on every process. The scenarios share one spawn of the 4 processes,
since starting processes dominates the cost."""

from __future__ import annotations

import collections
import copy
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import vflow
from vflow.pipeline import ProcessGrid
from vflow.world.launch import run_ranks

if not (dist.is_available() and dist.is_gloo_available()):
    pytest.skip("needs torch.distributed with Gloo", allow_module_level=True)

pytestmark = pytest.mark.slow

V = 6
B = 24
STEPS = 4
SEED = 11


def _model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        collections.OrderedDict(
            embed=nn.Linear(6, 16),
            # No bias before BatchNorm: its gradient is rounding noise, which AdamW blows up.
            block0=nn.Sequential(nn.Tanh(), nn.Dropout(0.3), nn.Linear(16, 16, bias=False)),
            norm=nn.BatchNorm1d(16),
            block1=nn.Sequential(nn.Tanh(), nn.Dropout(0.3), nn.Linear(16, 16)),
            head=nn.Linear(16, 3),
        )
    )


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    out = []
    for step in range(STEPS):
        g = torch.Generator().manual_seed(100 + step)
        out.append((torch.randn(B, 6, generator=g), torch.randint(0, 3, (B,), generator=g)))
    return out


def _mean_ce(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output, target)


def _summed_ce(output: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    target = torch.where(target == 2, torch.full_like(target, -100), target)  # padding
    return F.cross_entropy(output, target, reduction="sum", ignore_index=-100), (target >= 0).sum()


def _executor(grid: ProcessGrid | None, stages: int = 1, **kwargs: Any) -> vflow.PipelineExecutor:
    hook = kwargs.pop("pre_step_hook", None)
    ex = vflow.PipelineExecutor(
        _model(kwargs.pop("model_seed", 0)).to(kwargs.pop("dtype", torch.float32)),
        lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1),
        kwargs.pop("loss_fn", _mean_ce),
        kwargs.pop("virtual_nodes", V),
        seed=SEED,
        pipeline=vflow.Pipeline(stages, schedule=kwargs.pop("schedule", "1F1B")),
        grid=grid,
        buffer_rule="mean",
        timeout=kwargs.pop("timeout", 60),
        **kwargs,
    )
    if hook is not None:
        ex.register_pre_step_hook(hook)
    return ex


def _amplify_the_embedding(ex: vflow.PipelineExecutor) -> None:
    """A pre-step hook that changes one stage's gradient (on the stage holding it)."""
    for name, p in ex.stage_module.named_parameters():
        if name.startswith("embed."):
            p.grad.mul_(3.0)  # type: ignore[union-attr]


def _encoded() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The batches with their inputs stored twice over (12 features): ``_decode`` takes
    the first 6, so the inputs the first segment takes are not the ones given."""
    return [(torch.cat([x, x], dim=1), y) for x, y in _batches()]


def _decode(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """A vn_transform that changes the inputs' shape and draws from the VN's generator."""
    kept = x[:, :6]
    return kept + 0.05 * torch.randn(kept.shape, generator=generator)


def _train(
    ex: vflow.PipelineExecutor, steps: range, shares: bool = False, encoded: bool = False
) -> list[float]:
    """``shares``: each process is given only what it uses of its replica's share (Note
    [Data per replica]): inputs on the first stage, targets on the last, nothing between.
    ``encoded``: the batches of ``_encoded``."""
    batches = _encoded() if encoded else _batches()
    dtype = next(ex.stage_module.parameters()).dtype
    losses = []
    for step in steps:
        x, y = batches[step][0].to(dtype), batches[step][1]
        if shares:
            start, stop = ex.plan.worker_range(ex.grid.replica, B)
            x = x[start:stop] if ex.grid.is_first else None
            y = y[start:stop] if ex.grid.is_last else None
            losses.append(ex.step(x, y, global_batch_size=B).loss)
        else:
            losses.append(ex.step(x, y).loss)
    return losses


def _finish(ex: vflow.PipelineExecutor) -> dict[str, Any]:
    state = ex.full_state_dict()
    ex.close()
    return state


def _reference(loss_fn: Any = _mean_ce, deterministic: Any = True) -> dict[str, Any]:
    return _reference_of(_batches(), loss_fn, deterministic)


def _reference_of(
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    loss_fn: Any = _mean_ce,
    deterministic: Any = True,
    virtual_nodes: int = V,
    dtype: torch.dtype = torch.float32,
    **kwargs: Any,
) -> dict[str, Any]:
    """stages=1 on one process, one intra-op thread like the ranks."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ex = _executor(
            None,
            loss_fn=loss_fn,
            deterministic=deterministic,
            virtual_nodes=virtual_nodes,
            dtype=dtype,
            **kwargs,
        )
        for x, y in batches:
            ex.step(x.to(dtype), y)
        return _finish(ex)
    finally:
        torch.set_num_threads(threads)


# ---- the scenarios, on every rank of 4 -------------------------------------------------


def _profiles(ex: vflow.PipelineExecutor) -> dict[str, Any]:
    """The last step's profile on this process: its VNs and the bubble (time in the
    schedule not spent computing its VNs)."""
    result = ex.last_result
    assert result is not None
    profile = result.profile
    return {
        "vns": [v.vn for v in profile.vns],
        "timed": all(v.forward_s > 0 and v.backward_s > 0 for v in profile.vns),
        "bubble_s": result.timings.forward_backward - profile.compute_s,
    }


def _fixed_grids(rank: int, world_size: int) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for name, stages, kwargs in (
        ("2x2 1F1B", 2, {"deterministic": True}),
        (
            "2x2 GPipe, plan [4, 2]",
            2,
            {"deterministic": True, "schedule": "GPipe", "plan": vflow.Plan([4, 2])},
        ),
        ("1x4", 4, {"deterministic": True}),
        ("4x1", 1, {"deterministic": True}),
        ("2x2 summed losses", 2, {"deterministic": True, "loss_fn": _summed_ce}),
        ("2x2 exact", 2, {"deterministic": "exact"}),
        ("2x2 default", 2, {}),
        # bf16 parameters and activations, gradients accumulated in float32.
        ("2x2 bf16", 2, {"deterministic": True, "dtype": torch.bfloat16}),
        *((name, 2, {"deterministic": True, **kwargs}) for name, kwargs in _FEATURES.items()),
        (
            "2x2 data per replica, plan [4, 2]",
            2,
            {"deterministic": True, "plan": vflow.Plan([4, 2])},
        ),
    ):
        ex = _executor(ProcessGrid.of(stages), stages, **kwargs)
        losses = _train(ex, range(STEPS), "per replica" in name, "vn_transform" in name)
        profile = _profiles(ex)
        norm = ex.last_result.grad_norm  # type: ignore[union-attr]
        outputs = None
        if name in _INFERRED:
            ex.stage_module.eval()
            outputs = (ex.infer(_batches()[0][0]), ex.infer(_batches()[0][0], gather=False))
            ex.stage_module.train()
        local = ex.state_dict()  # this stage's own, no collective
        own = list(ex.stage_module.state_dict())
        results[name] = {"state": _finish(ex), "losses": losses, "profile": profile}
        # (An optimizer that never stepped, fp16's while it skips, has no state.)
        results[name]["local"] = list(local["model"]) == own and set(
            local["optimizer"]["state"]
        ) <= {n for n, _ in ex.stage_module.named_parameters()}
        results[name]["norms"] = [norm]
        results[name]["outputs"] = outputs
    return results


# Executor features on grids, each against the same settings on one process.
_FEATURES: dict[str, dict[str, Any]] = {
    "2x2 max_grad_norm": {"max_grad_norm": 0.3},
    # The hook runs before clipping: the grid's norm is of the amplified gradient.
    "2x2 pre-step hook, max_grad_norm": {
        "max_grad_norm": 0.3,
        "pre_step_hook": _amplify_the_embedding,
    },
    "2x2 amp bf16": {"amp": "bf16"},
    # Inputs decoded and jittered per VN, into another shape than the schedule is given.
    "2x2 vn_transform": {"vn_transform": _decode},
    # A scale that grows every good step until it overflows fp16 (the second step): the
    # grid skips that step as one, backs off, and steps again.
    "2x2 amp fp16": {"amp": "fp16", "loss_scale": vflow.LossScaler(2.0**18, growth_interval=1)},
}


# Grids whose trained model also infers, against the model trained on one process.
_INFERRED = ("2x2 1F1B", "1x4", "4x1")


def _moved(rank: int, world_size: int, checkpoint: str) -> dict[str, Any]:
    """2 replicas x 2 stages for a step, then replica 0 alone, then both again; the
    replica that comes back is new, its model from other weights: its stage 0 constructs
    its executor on the grid, its stage 1 builds it ahead on a detached stage and joins
    with ``reconfigure(newcomer=True)`` (Note [Building a stage ahead]). In the last
    step every process signals its rank + 1."""
    full = ProcessGrid.of(2)
    ex = _executor(full, 2, deterministic=True)
    _train(ex, range(1))
    vflow.pipeline.save(checkpoint, ex)
    half = ProcessGrid.of(2, [0, 1])
    if rank < 2:
        ex.reconfigure(half)
        assert (ex.grid.replicas, ex.plan) == (1, vflow.Plan([6]))
        _train(ex, range(1, 3))
    else:
        ex.close()
    again = ProcessGrid.of(2)
    refused = None
    if rank < 2:
        ex.reconfigure(again)
    elif rank == 2:
        ex = _executor(again, 2, deterministic=True, model_seed=99)
    else:
        ex = _executor(ProcessGrid.detached(2, 1), 2, deterministic=True, model_seed=99)
        try:
            _train(ex, range(3, 4))
        except RuntimeError as e:
            refused = str(e)
        ex.reconfigure(again, newcomer=True)
    assert ex.step_count == 3
    _train(ex, range(3, STEPS - 1))
    ex.signal(rank + 1)
    _train(ex, range(STEPS - 1, STEPS))
    signals = ex.last_result.signals  # type: ignore[union-attr]
    moved = _finish(ex)

    # The checkpoint of step 1, written by 2 x 2, resumed by 1 replica of 2 stages.
    resumed = None
    pair = ProcessGrid.of(2, [2, 3])
    if rank >= 2:
        ex = _executor(pair, 2, deterministic=True, model_seed=5)
        vflow.pipeline.load(checkpoint, ex)
        _train(ex, range(1, STEPS))
        resumed = _finish(ex)
    return {"moved": moved, "resumed": resumed, "signals": signals, "refused": refused}


def _refused(rank: int, world_size: int) -> list[str]:
    errors = []
    for attempt in (
        lambda: ProcessGrid.of(3),
        lambda: ProcessGrid.of(2, [1, 0, 2, 3]),
        lambda: _executor(ProcessGrid.of(2), 2, plan=vflow.Plan([5, 1])),
        lambda: _executor(ProcessGrid.of(2), 4),
    ):
        with pytest.raises(ValueError) as caught:
            attempt()
        errors.append(str(caught.value))
    # One process's refusal reaches the others at once, not after their timeout.
    started = time.monotonic()
    with pytest.raises(ValueError) as caught:
        _executor(ProcessGrid.of(2), 2, loss_fn=None if rank % 2 else _mean_ce)
    errors.append(str(caught.value) if time.monotonic() - started < 30 else "too late")
    # A batch whose VNs differ in size cannot be a schedule's microbatches: refused
    # before anything changes, and the next step runs.
    ex = _executor(ProcessGrid.of(2), 2, deterministic=True)
    before = {k: v.clone() for k, v in ex.stage_module.state_dict().items()}
    x, y = _batches()[0]
    with pytest.raises(ValueError) as caught:
        ex.step(x[:22], y[:22])
    errors.append(str(caught.value))
    after = ex.stage_module.state_dict()
    assert ex.step_count == 0 and all(torch.equal(before[k], after[k]) for k in before)
    ex.step(x, y)
    # Another B that splits into equal VNs: the stages infer their shapes again.
    ex.step(x[:12], y[:12])
    assert ex.step_count == 2
    ex.close()
    return errors


FAIL_TIMEOUT_S = 5.0


def _failing(rank: int, world_size: int) -> dict[str, Any]:
    """2 x 2; replica 0's last stage raises in its third VN's loss of step 1. It stays
    alive (sleeping past the others' timeout), so the others learn nothing but silence."""
    calls = [0]

    def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        calls[0] += 1
        if rank == 1 and calls[0] == 1 + V // 2 + 3:  # shape inference, step 0, 3rd VN
            raise ValueError("the loss failed")
        return _mean_ce(output, target)

    grid = ProcessGrid.of(2, timeout=FAIL_TIMEOUT_S)
    ex = _executor(grid, 2, deterministic=True, loss_fn=loss_fn, timeout=FAIL_TIMEOUT_S)
    x, y = _batches()[0]
    ex.step(x, y)
    before = {k: v.clone() for k, v in ex.stage_module.state_dict().items()}
    optimizer = copy.deepcopy(ex.optimizer.state_dict())
    started = time.monotonic()
    try:
        ex.step(x, y)
        outcome = "no error"
    except Exception as e:
        outcome = type(e).__name__ + ": " + str(e)
    waited = time.monotonic() - started
    after = ex.stage_module.state_dict()
    unchanged = (
        all(torch.equal(before[k], after[k]) for k in before)
        and ex.step_count == 1
        and str(ex.optimizer.state_dict()) == str(optimizer)
    )
    if rank == 1:
        time.sleep(2 * FAIL_TIMEOUT_S)
    return {"outcome": outcome, "waited": waited, "unchanged": unchanged}


def test_an_error_in_one_stage_fails_the_step_on_every_process_as_a_collective_error() -> None:
    results = [r.value for r in run_ranks(4, _failing, timeout=120)]
    assert results[1]["outcome"] == "ValueError: the loss failed"
    for rank in (0, 2, 3):
        outcome = results[rank]["outcome"]
        assert outcome.startswith("CollectiveError: vflow step 1: "), (rank, outcome)
        # Within the timeout (and the time to notice it), not at the backend's 30 min.
        assert results[rank]["waited"] < FAIL_TIMEOUT_S + 20, (rank, results[rank]["waited"])
    assert "pipeline's sends and receives" in results[0]["outcome"]
    assert "all-reduce of the VN losses" in results[2]["outcome"]
    assert all(r["unchanged"] for r in results)


def _assert_same(got: dict[str, Any], want: dict[str, Any], exact: bool, where: str) -> None:
    assert got["step_count"] == want["step_count"], where
    assert list(got["model"]) == list(want["model"]), where
    pairs = [(f"model[{k}]", got["model"][k], v) for k, v in want["model"].items()]
    for name, entries in want["optimizer"]["state"].items():
        pairs += [
            (f"optimizer[{name}][{key}]", got["optimizer"]["state"][name][key], value)
            for key, value in entries.items()
        ]
    for name, a, b in pairs:
        if exact or not b.is_floating_point():
            assert torch.equal(a, b), f"{where}: {name} differs"
        else:
            error = float((a.double() - b.double()).norm() / max(float(b.double().norm()), 1e-30))
            assert error <= 1e-6, f"{where}: {name} differs by {error:.2e} (relative 2-norm)"


def test_every_grid_trains_the_single_process_model() -> None:
    results = [r.value for r in run_ranks(4, _fixed_grids, timeout=300)]
    ordered, summed = _reference(), _reference(_summed_ce)
    for name, outcome in results[0].items():
        want = summed if "summed" in name else ordered
        exact = "default" not in name and "exact" not in name
        if "exact" in name:
            want = _reference(deterministic="exact")
        if name == "2x2 bf16":
            want = _reference_of(_batches(), dtype=torch.bfloat16)
        if name in _FEATURES:
            batches = _encoded() if "vn_transform" in name else _batches()
            want = _reference_of(batches, **copy.deepcopy(_FEATURES[name]))
        _assert_same(outcome["state"], want, exact, name)
        # Every process reports the same global loss, whichever stage it holds.
        assert all(r[name]["losses"] == outcome["losses"] for r in results), name
        assert all(r[name]["state"]["step_count"] == STEPS for r in results), name
        assert all(r[name]["local"] for r in results), name
    # Inference on the grid: the last stages return the whole batch's outputs, the
    # bits of the one-process executor's; the others return None.
    alone = _executor(None)
    alone.load_state_dict(ordered)
    alone.stage_module.eval()
    want = alone.infer(_batches()[0][0])
    alone.close()
    for name, stages in zip(_INFERRED, (2, 4, 1), strict=True):
        for rank, r in enumerate(results):
            gathered, own = r[name]["outputs"]
            if rank % stages != stages - 1:
                assert gathered is None and own is None, (name, rank)
                continue
            assert torch.equal(gathered, want), (name, rank)
            start, stop = vflow.Plan.even(V, 4 // stages).worker_range(rank // stages, B)
            assert torch.equal(own, want[start:stop]), (name, rank)
    # fp16: a step skipped and the others taken, alike everywhere.
    fp16 = results[0]["2x2 amp fp16"]["state"]
    assert 0 < fp16["skipped_steps"] < STEPS and fp16["optimizer"]["state"]
    assert all(r["2x2 amp fp16"]["state"]["loss_scaler"] == fp16["loss_scaler"] for r in results)
    clipped = [r["2x2 max_grad_norm"]["norms"] for r in results]
    assert all(n == clipped[0] for n in clipped) and all(n > 0.3 for n in clipped[0])

    # Per-VN, per-stage profiles: each process times the VNs of its replica.
    for rank, by_grid in enumerate(results):
        profile = by_grid["2x2 1F1B"]["profile"]
        assert profile["vns"] == ([0, 1, 2] if rank < 2 else [3, 4, 5]) and profile["timed"]
        assert by_grid["1x4"]["profile"]["vns"] == list(range(V))
        # Stage 3 of 4 waits for the 3 stages before it: the bubble is visible there.
        assert by_grid["1x4"]["profile"]["bubble_s"] > 0


def test_replicas_leave_and_come_back_and_checkpoints_move_between_grids(tmp_path: Path) -> None:
    checkpoint = str(tmp_path / "step1.pt")
    results = [r.value for r in run_ranks(4, _moved, checkpoint, timeout=300)]
    want = _reference()
    for rank, outcome in enumerate(results):
        _assert_same(outcome["moved"], want, True, f"2 -> 1 -> 2 replicas, rank {rank}")
        assert outcome["signals"] == (1, 2, 3, 4), (rank, outcome["signals"])
    assert "has no grid yet" in results[3]["refused"], results[3]["refused"]
    for rank in (2, 3):
        _assert_same(results[rank]["resumed"], want, True, f"2x2's checkpoint on 1x2, rank {rank}")

    # ... and on one process without a pipeline.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ex = _executor(None, deterministic=True, model_seed=7)
        vflow.pipeline.load(checkpoint, ex)
        assert ex.step_count == 1
        _train(ex, range(1, STEPS))
        _assert_same(_finish(ex), want, True, "2x2's checkpoint on one process")
    finally:
        torch.set_num_threads(threads)


def test_bad_grids_are_refused_on_every_process() -> None:
    results = [r.value for r in run_ranks(4, _refused, timeout=120)]
    assert all(r[:4] + r[5:] == results[0][:4] + results[0][5:] for r in results)
    for rank, result in enumerate(results):
        assert result[4] == (
            "loss_fn is None on the process holding the last stage (stage 1, replica "
            f"{rank // 2}): the loss runs there"
            if rank % 2
            else "process(es) [1, 3] of the grid refused their PipelineExecutor arguments "
            "(their own errors say why); nothing was changed"
        )
    grid, unordered, vns, stages, _, batch = results[0]
    assert unordered == "ranks must be in increasing order, got [1, 0, 2, 3]"
    assert "a global batch of 22 samples does not split into virtual_nodes=6 VNs of one" in batch
    assert "stages=3 does not divide the grid's 4 processes" in grid
    assert 'schedule="1F1B" needs at least stages=2 VNs (microbatches) per replica' in vns
    assert "grid has 2 stages per replica but pipeline.stages is 4" in stages


def test_the_full_state_keeps_the_unsplit_models_names() -> None:
    state = _reference()
    assert list(state["model"]) == list(_model().state_dict())
    assert set(state["optimizer"]["state"]) == {n for n, _ in _model().named_parameters()}
    copy.deepcopy(state)  # plain tensors and containers
