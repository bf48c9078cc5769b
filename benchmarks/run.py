"""The benchmark suite of a source checkout: runs the scripts of this folder (accumulate,
step, distributed, prefetch, heterogeneous, pipeline, pipeline_checkpoint, cluster,
store_load; elastic and elastic_scale only when named with ``--only``) one after another
and sums up their headline results in one table (``make bench``).

Each script runs as a file in a subprocess of this interpreter, as its README says to
run it, with ``--json`` into the output folder; its own tables stream to the terminal as
it measures. Among its JSON records, each script writes self-describing *headline
records* (``vflow/bench/records.py``): raw measurements of vflow, the peer baseline and
the limit, what the ratio is between, and the target with the conditions under which
it means something. The summary computes every ratio and verdict from those
measurements in one place, prints one row per headline with footnotes (what a limit is,
why a target is n/a here), counts the targets met and missed, and writes
``summary.json`` for a later ``--compare``.

The exit status is 1 when a script failed, timed out or wrote headline records that
could not be evaluated, and with ``--check`` also when a target was missed.
``python -m vflow bench`` runs the kernel microbenchmarks alone, from any folder.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import vflow
from vflow.bench.summary import (
    BenchError,
    Row,
    SummaryError,
    load_old_summary,
    print_report,
    rows_of,
    run_environment,
    write_summary,
)

Record = dict[str, Any]
PROG = "benchmarks/run.py"
HERE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Benchmark:
    name: str
    script: str
    about: str
    # distributed.py is CPU-only (Gloo) and has no --device option.
    takes_device: bool
    # Generous for a busy 2-core machine, where the quick runs take about 10-60 s each
    # and the full ones a few minutes; a hung script must not hang the whole suite.
    quick_timeout_s: float
    full_timeout_s: float
    # Run without --only (make bench); the others run only when --only names them.
    in_suite: bool = True


BENCHMARKS: dict[str, Benchmark] = {
    b.name: b
    for b in (
        Benchmark(
            "accumulate",
            "accumulate.py",
            "fused accumulate vs PyTorch per-tensor/foreach and copy bandwidth; exact kernels",
            True,
            300,
            1200,
        ),
        Benchmark(
            "step", "step.py", "Executor.step vs a hand-written accumulation loop", True, 300, 1200
        ),
        Benchmark(
            "distributed",
            "distributed.py",
            "2 Gloo ranks: vflow (default, ordered, exact) vs DDP + no_sync",
            False,
            # Above the script's own rank timeout (120 s quick, 600 s full), so that it
            # gets to report a hung rank itself.
            300,
            1200,
        ),
        Benchmark(
            "prefetch", "prefetch.py", "VN prefetching vs none vs the ideal", True, 300, 1200
        ),
        Benchmark(
            "heterogeneous",
            "heterogeneous.py",
            'Gloo ranks at emulated speeds 2:1 and 3:2:1: plan="auto" vs the even plan vs the '
            "limit; a straggler",
            False,
            # Above the script's own limits (3 runs of at most 80 s quick, 350 s full); the
            # quick run takes about 30 s, the full one about 3.5 min.
            300,
            1200,
        ),
        Benchmark(
            "pipeline",
            "pipeline.py",
            "PipelineExecutor on Gloo ranks: step vs the bubble formula, the halving, memory "
            "per stage vs an unsplit worker, vs torch.distributed.pipelining by hand",
            False,
            # Above the script's own limit (270 s quick, 1100 s full, all its groups of
            # processes together); the quick run takes about 40 s on 2 cores, the full
            # one about 100 s.
            300,
            1200,
        ),
        Benchmark(
            "pipeline_checkpoint",
            "pipeline_checkpoint.py",
            "vflow.pipeline.save on 2 x 2 Gloo ranks: each process's peak memory while saving "
            "against its training steps, beside the former gather-then-save",
            False,
            # Above the script's own limit (240 s quick, 600 s full); the quick run takes
            # about 25 s on 2 cores, the full one about 30 s.
            300,
            1200,
        ),
        Benchmark(
            "cluster",
            "cluster.py",
            "elastic cluster scheduling, simulated: priority, las, wfs, wfs-any average JCT on a "
            "VirtualFlow-shaped workload; a resize-cost sweep; 1,000 jobs on 64 slots",
            False,
            # The quick run (5 seeds, one timing of each 1,000-job simulation) takes about
            # 30 s on 2 busy cores, the full one (11 seeds, three timings) about 2 min;
            # --real, minutes of real jobs, is never run by the suite.
            300,
            1200,
        ),
        Benchmark(
            "store_load",
            "store_load.py",
            "the elastic control plane against one store: its capacity, requests per worker, "
            "a simulated crash's agreement and a knock's admission, N = 8 ... 1,024",
            False,
            # The quick run (N = 8 and 64) takes about a minute on 2 cores; the full one
            # (to N = 1,024) about 8 minutes.
            300,
            2400,
        ),
        Benchmark(
            "elastic",
            "elastic.py",
            "Gloo workers: ElasticJob leave, grow, SIGTERM, SIGKILL, SIGSTOP vs torchrun "
            "itself (default and tuned, checkpoint every K steps)",
            False,
            # Above the script's own limits. Its quick run (2 workers, grow and crash, tuned
            # torchrun) takes about 30 s; the full one about 50 min on 2 cores, as long as
            # the rest of the suite many times over: kept out of make bench.
            300,
            3 * 3600,
            in_suite=False,
        ),
        Benchmark(
            "elastic_scale",
            "elastic_scale.py",
            "2 to 32 Gloo workers of a small MLP: ElasticJob crash of 1 and of 3, leave, grow "
            "of 1 and of 8 at once: members' stall, set changes, steps recomputed and skipped",
            False,
            # Above the script's own limits (600 s quick, 4 h full). Its quick run (2 and 4
            # workers, crash of 1 and 3, grow of 8) took 116 s on 2 busy cores, most of it
            # joiners starting up: kept out of make bench with elastic. The full one, up to
            # 40 worker processes, takes hours.
            900,
            5 * 3600,
            in_suite=False,
        ),
    )
}


def suite_names() -> list[str]:
    """The benchmarks a run without --only runs."""
    return [name for name, bench in BENCHMARKS.items() if bench.in_suite]


@dataclass
class RunResult:
    name: str
    status: str  # "ok", "failed", "timeout", "summary failed"
    returncode: int | None
    seconds: float
    json_path: Path
    message: str = ""


def locate_benchmarks(folder: Path | None, names: Sequence[str]) -> Path:
    folder = HERE if folder is None else folder
    missing = [BENCHMARKS[n].script for n in names if not (folder / BENCHMARKS[n].script).is_file()]
    if not (folder / "_common.py").is_file():
        missing.insert(0, "_common.py")
    if missing:
        raise BenchError(
            f"no benchmark scripts ({', '.join(missing)}) in {folder}: --benchmarks-dir must "
            "be the benchmarks/ folder of a vflow source checkout"
        )
    return folder


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    # A benchmark has nothing worth a graceful shutdown, and distributed.py's ranks are
    # children of the script: kill its whole process group (its own session).
    if os.name == "posix":
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    else:
        proc.kill()
    proc.wait()


def run_script(
    bench: Benchmark,
    folder: Path,
    json_path: Path,
    *,
    quick: bool,
    device: str | None,
    timeout_s: float,
) -> RunResult:
    cmd = [sys.executable, str(folder / bench.script), "--json", str(json_path)]
    if quick:
        cmd.append("--quick")
    if device is not None and bench.takes_device:
        cmd += ["--device", device]
    env = dict(os.environ)
    # The scripts import vflow: put the vflow this runner imported first, so that they
    # measure that code, whatever else the environment would find.
    package_root = str(Path(vflow.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    # Streamed output stays in order with ours, and a killed script's last lines show.
    env["PYTHONUNBUFFERED"] = "1"
    # A stale file from an earlier run into the same folder must not pass for this one.
    json_path.unlink(missing_ok=True)
    print(f"\n=== {bench.name}: {' '.join(cmd)}", flush=True)
    if device is not None and not bench.takes_device:
        print(f"({bench.name} runs on the CPU with Gloo; --device {device} does not apply)")
    sys.stdout.flush()
    sys.stderr.flush()
    start = time.monotonic()
    # Its own session, so that a timeout or Ctrl-C can stop the script's children too.
    proc = subprocess.Popen(cmd, env=env, start_new_session=os.name == "posix")
    try:
        returncode = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        return RunResult(
            bench.name,
            "timeout",
            None,
            time.monotonic() - start,
            json_path,
            f"killed after {timeout_s:g} s (--timeout)",
        )
    except BaseException:
        _kill_group(proc)
        raise
    seconds = time.monotonic() - start
    if returncode != 0:
        return RunResult(
            bench.name, "failed", returncode, seconds, json_path, f"exit status {returncode}"
        )
    if not json_path.is_file():
        return RunResult(
            bench.name, "failed", returncode, seconds, json_path, f"wrote no {json_path.name}"
        )
    return RunResult(bench.name, "ok", returncode, seconds, json_path)


def load_records(path: Path) -> list[Record]:
    with open(path, encoding="utf-8") as f:
        records = json.load(f)
    if not isinstance(records, list) or not all(isinstance(r, dict) for r in records):
        raise SummaryError(f"{path}: expected a JSON list of objects")
    return records


def summarise(name: str, records: Sequence[Record]) -> list[Row]:
    """The rows of a script's headline records; SummaryError when it wrote none."""
    rows = rows_of(records)
    if not rows:
        raise SummaryError(f"{name} wrote no headline records among its {len(records)} results")
    return rows


