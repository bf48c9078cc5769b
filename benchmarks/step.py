"""vflow.Executor.step against a hand-written gradient-accumulation loop.

Both methods train their own copy of one model (same initial weights, same optimizer
settings) on the same global batch of B samples split into V virtual-node slices. The
hand loop is the textbook version::

    for each VN slice vn of n_i samples:
        (loss_fn(model, vn) * n_i / B).backward()   # autograd accumulates into p.grad
    optimizer.step(); optimizer.zero_grad()

Every measured step gets a fresh batch; step k of both methods uses the same batch k.
Measurements are interleaved (A, B, B, A, ...) so slow drift on a shared machine hits
both; the overhead is the median over batches of the two back-to-back step times' ratio,
beside each method's median step time. Per-phase times come from StepResult.timings for
vflow and from the same kind of clock for the hand loop.

The ``ranks2`` row measures the fixed cost of a distributed step: 2 Gloo ranks on this
machine (one torch thread each) train a 6-16-3 MLP on B = 48 as V = 12 VNs with
vflow.Executor, the same with deterministic=True, and a hand loop (its VN slices
accumulated into ``p.grad``, as under DDP's no_sync, the gradients being views of one
flat tensor that also holds the loss; one all-reduce of it; SGD). Each round runs one
step of each method on the same batch, in an order that rotates from round to round;
a step's time is its slowest rank's, and the ratios are medians over rounds of the
paired per-round ratios.

Run ``python benchmarks/step.py --help`` for options.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _common import Mlp, add_common_args, fmt_ms, format_table, median, open_session, synchronize
from torch import nn

import vflow
import vflow.bench.records as bench_records
from vflow.mapping.batching import slice_batch, split_sizes
from vflow.runtime.clock import StepClock
from vflow.runtime.step_stats import StatsLayout
from vflow.world import launch

TARGET_RATIO = 1.05  # vflow step time / hand loop step time, printed (not asserted)
# The ranks2 row (issue 34): vflow / the hand loop, and deterministic=True / the hand loop.
TARGET_RANKS = 1.10
TARGET_RANKS_DETERMINISTIC = 1.20

Batch = tuple[torch.Tensor, torch.Tensor]
MLP = Mlp(hidden=1024, layers=4)


def cross_entropy(model: nn.Module, batch: Batch) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)


@dataclass(frozen=True)
class ModelSpec:
    name: str
    build: Callable[[], nn.Module]
    make_batch: Callable[[int, torch.Generator, torch.device], Batch]
    global_batch: int
    virtual_nodes: tuple[int, ...]  # unless --vns says otherwise
    # Steps are short and noisy: more repetitions for the same confidence.
    reps_factor: int = 1


def mlp_batch(b: int, gen: torch.Generator, device: torch.device) -> Batch:
    x = torch.randn(b, 1024, generator=gen, device=device)
    return x, torch.randint(0, 10, (b,), generator=gen, device=device)


def tiny() -> nn.Module:
    """A model whose compute is negligible: its step time is the fixed cost of a step
    (per step and per VN) of whichever method runs it."""
    return nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 10))


def tiny_batch(b: int, gen: torch.Generator, device: torch.device) -> Batch:
    x = torch.randn(b, 16, generator=gen, device=device)
    return x, torch.randint(0, 10, (b,), generator=gen, device=device)


def cnn(classes: int = 10) -> nn.Module:
    def block(cin: int, cout: int, stride: int) -> list[nn.Module]:
        conv = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        return [conv, nn.BatchNorm2d(cout), nn.ReLU()]

    return nn.Sequential(
        *block(3, 32, 1),
        *block(32, 64, 2),
        *block(64, 128, 2),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(128, classes),
    )


def cnn_batch(b: int, gen: torch.Generator, device: torch.device) -> Batch:
    x = torch.randn(b, 3, 32, 32, generator=gen, device=device)
    return x, torch.randint(0, 10, (b,), generator=gen, device=device)


class HandLoop:
    """Standard gradient accumulation, the baseline vflow's overhead is measured against."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        virtual_nodes: int,
        device: torch.device,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.virtual_nodes = virtual_nodes
        self.device = device

    def step(self, batch: Batch) -> tuple[float, dict[str, float]]:
        total = batch[0].shape[0]
        clock = StepClock(self.device)
        step_start = clock.mark()
        loss_sum = torch.zeros((), device=self.device)
        offset = 0
        for size in split_sizes(total, self.virtual_nodes):
            vn = slice_batch(batch, offset, offset + size)
            offset += size
            loss = cross_entropy(self.model, vn) * (size / total)
            loss.backward()
            loss_sum += loss.detach()
        backward_end = clock.mark()
        self.optimizer.step()
        self.optimizer.zero_grad()
        # vflow's step returns the loss as a float too; reading it is part of the step.
        value = loss_sum.item()
        end = clock.mark()
        clock.finish(end)
        return value, {
            "forward_backward": clock.seconds(step_start, backward_end),
            "optimizer": clock.seconds(backward_end, end),
        }


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)


