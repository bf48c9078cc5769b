"""The main job: a small CNN on scikit-learn's bundled digits, trained with the same
global batch B and V virtual nodes under several mappings of the VNs onto real Gloo
worker processes — 1 worker x V VNs, 2 x V/2, 4 x V/4 and an uneven plan — in
deterministic mode, beside the baseline users get without virtual nodes: data
parallelism with a fixed per-device batch, whose global batch (and so training)
changes with the number of workers.

It prints a table (mapping, global batch, final loss and test accuracy, the largest
parameter difference to the first mapping, wall time), draws a progress bar, and
writes a PNG of the loss curves and a JSON of every number to the output folder. The
vflow curves coincide exactly; the baseline's do not. The exit status is 1 if the
vflow mappings do not end with bitwise-identical parameters.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import queue
import sys
import time
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import vflow

_HOST = "127.0.0.1"


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


@dataclass(frozen=True)
class Run:
    """One training run: vflow with a plan, or the data-parallel baseline."""

    name: str
    workers: int
    global_batch: int
    counts: tuple[int, ...] | None  # vflow plan; None for the baseline


@dataclass
class Outcome:
    run: Run
    losses: list[float] = field(default_factory=list)  # per step
    steps_per_epoch: int = 0
    test_accuracy: float = math.nan
    seconds: float = math.nan  # the training loop
    wall_seconds: float = math.nan  # from starting the workers to their result
    max_param_diff: float | None = None
    # numpy, not torch: a queue pickles tensors as handles to shared memory, which
    # die with the worker process that made them.
    params: list[Any] = field(default_factory=list, repr=False)


def plan_counts(spec: str, virtual_nodes: int) -> tuple[int, ...]:
    """ "W" is Plan.even(V, W); "a,b,c" gives worker w counts[w] VNs."""
    if "," in spec:
        counts = tuple(int(part) for part in spec.split(","))
        if any(c < 1 for c in counts) or sum(counts) != virtual_nodes:
            raise ValueError(
                f"mapping {spec!r}: counts must be >= 1 and add up to V={virtual_nodes}"
            )
        return counts
    workers = int(spec)
    if not 1 <= workers <= virtual_nodes:
        raise ValueError(
            f"mapping {spec!r}: the number of workers must be in [1, V={virtual_nodes}]"
        )
    return vflow.Plan.even(virtual_nodes, workers).counts


def default_mappings(virtual_nodes: int) -> list[str]:
    specs = [str(w) for w in (1, 2, 4) if w <= virtual_nodes]
    if virtual_nodes >= 3:
        first = virtual_nodes // 2 + 1
        rest = virtual_nodes - first
        counts = [first, (rest + 1) // 2, rest // 2] if rest >= 2 else [first, rest]
        specs.append(",".join(str(c) for c in counts))
    return specs


def describe(counts: tuple[int, ...]) -> str:
    if len(set(counts)) == 1:
        return f"{len(counts)} worker{'s' if len(counts) > 1 else ''} x {counts[0]} VNs"
    return f"{len(counts)} workers, VNs {list(counts)}"


# ---- one worker process ---------------------------------------------------------------


def _worker(
    rank: int,
    run: Run,
    port: int,
    args: dict[str, Any],
    data: tuple[torch.Tensor, ...],
    progress: Any,
    results: Any,
) -> None:
    # Several workers share the cores; one intra-op thread each is also a condition
    # of bitwise reproducibility on CPU.
    torch.set_num_threads(1)
    vflow.distributed.use_loopback_for_gloo()
    try:
        group = None
        if run.workers > 1:
            store = dist.TCPStore(_HOST, port, is_master=False, timeout=timedelta(seconds=120))
            dist.init_process_group(
                "gloo", store=store, rank=rank, world_size=run.workers,
                timeout=timedelta(seconds=120),
            )  # fmt: skip
            group = dist.group.WORLD
        outcome = _train(rank, run, args, data, group, progress)
        if rank == 0:
            results.put(("ok", outcome))
    except BaseException as exc:
        results.put(("error", f"{run.name}, rank {rank}: {type(exc).__name__}: {exc}"))
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _train(
    rank: int,
    run: Run,
    args: dict[str, Any],
    data: tuple[torch.Tensor, ...],
    group: Any,
    progress: Any,
) -> Outcome:
    x_train, y_train, x_test, y_test = data
    model = make_model(args["seed"])
    optimizer = torch.optim.SGD(model.parameters(), lr=args["lr"], momentum=0.9)
    outcome = Outcome(run)
    steps_per_epoch = len(y_train) // run.global_batch
    outcome.steps_per_epoch = steps_per_epoch
    start = time.perf_counter()
    if run.counts is not None:
        ex = vflow.Executor(
            model,
            optimizer,
            cross_entropy,
            args["virtual_nodes"],
            seed=args["seed"],
            plan=vflow.Plan(counts=list(run.counts)),
            process_group=group,
            deterministic=True,
        )
        ddp = None
    else:
        ex = None
        ddp = (
            nn.parallel.DistributedDataParallel(model, process_group=group)
            if group is not None
            else model
        )
        # Not dist.all_reduce: see Note [Collectives on tensors Python cannot see].
        collectives = (
            vflow.distributed.World(group, timedelta(seconds=120)) if group is not None else None
        )
    per_device = run.global_batch // run.workers
    for epoch in range(args["epochs"]):
        # The data order depends on (seed, epoch) alone: every run sees the same samples
        # in the same order, in batches of its own global size.
        order = torch.randperm(
            len(y_train), generator=torch.Generator().manual_seed(args["seed"] * 1000 + epoch)
        )
        for step in range(steps_per_epoch):
            idx = order[step * run.global_batch : (step + 1) * run.global_batch]
            if ex is not None:
                loss = ex.step((x_train[idx], y_train[idx])).loss
            else:
                mine = idx[rank * per_device : (rank + 1) * per_device]
                optimizer.zero_grad(set_to_none=True)
                local = cross_entropy(ddp, (x_train[mine], y_train[mine]))
                local.backward()
                optimizer.step()
                loss = local.detach()
                if collectives is not None:
                    collectives.sum([loss], "all-reduce of the baseline's loss", step)
                    loss /= run.workers
                loss = loss.item()
            outcome.losses.append(loss)
            if rank == 0:
                progress.put(1)
    outcome.seconds = time.perf_counter() - start
    if ex is not None:
        ex.close()
    outcome.test_accuracy = accuracy(model, x_test, y_test)
    outcome.params = [p.detach().numpy().copy() for p in model.parameters()]
    return outcome


# ---- the parent ------------------------------------------------------------------------


class ProgressBar:
    """Steps done over all runs. On a terminal it redraws one line (at most 10 times a
    second); in a log it prints one line per run instead."""

    def __init__(self, total: int, stream: Any = sys.stderr) -> None:
        self.total, self.done, self.stream = total, 0, stream
        self.label = ""
        self.start = time.perf_counter()
        self.last_draw = 0.0
        self.interactive = bool(getattr(stream, "isatty", lambda: False)())

    def advance(self, steps: int = 1, label: str | None = None) -> None:
        self.done += steps
        now = time.perf_counter()
        if label is not None:
            self.label = label
            if not self.interactive:
                self.stream.write(f"[{self.done}/{self.total} steps, {now - self.start:.1f}s] "
                                  f"{label}\n")  # fmt: skip
                self.stream.flush()
        if not self.interactive or (now - self.last_draw < 0.1 and self.done < self.total):
            return
        self.last_draw = now
        width = 30
        filled = int(width * self.done / max(1, self.total))
        elapsed = time.perf_counter() - self.start
        self.stream.write(
            f"\r[{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} steps "
            f"{elapsed:5.1f}s  {self.label:<40.40}"
        )
        self.stream.flush()

    def finish(self) -> None:
        if self.interactive:
            self.stream.write("\n")
        else:
            self.stream.write(
                f"[{self.done}/{self.total} steps, {time.perf_counter() - self.start:.1f}s] done\n"
            )
        self.stream.flush()


def run_one(
    run: Run, args: dict[str, Any], data: tuple[torch.Tensor, ...], bar: ProgressBar
) -> Outcome:
    ctx = mp.get_context("spawn")
    progress, results = ctx.Queue(), ctx.Queue()
    store = None
    port = 0
    if run.workers > 1:
        # The parent hosts the rendezvous on a port the OS picks: no collisions.
        store = dist.TCPStore(
            _HOST, 0, world_size=run.workers, is_master=True, wait_for_workers=False,
            timeout=timedelta(seconds=120),
        )  # fmt: skip
        port = store.port
    started = time.perf_counter()
    procs = [
        ctx.Process(target=_worker, args=(rank, run, port, args, data, progress, results))
        for rank in range(run.workers)
    ]
    for p in procs:
        p.start()
    outcome: Outcome | None = None
    error: str | None = None
    deadline = time.monotonic() + args["timeout"]
    bar.advance(0, run.name)
    try:
        while outcome is None and error is None:
            while True:
                try:
                    bar.advance(progress.get_nowait())
                except queue.Empty:
                    break
            try:
                status, value = results.get(timeout=0.1)
            except queue.Empty:
                if time.monotonic() > deadline:
                    error = f"{run.name}: no result within {args['timeout']:g} s"
                elif all(not p.is_alive() for p in procs) and results.empty():
                    error = f"{run.name}: the workers exited without a result"
                continue
            if status == "ok":
                outcome = value
            else:
                error = value
        while True:
            try:
                bar.advance(progress.get_nowait())
            except queue.Empty:
                break
    finally:
        for p in procs:
            p.join(timeout=30 if error is None else 1)
            if p.is_alive():
                p.kill()
                p.join()
        del store
    if error is not None:
        bar.finish()
        raise RuntimeError(error)
    assert outcome is not None
    outcome.wall_seconds = time.perf_counter() - started
    return outcome


def plot(outcomes: list[Outcome], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    styles = ["-", "--", ":", "-."]
    baseline_colors = ["tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown"]
    vflow_index = baseline_index = 0
    for outcome in outcomes:
        epochs = [(k + 1) / outcome.steps_per_epoch for k in range(len(outcome.losses))]
        if outcome.run.counts is not None:
            # Identical curves: distinct dash patterns keep every one of them visible.
            ax.plot(
                epochs, outcome.losses, styles[vflow_index % len(styles)], color="tab:blue",
                linewidth=2.2 - 0.4 * vflow_index, label=outcome.run.name,
            )  # fmt: skip
            vflow_index += 1
        else:
            color = baseline_colors[baseline_index % len(baseline_colors)]
            baseline_index += 1
            ax.plot(
                epochs, outcome.losses, color=color, alpha=0.8, linewidth=1,
                label=outcome.run.name,
            )  # fmt: skip
    ax.set_xlabel("epoch")
    ax.set_ylabel("training loss (global batch)")
    ax.set_yscale("log")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m vflow demo",
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=64, help="global batch B")
    parser.add_argument("--virtual-nodes", type=int, default=8, help="V")
    parser.add_argument(
        "--mappings",
        nargs="+",
        default=None,
        help='vflow mappings: "W" for W workers with V/W VNs each, "a,b,c" for an uneven '
        "plan (default: 1 2 4 and an uneven plan)",
    )
    parser.add_argument(
        "--baseline-batch",
        type=int,
        default=None,
        help="per-device batch of the data-parallel baseline (default: B / the largest "
        "worker count, so the baseline's largest run has global batch B)",
    )
    parser.add_argument("--no-baseline", action="store_true", help="skip the baseline runs")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("vflow_out/demo"), help="output folder")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per run")
    args = parser.parse_args(argv)
    for name in ("epochs", "virtual_nodes", "batch_size"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.batch_size < args.virtual_nodes:
        parser.error(
            f"--batch-size ({args.batch_size}) must be >= --virtual-nodes ({args.virtual_nodes})"
        )
    if not args.lr > 0:
        parser.error(f"--lr must be > 0, got {args.lr}")
    try:
        mappings = [
            plan_counts(spec, args.virtual_nodes)
            for spec in (args.mappings or default_mappings(args.virtual_nodes))
        ]
    except ValueError as exc:
        parser.error(f"--mappings: {exc}")
    data = load_digits_split(args.seed)
    if args.batch_size > len(data[1]):
        parser.error(f"--batch-size must be <= {len(data[1])} (the training set)")
    even_workers = sorted({len(c) for c in mappings if len(set(c)) == 1})
    baseline_batch = args.baseline_batch or max(1, args.batch_size // max(even_workers or [1]))
    if args.baseline_batch is not None and args.baseline_batch < 1:
        parser.error(f"--baseline-batch must be >= 1, got {args.baseline_batch}")

    runs = [Run(f"vflow, {describe(c)}", len(c), args.batch_size, c) for c in mappings]
    if not args.no_baseline:
        runs += [
            Run(f"baseline, {w} worker{'s' if w > 1 else ''} x {baseline_batch}", w,
                w * baseline_batch, None)
            for w in (even_workers or [1])
            if w * baseline_batch <= len(data[1])
        ]  # fmt: skip
    settings = {
        "epochs": args.epochs,
        "virtual_nodes": args.virtual_nodes,
        "lr": args.lr,
        "seed": args.seed,
        "timeout": args.timeout,
    }
    print(
        f"vflow {vflow.__version__} demo: digits ({len(data[1])} train / {len(data[3])} "
        f"test), global batch B={args.batch_size}, V={args.virtual_nodes}, {args.epochs} "
        f"epoch(s), SGD(lr={args.lr}, momentum=0.9), deterministic=True; baseline: data "
        f"parallel (DDP) with {baseline_batch} samples per device",
        flush=True,
    )
    total_steps = sum(args.epochs * (len(data[1]) // run.global_batch) for run in runs)
    bar = ProgressBar(total_steps)
    outcomes = [run_one(run, settings, data, bar) for run in runs]
    bar.finish()

    first = outcomes[0]
    for outcome in outcomes:
        outcome.max_param_diff = max(
            float(abs(p - q).max()) for p, q in zip(outcome.params, first.params, strict=True)
        )
    vflow_runs = [o for o in outcomes if o.run.counts is not None]
    identical = all(o.max_param_diff == 0.0 for o in vflow_runs)
    same_losses = all(o.losses == vflow_runs[0].losses for o in vflow_runs)

    headers = ["run", "workers", "global batch", "steps", "final loss", "test acc",
               "max |param diff| vs first", "train s", "wall s"]  # fmt: skip
    rows = [
        [
            o.run.name,
            str(o.run.workers),
            str(o.run.global_batch),
            str(len(o.losses)),
            f"{o.losses[-1]:.4f}",
            f"{o.test_accuracy:.3f}",
            f"{o.max_param_diff:.2e}" if o.max_param_diff else "0",
            f"{o.seconds:.1f}",
            f"{o.wall_seconds:.1f}",
        ]
        for o in outcomes
    ]
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    print()
    print(
        "  ".join(
            h.ljust(w) if i == 0 else h.rjust(w)
            for i, (h, w) in enumerate(zip(headers, widths, strict=True))
        )
    )
    print("  ".join("-" * w for w in widths))
    for row in rows:
        print(
            "  ".join(
                c.ljust(w) if i == 0 else c.rjust(w)
                for i, (c, w) in enumerate(zip(row, widths, strict=True))
            )
        )
    print()
    verdict = (
        f"vflow: the {len(vflow_runs)} mappings end with bitwise-identical parameters "
        f"(max parameter difference 0) and identical loss curves"
        if identical and same_losses
        else "vflow: the mappings DIFFER (expected bitwise-identical results)"
    )
    print(verdict)
    baselines = [o for o in outcomes if o.run.counts is None]
    if baselines:
        worst = max(o.max_param_diff or 0.0 for o in baselines)
        print(
            "baseline: the global batch grows with the worker count, so the same "
            "hyperparameters train a different model on every worker count (max parameter "
            f"difference to the first run up to {worst:.2e})"
        )

    args.out.mkdir(parents=True, exist_ok=True)
    png = args.out / "loss_curves.png"
    plot(
        outcomes,
        png,
        f"digits, B={args.batch_size}, V={args.virtual_nodes}: vflow mappings (blue, "
        "identical) vs data-parallel baseline",
    )
    record = {
        "settings": settings | {"batch_size": args.batch_size, "baseline_batch": baseline_batch},
        "vflow_identical": identical and same_losses,
        "runs": [
            {
                **asdict(o.run),
                "losses": o.losses,
                "test_accuracy": o.test_accuracy,
                "seconds": o.seconds,
                "wall_seconds": o.wall_seconds,
                "max_param_diff": o.max_param_diff,
            }
            for o in outcomes
        ],
    }
    (args.out / "results.json").write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {png} and {args.out / 'results.json'}")
    return 0 if identical and same_losses else 1