# Environment fields that differ between the scripts of one run (distributed.py always
# runs on the CPU with its own thread count; the load changes as the run goes on: what
# makes two runs' timings comparable or not), kept with each run instead.
PER_RUN_ENV = ("device", "device_name", "torch_threads", "busy_cpus_at_start", "busy_cpus_at_end")


def _run_entry(run: RunResult, records: list[Record] | None) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "name": run.name,
        "status": run.status,
        "returncode": run.returncode,
        "seconds": round(run.seconds, 2),
        "json": str(run.json_path),
    }
    if run.message:
        entry["message"] = run.message
    env = records[0].get("env") if records else None
    if isinstance(env, dict):
        entry |= {k: env[k] for k in PER_RUN_ENV if k in env}
    return entry


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Run vflow's benchmark scripts (quick by default) and summarise their "
        "headline results against the peer baselines and limits.",
    )
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument(
        "--quick",
        action="store_true",
        help="short runs: the default, accepted so that callers (make bench ARGS=--quick) "
        "can say so",
    )
    mode.add_argument(
        "--full", action="store_true", help="run every script with its default (long) settings"
    )
    parser.add_argument(
        "--only",
        nargs="+",
        choices=list(BENCHMARKS),
        metavar="NAME",
        help=f"run only these benchmarks (choices: {', '.join(BENCHMARKS)}; without --only: "
        f"{', '.join(suite_names())})",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        metavar="DIR",
        help="folder for the scripts' JSON and summary.json (default: vflow_out/bench-<time>)",
    )
    parser.add_argument(
        "--compare",
        type=Path,
        default=None,
        metavar="OLD_SUMMARY",
        help="an earlier run's summary.json: adds its value and new/old to each row both have "
        "(the ratio, or the vflow value for a row without one)",
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="also exit with status 1 when a target is missed (targets that are n/a on this "
        "machine do not count)",
    )
    parser.add_argument(
        "--device",
        default=None,
        help="cpu, cuda or cuda:N, passed to every script but distributed (CPU/Gloo only); "
        "default: the scripts' own (cuda if available, else cpu)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="per-script limit (default 300 quick, 1200 full)",
    )
    parser.add_argument(
        "--benchmarks-dir",
        type=Path,
        default=None,
        metavar="DIR",
        help="the folder of the scripts (default: this file's folder)",
    )
    args = parser.parse_args(list(argv))
    if args.timeout is not None and not args.timeout > 0:
        parser.error(f"--timeout must be > 0, got {args.timeout:g}")
    return args


