"""``python -m vflow bench``: runs the benchmark scripts of a source checkout and sums up
their headline results in one table.

Each script in ``benchmarks/`` (accumulate, step, distributed, prefetch) runs as a file
in a subprocess of this interpreter, as its README says to run it, with ``--json``
into the output folder; its own tables stream to the terminal as it measures. After
the last one, a summary table gives one row per headline result, read back from the
scripts' JSON: the value vflow reached, the peer baseline's (PyTorch's per-tensor loop,
a hand-written accumulation loop, DDP + no_sync, no prefetching), the limit where the
script measures one (copy bandwidth, the ideal step), their ratio and the target it is
held to. ``summary.json`` keeps the environment and those rows, so that ``--compare``
can put a later run beside it.

Targets are reported, never enforced: the exit status is non-zero only when a script
failed, timed out or wrote results that could not be summarised.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import vflow

Record = dict[str, Any]

# The summary.json layout; bumped when a field changes meaning, so --compare can refuse
# a file it would misread.
SUMMARY_FORMAT = 1


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
    )
}

# Method and kernel names as benchmarks/accumulate.py writes them.
FUSED = "vflow accumulate_"
LOOP = "per-tensor add_"
EXACT_ADD = "exact accumulate_ add"
EXACT_FOLD = "vflow float fold"

MIB = 2**20


class BenchError(Exception):
    """A problem the user can fix (a missing folder, an unreadable file), reported as
    one line instead of a traceback."""


class SummaryError(Exception):
    """A script's JSON lacks what its summary rows are built from."""


@dataclass
class Row:
    """One headline result: what vflow reached against the peer baseline and the limit.

    ``key`` names the result independently of measured values, so that ``--compare``
    finds the same row in another run; ``compared`` is its description for the table
    and says what ``ratio`` is.
    """

    benchmark: str
    key: str
    compared: str
    unit: str = ""
    vflow: float | None = None
    baseline: float | None = None
    limit: float | None = None
    ratio: float | None = None
    target: str = ""
    result: str = "-"
    old: float | None = None
    change: float | None = None

    @property
    def headline(self) -> float | None:
        """The number compared between runs: the ratio (less sensitive to the machine
        than the raw values), or the vflow value for a row without one."""
        return self.ratio if self.ratio is not None else self.vflow


@dataclass
class RunResult:
    name: str
    status: str  # "ok", "failed", "timeout", "summary failed"
    returncode: int | None
    seconds: float
    json_path: Path
    message: str = ""


# ---- Summary rows from each script's JSON records ----