@dataclass
class Series:
    times: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    phases: dict[str, list[float]] = field(default_factory=dict)

    def add(self, seconds: float, loss: float, phases: dict[str, float]) -> None:
        self.times.append(seconds)
        self.losses.append(loss)
        for name, value in phases.items():
            self.phases.setdefault(name, []).append(value)

    def phase_medians(self) -> dict[str, float]:
        return {name: median(values) for name, values in self.phases.items()}


def bench_config(
    spec: ModelSpec,
    virtual_nodes: int,
    device: torch.device,
    *,
    warmup: int,
    reps: int,
    steps_per_rep: int,
) -> dict[str, Any]:
    torch.manual_seed(0)
    initial = spec.build().to(device)
    model_v = copy.deepcopy(initial)
    model_h = copy.deepcopy(initial)
    opt_v = make_optimizer(model_v)
    ex = vflow.Executor(model_v, opt_v, cross_entropy, virtual_nodes=virtual_nodes, seed=0)
    hand = HandLoop(model_h, make_optimizer(model_h), virtual_nodes, device)

    gen = torch.Generator(device=device).manual_seed(1234)
    batches = [
        spec.make_batch(spec.global_batch, gen, device)
        for _ in range(warmup + reps * steps_per_rep)
    ]

    def run_vflow(batch: Batch) -> tuple[float, dict[str, float]]:
        result = ex.step(batch)
        t = result.timings
        return result.loss, {
            "forward_backward": t.forward_backward,
            "reduce": t.reduce,
            "optimizer": t.optimizer,
        }

    methods = {"vflow": run_vflow, "hand": hand.step}
    series = {name: Series() for name in methods}
    try:
        for k in range(warmup):
            for fn in methods.values():
                fn(batches[k])
        synchronize(device)
        for rep in range(reps):
            # A B then B A: each method runs first equally often, so a warm-cache or
            # post-switch penalty falls on both.
            order = ["vflow", "hand"] if rep % 2 == 0 else ["hand", "vflow"]
            for name in order:
                for k in range(steps_per_rep):
                    batch = batches[warmup + rep * steps_per_rep + k]
                    synchronize(device)
                    t0 = time.perf_counter()
                    loss, phases = methods[name](batch)
                    synchronize(device)
                    series[name].add(time.perf_counter() - t0, loss, phases)
    finally:
        ex.close()

    v, h = series["vflow"], series["hand"]
    # Steps on the same batch are paired; their losses agree while the two models stay
    # numerically identical up to summation order, which checks the comparison is fair.
    loss_diff = max(
        abs(a - b) / max(abs(b), 1e-12) for a, b in zip(v.losses, h.losses, strict=True)
    )
    # Both series are in batch order, so index i of each is the step on batch i. The two
    # steps on one batch ran back to back, so their ratio is little affected by drift;
    # the median of these ratios is the headline overhead.
    pairs = list(zip(v.times, h.times, strict=True))
    return {
        "benchmark": "step",
        "model": spec.name,
        "params": sum(p.numel() for p in initial.parameters()),
        "virtual_nodes": virtual_nodes,
        "global_batch": spec.global_batch,
        "optimizer": "SGD(momentum=0.9)",
        "measured_steps": reps * steps_per_rep,
        "vflow_median_s": median(v.times),
        "hand_median_s": median(h.times),
        "ratio": statistics.median(a / b for a, b in pairs),
        "target_ratio": TARGET_RATIO,
        "ratio_of_medians": median(v.times) / median(h.times),
        "extra_s": statistics.median(a - b for a, b in pairs),
        "vflow_phases_s": v.phase_medians(),
        "hand_phases_s": h.phase_medians(),
        "max_loss_rel_diff": loss_diff,
        "vflow_times_s": v.times,
        "hand_times_s": h.times,
    }


