"""A cluster trace: the slots and the jobs that arrive, as ``python -m vflow cluster``
reads them (TRACE.json)::

    {"slots": 8,
     "jobs": [{"name": "j1", "arrival_s": 0.0, "demand": 2, "priority": 1,
               "virtual_nodes": 8, "steps": 1000,
               "step_s": {"1": 0.80, "2": 0.42, "4": 0.23, "8": 0.13}}]}

A job may also carry ``"command"``, the real runner's command template for its workers
(vflow/cluster/runner.py), which the simulator ignores.

Note [Step time between the given counts]
``step_s`` gives seconds per step at some worker counts. Between two given counts the
job's *throughput* (steps per second) is interpolated linearly, not its step time: a
job that scales perfectly from 2 to 4 workers (0.42 s -> 0.21 s) then takes 0.28 s at 3,
where interpolating step times would say 0.315 s, a worse job than the one described.
Below the smallest given count the throughput falls in proportion to the workers (no
job runs faster per worker on fewer of them than the data says). Above the largest
given count, or above V (every worker needs a VN), the job does not run: its
``max_workers`` is the smaller of the two.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vflow.runtime.checkpoint import replacing_atomically

__all__ = ["JobSpec", "Trace", "TraceError", "load_trace", "parse_trace", "write_json"]


class TraceError(ValueError):
    """A trace that cannot be run; the message names the job and the field."""


@dataclass(frozen=True)
class JobSpec:
    """One job of a trace. ``step_s`` maps worker counts to seconds per step (the counts
    above ``virtual_nodes`` dropped); ``command`` is the real runner's template."""

    name: str
    arrival_s: float
    demand: int
    priority: float
    virtual_nodes: int
    steps: int
    step_s: Mapping[int, float]
    command: str | None = None
    _counts: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_counts", tuple(sorted(self.step_s)))

    @property
    def max_workers(self) -> int:
        """The most workers the job runs on: V and the largest count given."""
        return min(self.virtual_nodes, self._counts[-1])

    def step_time(self, workers: int) -> float:
        """Seconds per step on ``workers`` (1..max_workers) workers (Note [Step time
        between the given counts])."""
        if not 1 <= workers <= self.max_workers:
            raise ValueError(
                f"job {self.name!r}: workers must be in 1..{self.max_workers}, got {workers}"
            )
        return 1.0 / self.throughput(workers)

    def throughput(self, workers: int) -> float:
        """Steps per second on ``workers`` workers; 0 for 0 workers."""
        if workers <= 0:
            return 0.0
        counts = self._counts
        if workers in self.step_s:
            return 1.0 / self.step_s[workers]
        if workers < counts[0]:
            return workers / (counts[0] * self.step_s[counts[0]])
        upper = next(c for c in counts if c > workers)
        lower = max(c for c in counts if c < workers)
        low, high = 1.0 / self.step_s[lower], 1.0 / self.step_s[upper]
        return low + (high - low) * (workers - lower) / (upper - lower)

    def to_json(self) -> dict[str, Any]:
        record: dict[str, Any] = {
            "name": self.name,
            "arrival_s": self.arrival_s,
            "demand": self.demand,
            "priority": self.priority,
            "virtual_nodes": self.virtual_nodes,
            "steps": self.steps,
            "step_s": {str(count): self.step_s[count] for count in self._counts},
        }
        if self.command is not None:
            record["command"] = self.command
        return record


@dataclass(frozen=True)
class Trace:
    """``slots`` workers' places and the jobs, in order of arrival (then name)."""

    slots: int
    jobs: tuple[JobSpec, ...]

    def to_json(self) -> dict[str, Any]:
        return {"slots": self.slots, "jobs": [job.to_json() for job in self.jobs]}


