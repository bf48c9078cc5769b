"""The main job: a small CNN on scikit-learn's bundled digits, trained with the same
global batch B and V virtual nodes under several mappings of the VNs onto real Gloo
worker processes — 1 worker x V VNs, 2 x V/2, 4 x V/4 and an uneven plan — in
deterministic mode, beside the baseline users get without virtual nodes: data
parallelism with a fixed per-device batch, whose global batch (and so training)
changes with the number of workers.

It shows a progress bar (one line per run when the output is not a terminal), prints a
table (mapping, global batch, final loss and test accuracy, the largest parameter
difference to the first mapping, wall time), and writes to the output folder a PNG
with two panels — the loss curves, and the largest parameter difference to the first
run at every step, which stays exactly 0 for the vflow mappings and grows for the
baseline — and a JSON of every number.

Unless --no-heterogeneous, two more vflow runs on 2 workers of which the second is
emulated at half speed (vflow.emulation.SlowDown): the even plan and plan="auto", which
profiles the workers and moves VNs to the faster one. A second table gives their step
throughput side by side; their parameters too must equal the first run's bitwise.

Then, unless --no-elastic, the elastic scenario of vflow/demo_elastic.py: the same
training by vflow.elastic.ElasticJob while one worker grows to three, one of them is
killed with SIGKILL mid-step and another joins, checked bitwise against the
fixed-hardware run. The exit status is 1 if the vflow mappings do not end with
bitwise-identical parameters (the heterogeneous runs included), or the elastic job not
with the fixed-hardware run's.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import vflow
from vflow import launch, planner
from vflow.emulation import SlowDown
from vflow.table import format_table

DESCRIPTION = (
    "Train a small CNN on scikit-learn's digits with the same global batch B and V "
    "virtual nodes on 1, 2 and 4 Gloo worker processes and an uneven plan "
    "(deterministic mode: the runs end bitwise identical), beside data parallelism "
    "without virtual nodes, whose global batch grows with the worker count, and on 2 "
    "workers of which one is emulated at half speed, with the even plan and with "
    'plan="auto" (same bits, higher throughput). Then an '
    "elastic job (vflow.elastic) with the same settings: one worker grows to three, one "
    "is killed with SIGKILL mid-step, another joins, and the job ends bitwise equal to "
    "the fixed-hardware run. Prints tables and writes loss_curves.png, results.json, "
    "elastic.png and elastic.json to --out."
)
# The store key under which rank 0 counts the steps it has done, for the progress bar.
_PROGRESS_KEY = "vflow/demo/steps"
# Per rendezvous and collective inside the workers.
_COLLECTIVE_TIMEOUT_S = 120.0
# The elastic scenario's worker count and least number of steps (vflow/demo_elastic.py).
ELASTIC_WORKERS = 3
MIN_ELASTIC_STEPS = 12
# The heterogeneous runs: worker w's compute is SLOWDOWN[w] times slower (emulated).
SLOWDOWN = (1.0, 2.0)


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
    counts: tuple[int, ...] | None  # vflow plan (the first one under plan="auto"); None
    # for the baseline
    slowdown: tuple[float, ...] | None = None  # per worker, emulated (SlowDown)
    auto_plan: bool = False


@dataclass
class Outcome:
    run: Run
    losses: list[float] = field(default_factory=list)  # per step
    steps_per_epoch: int = 0
    test_accuracy: float = math.nan
    seconds: float = math.nan  # the training loop
    wall_seconds: float = math.nan  # from starting the workers to their result
    max_param_diff: float | None = None
    # Per step: the largest |parameter - first run's| at the same point of the data
    # (None where the first run has no step there: another global batch size).
    param_diff_per_step: list[float | None] = field(default_factory=list)
    # Every parameter, flattened, after every step (steps x parameters).
    trajectory: np.ndarray = field(default_factory=lambda: np.zeros((0, 0)), repr=False)
    step_seconds: list[float] = field(default_factory=list)  # rank 0's, per step
    # plan="auto": per change, the first step under the new plan, its counts, why, and
    # the predicted step time of the old plan over the new one.
    plan_changes: list[dict[str, Any]] = field(default_factory=list)
    # Per worker, the median seconds of one VN's forward and backward (vflow runs).
    vn_seconds: list[float] = field(default_factory=list)

    def data_points(self) -> list[tuple[int, int]]:
        """(epoch, samples of the epoch's order used so far) after each step: the same
        point of the data for runs of any global batch, since the order of an epoch
        depends on (seed, epoch) alone."""
        b, n = self.run.global_batch, self.steps_per_epoch
        return [(k // n, (k % n + 1) * b) for k in range(len(self.losses))]


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


def _train_rank(
    rank: int, world_size: int, run: Run, args: dict[str, Any], data: tuple[torch.Tensor, ...]
) -> Outcome | None:
    """One worker of ``run`` (started by vflow.launch, one torch thread: several workers
    share the cores, and one intra-op thread is also a condition of bitwise
    reproducibility on CPU). Rank 0 returns the outcome."""
    progress = launch.current_store() if rank == 0 else None
    outcome = _train(rank, run, args, data, dist.group.WORLD, progress)
    return outcome if rank == 0 else None


def _train(
    rank: int,
    run: Run,
    args: dict[str, Any],
    data: tuple[torch.Tensor, ...],
    group: dist.ProcessGroup,
    progress: dist.Store | None,
) -> Outcome:
    x_train, y_train, x_test, y_test = data
    model = make_model(args["seed"])
    optimizer = torch.optim.SGD(model.parameters(), lr=args["lr"], momentum=0.9)
    outcome = Outcome(run)
    steps_per_epoch = len(y_train) // run.global_batch
    outcome.steps_per_epoch = steps_per_epoch
    start = time.perf_counter()
    if run.counts is not None:
        loss_fn = cross_entropy
        if run.slowdown is not None:
            loss_fn = SlowDown(cross_entropy, run.slowdown[rank])
        ex = vflow.Executor(
            model,
            optimizer,
            loss_fn,
            args["virtual_nodes"],
            seed=args["seed"],
            plan="auto" if run.auto_plan else vflow.Plan(counts=list(run.counts)),
            process_group=group,
            deterministic=True,
        )
        ddp = None
    else:
        ex = None
        ddp = nn.parallel.DistributedDataParallel(model, process_group=group)
        # Not dist.all_reduce: see Note [Collectives on tensors Python cannot see].
        collectives = vflow.distributed.World(group, timedelta(seconds=_COLLECTIVE_TIMEOUT_S))
    per_device = run.global_batch // run.workers
    trajectory: list[np.ndarray] = []
    vn_times: list[list[float]] = [[] for _ in range(run.workers)]
    for epoch in range(args["epochs"]):
        # The data order depends on (seed, epoch) alone: every run sees the same samples
        # in the same order, in batches of its own global size.
        order = epoch_order(len(y_train), args["seed"], epoch)
        for step in range(steps_per_epoch):
            idx = order[step * run.global_batch : (step + 1) * run.global_batch]
            step_start = time.perf_counter()
            if ex is not None:
                loss = ex.step((x_train[idx], y_train[idx])).loss
            else:
                mine = idx[rank * per_device : (rank + 1) * per_device]
                optimizer.zero_grad(set_to_none=True)
                local = cross_entropy(ddp, (x_train[mine], y_train[mine]))
                local.backward()
                optimizer.step()
                loss = local.detach()
                collectives.sum([loss], "all-reduce of the baseline's loss", step)
                loss = (loss / run.workers).item()
            outcome.step_seconds.append(time.perf_counter() - step_start)
            profile = ex.last_profile if ex is not None else None
            if profile is not None and progress is not None:
                for w, worker in enumerate(profile.workers):
                    vn_times[w] += [vn.forward_s + vn.backward_s for vn in worker.vns]
            outcome.losses.append(loss)
            if progress is not None:
                trajectory.append(
                    torch.cat([p.detach().flatten() for p in model.parameters()]).numpy()
                )
                progress.add(_PROGRESS_KEY, 1)
    outcome.seconds = time.perf_counter() - start
    if ex is not None:
        outcome.vn_seconds = [float(np.median(t)) if t else math.nan for t in vn_times]
        outcome.plan_changes = [
            {"step": c.step, "counts": list(c.new.counts), "reason": c.reason,
             "predicted_gain": c.predicted_old_s / c.predicted_new_s}
            for c in ex.plan_history
        ]  # fmt: skip
        ex.close()
    outcome.test_accuracy = accuracy(model, x_test, y_test)
    # numpy, not torch: the result is pickled, and numpy arrays pickle as plain data.
    outcome.trajectory = np.stack(trajectory) if trajectory else outcome.trajectory
    return outcome


# ---- the parent ------------------------------------------------------------------------


class ProgressBar:
    """Steps done over all runs.

    On a terminal: one line redrawn in place (at most 10 times a second) with a bar, the
    share and count of steps done, the time so far, an estimate of the time left and
    the current run. Otherwise (a log, a pipe): one line per update, an update being a
    run starting or ending, so that a log shows how far the job got.
    """

    WIDTH = 30

    def __init__(self, total: int, stream: Any = sys.stderr) -> None:
        self.total, self.stream = max(1, total), stream
        self.done = self.run_start_done = 0
        self.label = ""
        self.start = self.run_start = time.perf_counter()
        self.last_draw = -math.inf
        self.interactive = bool(getattr(stream, "isatty", lambda: False)())

    def start_run(self, label: str) -> None:
        self.label = label
        self.run_start, self.run_start_done = time.perf_counter(), self.done
        if self.interactive:
            self._draw(force=True)
        else:
            self._line(f"{label} ...")

    def update(self, run_steps: int) -> None:
        """The current run has done ``run_steps`` steps."""
        self.done = self.run_start_done + run_steps
        if self.interactive:
            self._draw(force=False)

    def end_run(self) -> None:
        seconds = time.perf_counter() - self.run_start
        if self.interactive:
            self._draw(force=True)
        else:
            self._line(f"{self.label}: {self.done - self.run_start_done} steps in {seconds:.1f} s")

    def finish(self) -> None:
        if self.interactive:
            self.stream.write("\n")
            self.stream.flush()

    def _line(self, text: str) -> None:
        elapsed = time.perf_counter() - self.start
        self.stream.write(f"[{self.done}/{self.total} steps, {elapsed:.1f} s] {text}\n")
        self.stream.flush()

    def _draw(self, *, force: bool) -> None:
        now = time.perf_counter()
        if not force and now - self.last_draw < 0.1:
            return
        self.last_draw = now
        fraction = min(1.0, self.done / self.total)
        filled = round(self.WIDTH * fraction)
        elapsed = now - self.start
        # Steps of the later runs take about as long as those so far: a rough estimate,
        # shown once there is something to go on.
        left = f"~{elapsed * (1 - fraction) / fraction:.0f} s left" if self.done else ""
        self.stream.write(
            f"\r[{'#' * filled}{'.' * (self.WIDTH - filled)}] {100 * fraction:3.0f}% "
            f"{self.done}/{self.total} steps {elapsed:5.1f} s {left:<12} {self.label:<36.36}"
        )
        self.stream.flush()


def run_one(
    run: Run, args: dict[str, Any], data: tuple[torch.Tensor, ...], bar: ProgressBar
) -> Outcome:
    bar.start_run(run.name)

    def poll(store: dist.TCPStore) -> None:
        # add(key, 0) reads the counter and creates it if no step has been done yet.
        bar.update(store.add(_PROGRESS_KEY, 0))

    started = time.perf_counter()
    results = launch.run_ranks(
        run.workers,
        _train_rank,
        run,
        args,
        data,
        timeout=args["timeout"],
        collective_timeout=_COLLECTIVE_TIMEOUT_S,
        threads=1,
        fail_fast=True,
        poll=poll,
    )
    outcome = results[0].value
    assert isinstance(outcome, Outcome)
    outcome.wall_seconds = time.perf_counter() - started
    bar.end_run()
    return outcome


def compare_with_first(outcomes: list[Outcome]) -> None:
    """Sets each outcome's parameter differences to the first run: after the last step,
    and per step at the same point of the data."""
    first = outcomes[0]
    first_step = {point: k for k, point in enumerate(first.data_points())}
    for outcome in outcomes:
        outcome.max_param_diff = float(np.abs(outcome.trajectory[-1] - first.trajectory[-1]).max())
        outcome.param_diff_per_step = []
        for k, point in enumerate(outcome.data_points()):
            t = first_step.get(point)
            outcome.param_diff_per_step.append(
                None
                if t is None
                else float(np.abs(outcome.trajectory[k] - first.trajectory[t]).max())
            )


def speeds_label() -> str:
    """SLOWDOWN as relative speeds, e.g. "2:1"."""
    slowest = max(SLOWDOWN)
    return ":".join(f"{slowest / f:g}" for f in SLOWDOWN)


def steady_step_seconds(outcome: Outcome) -> float:
    """The median step time over the last half of the steps, when plan="auto" has long
    planned (it plans after a few steps)."""
    times = outcome.step_seconds[len(outcome.step_seconds) // 2 :]
    return float(np.median(times)) if times else math.nan


def _unit_models(slowdown: Sequence[float]) -> list[planner.WorkerModel]:
    """Worker w takes ``slowdown[w]`` units per VN, whatever its size."""
    return [planner.WorkerModel(per_vn_s=f, per_sample_s=0.0) for f in slowdown]


def _even_step_units(virtual_nodes: int, slowdown: Sequence[float]) -> float:
    even = vflow.Plan.even(virtual_nodes, len(slowdown))
    return planner.predict(even, _unit_models(slowdown), virtual_nodes).step_s


def best_whole_vn_gain(virtual_nodes: int, slowdown: Sequence[float]) -> float:
    """Step time of the even plan over that of the best counts plan (vflow.planner) when
    compute alone counts and worker w takes ``slowdown[w]`` units per VN: what moving
    whole, equal VNs can gain at these speeds."""
    best = planner.plan_counts(_unit_models(slowdown), virtual_nodes, virtual_nodes)
    return _even_step_units(virtual_nodes, slowdown) / best.step_s


def compute_bound_gain(virtual_nodes: int, slowdown: Sequence[float]) -> float:
    """The same for a perfect split of the compute (the sum of the workers' speeds)."""
    return _even_step_units(virtual_nodes, slowdown) * sum(1 / f for f in slowdown) / virtual_nodes


def _plan_path(outcome: Outcome) -> str:
    path = str(list(outcome.run.counts or ()))
    for change in outcome.plan_changes:
        path += f" -({change['step']})-> {change['counts']}"
    return path


def heterogeneous_table(outcomes: list[Outcome], virtual_nodes: int) -> str:
    """The heterogeneous runs side by side: plans, steady throughput, gain over even,
    and the bounds at the speeds set and at the speeds measured in the even run."""
    even = next(o for o in outcomes if not o.run.auto_plan)
    headers = ["run", "ms per VN by worker", "steady step ms", "samples/s", "vs even plan",
               "max |param diff| vs first", "plans"]  # fmt: skip
    rows = []
    for o in outcomes:
        step_s = steady_step_seconds(o)
        rows.append([
            o.run.name, " / ".join(f"{1e3 * t:.2f}" for t in o.vn_seconds),
            f"{1e3 * step_s:.1f}", f"{o.run.global_batch / step_s:.0f}",
            f"{steady_step_seconds(even) / step_s:.2f}x",
            f"{o.max_param_diff:.2e}" if o.max_param_diff else "0", _plan_path(o),
        ])  # fmt: skip
    lines = [
        "heterogeneous workers, EMULATED (vflow.emulation.SlowDown: worker w waits to run "
        f"{list(SLOWDOWN)} times slower); steady = median over the last half of the steps",
        format_table(headers, rows),
        f"bounds over the even plan, compute only (communication and the optimizer do not "
        f"shrink): speeds {speeds_label()} as set: "
        f"{compute_bound_gain(virtual_nodes, SLOWDOWN):.2f}x, "
        f"{best_whole_vn_gain(virtual_nodes, SLOWDOWN):.2f}x with V={virtual_nodes} whole VNs",
    ]
    measured = even.vn_seconds
    if measured and all(t > 0 for t in measured):
        fastest = min(measured)
        ratio = [t / fastest for t in measured]
        label = ":".join(f"{max(ratio) / r:.2f}" for r in ratio)
        lines[-1] += (
            f"; speeds {label} as measured in the even run: "
            f"{compute_bound_gain(virtual_nodes, ratio):.2f}x, "
            f"{best_whole_vn_gain(virtual_nodes, ratio):.2f}x with whole VNs"
        )
    return "\n".join(lines)


def plot(outcomes: list[Outcome], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (loss_ax, diff_ax) = plt.subplots(
        2, 1, figsize=(8, 7.5), sharex=True, gridspec_kw={"height_ratios": [3, 2]}
    )
    styles = ["-", "--", ":", "-."]
    baseline_colors = ["tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown"]
    vflow_index = baseline_index = 0
    for outcome in outcomes:
        epochs = [(k + 1) / outcome.steps_per_epoch for k in range(len(outcome.losses))]
        diffs = [(e, d) for e, d in zip(epochs, outcome.param_diff_per_step) if d is not None]
        if outcome.run.counts is not None:
            # Identical curves: distinct dash patterns keep every one of them visible.
            style = {
                "linestyle": styles[vflow_index % len(styles)],
                "color": "tab:blue",
                "linewidth": 2.2 - 0.4 * vflow_index,
            }
            vflow_index += 1
        else:
            style = {
                "color": baseline_colors[baseline_index % len(baseline_colors)],
                "alpha": 0.8,
                "linewidth": 1,
            }
            baseline_index += 1
        loss_ax.plot(epochs, outcome.losses, label=outcome.run.name, **style)
        if diffs and outcome is not outcomes[0]:
            diff_ax.plot(*zip(*diffs), label=outcome.run.name, **style)
    loss_ax.set_ylabel("training loss (global batch)")
    loss_ax.set_yscale("log")
    loss_ax.set_title(title, fontsize=10)
    loss_ax.legend(fontsize=8)
    diff_ax.set_xlabel("epoch")
    diff_ax.set_ylabel("max |param − first run's|", fontsize=9)
    # Linear near 0, logarithmic above: exact zeros stay on the axis while differences
    # from 1e-6 to 1 stay apart.
    diff_ax.set_yscale("symlog", linthresh=1e-6)
    # A little below 0, so that the vflow lines at exactly 0 are not hidden by the axis.
    diff_ax.set_ylim(bottom=-3e-7)
    diff_ax.set_title(
        f"largest parameter difference to the first run ({outcomes[0].run.name}) after the "
        "same samples",
        fontsize=9,
    )
    if vflow_index > 1:
        diff_ax.annotate(
            "every vflow mapping: exactly 0 at every step",
            xy=(0.01, 0.1),
            xycoords="axes fraction",
            color="tab:blue",
            fontsize=9,
        )
    diff_ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m vflow demo", description=DESCRIPTION)
    parser.add_argument(
        "--epochs", type=int, default=3, help="passes over the training set (default: 3)"
    )
    parser.add_argument("--batch-size", type=int, default=64, help="global batch B (default: 64)")
    parser.add_argument(
        "--virtual-nodes", type=int, default=8, help="virtual nodes V per step (default: 8)"
    )
    parser.add_argument(
        "--mappings",
        nargs="+",
        default=None,
        metavar="SPEC",
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
    parser.add_argument(
        "--no-elastic",
        action="store_true",
        help="skip the elastic scenario (vflow/demo_elastic.py: --epochs epochs, at least "
        f"{MIN_ELASTIC_STEPS} steps; it needs V >= {ELASTIC_WORKERS})",
    )
    parser.add_argument(
        "--no-heterogeneous",
        action="store_true",
        help="skip the 2 runs on workers of speeds 2:1 (emulated), even plan and "
        'plan="auto" (they need V >= 2)',
    )
    parser.add_argument(
        "--lr", type=float, default=0.05, help="SGD learning rate, momentum 0.9 (default: 0.05)"
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed of the model, the data split and order, and vflow's per-VN random "
        "streams (default: 0)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("vflow_out/demo"),
        help="output folder for loss_curves.png, results.json, elastic.png, elastic.json "
        "and the elastic workers' files (default: vflow_out/demo)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=600.0,
        help="seconds per run, and for the whole elastic scenario, before the workers are "
        "stopped (default: 600)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
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
    if not args.timeout > 0:
        parser.error(f"--timeout must be > 0, got {args.timeout}")
    if args.baseline_batch is not None and args.baseline_batch < 1:
        parser.error(f"--baseline-batch must be >= 1, got {args.baseline_batch}")
    if not args.no_elastic and args.virtual_nodes < ELASTIC_WORKERS:
        parser.error(
            f"the elastic scenario grows to {ELASTIC_WORKERS} workers: it needs "
            f"--virtual-nodes >= {ELASTIC_WORKERS} (or --no-elastic)"
        )
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

    runs = [Run(f"vflow, {describe(c)}", len(c), args.batch_size, c) for c in mappings]
    if not args.no_heterogeneous and args.virtual_nodes >= len(SLOWDOWN):
        even = vflow.Plan.even(args.virtual_nodes, len(SLOWDOWN)).counts
        runs += [
            Run(f"vflow, {len(SLOWDOWN)} workers at speeds {speeds_label()} (emulated), {kind}",
                len(SLOWDOWN), args.batch_size, even, SLOWDOWN, kind == 'plan="auto"')
            for kind in ("even plan", 'plan="auto"')
        ]  # fmt: skip
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
    try:
        outcomes = [run_one(run, settings, data, bar) for run in runs]
    finally:
        bar.finish()
    compare_with_first(outcomes)
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
    print()
    print(format_table(headers, rows))
    print()
    verdict = (
        f"vflow: the {len(vflow_runs)} mappings end with bitwise-identical parameters "
        f"(max parameter difference 0) and identical loss curves"
        if identical and same_losses
        else "vflow: the mappings DIFFER (expected bitwise-identical results)"
    )
    print(verdict)
    heterogeneous = [o for o in outcomes if o.run.slowdown is not None]
    if heterogeneous:
        print()
        print(heterogeneous_table(heterogeneous, args.virtual_nodes))
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
                "param_diff_per_step": o.param_diff_per_step,
                "step_seconds": o.step_seconds,
                "plan_changes": o.plan_changes,
            }
            for o in outcomes
        ],
    }
    (args.out / "results.json").write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {png} and {args.out / 'results.json'}")
    ok = identical and same_losses
    if not args.no_elastic:
        from vflow import demo_elastic

        ok = demo_elastic.run(settings | {"batch_size": args.batch_size}, data, args.out) and ok
    return 0 if ok else 1
