"""The main job: train a small CNN on scikit-learn's bundled digits with virtual nodes.

The global batch B and the number of virtual nodes V are fixed; the run trains the
same model twice from the same initialisation — once with ``vflow.Executor`` (V VNs
on this one worker, so only B/V samples' activations are live at a time) and once as
one plain big-batch step per batch — and reports both, showing that V virtual nodes
reproduce the big-batch training while holding a fraction of its activations.
"""

from __future__ import annotations

import argparse
import copy
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

import vflow


def load_digits_split(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
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


def make_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Dropout(0.1), nn.Linear(32 * 4 * 4, 10),
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


@dataclass
class RunSummary:
    name: str
    final_loss: float
    test_accuracy: float
    seconds: float
    model: nn.Module


def train(
    name: str, model: nn.Module, args: argparse.Namespace, data, use_vflow: bool
) -> RunSummary:
    x_train, y_train, x_test, y_test = data
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    ex = (
        vflow.Executor(model, opt, cross_entropy, args.virtual_nodes, seed=args.seed)
        if use_vflow
        else None
    )
    start = time.perf_counter()
    loss = float("nan")
    for epoch in range(args.epochs):
        order = torch.randperm(len(y_train), generator=torch.Generator().manual_seed(epoch))
        losses = []
        for i in range(0, len(order) - args.batch_size + 1, args.batch_size):
            idx = order[i : i + args.batch_size]
            batch = (x_train[idx], y_train[idx])
            if ex is not None:
                losses.append(ex.step(batch).loss)
            else:
                opt.zero_grad()
                step_loss = cross_entropy(model, batch)
                step_loss.backward()
                opt.step()
                losses.append(step_loss.item())
        loss = sum(losses) / len(losses)
        print(
            f"  [{name}] epoch {epoch + 1}/{args.epochs}  loss {loss:.4f}  "
            f"test acc {accuracy(model, x_test, y_test):.3f}",
            flush=True,
        )
    if ex is not None:
        ex.close()
    return RunSummary(
        name, loss, accuracy(model, x_test, y_test), time.perf_counter() - start, model
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vflow demo", description=__doc__)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=64, help="global batch B")
    parser.add_argument("--virtual-nodes", type=int, default=8, help="V")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.epochs < 1:
        parser.error(f"--epochs must be >= 1, got {args.epochs}")
    if args.virtual_nodes < 1:
        parser.error(f"--virtual-nodes must be >= 1, got {args.virtual_nodes}")
    if args.batch_size < args.virtual_nodes:
        parser.error(
            f"--batch-size ({args.batch_size}) must be >= --virtual-nodes ({args.virtual_nodes})"
        )
    if not args.lr > 0:
        parser.error(f"--lr must be > 0, got {args.lr}")
    torch.set_num_threads(max(1, torch.get_num_threads()))
    data = load_digits_split(args.seed)
    print(
        f"vflow {vflow.__version__} demo: digits ({len(data[1])} train / {len(data[3])} test), "
        f"global batch B={args.batch_size}, V={args.virtual_nodes} virtual nodes "
        f"({args.batch_size / args.virtual_nodes:.1f} samples each), epochs: {args.epochs}",
        flush=True,
    )
    # Dropout draws differ between the runs by design (per-VN streams vs one stream), so
    # the comparison of parameters is made on a dropout-free copy of the architecture.
    initial = make_model(args.seed)
    runs = [
        train(
            f"vflow 1 worker x {args.virtual_nodes} VNs", copy.deepcopy(initial), args, data, True
        ),
        train("plain big batch", copy.deepcopy(initial), args, data, False),
    ]
    no_dropout = copy.deepcopy(initial)
    no_dropout[6] = nn.Identity()
    twins = [
        train("vflow, no dropout", copy.deepcopy(no_dropout), args, data, True),
        train("plain, no dropout", copy.deepcopy(no_dropout), args, data, False),
    ]
    diff = max(
        (p - q).abs().max().item()
        for p, q in zip(twins[0].model.parameters(), twins[1].model.parameters())
    )
    print()
    print(f"{'run':<28}{'global batch':>14}{'final loss':>12}{'test acc':>10}{'wall s':>9}")
    for run in runs + twins:
        print(
            f"{run.name:<28}{args.batch_size:>14}{run.final_loss:>12.4f}"
            f"{run.test_accuracy:>10.3f}{run.seconds:>9.1f}"
        )
    print(
        f"\nmax |parameter difference| vflow vs plain big batch (no dropout): {diff:.2e} "
        "(float32 rounding only: same global batch, same hyperparameters)"
    )
    return 0
