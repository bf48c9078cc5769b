"""benchmarks/elastic_scale.py: how it plans a chain at N workers, how it reads the
workers' logs (a stall less a normal step, set changes, recomputed and skipped steps,
with the analysis shared with benchmarks/elastic.py), its targets and headline records,
on hand-made logs and results; no worker runs here."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.support.benchmark_scripts import load_script
from vflow.bench.records import evaluate

scale = load_script("elastic_scale")
trb = sys.modules["_torchrun_baseline"]
elastic = sys.modules["elastic"]


def _plan(n: int, names: tuple[str, ...] = tuple(scale.EVENTS)) -> list[tuple[str, int, bool]]:
    return [(e.kind, e.count, e.restore) for e in scale.plan_chain(names, n)]


def test_every_event_hits_a_job_of_n_workers() -> None:
    assert _plan(4) == [
        ("crash", 1, False),
        ("grow", 1, True),
        ("crash", 3, False),
        ("grow", 3, True),  # the three lost come back as one grow
        ("leave", 1, False),
        ("grow", 1, True),
        ("grow", 1, False),
        ("leave", 1, True),  # the grow1 joiner leaves before the grow of 8
        ("grow", 8, False),
    ]
    # Three killed of two cannot be: crash3 needs N >= 4.
    assert ("crash", 3, False) not in _plan(2)
    for n in (2, 4, 8, 32):
        size = n
        for e in scale.plan_chain(tuple(scale.EVENTS), n):
            if not e.restore:
                assert size == n, (n, e)
            size += e.count if e.kind == "grow" else -e.count
    assert _plan(8, ("grow8", "crash1")) == [
        ("crash", 1, False),
        ("grow", 1, True),
        ("grow", 8, False),
    ]


def test_event_names_and_the_most_joiners() -> None:
    for name, (kind, count) in scale.EVENTS.items():
        assert scale.event_name(trb.Event(kind, 0, count=count)) == name
    assert scale.most_joiners(("crash1", "grow1")) == 1
    assert scale.most_joiners(scale.QUICK_EVENTS) == 8
    assert scale.most_joiners(("leave",)) == 0


def test_nodes_are_named_beyond_26() -> None:
    names = [trb.node_name(i) for i in range(800)]
    assert names[:3] == ["a", "b", "c"] and names[25] == "z"
    assert names[26:29] == ["aa", "ab", "ac"] and names[701] == "zz" and names[702] == "aaa"
    assert len(set(names)) == len(names)
    assert all("." not in n and "+" not in n for n in names)


def test_only_a_chain_that_allows_it_hits_several_nodes_at_once(tmp_path: Path) -> None:
    s = trb.Settings(workers=8, tail_steps=5)
    events = [trb.Event("crash", 0, count=3), trb.Event("grow", 0, count=8)]
    job = scale.JOB
    vflow_chain = scale.ScaleChain(events, s, tmp_path, job)
    trb.check_chain(events, s, vflow_chain.size_after, vflow_chain.kinds, vflow_chain.counted)
    assert vflow_chain.size_after_event(events[0], 8) == 5
    assert vflow_chain.size_after_event(events[1], 5) == 13
    assert vflow_chain.max_workers == 16  # 8 + the grow's 8
    torchrun = trb._Chain(events, s, tmp_path)
    with pytest.raises(ValueError, match="3 nodes at once"):
        trb.check_chain(events, s, torchrun.size_after, torchrun.kinds, torchrun.counted)
    with pytest.raises(ValueError, match="fewer than min_workers"):
        trb.check_chain(
            [trb.Event("crash", 0, count=8)], s, vflow_chain.size_after, counted=("crash",)
        )


def _changes(sets: list[tuple[float, int, bool]], events: list[tuple[float, int]], end: float):
    return [(c.caused, c.other) for c in scale.set_changes(sets, events, end)]


def test_set_changes_up_to_the_new_worker_set_and_after_it() -> None:
    # 4 workers; a grow of 2 at 10.5 let in as 1 + 1 (sets at 11 and 16.5); a leave at
    # 25 (a set of 5 at 30), then a member dropped and back (sets at 33 and 35); at 41
    # the chain stops its workers.
    sets = [(0.0, 4, True), (11.0, 5, True), (16.5, 6, True), (30.0, 5, True)]
    sets += [(33.0, 4, True), (35.0, 5, True), (41.0, 4, True)]
    events = [(10.5, 6), (25.0, 5)]
    assert _changes(sets, events, 40.0) == [(2, 0), (1, 2)]
    # The sets formed once the chain stops its workers are not the last event's.
    assert _changes(sets, events, float("inf")) == [(2, 0), (1, 3)]
    # A set that never completed a step is a change, but not the new worker set.
    broken = [(0.0, 4, True), (11.0, 3, False), (12.0, 3, True), (13.0, 3, True)]
    assert _changes(broken, [(10.0, 3)], 20.0) == [(2, 1)]
    # No new worker set: every set until the next event.
    assert _changes([(0.0, 2, True), (3.0, 3, True)], [(1.0, 4)], 9.0) == [(1, 0)]
    assert _changes([], [(1.0, 2)], 2.0) == [(0, 0)]


# ---- hand-made worker logs, as benchmarks/_elastic_worker.py writes them ----


def _set_file(
    folder: Path,
    node: str,
    k: int,
    name: str,
    rank: int,
    n: int,
    t0: float,
    steps: range,
    dt: float,
) -> None:
    head = {"exec": t0, "pid": 1, "rank": rank, "restart": 0, "workers": n, "master": name}
    lines: list[dict[str, Any]] = [head, {"begin": t0, "step": steps[0], "workers": n}]
    lines += [{"t": t0 + dt * (i + 1), "step": s, "rank": rank} for i, s in enumerate(steps)]
    text = "".join(json.dumps(line) + "\n" for line in lines)
    (folder / f"{node}.s{k}.jsonl").write_text(text, encoding="utf-8")


def _result(
    folder: Path, fired: list[Any], start: int, end_step: int, end_t: float = float("inf")
) -> Any:
    logs = trb._Logs(folder)
    logs.poll()
    groups = logs.groups()
    r = trb.analyse(
        profile="vflow",
        settings={},
        groups=groups,
        procs=list(logs.procs.values()),
        fired=fired,
        start_size=start,
        end_step=end_step,
        first_start_t=None,
        wall_s=30.0,
        error=None,
        log_dir=None,
    )
    sets = [(g.start, g.world, bool(g.completions())) for g in groups]
    changes = scale.set_changes(sets, [(f.t, f.after) for f in fired], end_t)
    r.extra = {
        "set_changes": [{"caused": c.caused, "other": c.other} for c in changes],
        "memory": [{"a": {"VmRSS": 300 * 2**20, "VmHWM": 320 * 2**20}}] * len(fired),
        "kill_steps": [{}] * len(fired),
    }
    return r


def _crash3(folder: Path, resume: int) -> Any:
    """a..e train steps 0..9 together, 1 s a step; c, d, e die in step 10 at 10.5; a
    and b go on from step ``resume`` at 11.0, 0.5 s a step, to step 19."""
    for rank, node in enumerate("abcde"):
        _set_file(folder, node, 0, "round 0/set0", rank, 5, 0.0, range(10), 1.0)
    for rank, node in enumerate("ab"):
        _set_file(folder, node, 1, "round 0/set1", rank, 2, 11.0, range(resume, 20), 0.5)
    fired = [trb._Fired(trb.Event("crash", 0, count=3), "c+d+e", 10.5, 5, 2)]
    return _result(folder, fired, 5, 19)


def test_a_crash_of_three_stalls_the_gap_less_a_step_and_loses_no_step(tmp_path: Path) -> None:
    (s,) = scale.samples_of(0, 5, _crash3(tmp_path, 10))
    assert (s.event, s.sizes, s.recovered) == ("crash3", "5->2", True)
    assert s.gap_s == pytest.approx(1.5)  # a's and b's commits at 10.0 and 11.5
    assert s.step_s == pytest.approx(0.5)  # m(2)
    assert s.stall_s == pytest.approx(1.0)
    assert (s.set_changes, s.recomputed, s.skipped) == (1, 0, 0)
    assert s.rss_median == 300 * 2**20 and s.hwm_max == 320 * 2**20


def test_a_step_trained_twice_is_recomputed(tmp_path: Path) -> None:
    r = _crash3(tmp_path, 9)
    (s,) = scale.samples_of(0, 5, r)
    assert (s.recomputed, s.skipped) == (1, 0)
    assert r.steps_repeated == 1


def test_a_step_never_trained_is_skipped(tmp_path: Path) -> None:
    r = _crash3(tmp_path, 11)
    (s,) = scale.samples_of(0, 5, r)
    assert (s.recomputed, s.skipped) == (0, 1)
    assert r.missing_steps == [10]


def test_joiners_let_in_by_two_grows_are_two_set_changes(tmp_path: Path) -> None:
    # a, b train 0..9; c and d start at 9.5: c is let in at step 10 (set1, 3
    # workers), d only at step 15 (set2): the stall runs to a's first step in set2.
    for rank, node in enumerate("ab"):
        _set_file(tmp_path, node, 0, "round 0/set0", rank, 2, 0.0, range(10), 1.0)
    for rank, node in enumerate("abc"):
        _set_file(tmp_path, node, 1, "round 0/set1", rank, 3, 10.5, range(10, 15), 1.0)
    for rank, node in enumerate("abcd"):
        k = 0 if node == "d" else 2
        _set_file(tmp_path, node, k, "round 0/set2", rank, 4, 16.5, range(15, 25), 1.0)
    fired = [trb._Fired(trb.Event("grow", 0, count=2), "c+d", 9.5, 2, 4)]
    (s,) = scale.samples_of(0, 2, _result(tmp_path, fired, 2, 24))
    assert (s.event, s.sizes, s.set_changes) == ("grow2", "2->4", 2)
    assert s.gap_s == pytest.approx(2.0)  # 15.5 (step 14) -> 17.5 (step 15 in set2)
    assert (s.recomputed, s.skipped) == (0, 0)


# ---- rows, targets and headlines, on hand-made samples ----


def _config(**kw: Any) -> Any:
    fields: dict[str, Any] = {
        "workers": (8, 32),
        "events": ("crash1", "crash3", "grow8"),
        "repeats": 2,
        "hidden": 256,
        "layers": 4,
        "batch_size": 1536,
        "virtual_nodes": 48,
        "settle": 10,
        "tail": 10,
        "event_timeout_s": None,
        "timeout_s": 600.0,
    }
    return scale.Config(**(fields | kw))


def _event(kind: str, before: int, after: int, gap: float, **kw: Any) -> Any:
    fields: dict[str, Any] = {
        "kind": kind,
        "at_step": 0,
        "node": "b",
        "t_event": 0.0,
        "progress_at_event": 10,
        "size_before": before,
        "size_after": after,
        "recovered": True,
        "recovery_s": gap,
        "stall_s": {"a": gap},
        "last_step_before": 10,
        "checkpoint_step": 11,
        "recomputed_steps": 0,
        "recompute_s": 0.0,
    }
    return trb.EventResult(**(fields | kw))


def _chain(rep: int, n: int, events: list[Any], changes: list[int]) -> Any:
    result = trb.RunResult(
        profile="vflow",
        settings={},
        events=events,
        wall_s=60.0,
        startup_s=3.0,
        step_s={size: 0.1 for size in range(1, 41)},
        overhead_s=None,
        checkpoint_s=None,
        steps_completed=100,
        steps_repeated=0,
        missing_steps=[],
        error=None,
        log_dir=None,
    )
    result.extra = {"set_changes": [{"caused": c, "other": 0} for c in changes]}
    return scale.ChainRun(rep, n, result, 30.0)


def _chains(grow_changes: int = 1, recomputed: int = 0) -> list[Any]:
    out = []
    for rep in range(2):
        for n in (8, 32):
            events = [
                _event("crash", n, n - 1, 0.6 + 0.2 * rep),
                _event("grow", n - 1, n, 0.3, restore=True),
                _event("crash", n, n - 3, 1.3 if n == 8 else 0.7),
                _event("grow", n - 3, n, 0.3, restore=True),
                _event("grow", n, n + 8, 0.5, recomputed_steps=recomputed),
            ]
            out.append(_chain(rep, n, events, [1, 1, 1, 1, grow_changes]))
    return out


def test_rows_and_targets(capsys: pytest.CaptureFixture[str]) -> None:
    record = scale.summarise(_config(), _chains(), [])
    rows = {(r["workers"], r["event"]): r for r in record["rows"]}
    assert set(rows) == {(n, e) for n in (8, 32) for e in ("crash1", "crash3", "grow8")}
    crash1 = rows[8, "crash1"]
    assert crash1["sizes"] == "8->7" and crash1["samples"] == 2
    assert crash1["stall_s"] == pytest.approx(0.6)  # median of 0.5 and 0.7 (gap - 0.1)
    assert rows[32, "grow8"]["sizes"] == "32->40"
    verdicts = {(t["workers"], t["event"]): t["verdict"] for t in record["targets"]}
    assert verdicts == {
        (8, "crash1"): "met",
        (32, "crash1"): "met",
        (8, "crash3"): "MISSED (stall)",
        (32, "crash3"): "met",
        (32, "grow8"): "met",
        (None, "every event"): "met",
    }
    scale.print_results(record)
    out = capsys.readouterr().out
    assert "MISSED (stall)" in out and "set changes" in out and "RSS MiB" in out


def test_a_split_grow_and_a_recomputed_step_miss_their_targets() -> None:
    record = scale.summarise(_config(), _chains(grow_changes=2, recomputed=1), [])
    verdicts = {(t["workers"], t["event"]): t["verdict"] for t in record["targets"]}
    assert verdicts[32, "grow8"] == "MISSED (set changes)"
    assert verdicts[None, "every event"] == "MISSED (8 workers grow8, 32 workers grow8)"


def test_targets_not_measured_are_not_run() -> None:
    record = scale.summarise(_config(workers=(8,)), [c for c in _chains() if c.workers == 8], [])
    verdicts = {(t["workers"], t["event"]): t["verdict"] for t in record["targets"]}
    assert verdicts[32, "crash1"] == verdicts[32, "grow8"] == "not run"


def test_headlines_carry_a_target_only_where_issue_35_sets_one() -> None:
    record = scale.summarise(_config(), _chains(), [])
    results = {
        h["key"].split("/", 2)[2]: evaluate(h).result for h in scale.headline_records(record)
    }
    assert results == {
        "8w/crash1/stall": "met",
        "8w/crash3/stall": "MISSED",
        "8w/grow8/stall": "-",  # no target at 8 workers
        "32w/crash1/stall": "met",
        "32w/crash3/stall": "met",
        "32w/grow8/stall": "met",
    }


@pytest.mark.parametrize(
    "argv",
    [
        ["--workers", "1"],
        ["--workers", "2,x"],
        ["--events", "crash2"],
        ["--workers", "32", "--virtual-nodes", "32"],  # 32 + 8 joiners need V >= 40
        ["--repeat", "0"],
        ["--threads", "2"],
    ],
)
def test_bad_arguments(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        scale.main(argv)
    assert exc.value.code == 2


def test_options_parse() -> None:
    cfg = scale.config_of(scale._parser().parse_args(["--workers", "8,32", "--repeats", "2"]))
    assert (cfg.workers, cfg.repeats, cfg.events) == ((8, 32), 2, tuple(scale.EVENTS))
    quick = scale.config_of(scale._parser().parse_args(["--quick"]))
    assert (quick.workers, quick.repeats, quick.events) == ((2, 4), 1, scale.QUICK_EVENTS)
    assert scale.event_timeout_of(cfg, 32) == 60.0 + 6.0 * 40
    assert scale.poll_of(2) == trb.POLL_S and scale.poll_of(32) == pytest.approx(8 * trb.POLL_S)


def test_changes_beyond_one_per_event_are_listed(capsys: pytest.CaptureFixture[str]) -> None:
    events = [_event("leave", 8, 7, 0.2), _event("grow", 7, 8, 0.3, restore=True)]
    c = _chain(0, 8, events, [1, 2])
    c.result.extra["set_changes"][0]["other"] = 4  # a member dropped and back, twice
    assert scale.unexpected_changes(c) == [
        "repetition 1, 8 workers, leave 8->7: 1 set change(s) to its new worker set, "
        "4 more after it",
        "repetition 1, 8 workers, restore grow1 7->8: 2 set change(s) to its new worker "
        "set, 0 more after it",
    ]
    record = scale.summarise(_config(workers=(8,), events=("leave",)), [c], [])
    (row,) = record["rows"]
    assert (row["set_changes"], row["other_changes"]) == (1, 4)
    scale.print_results(record)
    assert "worker-set changes beyond one per event" in capsys.readouterr().out


def test_a_chain_of_32_workers_checks_and_names_its_nodes(tmp_path: Path) -> None:
    cfg = _config(workers=(32,), events=tuple(scale.EVENTS))
    s = scale.chain_settings(cfg, 32, None, 3600.0)
    assert (s.max_workers, s.event_timeout_s, s.poll_s) == (40, 300.0, pytest.approx(0.16))
    events = scale.plan_chain(cfg.events, 32)
    chain = scale.ScaleChain(events, s, tmp_path, scale.JOB)
    trb.check_chain(events, s, chain.size_after, chain.kinds, chain.counted)
    started = 32 + sum(e.count for e in events if e.kind == "grow")
    assert started == 46 and trb.node_name(started - 1) == "at"
    assert scale.VIRTUAL_NODES >= s.max_workers


def test_several_workers_are_told_a_step_none_has_begun(tmp_path: Path) -> None:
    for rank, node in enumerate("abcd"):
        _set_file(tmp_path, node, 0, "round 0/set0", rank, 4, 0.0, range(20), 0.05)
    chain = scale.ScaleChain([], trb.Settings(workers=4, tail_steps=5), tmp_path, scale.JOB)
    # 0.05 s steps: 0.5 s of them past the last step completed (19).
    assert chain.crash_step() == 29
    for rank, node in enumerate("abcd"):
        _set_file(tmp_path, node, 0, "round 0/set0", rank, 4, 0.0, range(20), 1.0)
    chain = scale.ScaleChain([], trb.Settings(workers=4, tail_steps=5), tmp_path, scale.JOB)
    assert chain.crash_step() == 22  # at least 3 steps on
    with open(tmp_path / "c.s0.jsonl", "a", encoding="utf-8") as f:
        f.write(json.dumps({"kill": 21.5, "step": 21}) + "\n")
    chain.logs.poll()
    assert chain.kill_stamp("c") == 21.5 and chain.kill_stamp("d") is None


def test_a_crashs_agreement_is_the_slowest_survivors_of_that_crash() -> None:
    crash = {"reason": "crash", "step": 40, "agreed_s": 0.3}
    ahead = {"reason": "crash", "step": 41, "agreed_s": 0.5}  # had committed step 40
    other = {"reason": "crash", "step": 90, "agreed_s": 9.0}  # a later crash
    grow = {"reason": "grow", "step": 40, "agreed_s": None}
    events = [[grow, crash, other], [ahead], []]
    assert scale.agreed_s(events, {40}) == 0.5
    assert scale.agreed_s(events, set()) is None  # no crash: no victims' step
