"""The demo's workload, also used by the examples: scikit-learn's bundled digits, a
small CNN with dropout, its loss and accuracy, and the data order of every epoch; for
the pipelined examples, a residual MLP cut into segments."""

from __future__ import annotations

from collections import OrderedDict

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "accuracy",
    "cross_entropy",
    "epoch_order",
    "load_digits_split",
    "make_model",
    "make_pipeline_model",
]


def load_digits_split(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Digits as (x_train, y_train, x_test, y_test): 8x8 images in [0, 1], 20 % test."""
    try:
        from sklearn.datasets import load_digits
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise SystemExit(
            "the demo needs scikit-learn for its bundled digits dataset: pip install scikit-learn"
        ) from exc
    data = load_digits()
    x = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(data.target, dtype=torch.long)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    x, y = x[order], y[order]
    n_test = len(y) // 5
    return x[n_test:], y[n_test:], x[:n_test], y[:n_test]


def epoch_order(samples: int, seed: int, epoch: int) -> torch.Tensor:
    """The order in which every run of the demo reads the training set in ``epoch``."""
    return torch.randperm(samples, generator=torch.Generator().manual_seed(seed * 1000 + epoch))


def make_model(seed: int) -> nn.Module:
    """Two convolutions of 64 and 128 channels and a linear layer, 95k parameters. This
    wide, so that on a CPU core a VN of 5 digits is ~2.6 ms of compute: with 16 and 32
    channels it was ~1 ms, and a step's fixed part on 2 workers sharing 2 cores (Gloo
    latency, the optimizer, bookkeeping: ~3 ms) was a quarter of the heterogeneous
    row's balanced step, whose gain over the even plan then moved with the machine's
    noise from run to run."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(1, 64, 3, padding=1), nn.ReLU(),
        nn.Conv2d(64, 128, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Dropout(0.1), nn.Linear(128 * 4 * 4, 10),
    )  # fmt: skip


def cross_entropy(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)


@torch.no_grad()
def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    model.eval()
    acc = (model(x).argmax(1) == y).float().mean().item()
    model.train()
    return acc


class ResidualBlock(nn.Module):
    """x + MLP(LayerNorm(x)), with dropout: one segment of the pipelined model."""

    def __init__(self, width: int, dropout: float) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.dropout(self.down(F.gelu(self.up(self.norm(x)))))


def make_pipeline_model(
    seed: int, width: int = 128, blocks: int = 4, dropout: float = 0.1
) -> nn.Sequential:
    """The digits as a residual MLP of ``blocks`` blocks, as segments a pipeline cuts
    between: ``embed`` (8x8 image to ``width``), ``block0``..., ``head`` (10 classes).
    Built the same on every process from ``seed``, whatever the grid."""
    torch.manual_seed(seed)
    layers: list[tuple[str, nn.Module]] = [
        ("embed", nn.Sequential(nn.Flatten(), nn.Linear(64, width), nn.GELU(), nn.Dropout(dropout)))
    ]
    layers += [(f"block{k}", ResidualBlock(width, dropout)) for k in range(blocks)]
    layers.append(("head", nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 10))))
    return nn.Sequential(OrderedDict(layers))
