"""Helpers shared by the vflow benchmarks: their command lines, device choice, the
environment header, timing, statistics, tables, the benchmark MLP and JSON output.

The scripts import this module by name, so they are meant to be run as files
(``python benchmarks/accumulate.py``), which puts this folder on ``sys.path``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

import torch
from torch import nn

import vflow
from vflow import _C, ops
from vflow.bench import cli as bench_cli
from vflow.bench.kernels import cpu_name
from vflow.bench.kernels import time_blocks as time_blocks  # one timer with python -m vflow bench
from vflow.bench.kernels import usable_cpus as usable_cpus
from vflow.bench.table import format_table as format_table  # the scripts' tables: one formatter

REPO_ROOT = Path(__file__).resolve().parent.parent


def add_output_args(parser: argparse.ArgumentParser, *, quick: str) -> None:
    """--quick (``quick`` says what it shortens) and --json, which every script has."""
    parser.add_argument("--quick", action="store_true", help=quick)
    parser.add_argument(
        "--json", type=Path, default=None, metavar="PATH", help="write the results to PATH"
    )


def add_common_args(parser: argparse.ArgumentParser) -> None:
    """The options of a script that measures in this process: --device, --quick, --json
    and --threads."""
    parser.add_argument(
        "--device",
        default=None,
        help="cpu, cuda or cuda:N (default: cuda if available, else cpu)",
    )
    add_output_args(
        parser, quick="short run with fewer repetitions and smaller inputs (CI smoke test)"
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch intra-op threads (default: torch's default); 1 avoids descheduled "
        "OpenMP workers on a busy machine",
    )


T = TypeVar("T", int, float)


@dataclass(frozen=True)
class Default(Generic[T]):
    """An option's default: one for a full run, one for --quick."""

    full: T
    quick: T

    def text(self) -> str:
        return f"default {self.full:g}, {self.quick:g} quick"

    def of(self, args: argparse.Namespace, name: str) -> T:
        """Option ``name``'s value in ``args``, or this default for the run they ask for
        (an unset option and 0 alike)."""
        return getattr(args, name) or (self.quick if args.quick else self.full)


