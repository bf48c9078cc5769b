"""Bad input to vflow.Executor: a clear error, and nothing changed."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import vflow
from tests.support import models


class Net(nn.Module):
    """BatchNorm (buffers) + momentum (optimizer state), so every kind of state shows."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(6, 8)
        self.bn = nn.BatchNorm1d(8)
        self.out = nn.Linear(8, 4)

    def forward(self, x):
        return self.out(torch.relu(self.bn(self.fc(x))))


def _snapshot(ex: vflow.Executor):
    return (
        {k: v.clone() for k, v in ex.model.state_dict().items()},
        copy.deepcopy(ex.optimizer.state_dict()),
        ex.step_count,
    )


def _assert_unchanged(ex: vflow.Executor, snap) -> None:
    state, opt_state, steps = snap
    for k, v in ex.model.state_dict().items():
        assert torch.equal(v, state[k]), f"{k} changed"
    now = ex.optimizer.state_dict()
    assert now["param_groups"] == opt_state["param_groups"]
    for i, s in opt_state["state"].items():
        for key, value in s.items():
            assert torch.equal(now["state"][i][key], value), f"optimizer state {i}.{key} changed"
    assert ex.step_count == steps


@pytest.fixture
def warm_executor():
    """An executor after one good step, so momentum buffers and running stats are set."""
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    calls = {"fn": models.mean_ce}
    ex = vflow.Executor(model, opt, lambda m, b: calls["fn"](m, b), virtual_nodes=4)
    ex.step(models.classification_data(16))
    yield ex, calls
    ex.close()


def _bad_at_vn(vn_to_break: int, bad):
    count = {"n": 0}

    def loss_fn(model, batch):
        loss = models.mean_ce(model, batch)
        vn = count["n"]
        count["n"] += 1
        return bad(model, batch, loss) if vn == vn_to_break else loss

    return loss_fn


@pytest.mark.parametrize(
    ("loss_fn", "error", "message"),
    [
        (
            _bad_at_vn(0, lambda m, b, loss: m(b[0])),
            ValueError,
            r"loss_fn \(virtual node 0\) returned a loss of shape \(4, 4\); expected a scalar",
        ),
        (
            _bad_at_vn(2, lambda m, b, loss: loss.item()),
            TypeError,
            r"loss_fn \(virtual node 2\) returned a float; expected a scalar loss tensor",
        ),
        (_bad_at_vn(1, lambda m, b, loss: [loss]), TypeError, "returned a list"),
        (_bad_at_vn(0, lambda m, b, loss: (loss, 2, 3)), TypeError, "returned a tuple"),
        (_bad_at_vn(3, lambda m, b, loss: (loss, "4")), TypeError, "num_items of type str"),
        (_bad_at_vn(0, lambda m, b, loss: (loss, True)), TypeError, "num_items of type bool"),
        (
            _bad_at_vn(2, lambda m, b, loss: (loss, -1)),
            ValueError,
            r"virtual node 2\) returned num_items=-1; expected a count >= 0",
        ),
        (_bad_at_vn(1, lambda m, b, loss: loss.detach()), ValueError, "does not require grad"),
        (_bad_at_vn(0, lambda m, b, loss: (loss > 0).sum()), TypeError, "expected floating point"),
        (
            _bad_at_vn(1, lambda m, b, loss: (loss, 3)),
            TypeError,
            "returned a sum loss for virtual node 1 but a mean loss for virtual node 0",
        ),
    ],
)
def test_bad_loss_fn_output(warm_executor, loss_fn, error, message):
    ex, calls = warm_executor
    snap = _snapshot(ex)
    calls["fn"] = loss_fn
    with pytest.raises(error, match=message):
        ex.step(models.classification_data(16))
    _assert_unchanged(ex, snap)
    assert all(p.grad is None for p in ex.model.parameters())
    calls["fn"] = models.mean_ce
    ex.step(models.classification_data(16))  # still usable


def test_zero_total_num_items(warm_executor):
    ex, calls = warm_executor
    snap = _snapshot(ex)

    def all_padding(model, batch):
        x, y = batch
        per = F.cross_entropy(model(x), y, reduction="none")
        return (per * 0).sum(), torch.tensor(0)

    calls["fn"] = all_padding
    with pytest.raises(ValueError, match="num_items summing to 0.0 over the global batch"):
        ex.step(models.classification_data(16))
    _assert_unchanged(ex, snap)


def test_tensor_num_items_negative(warm_executor):
    ex, calls = warm_executor
    snap = _snapshot(ex)
    calls["fn"] = lambda m, b: (models.mean_ce(m, b), torch.tensor(-2.0))
    with pytest.raises(ValueError, match=r"returned num_items=-2.0; expected a count >= 0"):
        ex.step(models.classification_data(16))
    _assert_unchanged(ex, snap)