def _num(value: Any) -> float | None:
    """A finite float, or None: a JSON record may hold null or NaN (a fraction with
    nothing to divide by), which the table shows as '-' and summary.json as null."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def _ms(seconds: Any) -> float | None:
    value = _num(seconds)
    return None if value is None else value * 1e3


def _judge(value: float | None, op: str, threshold: float | None) -> tuple[str, str]:
    """The target text and the verdict, as the scripts print them; a record without its
    target (written by an older script) gets none."""
    if threshold is None:
        return "", "-"
    target = f"{op} {threshold:g}"
    if value is None:
        return target, "n/a"
    ok = value >= threshold if op == ">=" else value <= threshold
    return target, "met" if ok else "MISSED"


def _field(record: Record, name: str) -> Any:
    try:
        return record[name]
    except KeyError:
        raise SummaryError(
            f"a {record.get('benchmark', '?')} record has no field {name!r}"
        ) from None


def accumulate_rows(records: Sequence[Record]) -> list[Row]:
    """Per parameter list and gradient dtype: the fused accumulate's GB/s beside the
    per-tensor loop's and the copy bandwidth; the ratio is the one the script's target
    is on (fp32: fraction of copy GB/s; bf16: speedup over the loop). Per size and
    vector path of the exact-kernel table: deterministic mode's exact add against the
    float fold, in time (no target)."""
    cases: dict[tuple[str, str], dict[str, Record]] = {}
    for r in records:
        if r.get("benchmark") == "accumulate" and r.get("status") == "ok":
            case = (_field(r, "list"), _field(r, "grad_dtype"))
            cases.setdefault(case, {})[_field(r, "method")] = r
    rows: list[Row] = []
    for (name, dtype), methods in cases.items():
        fused = methods.get(FUSED)
        if fused is None:
            continue
        loop = methods.get(LOOP)
        gbps = _num(_field(fused, "gbps"))
        copy_gbps = _num(_field(fused, "copy_gbps"))
        row = Row(
            benchmark="accumulate",
            key=f"accumulate/{name}/{dtype}",
            compared="",
            unit="GB/s",
            vflow=gbps,
            baseline=_num(loop["gbps"]) if loop else None,
            limit=copy_gbps,
        )
        if dtype == "fp32":
            row.compared = f"{name} fp32: fused / copy GB/s"
            row.ratio = gbps / copy_gbps if gbps is not None and copy_gbps else None
            row.target, row.result = _judge(
                row.ratio, ">=", _num(fused.get("target_fp32_copy_fraction"))
            )
        else:
            row.compared = f"{name} {dtype}->fp32: fused speedup vs loop"
            row.ratio = _num(fused.get("speedup_vs_loop"))
            row.target, row.result = _judge(
                row.ratio, ">=", _num(fused.get("target_bf16_speedup_vs_loop"))
            )
        rows.append(row)

    exact: dict[tuple[str, str], dict[str, Record]] = {}
    for r in records:
        if r.get("benchmark") == "exact" and r.get("path"):
            exact.setdefault((_field(r, "size"), r["path"]), {})[_field(r, "kernel")] = r
    for (size, path), kernels in exact.items():
        add = kernels.get(EXACT_ADD)
        if add is None:
            continue
        fold = kernels.get(EXACT_FOLD)
        copy_gbps = _num(_field(add, "copy_gbps"))
        nbytes = _num(_field(add, "bytes"))
        rows.append(
            Row(
                benchmark="accumulate",
                key=f"exact/{size}/{path}",
                compared=f"exact add {size} ({path}): time / float fold",
                unit="ms",
                vflow=_ms(_field(add, "median_s")),
                baseline=_ms(fold["median_s"]) if fold else None,
                # The time its bytes take at the copy bandwidth of the same size.
                limit=nbytes / copy_gbps / 1e6 if nbytes and copy_gbps else None,
                ratio=_num(add.get("time_vs_float_fold")),
            )
        )
    return rows


def step_rows(records: Sequence[Record]) -> list[Row]:
    """Per model and V: Executor.step against the hand-written loop, in ms per step;
    the ratio is the script's (median over batches of the paired ratio)."""
    rows: list[Row] = []
    for r in records:
        if r.get("benchmark") != "step":
            continue
        model, v = _field(r, "model"), _field(r, "virtual_nodes")
        ratio = _num(_field(r, "ratio"))
        target, result = _judge(ratio, "<=", _num(r.get("target_ratio")))
        rows.append(
            Row(
                benchmark="step",
                key=f"step/{model}/V={v}",
                compared=f"{model} V={v}: vflow / hand loop step",
                unit="ms",
                vflow=_ms(_field(r, "vflow_median_s")),
                baseline=_ms(_field(r, "hand_median_s")),
                ratio=ratio,
                target=target,
                result=result,
            )
        )
    return rows


def distributed_rows(records: Sequence[Record]) -> list[Row]:
    """Step time against DDP + no_sync and each deterministic kind's cost over the
    default path, the bytes each rank communicates per step, and how much of the
    communication the backward hid (vflow against DDP)."""
    rows: list[Row] = []
    for r in records:
        if r.get("benchmark") != "distributed":
            continue
        config = f"{_field(r, 'model')} V={_field(r, 'virtual_nodes')}"
        vflow_ms = _ms(_field(r, "vflow_median_s"))
        ratio = _num(_field(r, "ratio"))
        target, result = _judge(ratio, "<=", _num(r.get("target_ratio")))
        rows.append(
            Row(
                "distributed",
                f"distributed/{config}/step",
                f"{config}: vflow / DDP step",
                "ms",
                vflow_ms,
                _ms(_field(r, "ddp_median_s")),
                ratio=ratio,
                target=target,
                result=result,
            )
        )
        det_ratio = _num(_field(r, "deterministic_ratio"))
        det_target = _num(r.get("deterministic_target_ratio"))
        det = Row(
            "distributed",
            f"distributed/{config}/ordered",
            f"{config}: ordered / vflow step",
            "ms",
            _ms(_field(r, "deterministic_median_s")),
            vflow_ms,
            ratio=det_ratio,
        )
        if det_target is not None:
            det.target, det.result = _judge(det_ratio, "<=", det_target)
        rows.append(det)
        rows.append(
            Row(
                "distributed",
                f"distributed/{config}/exact",
                f"{config}: exact / vflow step",
                "ms",
                _ms(_field(r, "exact_median_s")),
                vflow_ms,
                ratio=_num(_field(r, "exact_ratio")),
            )
        )
        nbytes = _field(r, "bytes_per_step")
        for kind, peer, label in (
            ("vflow", "ddp", "vflow / DDP"),
            ("deterministic", "vflow", "ordered / vflow"),
            ("exact", "vflow", "exact / vflow"),
        ):
            mine, theirs = _num(nbytes.get(kind)), _num(nbytes.get(peer))
            rows.append(
                Row(
                    "distributed",
                    f"distributed/{config}/bytes/{kind}",
                    f"{config}: {label} MB/step per rank",
                    "MiB",
                    mine / MIB if mine is not None else None,
                    theirs / MIB if theirs is not None else None,
                    ratio=mine / theirs if mine is not None and theirs else None,
                )
            )
        hidden, ddp_hidden = _num(r.get("vflow_hidden")), _num(r.get("ddp_hidden"))
        rows.append(
            Row(
                "distributed",
                f"distributed/{config}/hidden",
                f"{config}: comm hidden, vflow vs DDP",
                "%",
                hidden * 100 if hidden is not None else None,
                ddp_hidden * 100 if ddp_hidden is not None else None,
            )
        )
    return rows


