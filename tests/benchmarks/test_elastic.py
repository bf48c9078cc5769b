"""benchmarks/elastic.py: how it plans its chains, how the vflow workers' logs are read
by the analysis it shares with the torchrun baseline (benchmarks/_torchrun_baseline.py),
its rows, targets and headline records (on hand-made results), and one --quick run end
to end, whose vflow side must commit every global batch exactly once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.support import REPO_ROOT
from tests.support.benchmark_scripts import load_script
from tests.support.rendezvous import store_process
from vflow.bench.records import evaluate

elastic = load_script("elastic")
trb = sys.modules["_torchrun_baseline"]  # imported by elastic.py, by name


def _plan(kinds: list[str], n: int, side: str) -> tuple[int, list[str]]:
    start, events = elastic.chain_events(kinds, n, side)
    return start, [("restore" if e.restore else e.kind) for e in events]


def test_every_event_but_a_grow_hits_a_job_of_n_workers() -> None:
    full = list(elastic.EVENTS)
    # vflow loses the worker of a term, crash or stop: one more joins before the next.
    assert _plan(full, 4, "vflow") == (
        4,
        ["leave", "grow", "term", "restore", "crash", "restore", "stop"],
    )
    # torchrun restarts it: only the leave shrinks, and the grow brings it back.
    assert _plan(full, 4, "torchrun") == (4, ["leave", "grow", "term", "crash", "stop"])
    # A grow without a leave comes first, from N - 1 workers.
    assert _plan(["crash", "grow"], 2, "vflow") == (1, ["grow", "crash"])
    assert _plan(["crash", "grow"], 2, "torchrun") == (1, ["grow", "crash"])
    # A leave not followed by a grow: a restore on both sides.
    assert _plan(["term", "leave"], 2, "torchrun") == (2, ["leave", "restore", "term"])
    for side in ("vflow", "torchrun"):
        start, events = elastic.chain_events(full, 2, side)
        size = start
        for e in events:
            assert size == (1 if e.kind == "grow" else 2), (side, e)
            size = elastic.size_after(side, e.kind, size)


def test_torchrun_runs_parse_as_profile_and_k() -> None:
    run = elastic.parse_torchrun("default:100")
    assert (run.profile, run.checkpoint_every, run.label) == (
        "default",
        100,
        "torchrun default K=100",
    )
    for bad in ("fast:10", "tuned", "tuned:x", "tuned:1"):
        with pytest.raises(Exception, match="PROFILE:K"):
            elastic.parse_torchrun(bad)


def test_events_fire_half_a_checkpoint_period_after_a_checkpoint(tmp_path: Path) -> None:
    s = trb.Settings(checkpoint_every=10, tail_steps=5, settle_steps=10, event_phase=5)
    chain = trb._Chain([], s, tmp_path)
    event = trb.Event("crash", elastic.first_event_step(10))
    assert chain.due_step(event, 0) == 15  # not before K + K/2
    assert chain.due_step(trb.Event("crash", 0), 150) == 165  # >= 160, at 5 mod 10
    assert chain.due_step(trb.Event("crash", 0), 146) == 165
    assert chain.due_step(trb.Event("crash", 0), 145) == 155
    # Not before the group is back where the previous one got (it recomputes first).
    assert chain.due_step(trb.Event("crash", 0), 140, high=158) == 165
    assert chain.due_step(trb.Event("crash", 0), 140, high=166) == 175
    open_ended = trb._Chain([], trb.Settings(), tmp_path)
    assert open_ended.due_step(trb.Event("crash", 7), 0) == 7  # no phase, no settle


# ---- the vflow workers' logs, read by the shared analysis ----


def _write(path: Path, lines: list[dict[str, Any]]) -> None:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")


def _set(node: str, k: int, name: str, rank: int, n: int, t0: float, steps: range, dt: float):
    """One worker's file of one worker set, as benchmarks/_elastic_worker.py writes it."""
    head = {"exec": t0, "pid": 1, "rank": rank, "restart": 0, "workers": n, "master": name}
    lines: list[dict[str, Any]] = [head, {"begin": t0, "step": steps[0], "workers": n}]
    for i, s in enumerate(steps):
        lines.append({"t": t0 + dt * (i + 1), "step": s, "rank": rank, "workers": n})
    return f"{node}.s{k}.jsonl", lines