def load_trace(path: str | Path) -> Trace:
    """The trace in the JSON file ``path``; TraceError (naming the file, and the job and
    field where one is wrong) if it cannot be read or run."""
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise TraceError(f"cannot read the trace {str(path)!r}: {e.strerror or e}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise TraceError(f"the trace {str(path)!r} is not JSON: {e}") from None
    return parse_trace(data)


def _number(value: Any, where: str, *, minimum: float, strict: bool = False) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < minimum or (strict and value == minimum):
        bound = f"> {minimum:g}" if strict else f">= {minimum:g}"
        raise TraceError(f"{where} must be a finite number {bound}, got {value!r}")
    return float(value)


def _whole(value: Any, where: str, *, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise TraceError(f"{where} must be a whole number >= {minimum}, got {value!r}")
    return value


_FIELDS = ("name", "arrival_s", "demand", "priority", "virtual_nodes", "steps", "step_s")


def _job(record: Any, index: int, slots: int) -> JobSpec:
    if not isinstance(record, dict):
        raise TraceError(f"jobs[{index}] must be an object, got {type(record).__name__}")
    name = record.get("name")
    if not isinstance(name, str) or not name or any(c.isspace() for c in name):
        raise TraceError(
            f"jobs[{index}].name must be a non-empty string without spaces, got {name!r}"
        )
    job = f"job {name!r}"
    missing = [key for key in _FIELDS if key not in record]
    if missing:
        raise TraceError(f"{job} is missing {', '.join(missing)}")
    unknown = sorted(set(record) - set(_FIELDS) - {"command"})
    if unknown:
        raise TraceError(
            f"{job} has unknown fields {unknown} (known: {', '.join(_FIELDS)}, command)"
        )
    arrival_s = _number(record["arrival_s"], f"{job}: arrival_s", minimum=0.0)
    demand = _whole(record["demand"], f"{job}: demand", minimum=1)
    if demand > slots:
        raise TraceError(f"{job}: demand {demand} is more than the cluster's {slots} slots")
    priority = _number(record["priority"], f"{job}: priority", minimum=0.0, strict=True)
    virtual_nodes = _whole(record["virtual_nodes"], f"{job}: virtual_nodes", minimum=1)
    if demand > virtual_nodes:
        raise TraceError(
            f"{job}: demand {demand} is more than its virtual_nodes {virtual_nodes} "
            "(every worker needs a VN)"
        )
    steps = _whole(record["steps"], f"{job}: steps", minimum=1)
    table = record["step_s"]
    if not isinstance(table, dict) or not table:
        raise TraceError(f"{job}: step_s must be a non-empty object of worker count -> seconds")
    step_s: dict[int, float] = {}
    for key, seconds in table.items():
        try:
            count = int(key)
        except (TypeError, ValueError):
            count = 0
        if count < 1 or str(count) != str(key):
            raise TraceError(f"{job}: step_s keys must be worker counts >= 1, got {key!r}")
        step_s[count] = _number(seconds, f"{job}: step_s[{key!r}]", minimum=0.0, strict=True)
    usable = {count: s for count, s in step_s.items() if count <= virtual_nodes}
    if not usable:
        raise TraceError(
            f"{job}: step_s has no usable worker count (every count is above its "
            f"virtual_nodes {virtual_nodes})"
        )
    if demand > max(usable):
        raise TraceError(
            f"{job}: step_s gives no count >= its demand {demand} (largest usable: {max(usable)})"
        )
    command = record.get("command")
    if command is not None and (not isinstance(command, str) or not command.strip()):
        raise TraceError(f"{job}: command must be a non-empty string, got {command!r}")
    return JobSpec(name, arrival_s, demand, priority, virtual_nodes, steps, usable, command)


def parse_trace(data: Any) -> Trace:
    """The trace in ``data`` (the parsed JSON); TraceError naming the job and field of
    the first problem found."""
    if not isinstance(data, dict):
        raise TraceError(f"a trace must be a JSON object, got {type(data).__name__}")
    unknown = sorted(set(data) - {"slots", "jobs"})
    if unknown:
        raise TraceError(f"the trace has unknown fields {unknown} (known: slots, jobs)")
    if "slots" not in data:
        raise TraceError("the trace is missing slots")
    slots = _whole(data["slots"], "slots", minimum=1)
    records = data.get("jobs")
    if not isinstance(records, list) or not records:
        raise TraceError("the trace's jobs must be a non-empty list")
    jobs = [_job(record, index, slots) for index, record in enumerate(records)]
    names = [job.name for job in jobs]
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        raise TraceError(f"job names must be unique, got {twice} more than once")
    return Trace(slots, tuple(sorted(jobs, key=lambda job: (job.arrival_s, job.name))))


def write_json(path: str | Path, data: Any) -> None:
    """Writes ``data`` as JSON to ``path`` so that a reader sees the old file or the
    whole new one, never a part."""
    text = json.dumps(data, indent=1) + "\n"
    with replacing_atomically(path) as f:
        f.write(text.encode())
