"""PipelineExecutor on one process (stages=1, the reference every grid must match):
the step's gradient is the global batch's, for mean losses and for (sum, num_items)
losses with padding; dropout draws from the segments' streams; bad input is refused
before anything changes; the training state round-trips."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import vflow
from vflow.mapping import rng

V = 4
B = 16


def _model(seed: int = 0, dropout: float = 0.0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(6, 16),
        nn.Sequential(nn.Tanh(), nn.Dropout(dropout), nn.Linear(16, 16)),
        nn.Sequential(nn.Tanh(), nn.Dropout(dropout), nn.Linear(16, 3)),
    )


def _batch(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, 6, generator=g), torch.randint(0, 3, (B,), generator=g)


def _sgd(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=1.0)


def _adamw(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2)


def _mean_ce(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output, target)


def _executor(model: nn.Sequential, optimizer: Any = _sgd, **kwargs: Any) -> vflow.PipelineExecutor:
    kwargs.setdefault("virtual_nodes", V)
    return vflow.PipelineExecutor(model, optimizer, kwargs.pop("loss_fn", _mean_ce), **kwargs)


def _expected_step(loss_of_batch: Any) -> dict[str, torch.Tensor]:
    """One SGD step (lr 1) on the gradient of the whole batch's loss, by plain torch."""
    model = _model()
    loss_of_batch(model).backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= p.grad
    return model.state_dict()


def test_the_step_follows_the_gradient_of_the_global_batch_mean_loss() -> None:
    x, y = _batch()
    want = _expected_step(lambda m: F.cross_entropy(m(x), y))
    with _executor(_model()) as ex:
        result = ex.step(x, y)
        got = ex.stage_module.state_dict()
    assert result.num_items == B and result.step == 0
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(
        torch.tensor(result.loss), F.cross_entropy(_model()(x), y).detach(), rtol=1e-6, atol=0
    )


def test_summed_losses_are_normalised_by_the_global_item_count() -> None:
    x, y = _batch()
    y = y.clone()
    y[:5] = -100  # padding: all of VN 0's first samples and one of VN 1's
    want = _expected_step(lambda m: F.cross_entropy(m(x), y, ignore_index=-100))

    def summed(output: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        loss = F.cross_entropy(output, target, ignore_index=-100, reduction="sum")
        return loss, (target != -100).sum()

    with _executor(_model(), loss_fn=summed) as ex:
        result = ex.step(x, y)
        got = ex.stage_module.state_dict()
    assert result.num_items == B - 5
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-6)


def test_dropout_draws_from_the_segment_streams_and_leaves_the_callers_rng_alone() -> None:
    x, y = _batch()

    def trained(seed: int) -> dict[str, torch.Tensor]:
        with _executor(_model(dropout=0.5), _adamw, seed=seed) as ex:
            torch.manual_seed(123)
            for _ in range(2):
                ex.step(x, y)
            after = torch.rand(3)
            torch.manual_seed(123)
            assert torch.equal(after, torch.rand(3)), "the step moved the caller's generator"
            return copy.deepcopy(ex.stage_module.state_dict())

    first, again, other = trained(7), trained(7), trained(8)
    assert all(torch.equal(first[k], again[k]) for k in first)
    assert not all(torch.equal(first[k], other[k]) for k in first)


def test_each_segment_of_each_vn_reseeds_with_its_own_stream() -> None:
    seen: list[tuple[int, torch.Tensor]] = []
    x, y = _batch()
    with _executor(_model(), seed=3) as ex:
        for k, segment in enumerate(ex.stage_module):  # after the executor's own hooks
            segment.register_forward_pre_hook(
                lambda module, args, k=k: seen.append((k, torch.default_generator.get_state()))
            )
        ex.step(x, y)
    assert len(seen) == V * 3
    for position, (k, state) in enumerate(seen):
        vn = position // 3
        expected = torch.Generator().manual_seed(rng.vn_seed(3, 0, vn, rng.SEGMENT_STREAMS + k))
        assert torch.equal(state, expected.get_state()), (vn, k)


def _unchanged(ex: vflow.PipelineExecutor, before: dict[str, torch.Tensor]) -> None:
    after = ex.stage_module.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert ex.step_count == 0 and ex.optimizer.state_dict()["state"] == {}
    assert all(p.grad is None for p in ex.stage_module.parameters())


