"""The summary of a benchmark run: headline rows as a table with footnotes, the count of
targets met and missed, ``--compare`` with an earlier run, and ``summary.json``.

Shared by ``python -m vflow bench`` (the kernel benchmarks of the installed package) and
the suite runner of a source checkout (``benchmarks/run.py``), so that both judge,
print and store results the same way. The rows come from ``records.evaluate``.
"""

from __future__ import annotations

import datetime
import json
import math
import platform
import sys
import textwrap
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from vflow._version import __version__
from vflow.bench.records import Row, SummaryError, evaluate, is_headline
from vflow.bench.table import format_table

__all__ = [
    "SUMMARY_FORMAT",
    "BenchError",
    "Counts",
    "Row",
    "SummaryError",
    "apply_compare",
    "count_targets",
    "load_old_summary",
    "print_report",
    "rows_of",
    "run_environment",
    "summary_table",
    "write_summary",
]

# The summary.json layout; bumped when a field changes meaning, so --compare can refuse
# a file it would misread. 2: rows evaluated from self-describing headline records.
SUMMARY_FORMAT = 2


class BenchError(Exception):
    """A problem the user can fix (a missing folder, an unreadable file), reported as
    one line instead of a traceback."""


def rows_of(records: Iterable[Any]) -> list[Row]:
    """The evaluated rows of the headline records among ``records`` (other records, a
    script's detailed results, are skipped)."""
    return [evaluate(r) for r in records if is_headline(r)]


@dataclass(frozen=True)
class Counts:
    met: int
    missed: int
    not_here: int
    no_ratio: int

    @property
    def judged(self) -> int:
        return self.met + self.missed

    def line(self) -> str:
        total = self.met + self.missed + self.not_here + self.no_ratio
        text = f"targets: {self.met} met, {self.missed} missed, {self.not_here} n/a here"
        if self.not_here:
            text += " (not meaningful on this machine or run, see the notes)"
        if self.no_ratio:
            text += f", {self.no_ratio} without a ratio"
        return f"{text}; {total} in all"


def count_targets(rows: Sequence[Row]) -> Counts:
    return Counts(
        met=sum(r.result == "met" for r in rows),
        missed=sum(r.result == "MISSED" for r in rows),
        not_here=sum(r.result == "n/a here" for r in rows),
        no_ratio=sum(r.result == "n/a" for r in rows),
    )


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
            f"--compare: {path} is not a summary.json of a vflow benchmark run (no 'rows' list)"
        )
    if old.get("format") != SUMMARY_FORMAT:
        raise BenchError(
            f"--compare: {path} has summary format {old.get('format')!r}, this version "
            f"reads format {SUMMARY_FORMAT}"
        )
    return old


def _num(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def apply_compare(rows: Sequence[Row], old: Mapping[str, Any]) -> int:
    """Sets ``old`` on every row whose key the old summary also has, and ``change``
    (new / old) where old > 0 and new >= 0: a ratio with a negative or zero old value
    (a share of a gap can be below 0 on a busy machine) says nothing. Returns how many
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


# ---- The table ----


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


def summary_table(rows: Sequence[Row], *, compared: bool) -> str:
    """The rows as a table, then numbered footnotes: what each limit is (and why it can
    be exceeded) and why a target is n/a here. Equal notes share a number."""
    notes: dict[str, int] = {}

    def mark(note: str) -> str:
        if not note:
            return ""
        return f" [{notes.setdefault(note, len(notes) + 1)}]"

    headers = ["benchmark", "compared", "unit", "vflow", "baseline", "limit", "ratio"]
    headers += ["target", "result"]
    align = "lllrrrrll"
    if compared:
        headers += ["old", "new/old"]
        align += "rr"
    cells = []
    for r in rows:
        line = [r.benchmark, r.compared, r.unit, _fmt(r.vflow), _fmt(r.baseline)]
        limit = _fmt(r.limit) + (mark(r.limit_note) if r.limit is not None else "")
        line += [limit, _fmt_ratio(r.ratio), r.target or "-", r.result + mark(r.result_note)]
        if compared:
            # The old value is a ratio wherever this row has one: shown as one.
            old = _fmt(r.old) if r.ratio is None else _fmt_ratio(r.old)
            line += [old, _fmt_ratio(r.change)]
        cells.append(line)
    text = format_table(headers, cells, align)
    if notes:
        text += "\n\n" + "\n".join(
            textwrap.fill(f"[{n}] {note}", width=100, subsequent_indent="    ")
            for note, n in notes.items()
        )
    return text


# ---- summary.json ----


def run_environment(records: Iterable[Any], *, mode: str) -> dict[str, Any]:
    """This command's interpreter and mode, with what the first record that has an
    ``env`` says about the machine and code."""
    env: dict[str, Any] = {}
    for r in records:
        if isinstance(r, Mapping) and isinstance(r.get("env"), Mapping):
            env = dict(r["env"])
            break
    return env | {
        "mode": mode,
        "python": platform.python_version(),
        "executable": sys.executable,
        "platform": platform.platform(),
        "vflow": __version__,
    }


def write_summary(
    path: Path,
    *,
    argv: Sequence[str],
    seconds: float,
    environment: Mapping[str, Any],
    rows: Sequence[Row],
    records: Sequence[Any],
    compared_with: Path | None,
    runs: Sequence[Mapping[str, Any]] = (),
) -> None:
    """summary.json: the environment, the evaluated rows, the target counts and the
    headline records they were computed from (so a summary can be re-evaluated)."""
    counts = count_targets(rows)
    summary = {
        "format": SUMMARY_FORMAT,
        "created": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "argv": list(argv),
        "seconds": round(seconds, 2),
        "environment": dict(environment),
        "runs": list(runs),
        "compared_with": str(compared_with) if compared_with else None,
        "targets": asdict(counts),
        "rows": [asdict(row) for row in rows],
        "headlines": [r for r in records if is_headline(r)],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=2, allow_nan=False)
        f.write("\n")


def print_report(
    rows: Sequence[Row], *, old: Mapping[str, Any] | None, old_path: Path | None, mode: str
) -> Counts:
    """Prints the comparison line (with ``old``), the table and the target counts."""
    if old is not None:
        matched = apply_compare(rows, old)
        old_env = old.get("environment", {})
        print(
            f"compared with {old_path} ({old_env.get('mode', '?')} run, git "
            f"{old_env.get('git', '?')}, {old.get('created', '?')}): {matched} of "
            f"{len(rows)} rows matched; new/old is on the ratio, or on vflow without one"
        )
        if old_env.get("mode") not in (None, mode):
            print(f"note: the old run was {old_env.get('mode')}, this one {mode}")
    print(
        "vflow / baseline / limit in the unit shown; ratio as the row says, computed from "
        "the measurements\n"
    )
    print(summary_table(rows, compared=old is not None))
    counts = count_targets(rows)
    print(f"\n{counts.line()}")
    return counts