def add_process_args(
    parser: argparse.ArgumentParser, *, per: str, timeout_s: Default[float]
) -> None:
    """--threads and --timeout of a script that runs one process per Gloo ``per`` (rank,
    worker) on this machine."""
    parser.add_argument(
        "--threads", type=int, default=1, help=f"torch intra-op threads per {per} (default 1)"
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=None,
        help=f"give up (and kill every {per}) after this many seconds ({timeout_s.text()})",
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
        "cpu": cpu_name(),
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


@dataclass(frozen=True)
class Session:
    """A script's run: the device it measures on, the environment its header printed
    (stored with every record) and where its results go."""

    device: torch.device
    env: dict[str, Any]
    json_path: Path | None

    def finish(self, records: list[dict[str, Any]]) -> int:
        """The closing lines: machine use at the end, then the JSON file; the exit status."""
        print()
        busy_end = other_cpu_use()
        report_machine_use("at end", busy_end, self.env["torch_threads"])
        if self.json_path:
            write_json(self.json_path, records, self.env | {"busy_cpus_at_end": busy_end})
        return 0


def _open(title: str, device: torch.device, json_path: Path | None, **extra: Any) -> Session:
    env = environment(device) | extra
    print_header(title, env)
    return Session(device, env, json_path)


def open_session(args: argparse.Namespace, title: str, *, threads: int | None = None) -> Session:
    """The opening of a script with add_common_args' options: torch's threads (--threads,
    else ``threads``, else torch's default), the device, then the environment header."""
    apply_threads(args.threads if args.threads is not None else threads)
    return _open(title, pick_device(args.device), args.json)


def open_process_session(
    args: argparse.Namespace, title: str, *, threads: int, **extra: Any
) -> Session:
    """The opening of a script whose processes on this machine (Gloo ranks, workers) each
    run ``threads`` torch threads on the CPU: this one runs as many, so that the header's
    thread count is theirs. ``extra`` joins the environment (the processes, the backend)."""
    apply_threads(threads)
    return _open(title, torch.device("cpu"), args.json, **extra)


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


def write_json(path: Path, records: list[dict[str, Any]], env: dict[str, Any]) -> None:
    """Writes ``records`` as a JSON list of dicts, each carrying the environment, so
    files from several machines or commits can be concatenated and compared."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump([{**record, "env": env} for record in records], f, indent=2)
        f.write("\n")
    print(f"wrote {len(records)} results to {path}")


# ---- The benchmark MLP ----

CLASSES = 10
HIDDEN = Default(full=1024, quick=512)
LAYERS = Default(full=12, quick=4)
BATCH_SIZE = Default(full=128, quick=64)


@dataclass(frozen=True)
class Mlp:
    """``layers`` x (Linear(hidden, hidden) + ReLU) and a 10-way head: the model
    distributed.py trains (step.py a 4-layer one), the one benchmarks/_elastic_worker.py
    builds for elastic.py, and the size of accumulate.py's exact-kernel table."""

    hidden: int
    layers: int

    @property
    def name(self) -> str:
        return f"mlp {self.layers}x{self.hidden}"

    @property
    def params(self) -> int:
        h = self.hidden
        return self.layers * (h * h + h) + h * CLASSES + CLASSES

    def build(self) -> nn.Module:
        blocks: list[nn.Module] = []
        for _ in range(self.layers):
            blocks += [nn.Linear(self.hidden, self.hidden), nn.ReLU()]
        return nn.Sequential(*blocks, nn.Linear(self.hidden, CLASSES))


FULL_MLP = Mlp(HIDDEN.full, LAYERS.full)


def add_mlp_args(parser: argparse.ArgumentParser) -> None:
    """--batch-size, --hidden and --layers: the benchmark MLP and its global batch."""
    parser.add_argument(
        "--batch-size", type=int, default=None, help=f"global batch B ({BATCH_SIZE.text()})"
    )
    parser.add_argument("--hidden", type=int, default=None, help=f"MLP width ({HIDDEN.text()})")
    parser.add_argument(
        "--layers",
        type=int,
        default=None,
        help=f"hidden Linear layers (default {LAYERS.full:g}, ~{FULL_MLP.params / 1e6:.1f} M "
        f"params; {LAYERS.quick:g} quick)",
    )


def mlp_of(args: argparse.Namespace) -> tuple[Mlp, int]:
    """The MLP and the global batch that add_mlp_args' options ask for."""
    mlp = Mlp(HIDDEN.of(args, "hidden"), LAYERS.of(args, "layers"))
    return mlp, BATCH_SIZE.of(args, "batch_size")


def size_problem(
    args: argparse.Namespace, *, processes: int, per: str, positive: Sequence[str]
) -> str | None:
    """What is wrong with the sizes asked for on a command line with add_mlp_args'
    options and --virtual-nodes, whose VNs ``processes`` processes (each a ``per``)
    share: an option of ``positive`` below 1, fewer VNs than processes or a global batch
    smaller than V. None when nothing is."""
    for name in positive:
        value = getattr(args, name)
        if value is not None and value < 1:
            return f"--{name.replace('_', '-')} must be >= 1, got {value}"
    if args.virtual_nodes < processes:
        return f"--virtual-nodes must be >= {processes} (one VN per {per} at least)"
    _, batch_size = mlp_of(args)
    if batch_size < args.virtual_nodes:
        return f"--batch-size {batch_size} < --virtual-nodes {args.virtual_nodes}"
    return None


# ---- resident memory (Linux) ----

# glibc's mmap threshold, fixed for the processes a benchmark starts (Note in
# benchmarks/pipeline.py's docstring: "memory").
MALLOC_ENV = "MALLOC_MMAP_THRESHOLD_"


def parse_status(text: str) -> dict[str, int]:
    """VmRSS and VmHWM of a /proc/<pid>/status text, in bytes."""
    out = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            number, unit = value.split()
            if unit != "kB":
                raise ValueError(f"unexpected unit in {line!r}")
            out[key] = int(number) * 1024
    if set(out) != {"VmRSS", "VmHWM"}:
        raise ValueError("no VmRSS/VmHWM in the status text")
    return out


def memory_status() -> dict[str, int]:
    """This process's VmRSS and VmHWM, in bytes."""
    with open("/proc/self/status", encoding="ascii") as f:
        return parse_status(f.read())


def reset_peak() -> bool:
    """Resets VmHWM to the current resident set (Linux); False when it cannot."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
    except OSError:
        return False
    return True


@contextlib.contextmanager
def malloc_env(mmap_threshold: int | None) -> Iterator[None]:
    """The processes started inside get glibc's mmap threshold fixed at
    ``mmap_threshold`` bytes (None: glibc's default, a threshold that rises to the
    largest block freed so far)."""
    saved = os.environ.pop(MALLOC_ENV, None)
    if mmap_threshold is not None:
        os.environ[MALLOC_ENV] = str(mmap_threshold)
    try:
        yield
    finally:
        os.environ.pop(MALLOC_ENV, None)
        if saved is not None:
            os.environ[MALLOC_ENV] = saved