def test_a_failing_step_changes_nothing_and_the_next_one_works() -> None:
    x, y = _batch()
    calls = []

    def failing_on_vn_2(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("loss failed")
        return F.cross_entropy(output, target)

    with _executor(_model(), _adamw, loss_fn=failing_on_vn_2) as ex:
        before = copy.deepcopy(ex.stage_module.state_dict())
        with pytest.raises(RuntimeError, match="loss failed"):
            ex.step(x, y)
        _unchanged(ex, before)
        with pytest.raises(ValueError, match="inputs and targets disagree on B"):
            ex.step(x, y[:8])
        with pytest.raises(ValueError, match="every VN needs at least one"):
            ex.step(x[:3], y[:3])
        with pytest.raises(ValueError, match="targets is None on the last stage"):
            ex.step(x, None)
        with pytest.raises(ValueError, match=r"inputs has 5 samples: neither the global batch"):
            ex.step(x[:5], y, global_batch_size=B)
        with pytest.raises(TypeError, match="inputs must be a tensor or a tuple of tensors"):
            ex.step([x.tolist()], y)
        _unchanged(ex, before)
        ex.step(x, y)
        assert ex.step_count == 1


def test_max_grad_norm_clips_the_global_batchs_gradient_as_clip_grad_norm_does() -> None:
    x, y = _batch()

    def clipped(m: nn.Module) -> torch.Tensor:
        loss = F.cross_entropy(m(x), y)
        loss.backward()
        clipped.norm = float(torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05))
        return loss.detach().requires_grad_()  # _expected_step's backward adds nothing

    want = _expected_step(clipped)
    with _executor(_model(), max_grad_norm=0.05) as ex:
        result = ex.step(x, y)
        got = ex.stage_module.state_dict()
    assert result.grad_norm == pytest.approx(clipped.norm, rel=1e-5)
    assert result.grad_norm > 0.05  # it did clip
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-6)


def test_pre_step_hooks_run_before_clipping_and_may_not_replace_a_gradient() -> None:
    x, y = _batch()

    def doubled_then_clipped(m: nn.Module) -> torch.Tensor:
        loss = F.cross_entropy(m(x), y)
        loss.backward()
        for p in m.parameters():
            p.grad.mul_(2.0)  # type: ignore[union-attr]
        doubled_then_clipped.norm = float(torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05))
        return loss.detach().requires_grad_()

    want = _expected_step(doubled_then_clipped)
    with _executor(_model(), max_grad_norm=0.05) as ex:
        handle = ex.register_pre_step_hook(
            lambda e: [p.grad.mul_(2.0) for p in e.stage_module.parameters()]
        )
        result = ex.step(x, y)
        got = ex.stage_module.state_dict()
        # The norm is the hooked gradient's: the hook ran before clipping.
        assert result.grad_norm == pytest.approx(doubled_then_clipped.norm, rel=1e-5)
        for key in want:
            torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-6)
        handle.remove()

        def replacing(e: vflow.PipelineExecutor) -> None:
            first = next(e.stage_module.parameters())
            first.grad = torch.zeros_like(first)

        ex.register_pre_step_hook(replacing)
        before = copy.deepcopy(ex.stage_module.state_dict())
        with pytest.raises(RuntimeError, match="a pre-step hook replaced param.grad"):
            ex.step(x, y)
        after = ex.stage_module.state_dict()
        assert all(torch.equal(before[k], after[k]) for k in before) and ex.step_count == 1
        with pytest.raises(TypeError, match="fn must be callable"):
            ex.register_pre_step_hook(3)  # type: ignore[arg-type]


