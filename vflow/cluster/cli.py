"""``python -m vflow cluster <simulate|run|generate>``: the cluster scheduler's commands.

* ``simulate --trace TRACE.json --policy NAME --out RESULT.json``: the discrete-event
  simulator (vflow/cluster/simulator.py);
* ``run --trace TRACE.json --policy NAME --out RESULT.json``: real elastic jobs on local
  emulated slots (vflow/cluster/runner.py);
* ``generate --seed N --out TRACE.json``: a trace in the shape of VirtualFlow's workload
  (vflow/cluster/workload.py).

A bad trace or option is an error naming the job and field (or the flag), and nothing
is written.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from vflow.cluster.flags import add_policy_arguments, policy_from_args
from vflow.cluster.policies import POLICIES
from vflow.cluster.simulator import MEASURED, Costs, simulate
from vflow.cluster.trace import TraceError, load_trace, write_json
from vflow.cluster.workload import VIRTUALFLOW, Shape, generate
from vflow.elastic.flags import seconds_or_zero

__all__ = ["main"]

PROG = "python -m vflow cluster"


def _out_path(text: str) -> Path:
    path = Path(text)
    if not path.parent.is_dir():
        raise argparse.ArgumentTypeError(f"its folder {str(path.parent)!r} does not exist")
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a folder, not a file")
    return path


def _simulate_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=f"{PROG} simulate",
        description="Simulate a trace under a scheduling policy (discrete events; "
        "Note [The simulator's model] in vflow/cluster/simulator.py) and write the "
        "jobs' completion times as JSON.",
    )
    parser.add_argument("--trace", required=True, help="TRACE.json (slots and jobs)")
    parser.add_argument("--policy", required=True, choices=list(POLICIES), help="the policy")
    parser.add_argument("--out", required=True, type=_out_path, help="RESULT.json to write")
    costs = (
        ("--grow-s", "grow_s", "a grow's cost"),
        ("--shrink-s", "shrink_s", "a shrink's cost"),
        ("--start-s", "start_s", "a job's first start's cost"),
        ("--restart-s", "restart_s", "a preempted job's restart's cost"),
        ("--start-per-worker-s", "start_per_worker_s", "added per worker to a (re)start's cost"),
    )
    release_help = (
        "seconds after its job's next step boundary until a released slot is free, which "
        "a start needing it waits for (Note [Slots released late]; default 0: at once)"
    )
    parser.add_argument(
        "--release-s", type=seconds_or_zero, default=MEASURED.release_s, metavar="SECONDS",
        help=release_help,
    )  # fmt: skip
    for flag, field, text in costs:
        default = getattr(MEASURED, field)
        parser.add_argument(
            flag,
            type=seconds_or_zero,
            default=default,
            metavar="SECONDS",
            help=f"{text}: seconds without progress (default {default}; 0: free)",
        )
    add_policy_arguments(parser)
    return parser


def _simulate(argv: list[str]) -> int:
    args = _simulate_parser().parse_args(argv)
    try:
        trace = load_trace(args.trace)
        policy = policy_from_args(args)
    except (TraceError, ValueError) as e:
        print(f"{PROG} simulate: error: {e}", file=sys.stderr)
        return 2
    costs = Costs(
        args.start_s,
        args.grow_s,
        args.shrink_s,
        args.restart_s,
        args.start_per_worker_s,
        args.release_s,
    )
    result = simulate(trace, policy, costs)
    write_json(args.out, result)
    print(
        f"{policy.name}: {len(result['jobs'])} jobs on {trace.slots} slots, average JCT "
        f"{result['avg_jct_s']:.1f} s, makespan {result['makespan_s']:.1f} s -> {args.out}"
    )
    return 0


_SHAPE_HELP = {
    "jobs": "jobs in the trace",
    "slots": "the cluster's slots",
    "arrivals_per_hour": "Poisson arrival rate, before --time-scale",
    "demands": "demands drawn from (slots)",
    "priorities": "priorities drawn from",
    "run_min_s": "a job's shortest run time alone on its demand, before --time-scale",
    "run_max_s": "a job's longest run time alone on its demand (log-uniform between)",
    "serial_min": "least serial fraction of a step (Amdahl)",
    "serial_max": "most serial fraction of a step",
    "step_min_s": "shortest step time on one worker",
    "step_max_s": "longest step time on one worker",
    "vn_per_slot": "a job's V is this times the slots (at least its demand)",
    "time_scale": "divides arrival gaps and run times (fewer steps)",
}


def _generate(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog=f"{PROG} generate",
        description="Write a synthetic trace in the shape of VirtualFlow's workload "
        "(vflow/cluster/workload.py says how it is drawn).",
    )
    parser.add_argument("--seed", type=int, default=0, help="the draw (default 0)")
    parser.add_argument("--out", required=True, type=_out_path, help="TRACE.json to write")
    for field in dataclasses.fields(Shape):
        default = getattr(VIRTUALFLOW, field.name)
        flag = "--" + field.name.replace("_", "-")
        if isinstance(default, tuple):
            kind = type(default[0])
            parser.add_argument(
                flag,
                type=lambda text, kind=kind: tuple(kind(part) for part in text.split(",")),
                default=None,
                metavar="A,B,...",
                help=f"{_SHAPE_HELP[field.name]}, comma-separated (default "
                + ",".join(f"{v:g}" for v in default)
                + (", those <= --slots)" if field.name == "demands" else ")"),
            )
        else:
            parser.add_argument(
                flag,
                type=type(default),
                default=default,
                help=f"{_SHAPE_HELP[field.name]} (default {default})",
            )
    args = parser.parse_args(argv)
    changes = {
        field.name: getattr(args, field.name)
        for field in dataclasses.fields(Shape)
        if getattr(args, field.name) is not None
    }
    if "demands" not in changes:
        changes["demands"] = tuple(d for d in VIRTUALFLOW.demands if d <= args.slots) or (1,)
    try:
        shape = VIRTUALFLOW.scaled(**changes)
    except (TypeError, ValueError) as e:
        parser.error(str(e))
    write_json(args.out, generate(shape, args.seed).to_json())
    print(f"{shape.jobs} jobs on {shape.slots} slots (seed {args.seed}) -> {args.out}")
    return 0


COMMANDS = {
    "simulate": "simulate a trace under a policy",
    "run": "run a trace's jobs for real, as elastic vflow jobs on local emulated slots",
    "generate": "write a synthetic trace in the shape of VirtualFlow's workload",
}


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        lines = [f"usage: {PROG} <command> [options]", "", "commands:"]
        lines += [f"  {name:<10}{text}" for name, text in COMMANDS.items()]
        print("\n".join(lines), file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "simulate":
        return _simulate(rest)
    if command == "generate":
        return _generate(rest)
    if command == "run":
        from vflow.cluster import runner

        return runner.main(rest)
    print(
        f"{PROG}: error: unknown command {command!r} (one of {', '.join(COMMANDS)})",
        file=sys.stderr,
    )
    return 2