def prefetch_rows(records: Sequence[Record]) -> list[Row]:
    """Per load kind and load: the step with prefetching against the step without it
    and the ideal; the ratio is the hidden fraction of the hideable load, with the
    script's target where it applies (L <= C)."""
    by_kind: dict[str, list[Record]] = {}
    for r in records:
        if r.get("benchmark") == "prefetch":
            by_kind.setdefault(_field(r, "load_kind"), []).append(r)
    rows: list[Row] = []
    for kind, group in by_kind.items():
        for i, r in enumerate(group):
            load, compute = _num(_field(r, "load_s")), _num(_field(r, "compute_per_vn_s"))
            share = f"{load / compute:.2f}C" if load is not None and compute else "?"
            hidden = _num(_field(r, "hidden_fraction"))
            met = r.get("target_met")
            row = Row(
                benchmark="prefetch",
                # The loads are set from the measured compute, so the key numbers them
                # instead of naming a value that changes from run to run.
                key=f"prefetch/{kind}/{i + 1}of{len(group)}",
                compared=(
                    f"{kind} load L={share}, V={_field(r, 'virtual_nodes')}: hidden fraction"
                ),
                unit="ms",
                vflow=_ms(_field(r, "prefetch_s")),
                baseline=_ms(_field(r, "no_prefetch_s")),
                limit=_ms(_field(r, "ideal_s")),
                ratio=hidden,
            )
            threshold = _num(r.get("target_hidden"))
            if met is None:
                row.result = "n/a (L > C)"
            elif threshold is not None:
                row.target = f">= {threshold:g}"
                row.result = "met" if met else "MISSED"
            rows.append(row)
    return rows


EXTRACTORS: dict[str, Callable[[Sequence[Record]], list[Row]]] = {
    "accumulate": accumulate_rows,
    "step": step_rows,
    "distributed": distributed_rows,
    "prefetch": prefetch_rows,
}


def summarise(name: str, records: Sequence[Record]) -> list[Row]:
    """The summary rows of benchmark ``name``'s JSON records; SummaryError when the
    records are not shaped as that script writes them."""
    try:
        rows = EXTRACTORS[name](records)
    except (TypeError, AttributeError, ValueError) as e:
        raise SummaryError(f"unexpected {name} JSON: {type(e).__name__}: {e}") from e
    if not rows:
        raise SummaryError(f"no {name} results in its JSON")
    return rows


def load_records(path: Path) -> list[Record]:
    with open(path, encoding="utf-8") as f:
        records = json.load(f)
    if not isinstance(records, list) or not all(isinstance(r, dict) for r in records):
        raise SummaryError(f"{path}: expected a JSON list of objects")
    return records


# ---- --compare ----