def _crash_logs(folder: Path) -> None:
    """a and b train steps 0..9 together (1 s each); b dies in step 10 at t = 10.5; a
    redoes step 10 alone from t = 11.0, 0.5 s per step, to step 19."""
    process = {"exec": -2.0, "pid": 1, "rank": -1, "restart": 0, "workers": 0, "master": ""}
    for node, rank in (("a", 0), ("b", 1)):
        _write(folder / f"{node}.p.jsonl", [process, {"ready": -1.5}, {"built": -1.0}])
        name, lines = _set(node, 0, "round 0/set0", rank, 2, 0.0, range(10), 1.0)
        if node == "b":
            lines.append({"kill": 10.5, "step": 10})
        _write(folder / name, lines)
    name, lines = _set("a", 1, "round 0/set1", 0, 1, 11.0, range(10, 20), 0.5)
    _write(folder / name, lines)


def _analysed(
    folder: Path,
    fired: list[trb._Fired],
    *,
    profile: str,
    start_size: int,
    end_step: int,
    first_start_t: float | None = None,
) -> trb.RunResult:
    """The logs in ``folder`` analysed as one 20 s run of a chain, without error."""
    logs = trb._Logs(folder)
    logs.poll()
    return trb.analyse(
        profile=profile,
        settings={},
        groups=logs.groups(),
        procs=list(logs.procs.values()),
        fired=fired,
        start_size=start_size,
        end_step=end_step,
        first_start_t=first_start_t,
        wall_s=20.0,
        error=None,
        log_dir=None,
    )


def test_the_vflow_logs_give_stall_recovery_and_no_recomputed_step(tmp_path: Path) -> None:
    _crash_logs(tmp_path)
    logs = trb._Logs(tmp_path)
    logs.poll()
    groups = logs.groups()
    assert [(g.key, g.world) for g in groups] == [("round 0/set0", 2), ("round 0/set1", 1)]
    fired = [trb._Fired(trb.Event("crash", 5), "b", 10.5, 2, 1)]
    r = _analysed(tmp_path, fired, profile="vflow", start_size=2, end_step=19, first_start_t=-2.0)
    (e,) = r.events
    assert e.recovered and e.recovery_s == pytest.approx(1.0)  # step 10 done at 11.5
    assert e.stall_s == {"a": pytest.approx(1.5)}  # its commits at 10.0 and 11.5
    assert e.resumed_s == {"a": pytest.approx(0.5)} and e.first_step_s["a"] == pytest.approx(1.0)
    assert (e.last_step_before, e.checkpoint_step, e.recomputed_steps) == (9, 10, 0)
    assert e.recompute_s == 0.0
    assert r.step_s == {2: pytest.approx(1.0), 1: pytest.approx(0.5)}
    # From the crash to step 19 (t = 16): 5.5 s for 10 steps of 0.5 s.
    assert e.overhead_s == pytest.approx(0.5)
    assert (r.steps_repeated, r.missing_steps, r.partial_steps) == (0, [], [])


def test_a_step_committed_by_part_of_a_worker_set_is_partial_and_missing(tmp_path: Path) -> None:
    _crash_logs(tmp_path)
    # b also committed step 10 before dying; a did not: a partial step, never completed.
    path = tmp_path / "b.s0.jsonl"
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    lines.insert(-1, {"t": 10.4, "step": 10, "rank": 1, "workers": 2})
    _write(path, lines)
    (tmp_path / "a.s1.jsonl").unlink()
    name, a_lines = _set("a", 1, "round 0/set1", 0, 1, 11.0, range(11, 20), 0.5)
    _write(tmp_path / name, a_lines)
    fired = [trb._Fired(trb.Event("crash", 5), "b", 10.5, 2, 1)]
    r = _analysed(tmp_path, fired, profile="vflow", start_size=2, end_step=19)
    assert r.partial_steps == [10] and r.missing_steps == [10]


