"""benchmarks/elastic.py: how it reads the workers' logs into event times and lost or
recomputed steps, its table and headline records (on hand-written logs), and one
--quick run end to end."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, cast

import pytest

from tests.support import REPO_ROOT
from tests.support.benchmark_scripts import load_script
from vflow.bench.records import evaluate

elastic = load_script("elastic")


def _worker(tmp_path: Path, name: str, started: float, lines: list[dict[str, Any]]) -> Any:
    path = tmp_path / f"{name}.log"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    log = elastic.WorkerLog(path)
    log.refresh()
    return elastic.Worker(name, cast(Any, None), log, tmp_path / f"{name}.err", started)


def _commit(t: float, step: int, rank: int, signals: list[int]) -> dict[str, Any]:
    return {"t": t, "step": step, "rank": rank, "workers": len(signals), "signals": signals}


def test_the_log_is_read_as_it_grows_and_a_partial_line_waits(tmp_path: Path) -> None:
    path = tmp_path / "w.log"
    log = elastic.WorkerLog(path)
    log.refresh()  # not written yet
    first = json.dumps({"ready": 1.0}) + "\n" + json.dumps(_commit(2.0, 0, 0, [0]))
    path.write_text(first[:-5], encoding="utf-8")
    log.refresh()
    assert log.stamp("ready") == 1.0 and log.commits == []
    with open(path, "a", encoding="utf-8") as f:
        f.write(first[-5:] + "\n")
    log.refresh()
    assert [c["step"] for c in log.commits] == [0] and log.last_step == 0
    assert log.commit_time(0) == 2.0
    with pytest.raises(elastic.BenchError, match="no 'joined' line"):
        log.stamp("joined")


def _grow(tmp_path: Path, waiting: int = elastic.WAITING) -> tuple[Any, Any]:
    a = _worker(
        tmp_path,
        "a",
        0.0,
        [_commit(10.0 + s, s, 0, [0]) for s in range(4)] + [_commit(14.0, 4, 0, [waiting])],
    )
    b = _worker(
        tmp_path,
        "b",
        11.0,
        [
            {"ready": 12.0},
            {"joined": 14.5, "workers": 2},
            {"built": 15.0},
            {"begin": 15.5},
            _commit(16.1, 5, 1, [0, 0]),
        ],
    )
    a.log.commits.append(_commit(16.0, 5, 0, [0, 0]))
    return a, b


def test_grow_is_timed_from_the_joiner_start_and_from_the_waiting_step(tmp_path: Path) -> None:
    start, waiting = elastic.grow_samples(*_grow(tmp_path))
    assert start.event == "grow-start" and start.seconds == pytest.approx(16.1 - 11.0)
    assert waiting.event == "grow-waiting" and waiting.seconds == pytest.approx(16.1 - 14.0)
    assert (start.lost, start.before, start.first) == (0, 4, 5)
    assert start.phases == pytest.approx(
        {"imports": 1.0, "formed": 3.5, "built": 4.0, "state": 4.5, "first step": 5.1}
    )
    assert waiting.phases["formed"] == pytest.approx(0.5)


def test_a_grow_whose_last_step_carried_no_waiting_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(elastic.BenchError, match="carries no WAITING"):
        elastic.grow_samples(*_grow(tmp_path, waiting=0))


def test_shrink_is_timed_from_the_leave_step_and_from_the_sigterm(tmp_path: Path) -> None:
    a = _worker(
        tmp_path,
        "a",
        0.0,
        [_commit(19.0, 8, 0, [0, 0]), _commit(20.0, 9, 0, [0, 2]), _commit(20.3, 10, 0, [0])],
    )
    b = _worker(
        tmp_path, "b", 1.0, [_commit(19.0, 8, 1, [0, 0]), _commit(20.05, 9, 1, [0, elastic.LEAVE])]
    )
    shrink, sigterm = elastic.shrink_samples(a, b, 19.5)
    assert shrink.seconds == pytest.approx(0.25) and shrink.lost == 0
    assert sigterm.seconds == pytest.approx(0.8)
    assert sigterm.phases["detection"] == pytest.approx(0.55)


def test_crash_is_timed_from_the_kill_and_a_skipped_or_repeated_batch_is_lost(
    tmp_path: Path,
) -> None:
    victim = _worker(tmp_path, "c", 5.0, [_commit(29.9, 11, 1, [0, 0]), {"kill": 30.0, "step": 12}])
    for redo, lost in ((12, 0), (13, 1), (11, 1)):
        survivor = _worker(
            tmp_path,
            f"a{redo}",
            0.0,
            [
                _commit(29.9, 11, 0, [0, 0]),
                {"failed": 30.01, "step": 12},
                _commit(33.0, redo, 0, [0]),
            ],
        )
        sample = elastic.crash_sample(survivor, victim)
        assert sample.seconds == pytest.approx(3.0)
        assert sample.lost == lost, redo
        assert sample.phases["detection"] == pytest.approx(0.01)


def test_restart_counts_the_steps_since_the_checkpoint(tmp_path: Path) -> None:
    old = [_worker(tmp_path, "old", 0.0, [_commit(50.0 + s, s, 0, [0]) for s in range(20, 28)])]
    stamps: list[dict[str, Any]] = [
        {"ready": 60.0},
        {"joined": 61.0, "workers": 1},
        {"built": 62.0},
        {"loaded": 62.5, "step": 20},
    ]
    new = [
        _worker(
            tmp_path, "new", 58.5, [*stamps, *(_commit(63.0 + s, 20 + s, 0, [0]) for s in range(8))]
        )
    ]
    sample = elastic.restart_sample("crash", 58.0, 58.2, old, new)
    assert sample.seconds == pytest.approx(5.0)
    assert (sample.lost, sample.before, sample.first) == (8, 27, 20)
    assert sample.phases["state"] == pytest.approx(4.5)
    assert sample.phases["recomputed"] == pytest.approx(63.0 + 7 - 58.0)


def test_the_whole_chain_counts_missing_repeated_and_partial_batches(tmp_path: Path) -> None:
    a = _worker(tmp_path, "a", 0.0, [_commit(float(s), s, 0, [0, 0]) for s in (0, 1, 2, 4)])
    b = _worker(tmp_path, "b", 0.0, [_commit(float(s), s, 1, [0, 0]) for s in (0, 1, 4)])
    c = _worker(tmp_path, "c", 9.0, [_commit(9.0, 1, 0, [0])])  # batch 1 again, alone
    check = elastic.whole_chain([a, b, c])
    # Batch 3 never; batch 1 twice; batch 2 by one of its two workers.
    assert check == {"batches": 5, "missing": 1, "repeated": 1, "partial": 1}


def _chains() -> list[Any]:
    def sample(event: str, seconds: float, lost: int = 0) -> Any:
        phases = {"detection": 0.05} if event == "shrink-sigterm" else {}
        return elastic.Sample(event, seconds, lost, 10, 11 - lost, phases)

    vflow = elastic.ChainResult(
        "vflow",
        [
            sample("grow-start", 6.0),
            sample("grow-waiting", 2.0),
            sample("shrink", 0.1),
            sample("shrink-sigterm", 0.15),
            sample("grow-start", 8.0),
            sample("grow-waiting", 3.0),
            sample("crash", 3.0),
        ],
        {"batches": 50, "missing": 0, "repeated": 0, "partial": 0},
        {1: [0.05, 0.06], 2: [0.04]},
        events=[{"reason": "crash", "seconds": 2.9}],
    )
    restart = elastic.ChainResult(
        "restart",
        [
            sample("grow", 12.0, 3),
            sample("shrink", 6.0, 5),
            sample("grow", 10.0, 1),
            sample("crash", 5.0, 9),
        ],
        {"batches": 40, "missing": 0, "repeated": 18, "partial": 0},
        {1: [0.03], 2: [0.04]},
        saves_s=[0.04, 0.05],
    )
    return [vflow, restart]


def _config() -> Any:
    return elastic.Config(
        hidden=16,
        layers=1,
        batch_size=8,
        virtual_nodes=4,
        threads=1,
        deterministic=False,
        warmup=13,
        settle=8,
        checkpoint_every=10,
        timeout_s=10.0,
        last_call_s=1.0,
        keep_alive_s=0.5,
        keep_alive_attempts=4,
        max_workers=2,
        wait_s=60.0,
    )


def test_rows_ratios_verdicts_and_headlines(capsys: pytest.CaptureFixture[str]) -> None:
    record = elastic.summarise(_config(), 1, _chains())
    rows = {row["key"]: row for row in record["rows"]}
    assert list(rows) == [key for key, _, _ in elastic.ROWS]
    grow = rows["grow-start"]
    assert grow["ratio"] == pytest.approx((6 / 12 + 8 / 10) / 2)  # median of the pairs
    assert grow["recomputed_steps"] == [3, 1]
    assert grow["verdict"] == "MISSED (ratio)"
    assert rows["shrink"]["verdict"] == "met"
    assert rows["shrink-sigterm"]["shrink_limit_s"] == pytest.approx(1.05)
    assert rows["crash"]["ratio"] == pytest.approx(0.6)
    assert record["restart"]["whole_chain"]["repeated"] == 18
    assert record["checkpoint_save_s"] == pytest.approx(0.045)

    elastic.print_results(record)
    out = capsys.readouterr().out
    assert "event" in out and "recomputed steps" in out and "MISSED (ratio)" in out
    assert "crash 2->1, from SIGKILL" in out and "K = 10" in out

    headlines = elastic.headline_records(record)
    for h in headlines:
        evaluate(h)  # a stated ratio that disagreed would raise
    results = {h["key"].rsplit("/", 1)[1]: evaluate(h).result for h in headlines}
    assert results["shrink"] == "met" and results["crash"] == "MISSED"
    assert results["shrink-budget"] == "met"


def test_a_lost_step_or_a_slow_shrink_misses_the_target() -> None:
    chains = _chains()
    chains[0].samples[2] = elastic.Sample("shrink", 1.1, 1, 10, 12, {})
    rows = {r["key"]: r for r in elastic.summarise(_config(), 1, chains)["rows"]}
    assert rows["shrink"]["verdict"] == "MISSED (steps lost, 1 s)"


@pytest.mark.parametrize("argv", [["--repeats", "0"], ["--virtual-nodes", "1"]])
def test_bad_arguments(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        elastic.main(argv)
    assert exc.value.code == 2


# The smallest run that still takes both chains through every event (a row of the table
# each) and restarts from a checkpoint: a 442-parameter model, K = 2 (so the first event,
# after K + 3 warm-up steps, has a checkpoint to load) and 2 steps per worker set between
# events. What remains is ten worker processes' start-up and ElasticJob's keep-alive and
# last-call waits, whose default settings the test asserts.
SMALLEST = (
    *("--hidden", "16", "--layers", "1", "--batch-size", "8"),
    *("--checkpoint-every", "2", "--settle", "2"),
)


@pytest.mark.slow
def test_quick_run_prints_its_table_and_writes_headlines(tmp_path: Path) -> None:
    out = tmp_path / "elastic.json"
    proc = subprocess.run(
        [sys.executable, "benchmarks/elastic.py", "--quick", *SMALLEST, "--json", str(out)],
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "event  " in proc.stdout and "restart s" in proc.stdout
    assert "keep_alive_s=0.5, keep_alive_attempts=4, last_call_s=1, timeout_s=10" in proc.stdout
    records = json.loads(out.read_text(encoding="utf-8"))
    detail = records[0]
    assert detail["benchmark"] == "elastic" and len(detail["rows"]) == len(elastic.ROWS)
    assert all(sum(row["steps_lost"]) == 0 for row in detail["rows"])
    # Every restarted worker set loaded the checkpoint: the restart path ran in full.
    assert all("state" in row["restart_phases_s"] for row in detail["rows"])
    assert detail["vflow"]["whole_chain"]["missing"] == 0
    headlines = [r for r in records if "headline" in r]
    assert len(headlines) == len(elastic.ROWS) + 1
    for h in headlines:
        evaluate(h)
