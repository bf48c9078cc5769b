"""Prefetching VN batches (vflow/data/prefetch.py, Note [Prefetch]) through the Executor.

No test here measures time: that prefetching overlaps is shown by a transform that
waits for the VN before it to be in loss_fn (it would time out without overlap), and
how much it hides by benchmarks/prefetch.py.
"""

from __future__ import annotations

import copy
import gc
import threading
import traceback

import pytest
import torch

import vflow
from tests.support import models
from tests.support.cuda_marks import requires_cuda

V = 4
B = 32


def _noisy(batch, generator: torch.Generator):
    """A transform with a random draw from the VN's generator and a real computation."""
    x, y = batch
    noise = torch.randn(x.shape, generator=generator) * 0.01
    return (x * 1.5 + noise.to(x.device), y)


def _train(prefetch: bool, deterministic: bool = False, steps: int = 3, **kwargs):
    model = models.mlp(0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    data = [models.classification_data(B, seed) for seed in range(steps)]
    losses = []
    with vflow.Executor(
        model,
        optimizer,
        models.mean_ce,
        V,
        seed=3,
        prefetch=prefetch,
        deterministic=deterministic,
        **kwargs,
    ) as ex:
        for batch in data:
            losses.append(ex.step(batch).loss)
    return [p.detach().clone() for p in model.parameters()], losses


def _prefetch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("vflow-prefetch")]


@pytest.mark.parametrize("deterministic", [False, True])
def test_results_are_identical_with_and_without_prefetch(deterministic: bool) -> None:
    with_prefetch = _train(True, deterministic, vn_transform=_noisy)
    without = _train(False, deterministic, vn_transform=_noisy)
    assert with_prefetch[1] == without[1]
    for a, b in zip(with_prefetch[0], without[0], strict=True):
        assert torch.equal(a, b)
    # The transform changes the result: it really ran.
    plain = _train(True, deterministic)
    assert plain[1] != with_prefetch[1]