def test_a_restart_recomputes_and_its_overhead_runs_to_the_last_groups_end(
    tmp_path: Path,
) -> None:
    # torchrun's way: a alone commits steps 0..12 (1 s each), dies at 13.5; the
    # restarted process loads the checkpoint of step 10 and commits 10..12 again.
    _, lines = _set("a", 0, "127.0.0.1:1", 0, 1, 0.0, range(13), 1.0)
    _write(tmp_path / "a.r0.p1.jsonl", lines)
    _, lines = _set("a", 1, "127.0.0.1:2", 0, 1, 15.0, range(10, 13), 1.0)
    lines.insert(1, {"loaded": 15.0, "step": 10})
    _write(tmp_path / "a.r1.p2.jsonl", lines)
    fired = [trb._Fired(trb.Event("crash", 5), "a", 13.5, 1, 1)]
    r = _analysed(tmp_path, fired, profile="tuned", start_size=1, end_step=12)
    (e,) = r.events
    assert (e.last_step_before, e.checkpoint_step, e.recomputed_steps) == (12, 10, 3)
    assert e.recompute_s == pytest.approx(3.0)  # began at 15, step 12 done at 18
    assert e.recovery_s == pytest.approx(2.5)
    # To the restarted group's completion of step 12 (18), without progress: 4.5 s.
    assert e.overhead_s == pytest.approx(4.5)
    assert r.steps_repeated == 3


# ---- rows, targets and headlines, on hand-made results ----


def _event(kind: str, before: int, after: int, stall: float, overhead: float, **kw: Any) -> Any:
    fields: dict[str, Any] = {
        "kind": kind,
        "at_step": 0,
        "node": "b",
        "t_event": 0.0,
        "progress_at_event": 10,
        "size_before": before,
        "size_after": after,
        "recovered": True,
        "recovery_s": stall,
        "stall_s": {"a": stall * 0.9, "c": stall},
        "last_step_before": 10,
        "checkpoint_step": 11,
        "recomputed_steps": 0,
        "recompute_s": 0.0,
        "overhead_s": overhead,
        "phases_s": {"begin": stall - 0.1, "step": stall},
        "resumed_s": {"a": 0.5, "c": 0.7},
        "first_step_s": {"a": 0.9, "c": 1.0},
    }
    return trb.EventResult(**(fields | kw))


def _result(events: list[Any], repeated: int = 0) -> Any:
    return trb.RunResult(
        profile="x",
        settings={},
        events=events,
        wall_s=60.0,
        startup_s=3.0,
        step_s={4: 0.3, 3: 0.25},
        overhead_s=5.0,
        checkpoint_s=None,
        steps_completed=100,
        steps_repeated=repeated,
        missing_steps=[],
        error=None,
        log_dir=None,
    )


def _config(**kw: Any) -> Any:
    fields: dict[str, Any] = {
        "hidden": 16,
        "layers": 1,
        "batch_size": 8,
        "virtual_nodes": 4,
        "threads": 1,
        "deterministic": False,
        "workers": (4,),
        "events": ("grow", "crash"),
        "torchrun": (elastic.TorchrunRun("default", 10), elastic.TorchrunRun("tuned", 10)),
        "repeats": 2,
        "settle": 10,
        "tail": 10,
        "event_timeout_s": 90.0,
        "timeout_s": 600.0,
        "default_stop_every_repeat": False,
        "collective_timeout_s": 10.0,
        "last_call_s": 1.0,
        "keep_alive_s": 0.5,
        "keep_alive_attempts": 4,
    }
    return elastic.Config(**(fields | kw))


def _chains() -> list[Any]:
    out = []
    for rep in range(2):
        vflow = [
            _event("grow", 3, 4, 1.0, 2.0),
            _event("crash", 4, 3, 0.5 + rep, 0.6, resumed_s={"a": 0.6, "c": 0.8 + rep}),
        ]
        default = [
            _event("grow", 3, 4, 10.0, 20.0),
            _event("crash", 4, 4, 4.0, 5.0, recomputed_steps=6, checkpoint_step=5),
        ]
        tuned = [
            _event("grow", 3, 4, 4.0, 5.0),
            _event("crash", 4, 4, 3.0, -1.0, recomputed_steps=6, checkpoint_step=5),
        ]
        out += [
            elastic.Chain(rep, 4, "vflow", _result(vflow), 30.0),
            elastic.Chain(rep, 4, "torchrun default K=10", _result(default, 6), 60.0),
            elastic.Chain(rep, 4, "torchrun tuned K=10", _result(tuned, 6), 40.0),
        ]
    return out


