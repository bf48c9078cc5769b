"""vflow/bench/kernels.py: the parameter list it measures, the one adapter to vflow's
kernels, and a tiny run whose headline records evaluate."""

from __future__ import annotations

import pytest
import torch

from vflow.bench import kernels
from vflow.bench.records import evaluate


def test_gradient_sizes_look_like_a_convnet() -> None:
    sizes = kernels.gradient_sizes(25_000_000, 160)
    assert len(sizes) == 160
    assert sum(sizes) == pytest.approx(25_000_000, rel=1e-3)
    weights, vectors = sizes[:53], sizes[53:]
    # Weights grow with depth and hold almost everything; vectors are small.
    assert weights == sorted(weights)
    assert sum(vectors) < 0.01 * sum(sizes)
    assert max(vectors) == 512


def test_gradient_sizes_rejects_a_list_it_cannot_build() -> None:
    with pytest.raises(ValueError, match="tensors >= 3 and numel >= 64 \\* tensors"):
        kernels.gradient_sizes(100, 160)


def test_a_tiny_run_gives_four_evaluable_headlines(capsys: pytest.CaptureFixture[str]) -> None:
    settings = kernels.Settings(numel=20_000, tensors=30, rounds=1, min_run_time=0.001)
    device = torch.device("cpu")
    records, detail = kernels.run(device, settings)
    env = kernels.environment(device)
    rows = [evaluate({**r, "env": env}) for r in records]
    assert [r.key for r in rows] == [
        "kernels/accumulate/fp32",
        "kernels/accumulate/bf16",
        "kernels/scale_check",
        "kernels/exact_add",
    ]
    assert [r.unit for r in rows] == ["GB/s", "GB/s", "GB/s", "ms"]
    assert all(r.ratio is not None and r.ratio > 0 for r in rows)
    assert [r.target for r in rows] == [">= 0.8", ">= 1.5", "", ""]
    for method in ("per-tensor add_", "vflow multi_accumulate_", "scale_check_", "copy_"):
        assert method in detail
    assert env["cpu_affinity"] >= 1 and env["vflow"] == kernels.__version__


def test_the_detail_table_warns_when_timings_are_noise() -> None:
    steady = {"copy_": [0.010, 0.010, 0.010, 0.010], "m": [0.005, 0.005, 0.005, 0.005]}
    nbytes = {("c", "copy_"): 10**6, ("c", "m"): 10**6}
    assert "WARNING" not in kernels._detail_table({"c": steady}, nbytes)
    noisy = steady | {"m": [0.001, 0.005, 0.005, 0.02]}
    table = kernels._detail_table({"c": noisy}, nbytes)
    assert "WARNING: 1 of 2 methods vary by more than 50% (IQR)" in table
