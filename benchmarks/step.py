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

Run ``python benchmarks/step.py --help`` for options.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from _common import Mlp, add_common_args, fmt_ms, format_table, median, open_session, synchronize
from torch import nn

import vflow
import vflow.bench.records as bench_records
from vflow.mapping.batching import slice_batch, split_sizes
from vflow.runtime.clock import StepClock

TARGET_RATIO = 1.05  # vflow step time / hand loop step time, printed (not asserted)

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
        choices=["mlp", "cnn", "tiny"],
        default=["mlp", "cnn", "tiny"],
        help="tiny: a 16-wide MLP whose compute is negligible, to measure the fixed cost of a step",
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
    for key in args.models:
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
    return session.finish(records + headline_records(records))


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