def test_rows_targets_verdicts_and_headlines(capsys: pytest.CaptureFixture[str]) -> None:
    record = elastic.summarise(_config(), _chains(), [])
    rows = {(r["event"], r["side"]): r for r in record["rows"]}
    assert rows["crash", "vflow"]["stall_s"] == pytest.approx(1.0)  # median of 0.5, 1.5
    assert rows["crash", "vflow"]["sizes"] == "4->3"
    assert rows["crash", "torchrun tuned K=10"]["recomputed"] == 6
    targets = {(t["event"], t["profile"]): t for t in record["targets"]}
    grow = targets["grow", "default"]
    assert grow["stall_ratio"] == pytest.approx(0.1) and grow["overhead_ratio"] == 0.1
    assert grow["verdict"] == "met"
    assert targets["grow", "tuned"]["stall_ratio"] == pytest.approx(0.25)
    crash_default = targets["crash", "default"]
    assert crash_default["stall_ratio"] == pytest.approx((0.5 / 4 + 1.5 / 4) / 2)
    assert crash_default["overhead_ratio"] == pytest.approx(0.12)
    assert crash_default["verdict"] == "MISSED (stall)"
    # A torchrun overhead <= 0 gives no ratio: the target cannot be judged on it.
    assert targets["crash", "tuned"]["overhead_ratio"] is None
    assert targets["crash", "tuned"]["verdict"] == "n/a (overhead (torchrun's <= 0))"
    assert all(e["verdict"] == "met" for e in record["exactly_once"])
    back = record["crash_back"]
    assert back["resumed_s"] == [0.8, 1.8] and back["verdict"] == "MISSED"
    assert record["vflow_whole_run"] == {
        "chains": 2,
        "batches": 200,
        "missing": 0,
        "repeated": 0,
        "partial": 0,
    }

    elastic.print_results(record)
    out = capsys.readouterr().out
    assert "torchrun default K=10" in out and "MISSED (stall)" in out
    assert "0 never committed, 0 committed again, 0 committed by part of a worker set" in out
    assert "back at training" in out

    headlines = elastic.headline_records(record)
    results = {h["key"].split("/", 2)[2]: evaluate(h).result for h in headlines}
    assert results == {
        "4w/grow/stall/default-k10": "met",
        "4w/grow/overhead/default-k10": "met",
        "4w/grow/stall/tuned-k10": "met",
        "4w/grow/overhead/tuned-k10": "met",
        "4w/crash/stall/default-k10": "MISSED",
        "4w/crash/overhead/default-k10": "met",
        "4w/crash/stall/tuned-k10": "met",  # 0.33 of tuned's
        # crash overhead vs tuned: torchrun's samples are <= 0, no record
        "4w/crash/back": "MISSED",
    }


def test_a_not_recovered_torchrun_event_is_said_so(capsys: pytest.CaptureFixture[str]) -> None:
    chains = _chains()
    for c in chains:
        if c.side == "torchrun default K=10":
            crash = c.result.events[1]
            crash.recovered, crash.recovery_s, crash.stall_s = False, None, {}
            crash.overhead_s = None
    record = elastic.summarise(_config(), chains, ["repetition 3/3, 4 workers, vflow"])
    target = next(
        t for t in record["targets"] if (t["event"], t["profile"]) == ("crash", "default")
    )
    assert target["torchrun_not_recovered"] == 2 and target["verdict"].startswith("n/a")
    elastic.print_results(record)
    out = capsys.readouterr().out
    assert "> 90" in out and "not recovered within the event deadline (90 s" in out
    assert "skipped for want of time: repetition 3/3, 4 workers, vflow" in out


