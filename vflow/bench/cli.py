"""``python -m vflow bench``: the kernel-throughput microbenchmarks, from any folder.

Runs ``vflow.bench.kernels`` in this process, prints the environment, a table of every
method and the summary of the headline results (vflow, the peer baseline, the limit,
their ratio, the target and whether it was met here), and writes ``summary.json``.
The full suite (accumulate, step, distributed, prefetch) needs a source checkout: it is
``benchmarks/run.py`` there (``make bench``).
"""

from __future__ import annotations

import argparse
import datetime
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from vflow._extension import _C
from vflow.bench import kernels
from vflow.bench.summary import (
    BenchError,
    load_old_summary,
    print_report,
    rows_of,
    run_environment,
    write_summary,
)

PROG = "python -m vflow bench"


def suite_location() -> str:
    """Where the full suite is: this checkout's runner when vflow runs from one (an
    editable install), else a description of where to find it."""
    runner = Path(__file__).resolve().parents[2] / "benchmarks" / "run.py"
    if runner.is_file():
        return f"{runner} (make bench)"
    return "benchmarks/run.py in a source checkout of vflow (make bench there)"


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Kernel-throughput microbenchmarks of the installed vflow: the fused "
        "gradient accumulation (fp32 and bf16 gradients), scale_check_ and the exact "
        "accumulation of deterministic mode, against PyTorch's per-tensor, foreach and "
        "two-pass equivalents, with the copy bandwidth measured in the same run as the "
        "limit. The full suite (accumulate, step, distributed, prefetch) runs from a "
        "source checkout: benchmarks/run.py.",
    )
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument(
        "--quick",
        action="store_true",
        help=f"short run, {kernels.QUICK.numel / 1e6:g} M elements (the default; accepted so "
        "that callers can say so)",
    )
    mode.add_argument(
        "--full",
        action="store_true",
        help=f"longer run, {kernels.FULL.numel / 1e6:g} M elements (a ResNet-50's gradient), "
        "more rounds",
    )
    parser.add_argument(
        "--numel",
        type=int,
        default=None,
        help="elements of the gradient (default: set by --quick/--full)",
    )
    parser.add_argument(
        "--device", default=None, help="cpu, cuda or cuda:N (default: cuda if available)"
    )
    parser.add_argument(
        "--threads", type=int, default=None, help="torch intra-op threads (default: torch's)"
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        metavar="DIR",
        help="folder for summary.json (default: vflow_out/bench-<time>)",
    )
    parser.add_argument(
        "--compare",
        type=Path,
        default=None,
        metavar="OLD_SUMMARY",
        help="an earlier run's summary.json: adds its value and new/old to each row both have",
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="exit with status 1 when a target is missed (targets that are n/a on this "
        "machine do not count)",
    )
    args = parser.parse_args(list(argv))
    if args.numel is not None and args.numel < 64 * kernels.FULL.tensors:
        parser.error(f"--numel must be >= {64 * kernels.FULL.tensors}, got {args.numel}")
    if args.threads is not None and args.threads < 1:
        parser.error(f"--threads must be >= 1, got {args.threads}")
    return args


def pick_device(name: str | None) -> torch.device:
    device = torch.device(name or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise BenchError(f"--device {name}: torch sees no CUDA device")
        if not _C.built_with_cuda():
            raise BenchError(
                f"--device {name}: this build of vflow has no CUDA kernels; rebuild it "
                "against a CUDA build of torch"
            )
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    elif device.type != "cpu":
        raise BenchError(f"--device {name}: only cpu and cuda are supported")
    return device


def print_header(env: dict[str, Any]) -> None:
    print(
        f"torch {env['torch']} (vflow built against {env['torch_built_against']}), vflow "
        f"{env['vflow']}, python {env['python']}\ndevice: {env['device']} "
        f"({env['device_name']}); {env['cpu_count']} CPUs ({env['cpu_affinity']} usable), "
        f"torch threads {env['torch_threads']}; vflow CPU vector path "
        f"{env['vflow_cpu_vector_path']}, CUDA kernels "
        f"{'yes' if env['vflow_built_with_cuda'] else 'no'}\n",
        flush=True,
    )


def main(argv: Sequence[str]) -> int:
    args = parse_args(argv)
    settings = kernels.FULL if args.full else kernels.QUICK
    if args.numel is not None:
        settings = kernels.Settings(
            args.numel, settings.tensors, settings.rounds, settings.min_run_time
        )
    mode = "full" if args.full else "quick"
    print(
        f"{PROG} ({mode}): the kernel-throughput microbenchmarks of the installed vflow.\n"
        f"The full suite (accumulate, step, distributed, prefetch) is {suite_location()}.\n"
    )
    try:
        old = load_old_summary(args.compare) if args.compare else None
        device = pick_device(args.device)
    except BenchError as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return 2
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    out: Path = args.out or Path("vflow_out") / datetime.datetime.now().strftime(
        "bench-%Y%m%d-%H%M%S"
    )
    env = kernels.environment(device)
    print_header(env)

    started = time.monotonic()
    records, detail = kernels.run(device, settings)
    for record in records:
        record["env"] = env
    print(f"\nevery method (median over all timed blocks; IQR relative to the median):\n{detail}")
    print(f"\n=== summary ({mode}, {time.monotonic() - started:.0f} s) ===")
    rows = rows_of(records)
    counts = print_report(rows, old=old, old_path=args.compare, mode=mode)
    summary_path = out / "summary.json"
    write_summary(
        summary_path,
        argv=[*PROG.split(), *argv],
        seconds=time.monotonic() - started,
        environment=run_environment([{"env": env}], mode=mode),
        rows=rows,
        records=records,
        compared_with=args.compare,
    )
    print(f"wrote {summary_path}")
    if args.check and counts.missed:
        print(f"{PROG}: --check: {counts.missed} target(s) missed", file=sys.stderr)
        return 1
    return 0
