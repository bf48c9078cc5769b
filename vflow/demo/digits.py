"""The demo's workload, also used by the examples: scikit-learn's bundled digits, a
small CNN with dropout, its loss and accuracy, and the data order of every epoch; for
the pipelined examples, a residual MLP and a small transformer, as segments a pipeline
cuts between."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Collection

import torch
import torch.nn.functional as F
from torch import nn

from vflow.pipeline.spec import Segments

__all__ = [
    "accuracy",
    "cross_entropy",
    "epoch_order",
    "load_digits_split",
    "make_model",
    "make_pipeline_model",
    "make_transformer_model",
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


def _segments(
    seed: int, factories: list[tuple[str, Callable[[], nn.Module]]], only: Collection[str] | None
) -> OrderedDict[str, nn.Module]:
    """Each segment built from a seed of its own, (seed, its index), so that a process
    that builds only ``only`` (a stage's segments: ``vflow.Pipeline.cut``) builds them
    with the weights of the whole model; the others are built on the meta device and
    never take memory. ``only=None``: every segment."""
    names = [name for name, _ in factories]
    if only is not None and not set(only) <= set(names):
        raise ValueError(f"only names no segment of the model {sorted(set(only) - set(names))}")
    built: OrderedDict[str, nn.Module] = OrderedDict()
    for index, (name, factory) in enumerate(factories):
        if only is None or name in only:
            torch.manual_seed(seed * 1_000_003 + index)
            built[name] = factory()
        else:
            with torch.device("meta"):
                built[name] = factory()
    return built


def make_pipeline_model(
    seed: int,
    width: int = 128,
    blocks: int = 4,
    dropout: float = 0.1,
    only: Collection[str] | None = None,
) -> nn.Sequential:
    """The digits as a residual MLP of ``blocks`` blocks, as segments a pipeline cuts
    between: ``embed`` (8x8 image to ``width``), ``block0``..., ``head`` (10 classes).
    Built the same on every process from ``seed``, whatever the grid; ``only``: the
    segments to build (the others on the meta device)."""
    factories: list[tuple[str, Callable[[], nn.Module]]] = [
        (
            "embed",
            lambda: nn.Sequential(
                nn.Flatten(), nn.Linear(64, width), nn.GELU(), nn.Dropout(dropout)
            ),
        )
    ]
    factories += [(f"block{k}", lambda: ResidualBlock(width, dropout)) for k in range(blocks)]
    factories.append(("head", lambda: nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 10))))
    return nn.Sequential(_segments(seed, factories, only))


class RowEmbedding(nn.Module):
    """An 8x8 digit as a sequence of 8 tokens (its rows), with a learned position, and
    the mask of the rows that hold ink: blank rows (a digit's top and bottom margins)
    are padding that attention must not look at. Returns ``(hidden, mask)``."""

    def __init__(self, width: int, dropout: float) -> None:
        super().__init__()
        self.proj = nn.Linear(8, width)
        self.position = nn.Parameter(torch.randn(8, width) * 0.02)
        self.dropout = nn.Dropout(dropout)

    def forward(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows = images.reshape(images.shape[0], 8, 8)
        mask = rows.abs().sum(-1) > 0
        mask[:, 0] = True  # never an empty sequence
        return self.dropout(self.proj(rows) + self.position), mask


class TransformerBlock(nn.Module):
    """A pre-norm transformer block, GPT-2's shape: masked self-attention and an MLP,
    each added to the residual stream. Takes and returns ``(hidden, mask)``: two
    tensors cross every cut between blocks."""

    def __init__(self, width: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(width)
        self.attention = nn.MultiheadAttention(width, heads, dropout=dropout, batch_first=True)
        self.norm2 = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)
        self.dropout = nn.Dropout(dropout)

    def forward(
        self, hidden: torch.Tensor, mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.norm1(hidden)
        attended, _ = self.attention(x, x, x, key_padding_mask=~mask, need_weights=False)
        hidden = hidden + self.dropout(attended)
        hidden = hidden + self.dropout(self.down(F.gelu(self.up(self.norm2(hidden)))))
        return hidden, mask


class MaskedMeanHead(nn.Module):
    """The mean of the tokens that are not padding, then the 10 classes."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.out = nn.Linear(width, 10)

    def forward(self, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        weights = mask.to(hidden.dtype).unsqueeze(-1)
        pooled = (hidden * weights).sum(1) / weights.sum(1)
        return self.out(self.norm(pooled))


def make_transformer_model(
    seed: int,
    width: int = 64,
    blocks: int = 4,
    heads: int = 4,
    dropout: float = 0.1,
    only: Collection[str] | None = None,
) -> Segments:
    """The digits as a small transformer over their rows: ``embed`` (to ``(hidden,
    mask)``), ``block0``... (GPT-2-style blocks passing ``(hidden, mask)`` on), ``head``.
    A ``vflow.pipeline.Segments``, so that it also runs whole in one process (a
    ``torch.nn.Sequential`` passes one tensor between children). Built the same on
    every process from ``seed``; ``only`` as for ``make_pipeline_model``."""
    if width % heads:
        raise ValueError(f"width ({width}) must be a multiple of heads ({heads})")
    factories: list[tuple[str, Callable[[], nn.Module]]] = [
        ("embed", lambda: RowEmbedding(width, dropout))
    ]
    factories += [
        (f"block{k}", lambda: TransformerBlock(width, heads, dropout)) for k in range(blocks)
    ]
    factories.append(("head", lambda: MaskedMeanHead(width)))
    return Segments(_segments(seed, factories, only))