def test_a_failed_vflow_chain_is_reported(capsys: pytest.CaptureFixture[str]) -> None:
    chains = _chains()
    chains[0].result.error = "no recovery from crash of b within 90 s"
    record = elastic.summarise(_config(), chains, [])
    assert record["vflow_errors"] == [
        "repetition 1, 4 workers: no recovery from crash of b within 90 s"
    ]
    elastic.print_results(record)
    assert "VFLOW CHAIN FAILED: repetition 1" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv",
    [
        ["--repeats", "0"],
        ["--workers", "1"],
        ["--workers", "2", "5"],  # more workers than V = 4
        ["--torchrun", "fast:10"],
        ["--events", "restore"],
    ],
)
def test_bad_arguments(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        elastic.main(argv)
    assert exc.value.code == 2


def test_help_estimates_the_full_run(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        elastic.main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "the full run (" in out and "min on a quiet 2-core machine" in out
    full = elastic.config_of(elastic._parser().parse_args([]))
    assert 20 * 60 < elastic.estimate_s(full) < 120 * 60


# The smallest run that still takes both sides through a grow and a crash: a
# 442-parameter model; what remains is the processes' start-up and the rendezvous.
SMALLEST = ("--hidden", "16", "--layers", "1", "--batch-size", "8")


def _processes_with(marker: str) -> list[str]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
            except OSError:
                continue
            if marker.encode() in cmdline:
                found.append(cmdline.replace(b"\0", b" ").decode(errors="replace"))
    return found


@pytest.mark.slow
def test_quick_run_commits_every_batch_once_and_writes_headlines(tmp_path: Path) -> None:
    out = tmp_path / "elastic.json"
    logs = tmp_path / "logs"
    proc = subprocess.run(
        [
            sys.executable,
            "benchmarks/elastic.py",
            "--quick",
            *SMALLEST,
            *("--json", str(out), "--keep-logs", str(logs)),
        ],
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert _processes_with(str(logs)) == []  # every worker, agent and store is gone
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in proc.stdout
    assert "torchrun tuned K=10" in proc.stdout and "stall ratio" in proc.stdout
    assert "ElasticJob timeout_s=10, last_call_s=1, keep_alive_s=0.5" in proc.stdout
    records = json.loads(out.read_text(encoding="utf-8"))
    detail = records[0]
    assert detail["benchmark"] == "elastic"
    # The vflow side: every global batch committed by a whole worker set, exactly once.
    whole = detail["vflow_whole_run"]
    assert whole["chains"] == 1 and whole["batches"] > 0
    assert (whole["missing"], whole["repeated"], whole["partial"]) == (0, 0, 0)
    assert detail["vflow_errors"] == []
    assert [e["verdict"] for e in detail["exactly_once"]] == ["met", "met"]
    rows = {(r["event"], r["side"]): r for r in detail["rows"]}
    assert set(rows) == {
        ("grow", "vflow"),
        ("crash", "vflow"),
        ("grow", "torchrun tuned K=10"),
        ("crash", "torchrun tuned K=10"),
    }
    assert all(r["recovered"] == 1 for r in rows.values())
    assert rows["crash", "vflow"]["sizes"] == "2->1"
    assert rows["crash", "torchrun tuned K=10"]["sizes"] == "2->2"
    # vflow computes no step again. How many torchrun does depends on where the kill
    # lands after its checkpoint: the quick run's steps take a few ms, so the signal's
    # delivery can carry the kill past the next checkpoint (0 then).
    assert rows["crash", "vflow"]["recomputed"] == 0 and rows["grow", "vflow"]["recomputed"] == 0
    assert {t["event"] for t in detail["targets"]} == {"grow", "crash"}
    for h in records[1:]:
        evaluate(h)


def test_a_joiner_told_to_knock_at_a_file_waits_for_it_once_built(tmp_path: Path) -> None:
    """benchmarks/_elastic_worker.py --knock-at: the worker builds its executor, then
    does not ask to join (so it does not start the job alone, min_workers 1) until the
    file exists; then it trains. How elastic_scale's joiners of one grow knock at once."""
    gate = tmp_path / "knock"
    prefix = tmp_path / "a"
    with store_process(cwd=REPO_ROOT) as (_, endpoint):
        worker = subprocess.Popen(
            [
                sys.executable,
                "benchmarks/_elastic_worker.py",
                *("--rdzv", endpoint, "--job", "knock-at", "--log-path", str(prefix)),
                *("--hidden", "16", "--layers", "1", "--batch-size", "8", "--virtual-nodes", "2"),
                *("--min-workers", "1", "--max-workers", "2", "--last-call", "0.2"),
                *("--steps", "3", "--knock-at", str(gate)),
            ],
            cwd=REPO_ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            process_log = tmp_path / "a.p.jsonl"
            until = time.monotonic() + 120
            while "built" not in (process_log.read_text() if process_log.exists() else ""):
                assert worker.poll() is None and time.monotonic() < until, "no executor built"
                time.sleep(0.05)
            # Told nothing yet: a worker that asked to join would start the job alone
            # within the last call (0.2 s) and open its first worker set's log.
            time.sleep(3.0)
            assert worker.poll() is None and not list(tmp_path.glob("a.s*.jsonl"))
            gate.write_text("")
            _, err = worker.communicate(timeout=120)
        finally:
            if worker.poll() is None:
                worker.kill()
                worker.wait()
    assert worker.returncode == 0, err[-3000:]
    lines = [json.loads(line) for line in (tmp_path / "a.s0.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines if "t" in line] == [0, 1, 2]