def test_exception_inside_loss_fn_rolls_back(warm_executor):
    ex, calls = warm_executor
    snap = _snapshot(ex)

    def explode(model, batch, loss):
        raise KeyError("boom")

    calls["fn"] = _bad_at_vn(3, explode)
    with pytest.raises(KeyError, match="boom"):
        ex.step(models.classification_data(16))
    _assert_unchanged(ex, snap)


@pytest.mark.parametrize(
    ("batch", "error", "message"),
    [
        (models.classification_data(3), ValueError, "batch has 3 samples but virtual_nodes=4"),
        (
            (torch.randn(16, 6), torch.zeros(15, dtype=torch.long)),
            ValueError,
            r"batch\[1\] has 15 samples in dim 0 but batch\[0\] has 16",
        ),
        ((torch.randn(16, 6), [1, 2]), TypeError, r"batch\[1\]\[0\] is a int"),
        ("not a batch", TypeError, "batch is a str"),
    ],
)
def test_bad_batches(warm_executor, batch, error, message):
    ex, _ = warm_executor
    snap = _snapshot(ex)
    with pytest.raises(error, match=message):
        ex.step(batch)
    _assert_unchanged(ex, snap)
    with pytest.raises(error, match=message):
        ex.infer(batch)


def _opt(model):
    return torch.optim.SGD(model.parameters(), lr=0.1)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"virtual_nodes": 0}, ValueError, "virtual_nodes must be >= 1, got 0"),
        ({"virtual_nodes": -3}, ValueError, "virtual_nodes must be >= 1, got -3"),
        ({"virtual_nodes": 2.0}, TypeError, "virtual_nodes must be an int, got float"),
        ({"virtual_nodes": True}, TypeError, "virtual_nodes must be an int, got bool"),
        ({"seed": -1}, ValueError, "seed must be >= 0"),
        ({"amp": "fp8"}, ValueError, "amp must be None, 'bf16' or 'fp16'"),
        ({"accumulate_dtype": torch.bfloat16}, ValueError, "accumulate_dtype must be"),
        ({"buffer_rule": "sum"}, ValueError, "buffer_rule must be one of"),
        ({"max_grad_norm": 0}, ValueError, "max_grad_norm must be a positive number"),
        ({"bucket_cap_mb": -1}, ValueError, "bucket_cap_mb must be a positive number"),
        ({"loss_scale": 1024}, TypeError, "loss_scale must be None, a bool or a vflow.LossScaler"),
        ({"loss_fn": 3}, TypeError, "loss_fn must be callable"),
        ({"optimizer": "sgd"}, TypeError, "optimizer must be a torch.optim.Optimizer"),
        ({"model": lambda x: x}, TypeError, "model must be a torch.nn.Module"),
    ],
)
def test_bad_constructor_arguments(kwargs, error, message):
    model = Net()
    args = {"model": model, "optimizer": _opt(model), "loss_fn": models.mean_ce, "virtual_nodes": 2}
    args.update(kwargs)
    with pytest.raises(error, match=message):
        vflow.Executor(**args)
    _constructor_left_no_trace(model)


def _constructor_left_no_trace(model: nn.Module) -> None:
    # No hooks and no ownership left behind: plain backward works, a new executor may bind.
    model.zero_grad(set_to_none=True)
    models.mean_ce(model, models.classification_data(8)).backward()
    assert all(p.grad is not None for p in model.parameters())
    vflow.Executor(model, _opt(model), models.mean_ce, virtual_nodes=2).close()


def test_optimizer_with_foreign_parameters():
    model = Net()
    stranger = nn.Parameter(torch.zeros(5, 3))
    opt = torch.optim.SGD([*model.parameters(), stranger], lr=0.1)
    with pytest.raises(
        ValueError,
        match=r"param_groups\[0\]\['params'\]\[6\] \(shape \(5, 3\)\) "
        "is not a parameter of model",
    ):
        vflow.Executor(model, opt, models.mean_ce, virtual_nodes=2)
    _constructor_left_no_trace(model)


def test_non_leaf_parameter():
    model = Net()
    model.fc._parameters["weight"] = model.fc.weight * 2  # a computed tensor, not a leaf
    opt = torch.optim.SGD(model.out.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="model parameter 'fc.weight' is not a leaf tensor"):
        vflow.Executor(model, opt, models.mean_ce, virtual_nodes=2)


def test_sparse_embedding_rejected():
    model = nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Flatten(), nn.Linear(8, 4))
    with pytest.raises(ValueError, match="module '0' produces sparse gradients"):
        vflow.Executor(model, _opt(model), models.mean_ce, virtual_nodes=2)


def test_model_without_trainable_parameters():
    model = Net()
    opt = _opt(model)
    model.requires_grad_(False)
    with pytest.raises(ValueError, match="model has no trainable parameters"):
        vflow.Executor(model, opt, models.mean_ce, virtual_nodes=2)
