"""Headline benchmark records, and the one place their ratios and verdicts are computed.

A benchmark (``python -m vflow bench``'s kernels, or a script of ``benchmarks/``) writes
its detailed results in whatever shape suits it, plus one *headline record* per result
worth a row of the summary. A headline record describes itself: it carries the raw
measurements of vflow, of the peer baseline and of the limit, what the ratio is taken
between, and the target with the conditions under which the target means something.
The summary reads nothing else, knows no script's field names, and never takes a ratio
or a verdict from a record: ``evaluate`` computes both here, from the measurements.

A headline record (JSON object)::

    {"headline": "resnet50 fp32: fused accumulate / copy GB/s",   # the row's text
     "benchmark": "accumulate", "key": "accumulate/resnet50/fp32", # key: for --compare
     "vflow":    {"seconds": [...], "bytes": 306_000_000, "label": "..."},
     "baseline": {"seconds": [...], "bytes": 306_000_000, "label": "per-tensor add_"},
     "limit":    {"seconds": [...], "bytes": 536_870_912, "label": "copy bandwidth",
                  "note": "what the limit is and why it can be exceeded"},
     "compare": "vflow/limit",
     "target": {"op": ">=", "value": 0.8, "requires": {"min_cpus": 4}, "why": "..."},
     "env": {...}}

A measurement is one of:

* ``{"seconds": [s, ...]}``: a time, shown in ms as the median of the samples;
* ``{"seconds": [...], "bytes": n}``: a throughput, n bytes moved per timed call,
  shown in GB/s (1e9 B) as n / median;
* ``{"seconds": [...], "bytes": n, "for_bytes": m}``: the time m bytes take at that
  throughput (m / n x median), shown in ms: a limit in time;
* ``{"bytes": n}``: a size, shown in MiB.

All measurements of a record are of one kind. ``compare`` is ``"vflow/baseline"``,
``"vflow/limit"``, ``"gap closed"`` ((baseline - vflow) / (baseline - limit): the share
of the distance from the baseline to the limit that vflow covers) or absent (no ratio).
With ``"paired": true`` sample i of vflow and of the baseline were taken back to back
(same batch, same repetition), and the ratio is the median of the per-pair ratios
(per-pair differences for "gap closed"), which drift on a shared machine affects less
than a ratio of medians. A record may state the ``ratio`` its script printed: it is
checked against the computed one, so that a script and the summary cannot disagree.

A target applies to the ratio. ``requires`` names what the target needs to be
meaningful — ``{"device": "cuda"}``, ``{"min_cpus": n}`` (usable CPUs, from the
record's ``env``), ``{"min_samples": n}`` (timed samples of vflow: a quick run may have
too few to resolve the target), with ``why`` they are needed; ``when`` lists conditions
on measurements of the record, each with the reason it is needed
(``[["load", "<=", "compute", "a load longer than ... cannot be hidden"]]``, by medians,
the names being ``vflow``, ``baseline``, ``limit`` or keys of its ``context``
measurements). A target whose requirements or conditions do not hold is "n/a here",
with the reason.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "COMPARISONS",
    "Row",
    "SummaryError",
    "copy_limit_note",
    "evaluate",
    "headline",
    "is_headline",
    "measurement",
    "target",
]

Record = Mapping[str, Any]

COMPARISONS = ("vflow/baseline", "vflow/limit", "gap closed")
ROLES = ("vflow", "baseline", "limit")
UNITS = {"time": "ms", "rate": "GB/s", "size": "MiB"}
# A stated ratio may differ from the computed one by float rounding only.
_RATIO_RTOL = 1e-9
_OPS = {"<=": lambda a, b: a <= b, ">=": lambda a, b: a >= b}
MIB = 2**20


def copy_limit_note(what: str) -> str:
    """The footnote of a copy-bandwidth limit: what was copied (``what``), and why an
    accumulation can beat it."""
    return (
        f"limit = copy bandwidth: dst.copy_(src) of {what}, read + write bytes counted, "
        "measured in the same run. Not a ceiling for accumulate: on a CPU a copy's plain "
        "stores first read each destination line (write-allocate, 1.5x the bytes "
        "counted), while accumulate reads its destination anyway, so it can exceed this"
    )


class SummaryError(Exception):
    """A headline record that cannot be evaluated: missing or malformed fields, mixed
    kinds of measurement, or a stated ratio that disagrees with its measurements."""


@dataclass
class Row:
    """One headline result, evaluated: values in ``unit``, the computed ratio, and the
    verdict on the target.

    ``key`` names the result independently of measured values, so that ``--compare``
    finds the same row in another run; ``compared`` is the record's text. Two notes
    become footnotes of the table: what the limit is (``limit_note``) and why the target
    does not apply here (``result_note``). ``labels`` name what each measurement is.
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
    limit_note: str = ""
    result_note: str = ""
    labels: dict[str, str] = field(default_factory=dict)

    @property
    def headline(self) -> float | None:
        """The number compared between runs: the ratio (less sensitive to the machine
        than the raw values), or the vflow value for a row without one."""
        return self.ratio if self.ratio is not None else self.vflow


