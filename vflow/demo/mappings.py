"""The main job's runs: a small CNN on scikit-learn's bundled digits, trained with the
same global batch B and V virtual nodes under several mappings of the VNs onto real
Gloo worker processes — 1 worker x V VNs, 2 x V/2, 4 x V/4 and an uneven plan — in
deterministic mode, beside the baseline users get without virtual nodes: data
parallelism with a fixed per-device batch, whose global batch (and so training)
changes with the number of workers.

``run_together`` trains one ``Run``, or several side by side with their steps
interleaved, on worker processes of their own (vflow.world.launch) and returns each
run's ``Outcome``: losses, test accuracy, times and every parameter after every step,
from which ``compare_with_first`` derives the parameter differences to the first run. The
command line that puts the runs together is vflow.demo.cli.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

import vflow
from vflow.demo.digits import accuracy, cross_entropy, epoch_order, make_model
from vflow.demo.progress import ProgressBar
from vflow.planning.emulation import SlowDown
from vflow.world import launch
from vflow.world.group import World

# The store key under which rank 0 counts the steps it has done, for the progress bar.
_PROGRESS_KEY = "vflow/demo/steps"
# Per rendezvous and collective inside the workers.
_COLLECTIVE_TIMEOUT_S = 120.0


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
    # plan="auto": every time the planner weighed a plan, taken or not, in words
    # (vflow.PlanDecision.describe), with the step it was for.
    plan_decisions: list[str] = field(default_factory=list)
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
    rank: int,
    world_size: int,
    runs: list[Run],
    args: dict[str, Any],
    data: tuple[torch.Tensor, ...],
) -> list[Outcome] | None:
    """One worker of ``runs`` (started by vflow.world.launch, one torch thread: several
    workers share the cores, and one intra-op thread is also a condition of bitwise
    reproducibility on CPU), stepped in turn: step k of every run, then step k + 1, so
    that runs compared with each other meet the same load on shared cores (see
    ``run_together``). Rank 0 returns the outcomes."""
    progress = launch.current_store() if rank == 0 else None
    trainers = [_Trainer(rank, run, args, data, dist.group.WORLD, progress) for run in runs]
    for epoch in range(args["epochs"]):
        # The data order depends on (seed, epoch) alone: every run sees the same samples
        # in the same order, in batches of its own global size.
        order = epoch_order(len(data[1]), args["seed"], epoch)
        for step in range(max(t.steps_per_epoch for t in trainers)):
            for trainer in trainers:
                if step < trainer.steps_per_epoch:
                    trainer.step(order, step)
    outcomes = [trainer.finish() for trainer in trainers]
    return outcomes if rank == 0 else None


class _Trainer:
    """One run's model, optimizer and vflow executor (or DDP for the baseline) on this
    worker, and the outcome it builds step by step."""

    def __init__(
        self,
        rank: int,
        run: Run,
        args: dict[str, Any],
        data: tuple[torch.Tensor, ...],
        group: dist.ProcessGroup,
        progress: dist.Store | None,
    ) -> None:
        self._rank, self._run, self._data, self._progress = rank, run, data, progress
        self._model = make_model(args["seed"])
        self._optimizer = torch.optim.SGD(self._model.parameters(), lr=args["lr"], momentum=0.9)
        self.outcome = Outcome(run)
        self.steps_per_epoch = len(data[1]) // run.global_batch
        self.outcome.steps_per_epoch = self.steps_per_epoch
        self._ex: vflow.Executor | None = None
        self._ddp: nn.parallel.DistributedDataParallel | None = None
        self._busy_s = 0.0  # in this run's steps and its bookkeeping
        started = time.perf_counter()
        if run.counts is not None:
            loss_fn: Any = cross_entropy
            if run.slowdown is not None:
                loss_fn = SlowDown(cross_entropy, run.slowdown[rank])
            self._ex = vflow.Executor(
                self._model,
                self._optimizer,
                loss_fn,
                args["virtual_nodes"],
                seed=args["seed"],
                plan="auto" if run.auto_plan else vflow.Plan(counts=list(run.counts)),
                process_group=group,
                deterministic=True,
            )
        else:
            self._ddp = nn.parallel.DistributedDataParallel(self._model, process_group=group)
            # Not dist.all_reduce: see Note [Collectives on tensors Python cannot see].
            self._collectives = World(group, timedelta(seconds=_COLLECTIVE_TIMEOUT_S))
        self._trajectory: list[np.ndarray] = []
        self._vn_times: list[list[float]] = [[] for _ in range(run.workers)]
        self._busy_s += time.perf_counter() - started

    def step(self, order: torch.Tensor, step: int) -> None:
        run, outcome = self._run, self.outcome
        x_train, y_train = self._data[0], self._data[1]
        started = time.perf_counter()
        idx = order[step * run.global_batch : (step + 1) * run.global_batch]
        if self._ex is not None:
            loss = self._ex.step((x_train[idx], y_train[idx])).loss
        else:
            assert self._ddp is not None
            per_device = run.global_batch // run.workers
            mine = idx[self._rank * per_device : (self._rank + 1) * per_device]
            self._optimizer.zero_grad(set_to_none=True)
            local = cross_entropy(self._ddp, (x_train[mine], y_train[mine]))
            local.backward()
            self._optimizer.step()
            loss = local.detach()
            self._collectives.sum([loss], "all-reduce of the baseline's loss", step)
            loss = (loss / run.workers).item()
        outcome.step_seconds.append(time.perf_counter() - started)
        profile = self._ex.last_profile if self._ex is not None else None
        if profile is not None and self._progress is not None:
            for w, worker in enumerate(profile.workers):
                self._vn_times[w] += [vn.forward_s + vn.backward_s for vn in worker.vns]
        outcome.losses.append(loss)
        if self._progress is not None:
            self._trajectory.append(
                torch.cat([p.detach().flatten() for p in self._model.parameters()]).numpy()
            )
            self._progress.add(_PROGRESS_KEY, 1)
        self._busy_s += time.perf_counter() - started

    def finish(self) -> Outcome:
        outcome, ex = self.outcome, self._ex
        outcome.seconds = self._busy_s
        if ex is not None:
            outcome.vn_seconds = [float(np.median(t)) if t else math.nan for t in self._vn_times]
            outcome.plan_changes = [
                {"step": c.step, "counts": list(c.new.counts), "reason": c.reason,
                 "predicted_gain": c.predicted_old_s / c.predicted_new_s}
                for c in ex.plan_history
            ]  # fmt: skip
            outcome.plan_decisions = [f"step {d.step}: {d.describe()}" for d in ex.plan_decisions]
            ex.close()
        outcome.test_accuracy = accuracy(self._model, self._data[2], self._data[3])
        # numpy, not torch: the result is pickled, and numpy arrays pickle as plain data.
        if self._trajectory:
            outcome.trajectory = np.stack(self._trajectory)
        return outcome


# ---- the parent ------------------------------------------------------------------------


def run_together(
    runs: list[Run], args: dict[str, Any], data: tuple[torch.Tensor, ...], bar: ProgressBar
) -> list[Outcome]:
    """Trains ``runs`` on one set of worker processes, their steps interleaved (step k
    of each run in turn), and returns their outcomes in order.

    Runs whose speeds are compared (the heterogeneous row's even and automatic plans)
    go together: on shared, noisy cores the load drifts over seconds, and two runs one
    after the other can meet different loads, while interleaved steps meet the same.
    Their results do not depend on it: each run has its own model, optimizer, executor
    and random streams, and the collectives of one step end before the next run's
    step starts. ``outcome.seconds`` is the time in the run's own steps; the wall time
    is the launch's, shared."""
    if not runs or len({run.workers for run in runs}) != 1:
        raise ValueError(
            f"runs must be a non-empty list of runs with one worker count, got "
            f"{[run.workers for run in runs]}"
        )
    bar.start_run(" + ".join(run.name for run in runs))

    def poll(store: dist.TCPStore) -> None:
        # add(key, 0) reads the counter and creates it if no step has been done yet.
        bar.update(store.add(_PROGRESS_KEY, 0))

    started = time.perf_counter()
    results = launch.run_ranks(
        runs[0].workers,
        _train_rank,
        runs,
        args,
        data,
        timeout=args["timeout"],
        collective_timeout=_COLLECTIVE_TIMEOUT_S,
        threads=1,
        fail_fast=True,
        poll=poll,
    )
    outcomes = results[0].value
    assert isinstance(outcomes, list) and len(outcomes) == len(runs)
    for outcome in outcomes:
        outcome.wall_seconds = time.perf_counter() - started
    bar.end_run()
    return outcomes


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