def print_records(records: list[dict[str, Any]]) -> None:
    """The table of the single-process rows."""
    rows = []
    for r in records:
        vp, hp = r["vflow_phases_s"], r["hand_phases_s"]
        ok = r["ratio"] <= TARGET_RATIO
        rows.append(
            [
                r["model"],
                str(r["virtual_nodes"]),
                str(r["global_batch"]),
                fmt_ms(r["vflow_median_s"]),
                fmt_ms(r["hand_median_s"]),
                f"{r['ratio']:.3f}",
                f"{r['ratio_of_medians']:.3f}",
                f"<={TARGET_RATIO}: {'met' if ok else 'MISSED'}",
                fmt_ms(vp["forward_backward"]),
                fmt_ms(vp["reduce"]),
                fmt_ms(vp["optimizer"]),
                fmt_ms(hp["forward_backward"]),
                fmt_ms(hp["optimizer"]),
                f"{r['max_loss_rel_diff']:.1e}",
            ]
        )
    print(
        "\nstep times in ms (medians); ratio = median over batches of vflow / hand on the same"
        "\nbatch (back to back); med/med = ratio of the two medians"
    )
    print(
        format_table(
            [
                "model",
                "V",
                "B",
                "vflow",
                "hand",
                "ratio",
                "med/med",
                "target",
                "v fwd+bwd",
                "v reduce",
                "v opt",
                "h fwd+bwd",
                "h opt",
                "loss diff",
            ],
            rows,
        )
    )
    misses = [r for r in records if r["ratio"] > TARGET_RATIO]
    print(
        f"\ntarget ratio <= {TARGET_RATIO}: met in {len(records) - len(misses)} of "
        f"{len(records)} configs"
    )
    for r in misses:
        print(
            f"  MISSED {r['model']} V={r['virtual_nodes']}: ratio {r['ratio']:.3f} "
            f"(+{fmt_ms(r['extra_s'])} ms per step, median over batches)"
        )


# ---- The fixed cost of a distributed step: 2 Gloo ranks (the ranks2 row) ----

RANKS = 2
RANKS_B, RANKS_V = 48, 12
RANKS_METHODS = ("vflow", "deterministic", "hand")


def small_mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))


class FlatAllReduceLoop:
    """The hand loop on several ranks: this rank's VN slices accumulated into ``p.grad``
    (DDP's no_sync), the gradients being views of one flat tensor whose last element
    takes the loss, then one all-reduce (SUM) of it and SGD: one collective per step."""

    def __init__(self, model: nn.Module, slices: list[tuple[int, int]], total: int) -> None:
        self.model = model
        self.optimizer = make_optimizer(model)
        self.slices = slices
        self.total = total
        # Per step: forward+backward, all-reduce, optimizer seconds (StepResult.timings'
        # phases; the all-reduce is all wait).
        self.phases: list[tuple[float, float, float, float]] = []
        params = list(model.parameters())
        self.flat = torch.zeros(sum(p.numel() for p in params) + 1)
        offset = 0
        for p in params:
            p.grad = self.flat[offset : offset + p.numel()].view_as(p)
            offset += p.numel()

    def step(self, batch: Batch) -> float:
        began = time.perf_counter()
        self.flat.zero_()
        loss_sum = torch.zeros(())
        for start, stop in self.slices:
            loss = cross_entropy(self.model, slice_batch(batch, start, stop)) * (
                (stop - start) / self.total
            )
            loss.backward()
            loss_sum += loss.detach()
        self.flat[-1] = loss_sum
        backward_end = time.perf_counter()
        dist.all_reduce(self.flat)
        reduced = time.perf_counter()
        self.optimizer.step()
        loss = float(self.flat[-1])
        end = time.perf_counter()
        self.phases.append(
            (backward_end - began, reduced - backward_end, end - reduced, reduced - backward_end)
        )
        return loss


def _collectives_per_step(step: Callable[[Batch], Any], batches: list[Batch]) -> float:
    """c10d operations (collectives and point-to-point transfers) one step starts, counted
    with torch.profiler over ``batches``."""
    from torch.profiler import ProfilerActivity, profile

    # The profiler's backend logs every start and stop to stderr, whatever its log level.
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for batch in batches:
                    step(batch)
    finally:
        os.dup2(saved, 2)
        os.close(saved)
    count = sum(
        e.count
        for e in prof.key_averages()
        if e.key.startswith("c10d::") and "barrier" not in e.key
    )
    return count / len(batches)


