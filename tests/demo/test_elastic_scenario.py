"""The main job's elastic scenario (vflow/demo/elastic_scenario.py): its pieces, and one
short run end to end with the real store and worker processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from vflow.demo import elastic_scenario

# (reason, workers after, what happened) of the table rows of a run that went to plan.
PLANNED_ROWS = [
    ("start", "1", "a starts the job alone"),
    ("grow", "2", "b joins"),
    ("grow", "3", "c joins"),
    ("crash", "2", "b killed by SIGKILL in its backward; the others redo step "),
    ("grow", "3", "d joins"),
    ("finish", "3", "done; a, c, d hold the final state"),
]


def _event(step: int, rnd: int, workers: int, reason: str) -> dict[str, Any]:
    return {"step": step, "round": rnd, "workers": workers, "reason": reason, "seconds": 0.5}


def _planned_outcome() -> elastic_scenario.Outcome:
    outcome = elastic_scenario.Outcome(epochs=1, steps=12)
    finish = _event(12, 4, 3, "finish")
    outcome.events = {
        "a": [_event(0, 0, 1, "start"), _event(2, 1, 2, "grow"), _event(4, 2, 3, "grow"),
              _event(5, 3, 2, "crash"), _event(7, 4, 3, "grow"), finish],
        "b": [],  # killed: it never writes its events
        "c": [_event(4, 2, 3, "start"), _event(5, 3, 2, "crash"), _event(7, 4, 3, "grow"),
              finish],
        "d": [_event(7, 4, 3, "start"), finish],
    }  # fmt: skip
    outcome.first_steps = {"a": 0, "b": 2, "c": 4, "d": 7}
    outcome.finishers = ["a", "c", "d"]
    return outcome


def test_the_scenario_has_whole_epochs_and_enough_steps() -> None:
    assert elastic_scenario.scenario_steps(22, 1) == (1, 22)
    assert elastic_scenario.scenario_steps(22, 3) == (3, 66)
    # Fewer steps than the changes need: whole epochs until there are enough.
    assert elastic_scenario.scenario_steps(11, 1) == (2, 22)
    assert elastic_scenario.scenario_steps(5, 1) == (3, 15)


def test_table_rows_name_the_workers_behind_each_change() -> None:
    outcome = _planned_outcome()
    rows = outcome.table_rows()
    assert [(r["step"], r["reason"], r["workers"]) for r in rows] == [
        (0, "start", 1), (2, "grow", 2), (4, "grow", 3), (5, "crash", 2), (7, "grow", 3),
        (12, "finish", 3),
    ]  # fmt: skip
    assert [r["what"] for r in rows] == [
        "a starts the job alone",
        "b joins",
        "c joins",
        "b killed by SIGKILL in its backward; the others redo step 5",
        "d joins",
        "done; a, c, d hold the final state",
    ]
    assert [r["label"] for r in rows] == [
        "start: a → 1", "+b → 2", "+c → 3", "b killed → 2", "+d → 3", "done → 3",
    ]  # fmt: skip
    assert outcome.as_planned() and outcome.one_worker_set() is None


def test_two_worker_sets_that_both_finish_are_reported() -> None:
    outcome = _planned_outcome()
    # a finished alone in round 3 while c and d finished in round 4: a split job.
    outcome.events["a"] = [_event(0, 0, 1, "start"), _event(7, 3, 1, "grow"),
                           _event(12, 3, 1, "finish")]  # fmt: skip
    outcome.events["c"][-1] = outcome.events["d"][-1] = _event(12, 4, 2, "finish")
    split = outcome.one_worker_set()
    assert split is not None and split.startswith("a: {'step': 12, 'round': 3")
    assert not outcome.as_planned()


def test_compare_is_bitwise() -> None:
    want = {"w": torch.tensor([1.0, 2.0]), "b": torch.tensor([0.5])}
    same = {name: value.clone() for name, value in want.items()}
    assert elastic_scenario.compare({"a": same, "c": same}, want) == (True, 0.0)
    off = {"w": torch.tensor([1.0, 2.0 + 2**-22]), "b": torch.tensor([0.5])}
    identical, worst = elastic_scenario.compare({"a": same, "c": off}, want)
    assert not identical and worst == 2**-22
    assert elastic_scenario.compare({"a": {"w": want["w"]}}, want) == (False, float("inf"))


def test_verdict_lines() -> None:
    outcome = _planned_outcome()
    outcome.identical = outcome.same_losses = True
    assert outcome.verdict(6, 8) == (
        "elastic: the final parameters of a, c, d equal the fixed-hardware run's bitwise "
        "(torch.equal on all 6 tensors; 1 process, V=8, same seed and data order)"
    )
    outcome.identical, outcome.max_param_diff = False, 3e-7
    assert outcome.verdict(6, 8) == (
        "elastic: the final parameters DIFFER from the fixed-hardware run's (expected "
        "bitwise-equal; max difference 3.00e-07)"
    )


def test_worker_logs_are_read_while_being_written(tmp_path: Path) -> None:
    path = tmp_path / "a.jsonl"
    assert elastic_scenario.WorkerLog.read(path) == elastic_scenario.WorkerLog()
    path.write_text(
        '{"hold": 0, "workers": 1}\n{"step": 0, "loss": 2.3, "workers": 1, "rank": 0}\n'
        '{"step": 1, "lo'
    )
    log = elastic_scenario.WorkerLog.read(path)
    assert [line["step"] for line in log.steps] == [0]
    assert log.holds_with(1) == 1 and log.holds_with(2) == 0 and log.end is None


class _Executor:
    def __init__(self, world_size: int, counts: list[int], rank: int) -> None:
        self.world_size, self.rank = world_size, rank
        self.plan = type("Plan", (), {"counts": counts})()


def test_the_kill_is_armed_in_the_chosen_step_with_all_workers() -> None:
    kill = elastic_scenario.Kill(step=1)
    armed = []
    for world_size in (1, 2, 3, 3, 3, 2):
        kill.begin_step(_Executor(world_size, [3] * world_size, 0))
        armed.append(kill.armed)
    assert armed == [False, False, False, True, False, False]
    assert not any(_armed_steps(elastic_scenario.Kill(step=None)))


def _armed_steps(kill: elastic_scenario.Kill) -> list[bool]:
    armed = []
    for world_size in (1, 3, 3, 3):
        kill.begin_step(_Executor(world_size, [1] * world_size, 0))
        armed.append(kill.armed)
    return armed


def test_the_kill_hook_sits_on_the_middle_vn_of_the_armed_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fired = []
    monkeypatch.setattr(
        elastic_scenario.Kill, "_fire", staticmethod(lambda g: fired.append(1) or g)
    )
    kill = elastic_scenario.Kill(step=0)
    kill.begin_step(_Executor(3, [3, 3, 2], 1))
    layer = torch.nn.ReLU()
    layer.register_forward_hook(kill.forward_hook)
    for vn in range(3):
        x = torch.randn(4, requires_grad=True)
        layer(x).sum().backward()
        assert fired == ([] if vn == 0 else [1])


def test_a_worker_that_fails_to_start_is_a_scenario_error(tmp_path: Path) -> None:
    procs = elastic_scenario._Processes(tmp_path, deadline=float("inf"))
    try:
        procs.start_worker("x", [])  # lacks every required option: exits 2
        with pytest.raises(
            elastic_scenario.ScenarioError, match="the process ended .exit status 2"
        ):
            procs.wait_ready("x")
    finally:
        procs.close()
    assert procs.workers["x"].returncode == 2
    assert "the following arguments are required" in (tmp_path / "x.err").read_text()


def _run_the_demo(out: Path) -> str:
    """A short main job with only the elastic scenario; its stdout."""
    result = subprocess.run(
        [sys.executable, "-m", "vflow", "demo", "--epochs", "1", "--mappings", "1",
         "--no-baseline", "--no-heterogeneous", "--virtual-nodes", "4", "--batch-size", "96",
         "--out", str(out), "--timeout", "240"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def _check_the_printed_report(stdout: str, record: dict[str, Any]) -> None:
    assert "elastic: the final parameters of a, c, d equal the fixed-hardware run's " in stdout
    assert "bitwise (torch.equal on all 6 tensors; 1 process, V=4" in stdout
    # The event table: its header, then one row per change, in order.
    lines = stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("step  event"))
    assert lines[header].split() == ["step", "event", "workers", "after", "seconds", "what",
                                     "happened"]  # fmt: skip
    rows = lines[header + 2 : header + 2 + len(PLANNED_ROWS)]
    assert lines[header + 2 + len(PLANNED_ROWS)] == "", stdout
    for row, event in zip(rows, record["table"], strict=True):
        step, reason, workers, seconds, what = row.split(maxsplit=4)
        assert (reason, workers, what) == (event["reason"], str(event["workers"]), event["what"])
        assert int(step) == event["step"] and float(seconds) == round(event["seconds"], 2), row


def test_the_main_job_ends_bitwise_equal_to_fixed_hardware(tmp_path: Path) -> None:
    """The scenario end to end, with the real store and worker processes. CI runs the
    main job (``make demo``) before the tests and passes its output folder in
    VFLOW_DEMO_OUT: the scenario then runs once, and this test checks what it wrote."""
    given = os.environ.get("VFLOW_DEMO_OUT")
    out = Path(given) if given else tmp_path / "demo"
    stdout = None if given else _run_the_demo(out)
    record = json.loads((out / "elastic.json").read_text())
    if stdout is not None:
        _check_the_printed_report(stdout, record)
    for event, planned in zip(record["table"], PLANNED_ROWS, strict=True):
        assert (event["reason"], str(event["workers"])) == planned[:2], record["table"]
        assert event["what"].startswith(planned[2]), event
    assert record["identical"] is True and record["same_losses"] is True
    assert record["as_planned"] is True and record["split"] is None
    settings = record["settings"]
    steps_per_epoch = 1438 // settings["batch_size"]  # the digits' training samples
    epochs, steps = elastic_scenario.scenario_steps(steps_per_epoch, settings["epochs"])
    assert (record["steps"], record["epochs"]) == (steps, epochs)
    assert record["losses"] == record["reference_losses"] and len(record["losses"]) == steps
    assert record["exit_codes"] == {"a": 0, "b": -signal.SIGKILL, "c": 0, "d": 0}
    crash = next(r for r in record["table"] if r["reason"] == "crash")
    # The victim died in its second step with three workers; the survivors hold two.
    assert record["workers_per_step"][crash["step"] - 1] == 3
    assert record["workers_per_step"][crash["step"]] == 2
    assert record["workers_per_step"][-1] == 3
    # The 1-worker mapping of the demo trained the same steps: the same losses.
    results = json.loads((out / "results.json").read_text())
    one_worker = next(r for r in results["runs"] if r["counts"] == [settings["virtual_nodes"]])
    common = min(len(one_worker["losses"]), steps)
    assert one_worker["losses"][:common] == record["losses"][:common]

    png = (out / "elastic.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000
    files = {path.name for path in (out / "elastic").iterdir()}
    assert {"a.jsonl", "b.jsonl", "c.jsonl", "d.jsonl", "a.pt", "c.pt", "d.pt"} <= files
    assert "b.pt" not in files