# ---- Writing records ----


def measurement(
    seconds: Sequence[float] | None = None,
    *,
    nbytes: int | None = None,
    for_bytes: int | None = None,
    label: str = "",
    note: str = "",
) -> dict[str, Any]:
    """A measurement as a headline record holds it (see the module docstring)."""
    m: dict[str, Any] = {}
    if seconds is not None:
        m["seconds"] = [float(s) for s in seconds]
    if nbytes is not None:
        m["bytes"] = int(nbytes)
    if for_bytes is not None:
        m["for_bytes"] = int(for_bytes)
    if label:
        m["label"] = label
    if note:
        m["note"] = note
    _kind(m, "measurement")
    return m


def target(
    op: str,
    value: float,
    *,
    requires: Mapping[str, Any] | None = None,
    when: Sequence[Sequence[str]] = (),
    why: str = "",
) -> dict[str, Any]:
    """A target on the ratio, with what it needs to mean something: ``requires`` and
    ``why`` they are needed, ``when`` conditions ``[name, op, name, reason]`` (module
    docstring)."""
    if op not in _OPS:
        raise ValueError(f"target op must be '<=' or '>=', got {op!r}")
    t: dict[str, Any] = {"op": op, "value": float(value)}
    if requires:
        t["requires"] = dict(requires)
    if when:
        t["when"] = [list(c) for c in when]
    if why:
        t["why"] = why
    return t


def headline(
    benchmark: str,
    key: str,
    compared: str,
    *,
    vflow: Mapping[str, Any],
    baseline: Mapping[str, Any] | None = None,
    limit: Mapping[str, Any] | None = None,
    compare: str | None = "vflow/baseline",
    paired: bool = False,
    target: Mapping[str, Any] | None = None,
    context: Mapping[str, Mapping[str, Any]] | None = None,
    stated_ratio: float | None = None,
) -> dict[str, Any]:
    """A headline record; checked at once, so that a script with a malformed one fails
    where it writes it rather than in the summary."""
    record: dict[str, Any] = {
        "headline": compared,
        "benchmark": benchmark,
        "key": key,
        "vflow": dict(vflow),
    }
    if baseline is not None:
        record["baseline"] = dict(baseline)
    if limit is not None:
        record["limit"] = dict(limit)
    if compare is not None:
        record["compare"] = compare
    if paired:
        record["paired"] = True
    if target is not None:
        record["target"] = dict(target)
    if context:
        record["context"] = {name: dict(m) for name, m in context.items()}
    if stated_ratio is not None:
        record["ratio"] = stated_ratio
    evaluate(record)
    return record


def is_headline(record: Any) -> bool:
    return isinstance(record, Mapping) and "headline" in record


# ---- Evaluating records: every ratio and verdict is computed here ----


def _fail(record: Record, problem: str) -> SummaryError:
    return SummaryError(f"headline {record.get('key', '?')!r}: {problem}")


def _kind(m: Any, where: str) -> str:
    if not isinstance(m, Mapping):
        raise SummaryError(f"{where} must be an object, got {type(m).__name__}")
    seconds, nbytes = m.get("seconds"), m.get("bytes")
    if seconds is not None:
        if (
            not isinstance(seconds, list)
            or not seconds
            or not all(_finite(s) and s > 0 for s in seconds)
        ):
            raise SummaryError(f"{where}: seconds must be a non-empty list of times > 0")
    if nbytes is not None and not (isinstance(nbytes, int) and nbytes > 0):
        raise SummaryError(f"{where}: bytes must be an int > 0, got {nbytes!r}")
    if "for_bytes" in m:
        if seconds is None or nbytes is None:
            raise SummaryError(f"{where}: for_bytes needs seconds and bytes")
        if not (isinstance(m["for_bytes"], int) and m["for_bytes"] > 0):
            raise SummaryError(f"{where}: for_bytes must be an int > 0")
        return "time"
    if seconds is not None:
        return "rate" if nbytes is not None else "time"
    if nbytes is not None:
        return "size"
    raise SummaryError(f"{where} has neither seconds nor bytes")


