"""vflow.cluster.trace: TRACE.json read and checked, and a job's step time between the
counts it gives (Note [Step time between the given counts])."""

from __future__ import annotations

import json
from typing import Any

import pytest

from vflow.cluster.trace import JobSpec, TraceError, load_trace, parse_trace, write_json
from vflow.runtime import checkpoint


def job(**changes: Any) -> dict[str, Any]:
    record = {
        "name": "j1",
        "arrival_s": 0.0,
        "demand": 2,
        "priority": 1,
        "virtual_nodes": 8,
        "steps": 1000,
        "step_s": {"1": 0.80, "2": 0.42, "4": 0.23, "8": 0.13},
    }
    record.update(changes)
    return record


def test_the_issues_example_reads_back_as_written() -> None:
    data = {"slots": 8, "jobs": [job()]}
    trace = parse_trace(data)
    assert trace.slots == 8 and len(trace.jobs) == 1
    spec = trace.jobs[0]
    assert (spec.name, spec.demand, spec.virtual_nodes, spec.steps) == ("j1", 2, 8, 1000)
    assert spec.max_workers == 8
    assert trace.to_json() == {"slots": 8, "jobs": [{**job(), "priority": 1.0}]}


def test_jobs_are_ordered_by_arrival_then_name() -> None:
    trace = parse_trace(
        {
            "slots": 4,
            "jobs": [job(name="b", arrival_s=5), job(name="c"), job(name="a", arrival_s=5)],
        }
    )
    assert [spec.name for spec in trace.jobs] == ["c", "a", "b"]


def test_throughput_is_interpolated_between_the_given_counts() -> None:
    spec = JobSpec("j", 0.0, 1, 1.0, 8, 10, {2: 0.42, 4: 0.21})
    assert spec.step_time(2) == pytest.approx(0.42)
    # halfway in throughput: 1/0.42 and 1/0.21 -> 3.5714 steps/s
    assert spec.step_time(3) == pytest.approx(1 / ((1 / 0.42 + 1 / 0.21) / 2))
    assert spec.step_time(3) == pytest.approx(0.28)
    # below the smallest count: throughput in proportion to the workers
    assert spec.step_time(1) == pytest.approx(0.84)
    assert spec.max_workers == 4
    with pytest.raises(ValueError, match="workers must be in 1..4"):
        spec.step_time(5)
    assert spec.throughput(0) == 0.0


def test_counts_above_v_are_dropped() -> None:
    spec = parse_trace({"slots": 8, "jobs": [job(virtual_nodes=4)]}).jobs[0]
    assert spec.max_workers == 4 and sorted(spec.step_s) == [1, 2, 4]


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (
            {"slots": 8, "jobs": [{k: v for k, v in job().items() if k != "steps"}]},
            "job 'j1' is missing steps",
        ),
        ({"slots": 1, "jobs": [job()]}, "job 'j1': demand 2 is more than the cluster's 1 slots"),
        (
            {"slots": 8, "jobs": [job(arrival_s=-1.0)]},
            r"job 'j1': arrival_s must be a finite number >= 0",
        ),
        (
            {"slots": 8, "jobs": [job(step_s={"16": 0.1})]},
            "job 'j1': step_s has no usable worker count",
        ),
        (
            {"slots": 8, "jobs": [job(step_s={"1": 0.8})]},
            "job 'j1': step_s gives no count >= its demand 2",
        ),
        (
            {"slots": 8, "jobs": [job(step_s={"two": 0.8})]},
            "job 'j1': step_s keys must be worker counts",
        ),
        (
            {"slots": 8, "jobs": [job(step_s={"2": -0.8})]},
            r"job 'j1': step_s\['2'\] must be a finite number > 0",
        ),
        ({"slots": 8, "jobs": [job(steps=0)]}, "job 'j1': steps must be a whole number >= 1"),
        ({"slots": 8, "jobs": [job(priority=0)]}, "job 'j1': priority must be a finite number > 0"),
        (
            {"slots": 8, "jobs": [job(demand=9, virtual_nodes=8)]},
            "demand 9 is more than the cluster",
        ),
        ({"slots": 8, "jobs": [job(demand=4, virtual_nodes=2)]}, "more than its virtual_nodes 2"),
        ({"slots": 8, "jobs": [job(), job()]}, r"job names must be unique, got \['j1'\]"),
        ({"slots": 8, "jobs": [job(speed=1)]}, r"job 'j1' has unknown fields \['speed'\]"),
        ({"slots": 8, "jobs": [job(name="")]}, r"jobs\[0\].name must be a non-empty string"),
        ({"slots": 0, "jobs": [job()]}, "slots must be a whole number >= 1"),
        ({"jobs": [job()]}, "missing slots"),
        ({"slots": 8, "jobs": []}, "jobs must be a non-empty list"),
        ([1, 2], "must be a JSON object"),
    ],
)
def test_bad_traces_are_refused_naming_the_job_and_field(data: Any, message: str) -> None:
    with pytest.raises(TraceError, match=message):
        parse_trace(data)


def test_load_trace_names_the_file(tmp_path) -> None:
    with pytest.raises(TraceError, match="cannot read the trace"):
        load_trace(tmp_path / "missing.json")
    broken = tmp_path / "broken.json"
    broken.write_text("{")
    with pytest.raises(TraceError, match="is not JSON"):
        load_trace(broken)
    good = tmp_path / "trace.json"
    good.write_text(json.dumps({"slots": 2, "jobs": [job()]}))
    assert load_trace(good).jobs[0].name == "j1"


def test_write_json_replaces_the_whole_file_or_leaves_the_old_one(tmp_path, monkeypatch) -> None:
    path = tmp_path / "result.json"
    write_json(path, {"first": 1})
    write_json(path, {"second": [1, 2]})
    assert json.loads(path.read_text()) == {"second": [1, 2]}

    def failing_fsync(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoint.os, "fsync", failing_fsync)
    with pytest.raises(OSError, match="No space left"):
        write_json(path, {"third": 3})
    with pytest.raises(TypeError):
        write_json(path, {"not json": object()})
    assert json.loads(path.read_text()) == {"second": [1, 2]}
    assert [p.name for p in tmp_path.iterdir()] == ["result.json"]