def test_vn_transform_draws_per_vn_alike_with_and_without_prefetch() -> None:
    x, y = _batch()
    seen: list[tuple[int, ...]] = []

    def jitter(inputs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        seen.append(tuple(inputs.shape))
        return inputs + 0.1 * torch.randn(inputs.shape, generator=generator)

    states = []
    for prefetch in (True, False):
        with _executor(_model(), _adamw, seed=2, prefetch=prefetch, vn_transform=jitter) as ex:
            ex.step(x, y)
            ex.step(x, y)
            states.append(copy.deepcopy(ex.stage_module.state_dict()))
    assert seen == [(B // V, 6)] * (4 * V)  # each VN's inputs, once a step
    assert all(torch.equal(states[0][k], states[1][k]) for k in states[0])
    with _executor(_model(), _adamw, seed=2) as plain:
        plain.step(x, y)
        plain.step(x, y)
        assert not all(
            torch.equal(states[0][k], v) for k, v in plain.stage_module.state_dict().items()
        )

    def dropping(inputs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        return inputs[1:]

    with _executor(_model(), vn_transform=dropping) as ex:
        before = copy.deepcopy(ex.stage_module.state_dict())
        with pytest.raises(ValueError, match="it must keep the number of samples"):
            ex.step(x, y)
        _unchanged(ex, before)


def test_amp_runs_the_forwards_and_the_loss_under_autocast() -> None:
    x, y = _batch()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        want = float(F.cross_entropy(_model()(x), y))
    with _executor(_model(), amp="bf16") as ex:
        result = ex.step(x, y)
    # The mean of the VNs' bf16 losses, each weighted 1/V: near the whole batch's.
    assert result.loss == pytest.approx(want, rel=2e-2)
    with torch.no_grad():
        full = float(F.cross_entropy(_model()(x), y))
    assert result.loss != pytest.approx(full, rel=1e-6, abs=0)


def test_fp16_loss_scaling_skips_an_overflowing_step_and_backs_off() -> None:
    x, y = _batch()
    scaler = vflow.LossScaler(init_scale=2.0**120, growth_interval=2)
    with _executor(_model(), _adamw, amp="fp16", loss_scale=scaler) as ex:
        before = copy.deepcopy(ex.stage_module.state_dict())
        first = ex.step(x, y)
        assert first.skipped and first.loss_scale == 2.0**120
        after = ex.stage_module.state_dict()
        assert all(torch.equal(before[k], after[k]) for k in before)
        assert ex.optimizer.state_dict()["state"] == {}
        scales, result = [], first
        while result.skipped:
            scales.append(result.loss_scale)
            result = ex.step(x, y)
        assert len(scales) > 1 and scales == [2.0**120 / 2**k for k in range(len(scales))]
        assert ex.skipped_steps == len(scales) and ex.state_dict()["loss_scaler"]["good_steps"] == 1


def test_infer_returns_the_models_outputs_in_batch_order_and_changes_nothing() -> None:
    x, y = _batch()
    with _executor(_model(dropout=0.5), _adamw, seed=3) as ex:
        ex.step(x, y)
        before = copy.deepcopy(ex.stage_module.state_dict())
        ex.stage_module.eval()
        got = ex.infer(x)
        with torch.no_grad():
            want = ex.stage_module(x)
        assert not got.requires_grad and ex.step_count == 1
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
        ex.stage_module.train()
        # Training mode: dropout draws from the VNs' streams, the same on every call.
        assert torch.equal(ex.infer(x), ex.infer(x)) and not torch.equal(ex.infer(x), got)
        after = ex.stage_module.state_dict()
        assert all(torch.equal(before[k], after[k]) for k in before) and ex.step_count == 1
        with pytest.raises(ValueError, match="inputs has 3 samples"):
            ex.infer(x[:3], global_batch_size=B)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"optimizer": torch.optim.SGD}, None, None),
        ({"amp": "fp8"}, ValueError, "amp must be None, 'bf16' or 'fp16', got 'fp8'"),
        ({"max_grad_norm": -1.0}, ValueError, "max_grad_norm must be a positive number"),
        ({"vn_transform": 3}, TypeError, "vn_transform must be callable or None"),
        ({"loss_fn": None}, ValueError, "loss_fn is None on the process holding the last stage"),
        ({"pipeline": 2}, ValueError, "stages=2 needs 2 processes"),
        ({"pipeline": "2"}, TypeError, "pipeline must be a vflow.Pipeline or a stage count"),
        ({"plan": vflow.Plan([2, 2])}, ValueError, "plan"),
        ({"plan": vflow.Plan(sizes=[[4, 4, 4, 4]])}, ValueError, "takes a counts plan"),
        ({"virtual_nodes": 0}, ValueError, "virtual_nodes must be"),
    ],
)
def test_bad_arguments_are_refused_before_the_model_changes(
    kwargs: dict, error: type | None, message: str | None
) -> None:
    model = _model()
    before = copy.deepcopy(model.state_dict())
    if error is None:  # an optimizer class builds one: it is a factory of params
        with _executor(model, **kwargs) as ex:
            assert isinstance(ex.optimizer, torch.optim.SGD)
        return
    with pytest.raises(error, match=message):
        _executor(model, **kwargs)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) and after[k].device.type == "cpu" for k in before)


def test_an_optimizer_instance_is_refused_since_each_stage_builds_its_own() -> None:
    model = _model()
    with pytest.raises(TypeError, match="optimizer must be a function params"):
        _executor(model, torch.optim.SGD(model.parameters(), lr=0.1))


def test_the_state_resumes_bit_for_bit() -> None:
    batches = [_batch(seed) for seed in range(4)]

    def run(resume_at: int | None) -> dict[str, torch.Tensor]:
        ex = _executor(_model(dropout=0.2), _adamw, seed=5, deterministic=True)
        for step, (x, y) in enumerate(batches):
            if step == resume_at:
                state = copy.deepcopy(ex.state_dict())
                ex.close()
                ex = _executor(_model(seed=9, dropout=0.2), _adamw, deterministic=True)
                ex.load_state_dict(state)
                assert (ex.step_count, ex.seed) == (resume_at, 5)
            ex.step(x, y)
        state = ex.state_dict()
        ex.close()
        return {
            **state["model"],
            **{f"opt.{k}": v["exp_avg"] for k, v in state["optimizer"]["state"].items()},
        }

    straight, resumed = run(None), run(2)
    assert straight.keys() == resumed.keys()
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)