def _finite(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


def _in_unit(m: Mapping[str, Any], kind: str, seconds: float) -> float:
    if kind == "rate":
        return m["bytes"] / seconds / 1e9
    scale = m["for_bytes"] / m["bytes"] if "for_bytes" in m else 1.0
    return seconds * scale * 1e3


def _value(m: Mapping[str, Any], kind: str) -> float:
    """The measurement's value in the unit of its kind; a time or throughput from the
    median time (a throughput is bytes over the median time, not the median of
    per-sample throughputs)."""
    if kind == "size":
        return m["bytes"] / MIB
    return _in_unit(m, kind, statistics.median(m["seconds"]))


def _samples(m: Mapping[str, Any], kind: str) -> list[float]:
    return [_in_unit(m, kind, s) for s in m["seconds"]]


def paired_ratio(vflow_s: Sequence[float], baseline_s: Sequence[float]) -> float:
    """The median over i of ``vflow_s[i] / baseline_s[i]``: the ratio of samples taken
    back to back (``"paired": true``), each pair meeting the same load, so that its
    ratio cancels what both met. Not the inverse of the median of the inverse ratios
    when the count is even."""
    if len(vflow_s) != len(baseline_s):
        raise ValueError(
            f"paired samples differ in number: vflow {len(vflow_s)}, baseline {len(baseline_s)}"
        )
    return statistics.median(x / y for x, y in zip(vflow_s, baseline_s))


def _ratio(record: Record, kind: str, values: dict[str, float]) -> float | None:
    compare = record.get("compare")
    if compare is None:
        return None
    if compare not in COMPARISONS:
        raise _fail(record, f"compare must be one of {', '.join(COMPARISONS)}, got {compare!r}")
    needed = ("vflow", "baseline", "limit") if compare == "gap closed" else compare.split("/")
    missing = [role for role in needed if role not in values]
    if missing:
        raise _fail(record, f"compare {compare!r} needs a {' and a '.join(missing)} measurement")
    paired = record.get("paired", False)
    if paired:
        if kind == "size":
            raise _fail(record, "paired needs timed samples")
        v, b = _samples(record["vflow"], kind), _samples(record["baseline"], kind)
        if len(v) != len(b):
            raise _fail(
                record, f"paired samples differ in number: vflow {len(v)}, baseline {len(b)}"
            )
    if compare == "gap closed":
        gap = values["baseline"] - values["limit"]
        if gap <= 0:
            return None  # the baseline is already at the limit: nothing to close
        closed = (
            statistics.median(y - x for x, y in zip(v, b))
            if paired
            else values["baseline"] - values["vflow"]
        )
        return closed / gap
    if compare == "vflow/limit":
        return values["vflow"] / values["limit"]
    if paired:
        return paired_ratio(v, b)
    return values["vflow"] / values["baseline"]


def _requirement_unmet(record: Record, requires: Any) -> str | None:
    """Why the run does not give what the target needs (None when it does)."""
    if not isinstance(requires, Mapping):
        raise _fail(record, f"target requires must be an object, got {requires!r}")
    env = record.get("env") or {}
    for name, wanted in requires.items():
        if name == "device":
            device = str(env.get("device", "cpu"))
            if not device.startswith(str(wanted)):
                return f"needs device {wanted}, this run used {device}"
        elif name == "min_cpus":
            cpus = env.get("cpu_affinity") or env.get("cpu_count")
            if not isinstance(cpus, int) or cpus < wanted:
                return f"needs >= {wanted} usable CPUs, this machine has {cpus}"
        elif name == "min_samples":
            samples = len(record["vflow"].get("seconds") or [])
            if samples < wanted:
                return f"needs >= {wanted} timed samples, this run has {samples}"
        else:
            raise _fail(
                record, f"target requires {name!r}: known are device, min_cpus and min_samples"
            )
    return None


def _condition_unmet(record: Record, when: Any) -> str | None:
    """Why a condition on the record's measurements fails (None when all hold)."""
    named = {role: record[role] for role in ROLES if role in record}
    named |= dict(record.get("context") or {})
    if not isinstance(when, list):
        raise _fail(record, "target when must be a list of [name, op, name]")
    for condition in when:
        if (
            not isinstance(condition, list)
            or len(condition) not in (3, 4)
            or condition[1] not in _OPS
            or condition[0] not in named
            or condition[2] not in named
        ):
            raise _fail(
                record,
                f"target when: {condition!r} is not [name, '<=' or '>=', name, reason] over "
                f"{sorted(named)}",
            )
        left, op, right = condition[:3]
        reason = f": {condition[3]}" if len(condition) == 4 else ""
        kinds = {_kind(named[left], left), _kind(named[right], right)}
        if len(kinds) != 1:
            raise _fail(record, f"target when compares {left} and {right} of different kinds")
        (their_kind,) = kinds
        a, b = _value(named[left], their_kind), _value(named[right], their_kind)
        if not _OPS[op](a, b):
            return (
                f"applies when {left} {op} {right}; here {a:.3g} vs {b:.3g} "
                f"{UNITS[their_kind]}{reason}"
            )
    return None


def evaluate(record: Record) -> Row:
    """The summary row of one headline record: values, ratio and verdict computed from
    its measurements; SummaryError when it is malformed or its stated ratio disagrees."""
    if not is_headline(record):
        raise SummaryError(f"not a headline record: {dict(record)!r:.200}")
    for name in ("benchmark", "key", "headline"):
        if not isinstance(record.get(name), str) or not record[name]:
            raise _fail(record, f"{name} must be a non-empty string")
    if "vflow" not in record:
        raise _fail(record, "has no vflow measurement")
    kinds = {role: _kind(record[role], role) for role in ROLES if role in record}
    for name, m in (record.get("context") or {}).items():
        _kind(m, f"context {name}")
    if len(set(kinds.values())) != 1:
        raise _fail(record, f"measurements of different kinds: {kinds}")
    kind = kinds["vflow"]
    values = {role: _value(record[role], kind) for role in kinds}
    ratio = _ratio(record, kind, values)
    stated = record.get("ratio")
    if stated is not None:
        if (
            ratio is None
            or not _finite(stated)
            or not math.isclose(stated, ratio, rel_tol=_RATIO_RTOL)
        ):
            raise _fail(
                record,
                f"states ratio {stated!r} but its measurements give "
                f"{'none' if ratio is None else f'{ratio:.6g}'} "
                f"({record.get('compare')}{', paired' if record.get('paired') else ''})",
            )
    row = Row(
        benchmark=record["benchmark"],
        key=record["key"],
        compared=record["headline"],
        unit=UNITS[kind],
        vflow=values["vflow"],
        baseline=values.get("baseline"),
        limit=values.get("limit"),
        ratio=ratio,
        limit_note=str(record.get("limit", {}).get("note", "")),
        labels={r: str(record[r]["label"]) for r in kinds if record[r].get("label")},
    )
    _judge(record, row)
    return row


def _judge(record: Record, row: Row) -> None:
    t = record.get("target")
    if t is None:
        return
    if not isinstance(t, Mapping) or t.get("op") not in _OPS or not _finite(t.get("value")):
        raise _fail(record, f"target must be {{op: '<=' or '>=', value: number}}, got {t!r}")
    if row.ratio is None and record.get("compare") is None:
        raise _fail(record, "has a target but no compare: a target is on the ratio")
    row.target = f"{t['op']} {t['value']:g}"
    unmet = _requirement_unmet(record, t.get("requires") or {})
    if unmet is not None and t.get("why"):
        unmet += f": {t['why']}"
    unmet = unmet or _condition_unmet(record, t.get("when") or [])
    if unmet is not None:
        row.result = "n/a here"
        row.result_note = f"{row.target} {unmet}"
    elif row.ratio is None:
        row.result = "n/a"
        row.result_note = "no ratio: the baseline is already at the limit"
    else:
        row.result = "met" if _OPS[t["op"]](row.ratio, t["value"]) else "MISSED"