def _collective_latency(numel: int, repeats: int) -> dict[str, float]:
    """Median seconds of a synchronous all-reduce and of an all-gather of ``numel``
    floats, each after a barrier: what Note [Small buckets by all-gather]
    (csrc/reduction/all_reduce.cpp) weighs for a small bucket."""
    tensor = torch.zeros(numel)
    gathered = [torch.empty(numel) for _ in range(dist.get_world_size())]
    ops: dict[str, Callable[[], Any]] = {
        "all_reduce": lambda: dist.all_reduce(tensor),
        "all_gather": lambda: dist.all_gather(gathered, tensor),
    }
    out = {}
    for name, op in ops.items():
        seconds = []
        for _ in range(repeats):
            dist.barrier()
            began = time.perf_counter()
            op()
            seconds.append(time.perf_counter() - began)
        out[name] = median(seconds)
    return out


def _ranks_main(rank: int, world_size: int, warmup: int, rounds: int) -> dict[str, Any]:
    torch.manual_seed(0)
    initial = small_mlp()
    models = {name: copy.deepcopy(initial) for name in RANKS_METHODS}
    executors = {
        name: vflow.Executor(
            models[name],
            make_optimizer(models[name]),
            cross_entropy,
            RANKS_V,
            seed=0,
            deterministic=name == "deterministic",
        )
        for name in ("vflow", "deterministic")
    }
    plan = executors["vflow"].plan
    sizes = split_sizes(RANKS_B, RANKS_V)
    starts = [sum(sizes[:vn]) for vn in range(RANKS_V + 1)]
    hand = FlatAllReduceLoop(
        models["hand"], [(starts[vn], starts[vn + 1]) for vn in plan.vns(rank)], RANKS_B
    )
    phases: dict[str, list[tuple[float, float, float, float]]] = {
        "vflow": [],
        "deterministic": [],
        "hand": hand.phases,
    }

    def executor_step(name: str) -> Callable[[Batch], float]:
        def run(batch: Batch) -> float:
            result = executors[name].step(batch)
            t = result.timings
            phases[name].append((t.forward_backward, t.reduce, t.optimizer, t.reduce_wait))
            return result.loss

        return run

    methods: dict[str, Callable[[Batch], float]] = {
        "vflow": executor_step("vflow"),
        "deterministic": executor_step("deterministic"),
        "hand": hand.step,
    }
    gen = torch.Generator().manual_seed(1234)
    batches = [
        (torch.randn(RANKS_B, 6, generator=gen), torch.randint(0, 3, (RANKS_B,), generator=gen))
        for _ in range(16)
    ]
    times: dict[str, list[float]] = {name: [] for name in RANKS_METHODS}
    losses: dict[str, list[float]] = {name: [] for name in RANKS_METHODS}
    try:
        for k in range(warmup):
            for step in methods.values():
                step(batches[k % len(batches)])
        for name in phases:
            phases[name].clear()
        for r in range(rounds):
            # Rotated, and reversed every other round: each method runs in each position
            # and after each other method equally often over 6 rounds.
            order = list(RANKS_METHODS[r % 3 :] + RANKS_METHODS[: r % 3])
            if (r // 3) % 2:
                order.reverse()
            batch = batches[r % len(batches)]
            for name in order:
                dist.barrier()
                t0 = time.perf_counter()
                losses[name].append(methods[name](batch))
                times[name].append(time.perf_counter() - t0)
        phase_medians = {
            name: [median([p[i] for p in values]) for i in range(4)]
            for name, values in phases.items()
        }
        collectives = {
            name: _collectives_per_step(methods[name], batches[:8]) for name in RANKS_METHODS
        }
        # The size of vflow's bucket 0 with the statistics' pieces behind it.
        stats_pieces = 4 * StatsLayout(RANKS_V, world_size).numel
        latency = _collective_latency(hand.flat.numel() - 1 + stats_pieces, max(50, rounds // 2))
    finally:
        for ex in executors.values():
            ex.close()
    return {
        "times": times,
        "losses": losses,
        "phases": phase_medians,
        "collectives": collectives,
        "latency": latency,
        "latency_numel": hand.flat.numel() - 1 + stats_pieces,
    }


def bench_ranks(warmup: int, rounds: int) -> dict[str, Any]:
    try:
        results = launch.run_ranks(
            RANKS, _ranks_main, warmup, rounds, timeout=600, threads=1, fail_fast=True
        )
    except (launch.RankError, TimeoutError) as e:
        raise SystemExit(f"ranks2 benchmark failed: {e}") from None
    values = [r.value for r in results]
    # A step ends on every rank when its slowest rank ends it.
    times = {
        name: [max(ts) for ts in zip(*(v["times"][name] for v in values), strict=True)]
        for name in RANKS_METHODS
    }
    hand = times["hand"]

    def ratios(name: str) -> list[float]:
        return [a / b for a, b in zip(times[name], hand, strict=True)]

    v0 = values[0]
    loss_diff = max(
        abs(a - b) / max(abs(b), 1e-12)
        for a, b in zip(v0["losses"]["vflow"], v0["losses"]["hand"], strict=True)
    )
    return {
        "benchmark": "step",
        "model": "mlp 6-16-3, 2 Gloo ranks",
        "ranks": RANKS,
        "threads_per_rank": 1,
        "params": sum(p.numel() for p in small_mlp().parameters()),
        "virtual_nodes": RANKS_V,
        "global_batch": RANKS_B,
        "optimizer": "SGD(momentum=0.9)",
        "measured_steps": rounds,
        "median_s": {name: median(times[name]) for name in RANKS_METHODS},
        "ratio": statistics.median(ratios("vflow")),
        "deterministic_ratio": statistics.median(ratios("deterministic")),
        "target_ratio": TARGET_RANKS,
        "deterministic_target_ratio": TARGET_RANKS_DETERMINISTIC,
        "phases_s": {
            name: dict(
                zip(("forward_backward", "reduce", "optimizer", "reduce_wait"), p, strict=True)
            )
            for name, p in v0["phases"].items()
        },
        "collectives_per_step": v0["collectives"],
        "collective_latency_s": v0["latency"],
        "collective_latency_numel": v0["latency_numel"],
        "max_loss_rel_diff": loss_diff,
        "times_s": times,
    }


def print_ranks(r: dict[str, Any]) -> None:
    m, ph, c = r["median_s"], r["phases_s"], r["collectives_per_step"]
    print(
        f"\n{r['model']}, B={r['global_batch']}, V={r['virtual_nodes']}, 1 torch thread per "
        f"rank, {r['measured_steps']} rounds (one step of each method per round, order "
        "rotated); a step's time is its slowest rank's; ratio = median over rounds of the "
        "method's step / the hand loop's; phases (rank 0's medians) from StepResult.timings, "
        "the hand loop's from the same kind of clock (its reduce: the all-reduce)"
    )
    rows = []
    for name, key, target in (
        ("vflow", "ratio", TARGET_RANKS),
        ("deterministic", "deterministic_ratio", TARGET_RANKS_DETERMINISTIC),
        ("hand", None, None),
    ):
        p = ph.get(name)
        rows.append(
            [
                name,
                fmt_ms(m[name]),
                "1" if key is None else f"{r[key]:.3f}",
                "" if target is None else f"<={target}: {'met' if r[key] <= target else 'MISSED'}",
                f"{c[name]:.1f}",
                "" if p is None else fmt_ms(p["forward_backward"]),
                "" if p is None else fmt_ms(p["reduce"]),
                "" if p is None else fmt_ms(p["reduce_wait"]),
                "" if p is None else fmt_ms(p["optimizer"]),
            ]
        )
    print(
        format_table(
            [
                "method",
                "step ms",
                "/ hand",
                "target",
                "c10d ops/step",
                "fwd+bwd",
                "reduce",
                "of it wait",
                "opt",
            ],
            rows,
        )
    )
    print(f"loss diff vflow vs hand (relative, max): {r['max_loss_rel_diff']:.1e}")
    lat = r["collective_latency_s"]
    print(
        f"one collective of {r['collective_latency_numel']} floats, synchronous, rank 0's "
        f"median: all_reduce {fmt_ms(lat['all_reduce'])} ms, all_gather "
        f"{fmt_ms(lat['all_gather'])} ms (Note [Small buckets by all-gather])"
    )


def ranks_headlines(r: dict[str, Any]) -> list[dict[str, Any]]:
    hand = bench_records.measurement(
        r["times_s"]["hand"], label="hand-written loop, one all-reduce"
    )
    why = "the per-round ratio of steps of a few ms on a shared machine needs many rounds"
    return [
        bench_records.headline(
            "step",
            f"step/ranks2/{name}",
            f"2 Gloo ranks, mlp 6-16-3, V=12: {label} / hand loop step",
            vflow=bench_records.measurement(r["times_s"][name]),
            baseline=hand,
            paired=True,
            target=bench_records.target("<=", target, requires={"min_samples": 100}, why=why),
            stated_ratio=r[key],
        )
        for name, label, key, target in (
            ("vflow", "vflow", "ratio", TARGET_RANKS),
            (
                "deterministic",
                "deterministic=True",
                "deterministic_ratio",
                TARGET_RANKS_DETERMINISTIC,
            ),
        )
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(parser)
    parser.add_argument(
        "--reps",
        type=int,
        default=None,
        help="interleaved repetitions per config (default 40, 3 with --quick)",
    )
    parser.add_argument(
        "--steps-per-rep",
        type=int,
        default=None,
        help="consecutive steps per method per repetition (default 1)",
    )
    parser.add_argument(
        "--vns",
        type=int,
        nargs="+",
        default=None,
        help="virtual node counts V (default: 1 4 8 for mlp and cnn, 1 8 32 for tiny)",
    )
    parser.add_argument(
        "--models",
        nargs="+",
        choices=["mlp", "cnn", "tiny", "ranks2"],
        default=["mlp", "cnn", "tiny", "ranks2"],
        help="tiny: a 16-wide MLP whose compute is negligible, to measure the fixed cost of a "
        "step; ranks2: the fixed cost of a distributed step (2 Gloo ranks, see above)",
    )
    args = parser.parse_args(argv)
    reps = args.reps or (3 if args.quick else 40)
    steps_per_rep = args.steps_per_rep or 1
    warmup = 1 if args.quick else 2
    session = open_session(args, "vflow benchmark: Executor.step vs hand-written accumulation")
    specs = {
        "mlp": ModelSpec(MLP.name, MLP.build, mlp_batch, 256, (1, 4, 8)),
        "cnn": ModelSpec("cnn 3xconv+BN", cnn, cnn_batch, 64, (1, 4, 8)),
        "tiny": ModelSpec("tiny mlp 16", tiny, tiny_batch, 64, (1, 8, 32), reps_factor=10),
    }
    print(
        f"optimizer SGD(momentum=0.9); {reps} interleaved reps x {steps_per_rep} step(s) "
        f"per method, after {warmup} warm-up step(s); times are medians\n",
        flush=True,
    )

    records = []
    for key in [m for m in args.models if m != "ranks2"]:
        spec = specs[key]
        for v in args.vns or spec.virtual_nodes:
            print(f"measuring {spec.name}, V={v}, B={spec.global_batch} ...", flush=True)
            records.append(
                bench_config(
                    spec,
                    v,
                    session.device,
                    warmup=warmup * spec.reps_factor,
                    reps=reps * spec.reps_factor,
                    steps_per_rep=steps_per_rep,
                )
            )

    if records:
        print_records(records)
    extra: list[dict[str, Any]] = []
    if "ranks2" in args.models:
        rounds = args.reps * 10 if args.reps else (30 if args.quick else 400)
        print(f"\nmeasuring the ranks2 row: {rounds} rounds ...", flush=True)
        ranks = bench_ranks(warmup=5 if args.quick else 30, rounds=rounds)
        print_ranks(ranks)
        extra = [ranks, *ranks_headlines(ranks)]
    return session.finish(records + headline_records(records) + extra)


# ---- Headline records for the suite's summary (vflow/bench/records.py) ----


def headline_records(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per model and V: vflow's step against the hand loop's on the same batches (raw
    times, paired); the summary computes the ratio and judges the target."""
    return [
        bench_records.headline(
            "step",
            f"step/{r['model']}/V={r['virtual_nodes']}",
            f"{r['model']} V={r['virtual_nodes']}: vflow / hand loop step",
            vflow=bench_records.measurement(r["vflow_times_s"]),
            baseline=bench_records.measurement(r["hand_times_s"], label="hand-written loop"),
            paired=True,
            target=bench_records.target(
                "<=",
                TARGET_RATIO,
                requires={"min_samples": 20},
                why="a 5 % budget is below the noise of a few steps (--quick runs 3)",
            ),
            stated_ratio=r["ratio"],
        )
        for r in records
    ]


if __name__ == "__main__":
    sys.exit(main())