def test_a_state_of_another_model_is_refused_before_anything_changes() -> None:
    with _executor(_model(), _adamw) as ex:
        state = ex.state_dict()
    wider = nn.Sequential(nn.Linear(6, 16), nn.Sequential(nn.Tanh(), nn.Linear(16, 3)))
    with _executor(wider, _adamw) as other:
        before = copy.deepcopy(other.stage_module.state_dict())
        with pytest.raises(ValueError, match="model"):
            other.load_state_dict(state)
        with pytest.raises(ValueError, match="not a vflow pipeline state"):
            other.load_state_dict({"format": "vflow.executor"})
    with _executor(_model(), _adamw) as same:
        larger = {**state, "model": {**state["model"], "3.weight": torch.zeros(3, 3)}}
        with pytest.raises(
            ValueError, match=r"entries of no segment of this model, \['3.weight'\]"
        ):
            same.load_state_dict(larger)
        same.load_state_dict(state)
        after = other.stage_module.state_dict()
        assert all(torch.equal(before[k], after[k]) for k in before)


def test_signal_words_travel_with_the_next_step_only() -> None:
    ex = _executor(_model())
    ex.signal(5)
    assert ex.step(*_batch()).signals == (5,)
    assert ex.step(*_batch()).signals == (0,)  # reset once a step succeeded
    ex.signal(lambda: 3)  # read when the step sends its losses
    assert ex.step(*_batch()).signals == (3,)
    for bad in (-1, 2**31, True, 1.5):
        with pytest.raises(ValueError, match="word must be an int in"):
            ex.signal(bad)
    ex.close()


def test_a_detached_stage_builds_but_does_not_train() -> None:
    """Note [Building a stage ahead]: stage 1 of 3 built alone holds only its segment."""
    grid = vflow.pipeline.ProcessGrid.detached(3, 1)
    assert grid.is_detached and (grid.stage, grid.stages, grid.replicas) == (1, 3, 1)
    ex = _executor(_model(), pipeline=3, grid=grid)
    assert list(ex.stage_module.state_dict()) == ["1.2.weight", "1.2.bias"]
    with pytest.raises(RuntimeError, match=r"holds stage 1 of 3 but has no grid yet"):
        ex.step(None, None, global_batch_size=B)
    with pytest.raises(RuntimeError, match="has no grid yet"):
        ex.infer(None, global_batch_size=B)
    assert ex.step_count == 0
    ex.close()


@pytest.mark.parametrize(
    ("stages", "stage", "error"),
    [
        (1, 0, "stages must be >= 2"),
        (2, 2, r"stage must be in \[0, 2\)"),
        (2, -1, r"stage must be in \[0, 2\)"),
        (2.0, 0, "stages must be an int"),
        (2, True, "stage must be an int"),
    ],
)
def test_bad_detached_stages_are_refused(stages: Any, stage: Any, error: str) -> None:
    with pytest.raises((TypeError, ValueError), match=error):
        vflow.pipeline.ProcessGrid.detached(stages, stage)


def test_abort_group_alone_keeps_the_state_and_the_next_step_works() -> None:
    ex, reference = _executor(_model()), _executor(_model())
    ex.step(*_batch())
    reference.step(*_batch())
    ex.abort_group()
    assert ex.grid == vflow.pipeline.ProcessGrid.alone() and ex.step_count == 1
    ex.step(*_batch(2))
    reference.step(*_batch(2))
    for name, value in reference.stage_module.state_dict().items():
        assert torch.equal(ex.stage_module.state_dict()[name], value), name
    ex.close()
    reference.close()


def test_a_grid_with_a_stage_behind_every_other_cannot_catch_up() -> None:
    """Note [Catching up on a grid]: each stage needs a process at the highest step."""
    from vflow.pipeline.executor import _check_every_stage_caught_up

    two_by_two = vflow.pipeline.ProcessGrid(2, 2, True, 0, 0, None, None, None)
    # (member, step count, stage) by grid rank: stage 1 has a process at step 4.
    _check_every_stage_caught_up([[1, 4, 0], [1, 3, 1], [1, 3, 0], [1, 4, 1]], two_by_two)
    _check_every_stage_caught_up([[0, 0, 0], [0, 0, 1], [0, 0, 0], [0, 0, 1]], two_by_two)
    # Newcomers (member 0) do not count: only stage 0's members reached step 4.
    with pytest.raises(ValueError, match=r"stage\(s\) \[1\] of the grid have no process at step 4"):
        _check_every_stage_caught_up([[1, 4, 0], [1, 3, 1], [1, 4, 0], [0, 0, 1]], two_by_two)
