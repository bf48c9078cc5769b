"""vflow.Executor on one worker: the step's gradient is the global-batch gradient."""

import copy

import pytest
import torch

import vflow
from tests.support import models
from tests.support.cuda_marks import requires_cuda
from tests.support.models import max_relative_error
from tests.support.seeds import expected_seed


def _run_step(model, loss_fn, batch, v, **kwargs):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with vflow.Executor(model, opt, loss_fn, virtual_nodes=v, seed=7, **kwargs) as ex:
        result = ex.step(batch)
        grads = [p.grad.clone() for p in model.parameters()]
    return result, grads


@pytest.mark.parametrize("v", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("b", [32, 37])
def test_mean_loss_gradient_matches_float64_big_batch(v, b):
    model = models.mlp()
    batch = models.classification_data(b)
    want = models.float64_grads(model, models.mean_ce, batch)
    before = [p.detach().clone() for p in model.parameters()]
    result, grads = _run_step(model, models.mean_ce, batch, v)
    assert max_relative_error(grads, want) <= 1e-5
    # The optimizer stepped once with that gradient.
    for p, p0, g in zip(model.parameters(), before, want):
        torch.testing.assert_close(p.detach().double(), p0.double() - 0.1 * g, rtol=0, atol=1e-6)
    ref_loss = models.mean_ce(
        copy.deepcopy(models.mlp()).double(), (batch[0].double(), batch[1])
    ).item()
    assert result.loss == pytest.approx(ref_loss, rel=1e-6)
    assert result.num_items == b and result.step == 0 and not result.skipped


@pytest.mark.parametrize("v", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("b", [24, 29])
def test_summed_loss_is_normalised_by_global_item_count(v, b):
    model = models.TokenModel()
    batch = models.padded_tokens(b)
    want = models.float64_grads(model, models.token_sum_loss, batch)
    result, grads = _run_step(model, models.token_sum_loss, batch, v)
    assert max_relative_error(grads, want) <= 1e-5
    assert result.num_items == batch[2].sum().item()
    if v > 1:
        # The common gradient-accumulation bug — averaging per-VN token means — is
        # measurably different here, so this test would catch it.
        naive = [torch.zeros_like(g) for g in want]
        for vn_batch in zip(*(torch.tensor_split(t, v) for t in batch)):
            vn_grads = models.float64_grads(model, models.token_sum_loss, vn_batch)
            for acc, g in zip(naive, vn_grads):
                acc += g / v
        assert max_relative_error(naive, want) > 1e-3


def _bf16_error(model, batch, use_vflow: bool, v: int) -> float:
    want = models.float64_grads(model, models.mean_ce, batch)
    if use_vflow:
        _, grads = _run_step(copy.deepcopy(model), models.mean_ce, batch, v, amp="bf16")
    else:
        m = copy.deepcopy(model)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = models.mean_ce(m, batch)
        loss.backward()
        grads = [p.grad for p in m.parameters()]
    return max_relative_error(grads, want)


@pytest.mark.parametrize("v", [2, 4])
def test_bf16_autocast_error_within_twice_torch_own(v):
    model = models.mlp()
    batch = models.classification_data(64)
    torch_error = _bf16_error(model, batch, use_vflow=False, v=v)
    vflow_error = _bf16_error(model, batch, use_vflow=True, v=v)
    assert torch_error > 1e-4  # bf16 is really in play
    assert vflow_error <= 2 * torch_error


def test_bf16_parameters_accumulate_in_float32():
    model = models.mlp(dtype=torch.bfloat16)
    batch = (models.classification_data(64)[0].bfloat16(), models.classification_data(64)[1])
    want = models.float64_grads(model, models.mean_ce, batch)
    m = copy.deepcopy(model)
    models.mean_ce(m, batch).backward()
    torch_error = max_relative_error([p.grad for p in m.parameters()], want)
    _, grads = _run_step(copy.deepcopy(model), models.mean_ce, batch, 8)
    assert all(g.dtype == torch.bfloat16 for g in grads)
    assert max_relative_error(grads, want) <= 2 * torch_error


@pytest.mark.parametrize("rule", ["vn0", "mean"])
def test_batchnorm_and_dropout_behave_as_separate_devices(rule):
    v, b = 3, 20
    model = models.bn_net()
    g = torch.Generator().manual_seed(3)
    batch = (torch.randn(b, 2, 5, 5, generator=g), torch.randint(0, 4, (b,), generator=g))
    seeds = [expected_seed(7, 0, i) for i in range(v)]
    want, states = models.per_vn_reference(model, models.mean_ce, batch, v, seeds)
    _, grads = _run_step(model, models.mean_ce, batch, v, buffer_rule=rule)
    assert max_relative_error(grads, want) <= 1e-5
    bn = model[1]
    if rule == "vn0":
        expected_mean = states[0]["1.running_mean"]
        expected_var = states[0]["1.running_var"]
    else:
        expected_mean = torch.stack([s["1.running_mean"] for s in states]).mean(0)
        expected_var = torch.stack([s["1.running_var"] for s in states]).mean(0)
    torch.testing.assert_close(bn.running_mean, expected_mean)
    torch.testing.assert_close(bn.running_var, expected_var)
    assert bn.num_batches_tracked.item() == 1


def test_dropout_draws_depend_on_seed_step_and_vn_only():
    model = models.bn_net()
    batch = (torch.randn(12, 2, 5, 5), torch.randint(0, 4, (12,)))
    results = []
    for _ in range(2):
        m = copy.deepcopy(model)
        torch.manual_seed(999)  # the caller's RNG state must not matter
        _, grads = _run_step(m, models.mean_ce, batch, 4)
        results.append(grads)
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_caller_rng_state_is_preserved():
    model = models.bn_net()
    batch = (torch.randn(12, 2, 5, 5), torch.randint(0, 4, (12,)))
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    _run_step(model, models.mean_ce, batch, 4)
    assert torch.equal(torch.rand(3), expected)


def test_infer_equals_plain_forward():
    model = models.bn_net().eval()
    x = torch.randn(37, 2, 5, 5)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with vflow.Executor(model, opt, models.mean_ce, virtual_nodes=5) as ex:
        out = ex.infer(x)
        pair = ex.infer((x,), forward_fn=lambda m, b: {"logits": m(b[0]), "x": b[0]})
    torch.testing.assert_close(out, model(x), rtol=1e-6, atol=1e-6)
    assert torch.equal(pair["x"], x)


def test_grads_are_views_into_flat_buffer_and_steps_count():
    model = models.mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batch = models.classification_data(16)
    with vflow.Executor(model, opt, models.mean_ce, virtual_nodes=4) as ex:
        for step in range(3):
            result = ex.step(batch)
            assert result.step == step
            assert all(
                t >= 0
                for t in (
                    result.timings.forward_backward,
                    result.timings.reduce,
                    result.timings.optimizer,
                )
            )
        flat = ex.grad_buffers[0].data
        lo, hi = flat.data_ptr(), flat.data_ptr() + flat.numel() * 4
        for p in model.parameters():
            assert lo <= p.grad.data_ptr() < hi
        assert ex.step_count == 3


def test_grad_clipping_matches_torch():
    model = models.mlp()
    batch = models.classification_data(32)
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    models.mean_ce(ref, batch).backward()
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
    ref_opt.step()
    result, _grads = _run_step(model, models.mean_ce, batch, 4, max_grad_norm=0.05)
    assert result.grad_norm == pytest.approx(ref_norm.item(), rel=1e-5)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_unused_parameter_counts_as_zero():
    class Partial(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.used = torch.nn.Linear(6, 4)
            self.unused = torch.nn.Linear(6, 4)

        def forward(self, x):
            return self.used(x)

    model = Partial()
    batch = models.classification_data(16)
    _, grads = _run_step(model, models.mean_ce, batch, 4)
    assert grads[2].eq(0).all() and grads[3].eq(0).all()
    assert grads[0].abs().sum() > 0


def test_fp16_loss_scaling_skips_overflowing_step_and_recovers(caplog):
    model = models.mlp()
    batch = models.classification_data(32)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    scaler = vflow.LossScaler(init_scale=2.0**100, growth_interval=1)
    with vflow.Executor(
        model, opt, models.mean_ce, virtual_nodes=4, amp="fp16", loss_scale=scaler
    ) as ex:
        with caplog.at_level("WARNING", logger="vflow"):
            result = ex.step(batch)
        assert result.skipped and result.loss_scale == 2.0**100
        assert "vflow step 0: inf/NaN in the gradients, optimizer step skipped" in caplog.text
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
        assert scaler.scale == 2.0**99 and ex.skipped_steps == 1
        scaler.scale = 2.0**8
        result = ex.step(batch)
        assert not result.skipped and result.loss_scale == 2.0**8
        assert scaler.scale == 2.0**9  # grows after growth_interval good steps
    assert any(not torch.equal(p, q) for p, q in zip(model.parameters(), before))


def test_fp16_step_matches_reference_within_fp16_tolerance():
    model = models.mlp()
    batch = models.classification_data(32)
    want = models.float64_grads(model, models.mean_ce, batch)
    _, grads = _run_step(model, models.mean_ce, batch, 4, amp="fp16")
    assert max_relative_error(grads, want) <= 5e-3


def test_nonfinite_gradient_skips_step_when_requested():
    model = models.mlp()
    batch = models.classification_data(16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]

    def nan_loss(m, b):
        return models.mean_ce(m, b) * torch.tensor(float("nan"))

    with vflow.Executor(model, opt, nan_loss, virtual_nodes=2, skip_nonfinite=True) as ex:
        result = ex.step(batch)
    assert result.skipped
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))


def test_user_backward_outside_vflow_is_untouched_and_close_removes_hooks():
    model = models.mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batch = models.classification_data(16)
    ex = vflow.Executor(model, opt, models.mean_ce, virtual_nodes=2)
    model.zero_grad(set_to_none=True)
    models.mean_ce(model, batch).backward()
    assert all(p.grad is not None for p in model.parameters())
    with pytest.raises(ValueError, match="already driven by another live vflow.Executor"):
        vflow.Executor(model, opt, models.mean_ce, virtual_nodes=2)
    ex.close()
    with pytest.raises(RuntimeError, match="closed"):
        ex.step(batch)
    vflow.Executor(model, opt, models.mean_ce, virtual_nodes=2).close()


@requires_cuda
@pytest.mark.parametrize("param_dtype", [torch.float32, torch.bfloat16])
def test_cuda_step_matches_float64_big_batch(param_dtype):
    model = models.mlp(dtype=param_dtype)
    x, y = models.classification_data(37)
    want = models.float64_grads(model, models.mean_ce, (x.to(param_dtype), y))
    m = copy.deepcopy(model).cuda()
    models.mean_ce(m, (x.to(param_dtype).cuda(), y.cuda())).backward()
    torch_error = max_relative_error([p.grad.cpu() for p in m.parameters()], want)
    model = model.cuda()
    _, grads = _run_step(model, models.mean_ce, (x.to(param_dtype).cuda(), y.cuda()), 4)
    error = max_relative_error([g.cpu() for g in grads], want)
    assert error <= max(1e-5, 2 * torch_error)


class _Branchy(torch.nn.Module):
    """A head used only by VNs whose first sample is positive: data-dependent unused params."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Linear(6, 4)
        self.extra = torch.nn.Linear(6, 4)

    def forward(self, x):
        out = self.body(x)
        return out + self.extra(x) if x[0, 0] > 0 else out


@pytest.mark.parametrize("bucket_cap_mb", [1e-9, 25.0])
def test_parameters_unused_in_some_vns_and_steps(bucket_cap_mb):
    model = _Branchy()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = models.classification_data(16)
    x[:, 0] = -1.0
    x[8, 0] = 1.0  # only VN 2 of 4 uses `extra` in step 0
    with vflow.Executor(model, opt, models.mean_ce, 4, bucket_cap_mb=bucket_cap_mb) as ex:
        reference = copy.deepcopy(model)
        ex.step((x, y))
        want, _ = models.per_vn_reference(reference, models.mean_ce, (x, y), 4, [0] * 4)
        got = [p.grad for p in model.parameters()]
        assert max_relative_error(got, want) <= 1e-5
        assert got[2].abs().sum() > 0
        x[8, 0] = -1.0  # step 1: nobody uses `extra`; last step's gradient must not leak
        ex.step((x, y))
        assert model.extra.weight.grad.eq(0).all() and model.extra.bias.grad.eq(0).all()


def test_float64_accumulation_for_float32_parameters():
    model = models.mlp()
    batch = models.classification_data(37)
    want = models.float64_grads(model, models.mean_ce, batch)
    _, grads = _run_step(model, models.mean_ce, batch, 8, accumulate_dtype=torch.float64)
    assert all(g.dtype == torch.float32 for g in grads)  # handed to the optimizer as float32
    assert max_relative_error(grads, want) <= 1e-6


@pytest.mark.parametrize(
    ("plan", "b"), [(vflow.Plan(sizes=[[20, 4, 9, 4]]), 37), (vflow.Plan(counts=[5]), 37)]
)
def test_plan_on_one_worker_gives_the_global_batch_gradient(plan, b):
    """VirtualFlow's heterogeneous split: VNs of very different sizes are weighted by
    their item counts, so the gradient is still the global-batch gradient."""
    model = models.mlp()
    batch = models.classification_data(b)
    want = models.float64_grads(model, models.mean_ce, batch)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with vflow.Executor(model, opt, models.mean_ce, plan.virtual_nodes, plan=plan) as ex:
        result = ex.step(batch)
        assert max_relative_error([p.grad for p in model.parameters()], want) < 1e-5
        assert ex.world_size == 1 and ex.rank == 0 and ex.plan == plan
    assert result.num_items == b


def test_step_accepts_this_workers_samples_with_global_batch_size():
    model = models.mlp()
    twin = copy.deepcopy(model)
    batch = models.classification_data(24)
    grads = []
    for m, kwargs in ((model, {}), (twin, {"global_batch_size": 24})):
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        with vflow.Executor(m, opt, models.mean_ce, 4) as ex:
            ex.step(batch, **kwargs)
            grads.append([p.grad.clone() for p in m.parameters()])
    for a, b in zip(*grads):
        assert torch.equal(a, b)


def test_num_items_is_the_int_batch_size_for_mean_losses_and_a_float_sum_otherwise():
    model = models.TokenModel()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batch = models.padded_tokens(12)
    with vflow.Executor(model, opt, models.token_sum_loss, virtual_nodes=3) as ex:
        summed = ex.step(batch)
    assert isinstance(summed.num_items, float) and summed.num_items == batch[2].sum().item()
    model = models.mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with vflow.Executor(model, opt, models.mean_ce, virtual_nodes=4) as ex:
        mean = ex.step(models.classification_data(16))
    assert type(mean.num_items) is int and mean.num_items == 16


def test_infer_in_training_mode_warns_once_that_batchnorm_statistics_change(caplog):
    model = models.bn_net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(8, 2, 5, 5)
    with vflow.Executor(model, opt, models.mean_ce, virtual_nodes=2) as ex:
        with caplog.at_level("WARNING", logger="vflow"):
            ex.infer(x)
            ex.infer(x)
        warnings = [r for r in caplog.records if "training mode" in r.getMessage()]
        assert len(warnings) == 1 and "model.eval()" in warnings[0].getMessage()
        caplog.clear()
        model.eval()
        before = model[1].running_mean.clone()
        ex.infer(x)
        assert torch.equal(model[1].running_mean, before)
        assert not caplog.records


def test_signal_travels_with_the_next_step_and_is_checked():
    model = torch.nn.Linear(4, 2)
    ex = vflow.Executor(
        model, torch.optim.SGD(model.parameters(), lr=0.1), lambda m, b: m(b).sum(), 2
    )
    batch = torch.randn(4, 4)
    for bad in (-1, 2**31, True, 1.0):
        with pytest.raises(ValueError, match="word must be an int in"):
            ex.signal(bad)  # type: ignore[arg-type]
    ex.signal(3)
    assert ex.step(batch).signals == (3,)
    assert ex.step(batch).signals == (0,)


def test_a_signal_function_is_read_at_the_last_vn_and_its_result_checked():
    model = torch.nn.Linear(4, 2)
    forwards: list[int] = []
    reads: list[int] = []

    def loss_fn(m: torch.nn.Module, b: torch.Tensor) -> torch.Tensor:
        forwards.append(len(forwards))
        return m(b).sum()

    ex = vflow.Executor(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn, 3)
    batch = torch.randn(6, 4)

    def word() -> int:
        reads.append(len(forwards))
        return 9

    ex.signal(word)
    assert ex.step(batch).signals == (9,)
    assert reads == [3]  # after the last VN's forward, before its backward
    assert ex.step(batch).signals == (0,)
    before = [p.detach().clone() for p in model.parameters()]
    for bad in (-1, 2**31, True, None):
        ex.signal(lambda bad=bad: bad)  # type: ignore[misc,return-value]
        with pytest.raises(ValueError, match="the signal function's result must be an int"):
            ex.step(batch)
    assert ex.step_count == 2
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