def load_old_summary(path: Path) -> dict[str, Any]:
    """A previous run's summary.json, checked before any benchmark runs so that a
    typo in the path fails at once instead of after minutes of measuring."""
    try:
        with open(path, encoding="utf-8") as f:
            old = json.load(f)
    except OSError as e:
        raise BenchError(f"--compare: cannot read {path}: {e.strerror or e}") from e
    except json.JSONDecodeError as e:
        raise BenchError(f"--compare: {path} is not JSON: {e}") from e
    if not isinstance(old, dict) or not isinstance(old.get("rows"), list):
        raise BenchError(
            f"--compare: {path} is not a summary.json of python -m vflow bench (no 'rows' list)"
        )
    if old.get("format") != SUMMARY_FORMAT:
        raise BenchError(
            f"--compare: {path} has summary format {old.get('format')!r}, this version "
            f"reads format {SUMMARY_FORMAT}"
        )
    return old


def apply_compare(rows: Sequence[Row], old: dict[str, Any]) -> int:
    """Sets ``old`` on every row whose key the old summary also has, and ``change``
    (new / old) where old > 0 and new >= 0: a ratio with a negative or zero old value
    (a hidden fraction can be below 0 on a busy machine) says nothing. Returns how many
    rows matched."""
    old_values: dict[str, float | None] = {}
    for r in old["rows"]:
        if isinstance(r, dict) and isinstance(r.get("key"), str):
            ratio = _num(r.get("ratio"))
            old_values[r["key"]] = ratio if ratio is not None else _num(r.get("vflow"))
    matched = 0
    for row in rows:
        if row.key not in old_values:
            continue
        matched += 1
        row.old = old_values[row.key]
        new = row.headline
        if new is not None and new >= 0 and row.old is not None and row.old > 0:
            row.change = new / row.old
    return matched


# ---- Output ----


def _fmt(value: float | None) -> str:
    if value is None:
        return "-"
    magnitude = abs(value)
    if magnitude >= 100:
        return f"{value:.1f}"
    if magnitude >= 1:
        return f"{value:.2f}"
    if magnitude >= 0.01:
        return f"{value:.3f}"
    return f"{value:.2g}"


def _fmt_ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def format_table(headers: Sequence[str], rows: Sequence[Sequence[str]], align: str) -> str:
    """Plain text; ``align`` has one letter per column: "l" (text) or "r" (numbers)."""
    widths = [len(h) for h in headers]
    for row in rows:
        widths = [max(w, len(cell)) for w, cell in zip(widths, row)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(
            cell.rjust(w) if a == "r" else cell.ljust(w) for cell, w, a in zip(cells, widths, align)
        ).rstrip()

    return "\n".join([line(headers), "  ".join("-" * w for w in widths), *map(line, rows)])


def summary_table(rows: Sequence[Row], *, compared: bool) -> str:
    headers = ["benchmark", "compared", "unit", "vflow", "baseline", "limit", "ratio"]
    headers += ["target", "result"]
    align = "lllrrrrll"
    if compared:
        headers += ["old", "new/old"]
        align += "rr"
    cells = []
    for r in rows:
        line = [r.benchmark, r.compared, r.unit, _fmt(r.vflow), _fmt(r.baseline)]
        line += [_fmt(r.limit), _fmt_ratio(r.ratio), r.target or "-", r.result]
        if compared:
            # The old value is a ratio wherever this row has one: shown as one.
            old = _fmt(r.old) if r.ratio is None else _fmt_ratio(r.old)
            line += [old, _fmt_ratio(r.change)]
        cells.append(line)
    return format_table(headers, cells, align)


# ---- Running the scripts ----


def source_root() -> Path:
    """The folder holding the vflow package: a source checkout's root (also for an
    editable install); site-packages for a wheel, which has no benchmarks/."""
    return Path(vflow.__file__).resolve().parent.parent


def locate_benchmarks(folder: Path | None, names: Sequence[str]) -> Path:
    if folder is None:
        folder = source_root() / "benchmarks"
        hint = (
            "the benchmarks ship with vflow's source tree, not with an installed wheel: run "
            "this from a source checkout (pip install -e .), or pass --benchmarks-dir "
            "pointing to a checkout's benchmarks/ folder"
        )
    else:
        hint = "--benchmarks-dir must be the benchmarks/ folder of a vflow source checkout"
    missing = [BENCHMARKS[n].script for n in names if not (folder / BENCHMARKS[n].script).is_file()]
    if not (folder / "_common.py").is_file():
        missing.insert(0, "_common.py")
    if missing:
        raise BenchError(f"no benchmark scripts ({', '.join(missing)}) in {folder}: {hint}")
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
    # The scripts import vflow: put this vflow first, so they measure the code this
    # command came from, whatever else the environment would find.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(source_root()), env.get("PYTHONPATH")) if p)
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


# Environment fields that differ between the scripts of one run (distributed.py always
# runs on the CPU with its own thread count; the load changes as the run goes on: what
# makes two runs' timings comparable or not), kept with each run instead.
PER_RUN_ENV = ("device", "device_name", "torch_threads", "busy_cpus_at_start", "busy_cpus_at_end")


def environment(records_by_name: dict[str, list[Record]], *, mode: str) -> dict[str, Any]:
    """This command's interpreter and mode, with what the scripts recorded about the
    machine and code (the first script's; the per-script load is kept per run)."""
    env: dict[str, Any] = {}
    for records in records_by_name.values():
        if records and isinstance(records[0].get("env"), dict):
            env = {k: v for k, v in records[0]["env"].items() if k not in PER_RUN_ENV}
            break
    return env | {
        "mode": mode,
        "python": platform.python_version(),
        "executable": sys.executable,
        "platform": platform.platform(),
        "vflow": getattr(vflow, "__version__", "unknown"),
    }


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
        prog="python -m vflow bench",
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
        help=f"run only these benchmarks (choices: {', '.join(BENCHMARKS)})",
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
        help="the benchmarks/ folder (default: beside the vflow package, in a source tree)",
    )
    args = parser.parse_args(list(argv))
    if args.timeout is not None and not args.timeout > 0:
        parser.error(f"--timeout must be > 0, got {args.timeout:g}")
    return args