def main(argv: Sequence[str]) -> int:
    args = parse_args(argv)
    names = list(dict.fromkeys(args.only)) if args.only else suite_names()
    quick = not args.full
    mode = "quick" if quick else "full"
    try:
        old = load_old_summary(args.compare) if args.compare else None
        folder = locate_benchmarks(args.benchmarks_dir, names)
    except BenchError as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return 2
    out: Path = args.out or Path("vflow_out") / datetime.datetime.now().strftime(
        "bench-%Y%m%d-%H%M%S"
    )
    out.mkdir(parents=True, exist_ok=True)
    print(f"vflow bench suite ({mode}): {', '.join(names)}; scripts in {folder}; results in {out}")

    started = time.monotonic()
    runs: list[RunResult] = []
    records_by_name: dict[str, list[Record]] = {}
    rows: list[Row] = []
    try:
        for name in names:
            bench = BENCHMARKS[name]
            timeout_s = args.timeout or (bench.quick_timeout_s if quick else bench.full_timeout_s)
            json_path = out / f"{name}.json"
            run = run_script(
                bench, folder, json_path, quick=quick, device=args.device, timeout_s=timeout_s
            )
            runs.append(run)
            if run.status == "ok":
                try:
                    records_by_name[name] = load_records(run.json_path)
                    rows += summarise(name, records_by_name[name])
                except (OSError, json.JSONDecodeError, SummaryError) as e:
                    run.status, run.message = "summary failed", str(e)
            if run.status != "ok":
                print(f"*** {name}: {run.status}: {run.message}", file=sys.stderr, flush=True)
                rows.append(Row(name, f"{name}/run", "(no results)", result=run.status.upper()))
    except KeyboardInterrupt:
        print(f"\n{PROG}: interrupted", file=sys.stderr)
        return 130
    total_s = time.monotonic() - started

    print(f"\n=== summary ({mode}, {total_s:.0f} s) ===")
    for run in runs:
        note = f" ({run.message})" if run.message else ""
        print(f"  {run.name}: {run.status} in {run.seconds:.0f} s{note}")
    counts = print_report(rows, old=old, old_path=args.compare, mode=mode)
    all_records = [r for records in records_by_name.values() for r in records]
    env = run_environment(all_records, mode=mode)
    summary_path = out / "summary.json"
    write_summary(
        summary_path,
        argv=[PROG, *argv],
        seconds=total_s,
        environment={k: v for k, v in env.items() if k not in PER_RUN_ENV},
        rows=rows,
        records=all_records,
        compared_with=args.compare,
        runs=[_run_entry(run, records_by_name.get(run.name)) for run in runs],
    )
    print(f"\nwrote {summary_path}")
    failed = [run.name for run in runs if run.status != "ok"]
    if failed:
        print(f"{PROG}: failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    if args.check and counts.missed:
        print(f"{PROG}: --check: {counts.missed} target(s) missed", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
