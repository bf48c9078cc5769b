"""How much of a data path's cost VN prefetching hides (vflow/data/prefetch.py).

Each VN's batch goes through a ``vn_transform`` of known cost L per VN, and the model's
forward+backward of a VN takes C. Three executors train the same model on the same
batches, interleaved step by step:

* compute only: no transform (nothing to load), the compute floor;
* no prefetch: ``prefetch=False``: every VN waits for its own transform, L + C per VN;
* prefetch: ``prefetch=True``: VN i+1's transform runs while VN i computes.

The ideal with prefetching is the compute-only step plus L for the step's first VN
(its batch is not known before ``step`` is called) plus, per later VN, whatever of L
exceeds C: ``ideal = compute_only + L + (V - 1) * max(0, L - C)``. The hidden fraction
is the share of the gap between no prefetching and the ideal that prefetching closed:
``hidden = (no_prefetch - prefetch) / (no_prefetch - ideal)``, the numerator the median
over paired steps (the summary's "gap closed", vflow/bench/records.py, computes it; this
script prints the same number); the target is >= 90 % when L <= C. C is measured (the
compute-only step's forward+backward time / V).

L is the transform's measured duration (median over its calls), not its nominal
value. Load kinds: ``sleep`` waits L (I/O-like: a read or a decode in another library that
releases the GIL); ``compute`` runs torch work calibrated to take L on one thread
(CPU-side preprocessing; it needs a free core to overlap, which a 2-core machine has
with one compute thread). On CUDA the batch is kept on the CPU, so every VN is also
copied to the GPU (pinned memory, side stream when prefetching).

Run ``python benchmarks/prefetch.py --help`` for options.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from _common import add_common_args, fmt_ms, format_table, iqr, median, open_session, synchronize
from torch import nn

import vflow
from vflow.bench.records import evaluate, headline, measurement, target

TARGET_HIDDEN = 0.9  # of the gap to the ideal, when L <= C


def make_model(width: int, depth: int, device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(256, width), nn.ReLU()]
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    layers.append(nn.Linear(width, 10))
    return nn.Sequential(*layers).to(device)


def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)


def calibrated_work(seconds: float) -> Callable[[], None]:
    """A torch computation that takes about ``seconds`` on one thread here."""
    a = torch.randn(192, 192)

    def work(reps: int) -> None:
        x = a
        for _ in range(reps):
            x = torch.tanh(x @ a) * 0.05

    work(2)
    start = time.perf_counter()
    work(20)
    per_rep = (time.perf_counter() - start) / 20
    reps = max(1, round(seconds / per_rep))
    return lambda: work(reps)


def make_transform(kind: str, seconds: float, durations: list[float]) -> vflow.VNTransform:
    """The transform, which appends how long each call really took to ``durations``
    (a sleep overshoots its argument; the calibration is approximate)."""
    work = (lambda: time.sleep(seconds)) if kind == "sleep" else calibrated_work(seconds)

    def transform(batch: Any, generator: torch.Generator) -> Any:
        start = time.perf_counter()
        work()
        durations.append(time.perf_counter() - start)
        return batch

    return transform


def measure(
    device: torch.device,
    *,
    virtual_nodes: int,
    batch_size: int,
    width: int,
    depth: int,
    load_s: float,
    kind: str,
    warmup: int,
    reps: int,
) -> dict[str, Any]:
    batches = [
        (torch.randn(batch_size, 256), torch.randint(0, 10, (batch_size,)))
        for _ in range(warmup + reps)
    ]
    if device.type != "cuda":
        batches = [(x.to(device), y.to(device)) for x, y in batches]
    durations: list[float] = []
    transform = make_transform(kind, load_s, durations)
    methods = {
        "compute only": {"prefetch": True, "vn_transform": None},
        "no prefetch": {"prefetch": False, "vn_transform": transform},
        "prefetch": {"prefetch": True, "vn_transform": transform},
    }
    executors = {}
    for name, kwargs in methods.items():
        model = make_model(width, depth, device)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        executors[name] = vflow.Executor(model, optimizer, loss_fn, virtual_nodes, **kwargs)
    times: dict[str, list[float]] = {name: [] for name in methods}
    fwd_bwd: list[float] = []
    losses: dict[str, list[float]] = {name: [] for name in methods}
    try:
        for k, batch in enumerate(batches):
            # Rotate the order so each method runs first, second and last equally often.
            names = list(methods)
            names = names[k % 3 :] + names[: k % 3]
            for name in names:
                synchronize(device)
                start = time.perf_counter()
                result = executors[name].step(batch)
                synchronize(device)
                elapsed = time.perf_counter() - start
                if k >= warmup:
                    times[name].append(elapsed)
                    losses[name].append(result.loss)
                    if name == "compute only":
                        fwd_bwd.append(result.timings.forward_backward)
    finally:
        for ex in executors.values():
            ex.close()
    compute_only = median(times["compute only"])
    per_vn = [t / virtual_nodes for t in fwd_bwd]
    nominal_s, load_s = load_s, median(durations) if durations else 0.0
    ideal = compute_only + load_s + (virtual_nodes - 1) * max(0.0, load_s - median(per_vn))
    return {
        "benchmark": "prefetch",
        "device": str(device),
        "load_kind": kind,
        "virtual_nodes": virtual_nodes,
        "global_batch": batch_size,
        "load_s": load_s,
        "load_nominal_s": nominal_s,
        "load_times_s": durations,
        "compute_per_vn_s": median(per_vn),
        "compute_per_vn_times_s": per_vn,
        "compute_only_s": compute_only,
        "no_prefetch_s": median(times["no prefetch"]),
        "prefetch_s": median(times["prefetch"]),
        "ideal_s": ideal,
        "iqr_s": {name: iqr(t) for name, t in times.items()},
        "losses_equal": losses["prefetch"] == losses["no prefetch"],
        "times_s": times,
    }


def headline_of(r: dict[str, Any], index: int, count: int) -> dict[str, Any]:
    """The record's headline: prefetching against no prefetching, the ideal as the limit;
    the share of the gap closed is judged where L <= C (and, for a CPU-bound load, where
    a core is free for it)."""
    requires: dict[str, int] = {}
    why = ""
    if r["load_kind"] == "compute":
        requires = {"min_cpus": 4}
        why = "a CPU-bound load needs a core of its own; of 2, the spare one goes to any other load"
    share = r["load_s"] / r["compute_per_vn_s"]
    return headline(
        "prefetch",
        # The loads are set from the measured compute, so the key numbers them instead
        # of naming a value that changes from run to run.
        f"prefetch/{r['load_kind']}/{index + 1}of{count}",
        f"{r['load_kind']} load L={share:.2f}C, V={r['virtual_nodes']}: gap to ideal closed",
        vflow=measurement(r["times_s"]["prefetch"]),
        baseline=measurement(r["times_s"]["no prefetch"], label="no prefetch"),
        limit=measurement(
            [r["ideal_s"]],
            label="ideal",
            note="limit = the ideal step: compute only + L + (V-1) max(0, L-C), from the "
            "measured compute-only step, L and C; noise can take prefetch below it",
        ),
        compare="gap closed",
        paired=True,
        context={
            "load": measurement(r["load_times_s"]),
            "compute": measurement(r["compute_per_vn_times_s"]),
        },
        target=target(
            ">=",
            TARGET_HIDDEN,
            requires=requires,
            when=[["load", "<=", "compute", "a load longer than a VN's compute cannot be hidden"]],
            why=why,
        ),
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(parser)
    parser.add_argument("--reps", type=int, default=None, help="timed steps (default 15, 4 quick)")
    parser.add_argument("--virtual-nodes", type=int, default=8, help="V (default 8)")
    parser.add_argument(
        "--load-ms",
        type=float,
        nargs="+",
        default=None,
        help="per-VN transform costs L in ms (default: 0.25, 0.5, 0.9 and 1.5 times the "
        "measured per-VN compute)",
    )
    parser.add_argument(
        "--load", choices=["sleep", "compute", "both"], default="both", help="load kind"
    )
    args = parser.parse_args(argv)
    if args.virtual_nodes < 2:
        parser.error("--virtual-nodes must be >= 2 (one VN has nothing to prefetch)")
    quick = args.quick
    reps = args.reps or (4 if quick else 15)
    warmup = 1 if quick else 2
    batch_size = 64 * args.virtual_nodes if quick else 128 * args.virtual_nodes
    width, depth = (256, 2) if quick else (512, 4)
    session = open_session(
        args, "vflow benchmark: VN prefetching against a data path of known cost", threads=1
    )
    device = session.device

    # The compute per VN sets the default loads; measured once up front.
    probe = measure(
        device,
        virtual_nodes=args.virtual_nodes,
        batch_size=batch_size,
        width=width,
        depth=depth,
        load_s=0.0,
        kind="sleep",
        warmup=1,
        reps=3,
    )
    per_vn = probe["compute_per_vn_s"]
    loads = (
        [ms / 1e3 for ms in args.load_ms]
        if args.load_ms
        else [f * per_vn for f in ((0.5, 1.5) if quick else (0.25, 0.5, 0.9, 1.5))]
    )
    kinds = ["sleep", "compute"] if args.load == "both" else [args.load]
    if device.type == "cuda" and "compute" in kinds and args.load == "both":
        kinds = ["sleep"]  # CPU-side torch work competes with nothing worth measuring here
    print(
        f"MLP {depth + 2} layers, width {width}; V={args.virtual_nodes}, "
        f"B={batch_size}; torch threads {torch.get_num_threads()}; per-VN compute "
        f"~{per_vn * 1e3:.1f} ms; {reps} steps per method after {warmup} warm-up, "
        "interleaved\n",
        flush=True,
    )
    records = []
    for kind in kinds:
        for load_s in loads:
            print(f"measuring load={kind} {load_s * 1e3:.1f} ms per VN ...", flush=True)
            records.append(
                measure(
                    device,
                    virtual_nodes=args.virtual_nodes,
                    batch_size=batch_size,
                    width=width,
                    depth=depth,
                    load_s=load_s,
                    kind=kind,
                    warmup=warmup,
                    reps=reps,
                )
            )
    headlines = []
    for kind in kinds:
        of_kind = [r for r in records if r["load_kind"] == kind]
        headlines += [
            {**headline_of(r, i, len(of_kind)), "env": session.env} for i, r in enumerate(of_kind)
        ]
    rows = []
    for r, h in zip(records, headlines, strict=True):
        # The table shows what the suite's summary will: one evaluation of the headline.
        row = evaluate(h)
        rows.append(
            [
                r["load_kind"],
                fmt_ms(r["load_s"]),
                fmt_ms(r["compute_per_vn_s"]),
                fmt_ms(r["compute_only_s"]),
                fmt_ms(r["no_prefetch_s"]),
                fmt_ms(r["prefetch_s"]),
                fmt_ms(r["ideal_s"]),
                "-" if row.ratio is None else f"{100 * row.ratio:.0f}%",
                row.result,
                "yes" if r["losses_equal"] else "NO",
            ]
        )
        if row.result_note:
            print(f"{r['load_kind']} L={fmt_ms(r['load_s'])} ms: target {row.result_note}")
    print(
        "\nstep times in ms (medians); L = transform cost per VN, C = compute per VN;"
        "\nideal = compute only + L + (V-1) max(0, L-C); hidden = (no prefetch - prefetch)"
        " / (no prefetch - ideal), the numerator a median over paired steps; target >= "
        f"{TARGET_HIDDEN:.0%} when L <= C (and, for compute loads, a free core)"
    )
    print(
        format_table(
            [
                "load",
                "L ms",
                "C ms",
                "compute only",
                "no prefetch",
                "prefetch",
                "ideal",
                "hidden",
                "target",
                "same losses",
            ],
            rows,
        )
    )
    return session.finish(records + headlines)


if __name__ == "__main__":
    sys.exit(main())