def main(argv: Sequence[str]) -> int:
    args = parse_args(argv)
    names = list(dict.fromkeys(args.only)) if args.only else list(BENCHMARKS)
    quick = not args.full
    mode = "quick" if quick else "full"
    try:
        old = load_old_summary(args.compare) if args.compare else None
        folder = locate_benchmarks(args.benchmarks_dir, names)
    except BenchError as e:
        print(f"python -m vflow bench: {e}", file=sys.stderr)
        return 2
    out: Path = args.out or Path("vflow_out") / datetime.datetime.now().strftime(
        "bench-%Y%m%d-%H%M%S"
    )
    out.mkdir(parents=True, exist_ok=True)
    print(f"vflow bench ({mode}): {', '.join(names)}; scripts in {folder}; results in {out}")

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
                rows.append(
                    Row(name, f"{name}/run", "(no results)", result=f"{run.status.upper()}")
                )
    except KeyboardInterrupt:
        print("\npython -m vflow bench: interrupted", file=sys.stderr)
        return 130
    total_s = time.monotonic() - started

    matched = apply_compare(rows, old) if old is not None else 0
    print(f"\n=== summary ({mode}, {total_s:.0f} s) ===")
    for run in runs:
        note = f" ({run.message})" if run.message else ""
        print(f"  {run.name}: {run.status} in {run.seconds:.0f} s{note}")
    if old is not None:
        old_env = old.get("environment", {})
        print(
            f"compared with {args.compare} ({old_env.get('mode', '?')} run, git "
            f"{old_env.get('git', '?')}, {old.get('created', '?')}): {matched} of "
            f"{len(rows)} rows matched; new/old is on the ratio, or on vflow without one"
        )
        if old_env.get("mode") not in (None, mode):
            print(f"note: the old run was {old_env.get('mode')}, this one {mode}")
    print(
        "vflow / baseline / limit in the unit shown; baseline: PyTorch per-tensor loop, hand "
        "loop, DDP, default vflow or no prefetch; limit: copy bandwidth or ideal step\n"
    )
    print(summary_table(rows, compared=old is not None))

    summary = {
        "format": SUMMARY_FORMAT,
        "created": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "argv": ["python", "-m", "vflow", "bench", *argv],
        "seconds": round(total_s, 2),
        "environment": environment(records_by_name, mode=mode),
        "runs": [_run_entry(run, records_by_name.get(run.name)) for run in runs],
        "compared_with": str(args.compare) if args.compare else None,
        "rows": [asdict(row) for row in rows],
    }
    summary_path = out / "summary.json"
    with open(summary_path, "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=2, allow_nan=False)
        f.write("\n")
    print(f"\nwrote {summary_path}")
    failed = [run.name for run in runs if run.status != "ok"]
    if failed:
        print(f"python -m vflow bench: failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0
