"""What the torch.compile tests share: a tiny model with dropout, its data, and one
inductor cache for the whole test session.

Inductor compiles C++ for the CPU, which takes tens of seconds on a 2-core machine.
Every process of a session (pytest's, its xdist workers' and the processes they
start) compiles the same few graphs, so they share one cache directory: the first
process to compile a graph pays for it, the others load it. Compile workers are off
(one thread): a pool of compile processes costs more to start than it saves on these
graphs.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F
from torch import nn

# Environment of the processes that compile: read by inductor when it is imported.
INDUCTOR_ENV = {"TORCHINDUCTOR_COMPILE_THREADS": "1"}


@contextlib.contextmanager
def shared_inductor_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Points this process and the ranks it spawns meanwhile at the session's inductor
    cache."""
    base = tmp_path_factory.getbasetemp()
    # Under pytest-xdist each worker has a base of its own; their common parent is
    # the session's.
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    path = root / "inductor-cache"
    path.mkdir(exist_ok=True)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TORCHINDUCTOR_CACHE_DIR", str(path))
        for key, value in INDUCTOR_ENV.items():
            patch.setenv(key, value)
        yield str(path)


def dropout_mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.5), nn.Linear(16, 3))


def mean_ce(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)


def batches(steps: int, size: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(size, 6, generator=g), torch.randint(0, 3, (size,), generator=g))
        for _ in range(steps)
    ]


def snapshot(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Parameters and optimizer state, by name, as CPU copies."""
    out = {f"param {k}": v.detach().clone() for k, v in model.named_parameters()}
    for index, state in optimizer.state_dict()["state"].items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                out[f"optimizer {index} {key}"] = value.clone()
    return out


def differing(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> list[str]:
    """The names whose tensors are not bitwise equal (all names when the keys differ)."""
    if got.keys() != want.keys():
        return sorted(got.keys() ^ want.keys())
    return [key for key in want if not torch.equal(got[key], want[key])]
