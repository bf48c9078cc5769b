"""``python -m vflow demo``: the main job end to end.

A small CNN on scikit-learn's bundled digits, trained with the same global batch B and
V virtual nodes under several mappings onto real Gloo worker processes (vflow.demo.
mappings), beside the data-parallel baseline; then the heterogeneous row (vflow.demo.
heterogeneous), the pipeline row (vflow.demo.pipeline_row) and the elastic scenario
(vflow.demo.elastic_scenario). It shows a
progress bar, prints the tables, writes loss_curves.png, results.json, elastic.png and
elastic.json, and exits with status 1 if the vflow runs do not end bitwise identical
(the heterogeneous runs included), the pipeline runs not with each other, or the
elastic job not with the fixed-hardware run's.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path

import vflow
from vflow.bench.table import format_table
from vflow.demo import elastic_scenario, heterogeneous, pipeline_row, plots
from vflow.demo.digits import load_digits_split
from vflow.demo.mappings import (
    Run,
    compare_with_first,
    default_mappings,
    describe,
    plan_counts,
    run_together,
)
from vflow.demo.progress import ProgressBar

DESCRIPTION = (
    "Train a small CNN on scikit-learn's digits with the same global batch B and V "
    "virtual nodes on 1, 2 and 4 Gloo worker processes and an uneven plan "
    "(deterministic mode: the runs end bitwise identical), beside data parallelism "
    "without virtual nodes, whose global batch grows with the worker count, and on 2 "
    "workers of which one is emulated at half speed, with the even plan and with "
    'plan="auto" (same bits, higher throughput). Then a residual MLP cut into 2 '
    "pipeline stages, on 2 replicas and on 1 (half the processes, same bits). Then an "
    "elastic job (vflow.elastic) with the same settings: one worker grows to three, one "
    "is killed with SIGKILL mid-step, another joins, and the job ends bitwise equal to "
    "the fixed-hardware run. Prints tables and writes loss_curves.png, results.json, "
    "elastic.png and elastic.json to --out."
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m vflow demo", description=DESCRIPTION)
    parser.add_argument(
        "--epochs", type=int, default=3, help="passes over the training set (default: 3)"
    )
    parser.add_argument("--batch-size", type=int, default=64, help="global batch B (default: 64)")
    parser.add_argument(
        "--virtual-nodes",
        type=int,
        default=12,
        help="virtual nodes V per step (default: 12, which whole VNs can split 2:1 "
        "exactly for the heterogeneous row)",
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
        help="skip the elastic scenario (vflow/demo/elastic_scenario.py: --epochs epochs, at "
        f"least {elastic_scenario.MIN_STEPS} steps; it needs V >= {elastic_scenario.WORKERS})",
    )
    parser.add_argument(
        "--no-heterogeneous",
        action="store_true",
        help="skip the 2 runs on workers of speeds 2:1 (emulated), even plan and "
        'plan="auto" (they need V >= 2)',
    )
    parser.add_argument(
        "--no-pipeline",
        action="store_true",
        help="skip the pipeline row (vflow/demo/pipeline_row.py: 2 stages on 2 replicas and on "
        "1, beside 1 process; its V is the largest divisor of B up to --virtual-nodes)",
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
    if not args.no_elastic and args.virtual_nodes < elastic_scenario.WORKERS:
        parser.error(
            f"the elastic scenario grows to {elastic_scenario.WORKERS} workers: it needs "
            f"--virtual-nodes >= {elastic_scenario.WORKERS} (or --no-elastic)"
        )
    if not args.no_pipeline:
        try:
            pipeline_row.virtual_nodes_for(args.batch_size, args.virtual_nodes)
        except ValueError as exc:
            parser.error(f"{exc} (or --no-pipeline)")
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

    # Runs in one group train side by side (vflow.demo.mappings.run_together): the
    # heterogeneous row's even and automatic plans, whose speeds are compared.
    groups = [[Run(f"vflow, {describe(c)}", len(c), args.batch_size, c)] for c in mappings]
    if not args.no_heterogeneous and args.virtual_nodes >= len(heterogeneous.SLOWDOWN):
        groups.append(heterogeneous.runs(args.virtual_nodes, args.batch_size))
    if not args.no_baseline:
        groups += [
            [Run(f"baseline, {w} worker{'s' if w > 1 else ''} x {baseline_batch}", w,
                 w * baseline_batch, None)]
            for w in (even_workers or [1])
            if w * baseline_batch <= len(data[1])
        ]  # fmt: skip
    runs = [run for group in groups for run in group]
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
        outcomes = [o for group in groups for o in run_together(group, settings, data, bar)]
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
    hetero_outcomes = [o for o in outcomes if o.run.slowdown is not None]
    if hetero_outcomes:
        print()
        print(heterogeneous.table(hetero_outcomes, args.virtual_nodes))
    baselines = [o for o in outcomes if o.run.counts is None]
    if baselines:
        worst = max(o.max_param_diff or 0.0 for o in baselines)
        print(
            "baseline: the global batch grows with the worker count, so the same "
            "hyperparameters train a different model on every worker count (max parameter "
            f"difference to the first run up to {worst:.2e})"
        )

    pipeline_ok = True
    pipeline_record = None
    if not args.no_pipeline:
        pipeline_v = pipeline_row.virtual_nodes_for(args.batch_size, args.virtual_nodes)
        pipeline_settings = settings | {
            "batch_size": args.batch_size,
            "virtual_nodes": pipeline_v,
            "steps": args.epochs * (len(data[1]) // args.batch_size),
        }
        print(
            f"\npipeline row: B={args.batch_size}, V={pipeline_v}, "
            f"{pipeline_settings['steps']} steps, AdamW(lr={pipeline_row.LR}), "
            "deterministic=True",
            flush=True,
        )
        pipelined = pipeline_row.run(pipeline_settings)
        pipeline_ok = pipeline_row.identical(pipelined)
        print(pipeline_row.table(pipelined, pipeline_v))
        print(
            "pipeline: the 3 runs end with bitwise-identical parameters and loss curves"
            if pipeline_ok
            else "pipeline: the runs DIFFER (expected bitwise-identical results)"
        )
        pipeline_record = {
            "virtual_nodes": pipeline_v,
            "identical": pipeline_ok,
            "runs": [
                {
                    "stages": o.stages,
                    "replicas": o.replicas,
                    "step_seconds": o.step_seconds,
                    "predicted_step_seconds": pipeline_row.predicted_step_seconds(
                        o, pipelined[0], pipeline_v
                    ),
                    "peak_mib": o.peak_mib,
                    "losses": o.losses,
                }
                for o in pipelined
            ],
        }

    args.out.mkdir(parents=True, exist_ok=True)
    png = args.out / "loss_curves.png"
    plots.loss_curves(
        outcomes,
        png,
        f"digits, B={args.batch_size}, V={args.virtual_nodes}: vflow mappings (blue, "
        "identical) vs data-parallel baseline",
    )
    record = {
        "settings": settings | {"batch_size": args.batch_size, "baseline_batch": baseline_batch},
        "vflow_identical": identical and same_losses,
        "pipeline": pipeline_record,
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
                "plan_decisions": o.plan_decisions,
            }
            for o in outcomes
        ],
    }
    (args.out / "results.json").write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {png} and {args.out / 'results.json'}")
    ok = identical and same_losses and pipeline_ok
    if not args.no_elastic:
        ok = elastic_scenario.run(settings | {"batch_size": args.batch_size}, data, args.out) and ok
    return 0 if ok else 1
