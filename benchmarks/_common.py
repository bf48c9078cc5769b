"""Helpers shared by the vflow benchmarks: device choice, environment header, timing,
statistics, tables and JSON output.

The scripts import this module by name, so they are meant to be run as files
(``python benchmarks/accumulate.py``), which puts this folder on ``sys.path``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import time
import timeit
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.utils.benchmark as tbench

import vflow
from vflow import _C, ops
from vflow.bench import cli as bench_cli
from vflow.bench.table import format_table as format_table  # the scripts' tables: one formatter

REPO_ROOT = Path(__file__).resolve().parent.parent


def add_common_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--device",
        default=None,
        help="cpu, cuda or cuda:N (default: cuda if available, else cpu)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="short run with fewer repetitions and smaller inputs (CI smoke test)",
    )
    parser.add_argument(
        "--json", type=Path, default=None, metavar="PATH", help="write all results to PATH"
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch intra-op threads (default: torch's default); 1 avoids descheduled "
        "OpenMP workers on a busy machine",
    )


def apply_threads(threads: int | None) -> None:
    if threads is not None:
        if threads < 1:
            raise SystemExit(f"--threads must be >= 1, got {threads}")
        torch.set_num_threads(threads)


def pick_device(name: str | None) -> torch.device:
    """The device a ``--device`` option names (vflow.bench.cli's rules), or exit."""
    try:
        return bench_cli.pick_device(name)
    except bench_cli.BenchError as e:
        raise SystemExit(str(e)) from None


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _cpu_model_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _git(*args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=5, check=True
    ).stdout.strip()


def _git_revision() -> str | None:
    # Results are only comparable between runs of known code; a dirty tree is flagged.
    try:
        rev = _git("rev-parse", "--short", "HEAD")
        dirty = _git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return None
    return f"{rev}-dirty" if dirty else rev


def usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def other_cpu_use(sample_s: float = 0.5) -> float | None:
    """CPUs' worth of time the rest of the machine used over a short sample, during which
    this process sleeps (Linux /proc/stat; None elsewhere).

    Unlike the load average, this is not inflated by the run that just finished.
    """

    def read() -> tuple[int, int]:
        with open("/proc/stat", encoding="ascii") as f:
            fields = [int(x) for x in f.readline().split()[1:9]]
        return sum(fields), fields[3] + fields[4]  # idle + iowait

    try:
        total0, idle0 = read()
        time.sleep(sample_s)
        total1, idle1 = read()
    except (OSError, ValueError, IndexError):
        return None
    if total1 <= total0:
        return None
    return (1 - (idle1 - idle0) / (total1 - total0)) * (os.cpu_count() or 1)


def report_machine_use(when: str, busy: float | None, threads: int) -> None:
    if busy is None:
        return
    cpus = usable_cpus()
    print(f"other processes' CPU use {when}: {busy:.2f} of {cpus} CPUs")
    # With another process runnable, an OpenMP parallel region waits for its descheduled
    # workers; every multi-threaded torch op then costs time slices, and code that opens
    # many regions (a per-tensor loop) can look tens of times slower.
    if busy + threads > cpus + 0.25:
        print(
            f"WARNING: busy machine ({busy:.2f} CPUs in use by others, {threads} torch "
            f"threads on {cpus} CPUs): results may be dominated by descheduled threads; "
            "rerun on a quiet machine or compare with --threads 1"
        )


def environment(device: torch.device) -> dict[str, Any]:
    """What a result depends on, recorded with every JSON record."""
    affinity = usable_cpus()
    env: dict[str, Any] = {
        "torch": torch.__version__,
        "torch_built_against": getattr(_C, "torch_version", "unknown"),
        "vflow": vflow.__version__,
        "git": _git_revision(),
        "python": platform.python_version(),
        "device": str(device),
        "cpu": _cpu_model_name(),
        "cpu_count": os.cpu_count(),
        "cpu_affinity": affinity,
        "torch_threads": torch.get_num_threads(),
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "vflow_cpu_vector_path": ops.cpu_vector_path(),
        "vflow_built_with_cuda": ops.built_with_cuda(),
        "busy_cpus_at_start": other_cpu_use(),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env["device_name"] = props.name
        env["cuda"] = torch.version.cuda
        env["gpu_memory_gib"] = round(props.total_memory / 2**30, 1)
    else:
        env["device_name"] = env["cpu"]
    return env


def print_header(title: str, env: dict[str, Any]) -> None:
    print(f"== {title} ==")
    print(
        f"torch {env['torch']} (vflow built against {env['torch_built_against']}), "
        f"vflow {env['vflow']}, git {env['git'] or 'unknown'}, python {env['python']}"
    )
    print(f"device: {env['device']} ({env['device_name']})")
    if "cuda" in env:
        print(f"CUDA {env['cuda']}, {env['gpu_memory_gib']} GiB")
    print(
        f"CPU: {env['cpu']}; {env['cpu_count']} CPUs ({env['cpu_affinity']} usable), "
        f"torch threads {env['torch_threads']}, torch CPU capability "
        f"{env['torch_cpu_capability']}"
    )
    print(
        f"vflow CPU vector path: {env['vflow_cpu_vector_path']}, "
        f"CUDA kernels: {'yes' if env['vflow_built_with_cuda'] else 'no'}"
    )
    report_machine_use("at start", env["busy_cpus_at_start"], env["torch_threads"])
    print(flush=True)


def time_blocks(
    fn: Callable[[], object],
    device: torch.device,
    *,
    min_run_time: float,
    num_threads: int | None = None,
    label: str = "",
    description: str = "",
) -> list[float]:
    """Seconds per call of ``fn``, one value per block of torch's blocked_autorange.

    Callers pool the blocks of several calls (taken in rounds, interleaved with the
    other methods) and report the median, so slow drift on a shared machine hits every
    method alike.
    """
    timer = tbench.Timer(
        stmt="fn()",
        globals={"fn": fn},
        label=label,
        description=description,
        # Timer defaults to one thread; benchmark what users run.
        num_threads=torch.get_num_threads() if num_threads is None else num_threads,
        # Timer's default clock synchronises the accelerator; a CPU run need not pay it.
        **({} if device.type == "cuda" else {"timer": timeit.default_timer}),
    )
    return list(timer.blocked_autorange(min_run_time=min_run_time).times)


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


def iqr(values: Sequence[float]) -> float:
    if len(values) < 2:
        return 0.0
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q3 - q1


def fmt_ms(seconds: float | None) -> str:
    if seconds is None:
        return "n/a"
    ms = seconds * 1e3
    if ms >= 100:
        return f"{ms:.1f}"
    if ms >= 1:
        return f"{ms:.2f}"
    return f"{ms:.4f}"


def finish_run(json_path: Path | None, records: list[dict[str, Any]], env: dict[str, Any]) -> int:
    """Closing lines shared by the scripts: machine use at the end, then the JSON file."""
    print()
    busy_end = other_cpu_use()
    report_machine_use("at end", busy_end, env["torch_threads"])
    if json_path:
        write_json(json_path, records, env | {"busy_cpus_at_end": busy_end})
    return 0


def write_json(path: Path, records: list[dict[str, Any]], env: dict[str, Any]) -> None:
    """Writes ``records`` as a JSON list of dicts, each carrying the environment, so
    files from several machines or commits can be concatenated and compared."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump([{**record, "env": env} for record in records], f, indent=2)
        f.write("\n")
    print(f"wrote {len(records)} results to {path}")