def test_transform_generator_depends_on_seed_step_and_vn_only() -> None:
    seen: dict[tuple[int, int], float] = {}
    step_of = {"step": 0}

    def record(batch, generator: torch.Generator):
        x, _ = batch
        seen[(step_of["step"], int(x[0, 0].item()))] = torch.rand((), generator=generator).item()
        return batch

    def loss(model, batch):
        return model(batch[0]).sum() * 0.0

    runs = []
    for prefetch in (True, False):
        seen.clear()
        model = models.mlp(0)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
        # Column 0 of each sample holds its VN index, so `record` knows which VN it saw.
        x = torch.arange(V).repeat_interleave(B // V).float()[:, None].expand(B, 6).clone()
        with vflow.Executor(
            model, optimizer, loss, V, seed=3, prefetch=prefetch, vn_transform=record
        ) as ex:
            for step in range(2):
                step_of["step"] = step
                ex.step((x, torch.zeros(B, dtype=torch.long)))
        runs.append(dict(seen))
    assert runs[0] == runs[1]
    assert len(set(runs[0].values())) == 2 * V  # every (step, VN) draws differently


def test_the_next_vn_is_prepared_while_the_current_one_computes() -> None:
    """VN i's loss_fn waits until the transform of VN i+1 has started: without
    overlap the wait would time out."""
    started = [threading.Event() for _ in range(V)]

    def transform(batch, generator):
        started[int(batch[0][0, 0].item())].set()
        return batch

    overlapped = []

    def loss(model, batch):
        vn = int(batch[0][0, 0].item())
        if vn + 1 < V:
            overlapped.append(started[vn + 1].wait(timeout=30))
        return model(batch[0]).sum() * 0.0

    model = models.mlp(0)
    x = torch.arange(V).repeat_interleave(B // V).float()[:, None].expand(B, 6).clone()
    with vflow.Executor(
        model, torch.optim.SGD(model.parameters(), lr=0.0), loss, V, vn_transform=transform
    ) as ex:
        ex.step((x, torch.zeros(B, dtype=torch.long)))
    assert overlapped == [True] * (V - 1)


def _failing_transform(batch, generator):
    if batch[0].shape[0] and batch[0][0, 0].item() == 2:
        raise ValueError("cannot decode sample 17")
    return batch


def test_an_error_in_the_data_path_reaches_the_caller_and_changes_nothing() -> None:
    model = models.mlp(0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x = torch.arange(V).repeat_interleave(B // V).float()[:, None].expand(B, 6).clone()
    good = (torch.zeros(B, 6), torch.zeros(B, dtype=torch.long))
    with vflow.Executor(model, optimizer, models.mean_ce, V, vn_transform=_failing_transform) as ex:
        ex.step(good)
        before = copy.deepcopy((model.state_dict(), optimizer.state_dict()))
        with pytest.raises(ValueError, match="cannot decode sample 17") as info:
            ex.step((x, torch.zeros(B, dtype=torch.long)))
        # The original traceback, down to the line that raised in the thread.
        frames = [frame.name for frame in traceback.extract_tb(info.value.__traceback__)]
        assert frames[-1] == "_failing_transform"
        assert ex.step_count == 1
        assert all(p.grad is None for p in model.parameters())
        after = (model.state_dict(), optimizer.state_dict())
        for k, v in before[0].items():
            assert torch.equal(after[0][k], v)
        assert after[1]["state"].keys() == before[1]["state"].keys()
        for index, state in before[1]["state"].items():
            momentum = after[1]["state"][index]["momentum_buffer"]
            assert torch.equal(momentum, state["momentum_buffer"])
        ex.step(good)  # still usable
        assert ex.step_count == 2


def test_an_error_in_loss_fn_waits_for_the_prefetch_in_flight() -> None:
    """When a VN fails, the job preparing the next VN has finished before step()
    raises: nothing of the failed step keeps running in the background."""
    finished = threading.Event()
    release = threading.Event()

    def slow_transform(batch, generator):
        if batch[0][0, 0].item() == 1:
            release.wait(timeout=30)
            finished.set()
        return batch

    def loss(model, batch):
        if batch[0][0, 0].item() == 0:
            release.set()
            raise RuntimeError("loss failed in VN 0")
        return model(batch[0]).sum()

    model = models.mlp(0)
    x = torch.arange(V).repeat_interleave(B // V).float()[:, None].expand(B, 6).clone()
    with vflow.Executor(
        model, torch.optim.SGD(model.parameters(), lr=0.1), loss, V, vn_transform=slow_transform
    ) as ex:
        with pytest.raises(RuntimeError, match="loss failed in VN 0"):
            ex.step((x, torch.zeros(B, dtype=torch.long)))
        assert finished.is_set()


def test_no_thread_outlives_its_executor() -> None:
    assert _prefetch_threads() == []
    model = models.mlp(0)
    ex = vflow.Executor(
        model, torch.optim.SGD(model.parameters(), lr=0.1), models.mean_ce, V, vn_transform=_noisy
    )
    ex.step(models.classification_data(B))
    assert len(_prefetch_threads()) == 1
    ex.close()
    assert _prefetch_threads() == []

    model = models.mlp(0)
    ex = vflow.Executor(
        model, torch.optim.SGD(model.parameters(), lr=0.1), models.mean_ce, V, vn_transform=_noisy
    )
    ex.step(models.classification_data(B))
    del ex
    gc.collect()
    assert _prefetch_threads() == []


def test_plain_slicing_starts_no_thread() -> None:
    model = models.mlp(0)
    with vflow.Executor(
        model, torch.optim.SGD(model.parameters(), lr=0.1), models.mean_ce, V
    ) as ex:
        ex.step(models.classification_data(B))
        assert _prefetch_threads() == []


def test_a_transform_that_changes_the_sample_count_is_an_error() -> None:
    model = models.mlp(0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def drop_one(batch, generator):
        return (batch[0][1:], batch[1][1:])

    with vflow.Executor(model, optimizer, models.mean_ce, V, vn_transform=drop_one) as ex:
        before = [p.detach().clone() for p in model.parameters()]
        with pytest.raises(ValueError, match="returned a batch of 7 samples for virtual node 0"):
            ex.step(models.classification_data(B))
        assert ex.step_count == 0
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before, strict=True))


def test_prefetch_arguments_are_checked() -> None:
    model = models.mlp(0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match="prefetch must be a bool"):
        vflow.Executor(model, optimizer, models.mean_ce, V, prefetch=1)
    with pytest.raises(TypeError, match="vn_transform must be callable or None"):
        vflow.Executor(model, optimizer, models.mean_ce, V, vn_transform="flip")
    with vflow.Executor(model, optimizer, models.mean_ce, V, prefetch=False) as ex:
        ex.step(models.classification_data(B))


@requires_cuda
@pytest.mark.parametrize("pinned", [False, True])
def test_cuda_model_with_a_cpu_batch_is_fed_through_a_side_stream(pinned: bool) -> None:
    """The batch stays on the CPU; VN slices reach the GPU via pinned memory and a side
    stream. Same bits as handing the executor a GPU batch, with or without prefetch."""
    data = [models.classification_data(B, seed) for seed in range(3)]
    if pinned:
        data = [(x.pin_memory(), y.pin_memory()) for x, y in data]
    results = []
    for prefetch, on_gpu in ((True, False), (False, False), (True, True)):
        model = models.mlp(0).cuda()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        with vflow.Executor(
            model, optimizer, models.mean_ce, V, prefetch=prefetch, vn_transform=_noisy
        ) as ex:
            for x, y in data:
                batch = (x.cuda(), y.cuda()) if on_gpu else (x, y)
                ex.step(batch)
        results.append([p.detach().cpu() for p in model.parameters()])
    for other in results[1:]:
        for a, b in zip(results[0], other, strict=True):
            assert torch.equal(a, b)
