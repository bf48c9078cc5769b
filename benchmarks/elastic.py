"""Elastic training (vflow.elastic.ElasticJob) against the torchrun way (stop every
worker, start fresh processes, load the last checkpoint), on the same events of a
2-worker job: grow 1 -> 2, shrink 2 -> 1 and crash recovery.

Both paths train distributed.py's benchmark MLP on 2 Gloo workers on localhost, one
process per worker (``benchmarks/_elastic_worker.py``), against one rendezvous store
(``python -m vflow rendezvous``) that lives for the whole run. Every worker writes one
JSON line per committed step with ``time.time()``; all timings below are differences
of such wall-clock stamps, of the benchmark's own (taken right before it starts a
process or sends a signal) and of the kill stamp a crashing worker writes right before
it sends itself SIGKILL.

Each repetition runs two chains of events, in alternating order:

* vflow: one elastic job (``min_workers=1``, ``max_workers=2`` unless
  ``--max-workers`` says otherwise). Worker a starts
  alone; after ``warmup`` steps worker b starts and joins (grow); after b has committed
  ``settle`` steps it gets SIGTERM and leaves (shrink; ElasticJob's SIGTERM handler
  asks it to leave after its current step); after a has committed ``settle`` steps
  alone, worker c starts and joins (grow, a second sample); after ``settle`` steps c
  gets SIGUSR1, which makes it kill itself with SIGKILL in the backward of its next
  step (crash); a commits ``settle`` steps alone and is sent SIGTERM (it leaves and the
  chain ends).
* restart: the same events at the same points (after ``warmup`` steps, then after
  ``settle`` new steps of each worker set), handled as torchrun's agent would, with
  instant detection: the benchmark SIGKILLs every worker, starts the new worker count
  of fresh processes (new Python processes importing torch and vflow) in a fresh
  rendezvous (a new job id, ``min_workers = max_workers`` = that count, the other
  ElasticJob settings as in the vflow chain), each builds its executor and
  ``vflow.load``s the checkpoint that the workers write with ``vflow.save`` every
  ``checkpoint_every`` (K) steps, and training resumes from there. For the crash the
  victim kills itself exactly as in the vflow chain; the benchmark sees its exit
  within its poll interval and then stops the survivor. After the crash both paths
  go on with the survivor alone (the lost worker's node is gone).

Definitions (seconds from the event to the first step completed after it; a step is
completed by a worker set when every member has committed it, the latest of their
stamps):

* grow, from the joiner's start: from the benchmark's stamp right before it starts the
  joiner process to the first step completed by the 2-worker set.
* grow, from WAITING: from the commit of the last 1-worker step (whose signal words
  carry WAITING: the running worker saw the joiner on the wait list) to the same end.
* shrink: from the completion of the step whose signal words carry LEAVE to the first
  step the survivor completes alone. Detection (the SIGTERM to the end of that step)
  is printed apart; "shrink, from SIGTERM" is the sum.
* crash: from the victim's kill stamp to the first step the survivor completes alone.
* restart: from the event (grow, shrink: the benchmark's stamp when it decides to stop
  the workers, right after it saw the triggering step's commit; crash: the victim's
  kill stamp) to the first step completed by the restarted worker set. Recomputing
  the steps since the checkpoint comes after that and is not in this time.
* steps lost (vflow) and recomputed steps (restart), per event: with s_b the highest
  global batch committed before the event and s_f the first one the new worker set
  commits, |s_f - (s_b + 1)|: batches committed again (s_f <= s_b) or skipped
  (s_f > s_b + 1). A step in flight when the event hits is computed again in both
  paths and counted in neither. Each chain is also checked as a whole: every global
  batch 0..max committed, and how many commits repeat a batch.

Targets (printed, not asserted): each vflow event <= 1/5 of the restart path's time
(median of the per-repetition ratios); shrink <= 1 s after detection; 0 steps lost.

Run ``python benchmarks/elastic.py --help`` for options.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from _common import (
    Default,
    Mlp,
    add_mlp_args,
    add_output_args,
    add_process_args,
    format_table,
    median,
    mlp_of,
    open_process_session,
    size_problem,
    usable_cpus,
)

import vflow
import vflow.bench.records as bench_records
from vflow.elastic import LEAVE, WAITING

WORKER = Path(__file__).resolve().with_name("_elastic_worker.py")
WORKERS = 2
TIMEOUT_S = Default(full=1200.0, quick=240.0)
TARGET_RATIO = 0.2  # vflow event / restart path
TARGET_SHRINK_S = 1.0  # after detection
POLL_S = 0.02  # the benchmark's log and process poll: its "agent" reacts this fast
# (key, row label, restart event it is compared with)
ROWS = (
    ("grow-start", "grow 1->2, from joiner start", "grow"),
    ("grow-waiting", "grow 1->2, from WAITING step", "grow"),
    ("shrink", "shrink 2->1, from LEAVE step", "shrink"),
    ("shrink-sigterm", "shrink 2->1, from SIGTERM", "shrink"),
    ("crash", "crash 2->1, from SIGKILL", "crash"),
)


@dataclass(frozen=True)
class Config:
    hidden: int
    layers: int
    batch_size: int
    virtual_nodes: int
    threads: int
    deterministic: bool
    warmup: int
    settle: int
    checkpoint_every: int
    timeout_s: float
    last_call_s: float
    keep_alive_s: float
    keep_alive_attempts: int
    max_workers: int
    wait_s: float

    @property
    def mlp(self) -> Mlp:
        return Mlp(self.hidden, self.layers)


class BenchError(RuntimeError):
    """A chain did not go as planned (a worker failed, a wait timed out)."""


# ---- worker processes and their logs ----------------------------------------------------


class WorkerLog:
    """A worker's JSON lines, read incrementally (the benchmark polls while it writes)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._offset = 0
        self._partial = ""
        self.commits: list[dict[str, Any]] = []
        self.marks: dict[str, list[dict[str, Any]]] = {}  # the other lines, by kind

    def refresh(self) -> None:
        if not self.path.exists():
            return
        with open(self.path, encoding="utf-8") as f:
            f.seek(self._offset)
            text = f.read()
            self._offset = f.tell()
        lines = (self._partial + text).split("\n")
        self._partial = lines.pop()
        for line in lines:
            if not line:
                continue
            entry = json.loads(line)
            if "t" in entry:
                self.commits.append(entry)
            else:
                self.marks.setdefault(next(iter(entry)), []).append(entry)

    def stamp(self, kind: str) -> float:
        """The time of this worker's first line of ``kind`` ("ready", "joined", ...)."""
        if kind not in self.marks:
            raise BenchError(f"{self.path.name} has no {kind!r} line")
        return float(self.marks[kind][0][kind])

    def commit_time(self, step: int) -> float:
        for c in self.commits:
            if c["step"] == step:
                return float(c["t"])
        raise BenchError(f"{self.path.name} has no commit of step {step}")

    @property
    def last_step(self) -> int:
        return self.commits[-1]["step"] if self.commits else -1


@dataclass
class Worker:
    name: str
    proc: subprocess.Popen[bytes]
    log: WorkerLog
    err: Path
    started: float  # time.time() right before the process was started
    ended_as_planned: bool = False  # left, crashed or stopped by the benchmark

    def stderr_tail(self) -> str:
        try:
            return self.err.read_text(encoding="utf-8", errors="replace")[-3000:]
        except OSError:
            return ""


class Chain:
    """The worker processes of one chain; every one is killed at the end."""

    def __init__(self, cfg: Config, endpoint: str, folder: Path, deadline: float) -> None:
        self.cfg, self.endpoint, self.folder, self.deadline = cfg, endpoint, folder, deadline
        self.workers: list[Worker] = []
        folder.mkdir(parents=True, exist_ok=True)

    def start(
        self, name: str, job: str, *, min_workers: int, max_workers: int, checkpoint: Path | None
    ) -> Worker:
        cfg = self.cfg
        log = self.folder / f"{name}.log"
        err = self.folder / f"{name}.err"
        cmd = [
            sys.executable,
            str(WORKER),
            *("--rdzv", self.endpoint, "--job", job, "--log", str(log)),
            *("--hidden", str(cfg.hidden), "--layers", str(cfg.layers)),
            *("--batch-size", str(cfg.batch_size), "--virtual-nodes", str(cfg.virtual_nodes)),
            *("--threads", str(cfg.threads)),
            *("--min-workers", str(min_workers), "--max-workers", str(max_workers)),
            *("--timeout", str(cfg.timeout_s), "--last-call", str(cfg.last_call_s)),
            *("--keep-alive", str(cfg.keep_alive_s)),
            *("--keep-alive-attempts", str(cfg.keep_alive_attempts)),
            *(["--deterministic"] if cfg.deterministic else []),
        ]
        if checkpoint is not None:
            cmd += [
                "--checkpoint",
                str(checkpoint),
                "--checkpoint-every",
                str(cfg.checkpoint_every),
            ]
        started = time.time()
        with open(err, "wb") as err_file:
            proc = subprocess.Popen(cmd, env=_worker_env(), stderr=err_file)
        worker = Worker(name, proc, WorkerLog(log), err, started)
        self.workers.append(worker)
        return worker

    def wait_for(self, what: str, done: Callable[[], bool]) -> None:
        """Polls the logs until ``done()``; a worker that ends unplanned, or the wait
        bound, fails the chain."""
        limit = min(time.monotonic() + self.cfg.wait_s, self.deadline)
        while True:
            for w in self.workers:
                w.log.refresh()
            if done():
                return
            for w in self.workers:
                code = w.proc.poll()
                if code is not None and not w.ended_as_planned:
                    raise BenchError(
                        f"worker {w.name} ended with status {code} while waiting for {what}:\n"
                        f"{w.stderr_tail()}"
                    )
            if time.monotonic() > limit:
                raise BenchError(
                    f"no {what} within {self.cfg.wait_s:g} s (or the run's --timeout); "
                    + "; ".join(f"{w.name}: last step {w.log.last_step}" for w in self.workers)
                )
            time.sleep(POLL_S)

    def wait_exit(self, worker: Worker, what: str) -> int:
        worker.ended_as_planned = True
        self.wait_for(what, lambda: worker.proc.poll() is not None)
        code = worker.proc.wait()
        worker.log.refresh()
        return code

    def stop(self, workers: Sequence[Worker]) -> None:
        """SIGKILL and reap, as torchrun's agent stops a worker group."""
        for w in workers:
            w.ended_as_planned = True
            if w.proc.poll() is None:
                w.proc.kill()
        for w in workers:
            w.proc.wait(timeout=30)
            w.log.refresh()

    def kill_all(self) -> None:
        for w in self.workers:
            if w.proc.poll() is None:
                w.proc.kill()
        for w in self.workers:
            try:
                w.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass


def _worker_env() -> dict[str, str]:
    env = dict(os.environ)
    # The workers import the vflow this script imported, whatever else is installed.
    root = str(Path(vflow.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return env


# ---- samples ------------------------------------------------------------------------------


@dataclass
class Sample:
    """One event of one chain: its seconds, the steps lost (or recomputed), and the
    stamps of its phases (seconds from the event, for the breakdown)."""

    event: str  # a ROWS key (vflow) or "grow"/"shrink"/"crash" (restart)
    seconds: float
    lost: int
    before: int  # s_b: the highest global batch committed before the event
    first: int  # s_f: the first global batch of the new worker set
    phases: dict[str, float] = field(default_factory=dict)


def lost_steps(before: int, first: int) -> int:
    return abs(first - (before + 1))


def completed(workers: Sequence[Worker], step: int) -> float:
    """When ``step`` was completed by these workers: the latest commit among them."""
    return max(w.log.commit_time(step) for w in workers)


def _new_set_index(log: WorkerLog, workers: int, after: float) -> int:
    """Index in ``log`` of the first commit made by a worker set of ``workers`` after
    ``after``."""
    for i, c in enumerate(log.commits):
        if c["t"] > after and c["workers"] == workers:
            return i
    raise BenchError(f"{log.path.name}: no {workers}-worker commit after {after}")


def grow_samples(a: Worker, joiner: Worker) -> list[Sample]:
    """The 'from joiner start' and 'from WAITING' samples of a grow."""
    i = _new_set_index(a.log, 2, joiner.started)
    if i == 0:
        raise BenchError("the running worker has no step before the grow")
    first = a.log.commits[i]["step"]
    if joiner.log.commits[0]["step"] != first:
        raise BenchError(
            f"the joiner's first step is {joiner.log.commits[0]['step']}, the running "
            f"worker's first 2-worker step {first}"
        )
    last_alone = a.log.commits[i - 1]
    if not any(int(w) & WAITING for w in last_alone["signals"]):
        raise BenchError(f"step {last_alone['step']}, the last 1-worker step, carries no WAITING")
    done = completed([a, joiner], first)
    lost = lost_steps(last_alone["step"], first)
    stamp = joiner.log.stamp
    phases = {
        "imports": stamp("ready") - joiner.started,
        "formed": stamp("joined") - joiner.started,
        "built": stamp("built") - joiner.started,
        "state": stamp("begin") - joiner.started,
        "first step": done - joiner.started,
    }
    waiting_end = float(last_alone["t"])
    return [
        Sample("grow-start", done - joiner.started, lost, last_alone["step"], first, phases),
        Sample(
            "grow-waiting",
            done - waiting_end,
            lost,
            last_alone["step"],
            first,
            {k: v - (waiting_end - joiner.started) for k, v in phases.items() if k != "imports"},
        ),
    ]


def shrink_samples(a: Worker, leaver: Worker, sigterm: float) -> list[Sample]:
    last = leaver.log.commits[-1]
    if not any(int(w) & LEAVE for w in last["signals"]):
        raise BenchError(f"the leaver's last step {last['step']} carries no LEAVE")
    leave_end = completed([a, leaver], last["step"])
    i = _new_set_index(a.log, 1, leave_end)
    first = a.log.commits[i]["step"]
    done = float(a.log.commits[i]["t"])
    lost = lost_steps(last["step"], first)
    detection = leave_end - sigterm
    return [
        Sample("shrink", done - leave_end, lost, last["step"], first),
        Sample(
            "shrink-sigterm",
            done - sigterm,
            lost,
            last["step"],
            first,
            {"detection": detection, "first step": done - sigterm},
        ),
    ]


def crash_sample(survivor: Worker, victim: Worker) -> Sample:
    if "kill" not in victim.log.marks:
        raise BenchError(f"worker {victim.name} wrote no kill stamp:\n{victim.stderr_tail()}")
    t_kill = victim.log.stamp("kill")
    i = _new_set_index(survivor.log, 1, t_kill)
    before = max(
        [c["step"] for c in survivor.log.commits[:i]] + [c["step"] for c in victim.log.commits]
    )
    first = survivor.log.commits[i]["step"]
    done = float(survivor.log.commits[i]["t"])
    phases = {"first step": done - t_kill}
    failed = [f["failed"] for f in survivor.log.marks.get("failed", []) if f["failed"] > t_kill]
    if failed:
        phases["detection"] = failed[0] - t_kill
    return Sample("crash", done - t_kill, lost_steps(before, first), before, first, phases)


def restart_sample(
    event: str, t_event: float, stopped_at: float, old: Sequence[Worker], new: Sequence[Worker]
) -> Sample:
    before = max(w.log.last_step for w in old)
    first = new[0].log.commits[0]["step"]
    for w in new:
        if w.log.commits[0]["step"] != first:
            raise BenchError("the restarted workers began at different steps")
    done = completed(new, first)

    def latest(kind: str) -> float:
        return max(w.log.stamp(kind) for w in new) - t_event

    phases = {
        "stopped": stopped_at - t_event,
        "imports": latest("ready"),
        "formed": latest("joined"),
        "built": latest("built"),
    }
    if all("loaded" in w.log.marks for w in new):
        phases["state"] = latest("loaded")
    phases["first step"] = done - t_event
    # Back where the event hit: the recomputation done.
    if before >= first:
        phases["recomputed"] = completed(new, before) - t_event
    return Sample(event, done - t_event, lost_steps(before, first), before, first, phases)


def whole_chain(workers: Sequence[Worker]) -> dict[str, int]:
    """The chain as a whole: global batches 0..max, how many no worker set committed,
    how many extra times a batch was committed (every worker set has a rank 0, so a
    batch's rank-0 commits count the worker sets that committed it), and batches whose
    commits do not add up to whole worker sets (a member missing)."""
    commits: dict[int, list[dict[str, Any]]] = {}
    for w in workers:
        for c in w.log.commits:
            commits.setdefault(c["step"], []).append(c)
    top = max(commits, default=-1)
    missing = repeated = partial = 0
    for step in range(top + 1):
        here = commits.get(step, [])
        sets = [c for c in here if c["rank"] == 0]
        if not sets:
            missing += 1
        repeated += max(0, len(sets) - 1)
        if len(here) != sum(c["workers"] for c in sets):
            partial += 1
    return {"batches": top + 1, "missing": missing, "repeated": repeated, "partial": partial}


# ---- the two chains ------------------------------------------------------------------------


@dataclass
class ChainResult:
    path: str  # "vflow" or "restart"
    samples: list[Sample]
    check: dict[str, int]  # whole_chain's counts
    step_s: dict[int, list[float]]  # worker count -> intervals between commits
    saves_s: list[float] = field(default_factory=list)  # vflow.save durations
    events: list[dict[str, Any]] = field(default_factory=list)  # ElasticJob.events of a


def step_intervals(workers: Sequence[Worker]) -> dict[int, list[float]]:
    """Seconds between a worker's consecutive commits of consecutive batches in the same
    worker set, by worker count: the steady step time (a checkpoint in between is left
    out: the restart path's workers log a save right after the step it follows)."""
    out: dict[int, list[float]] = {}
    for w in workers:
        saved = {int(m["step_count"]) - 1 for m in w.log.marks.get("saved", [])}
        for prev, cur in zip(w.log.commits, w.log.commits[1:]):
            if (
                cur["step"] == prev["step"] + 1
                and cur["workers"] == prev["workers"]
                and prev["step"] not in saved
            ):
                out.setdefault(cur["workers"], []).append(cur["t"] - prev["t"])
    return out


def reached(workers: Sequence[Worker], step: int) -> Callable[[], bool]:
    """Whether every one of ``workers`` has committed global batch ``step`` or later."""
    return lambda: all(w.log.last_step >= step for w in workers)


def ran(worker: Worker, steps: int) -> Callable[[], bool]:
    return lambda: len(worker.log.commits) >= steps


def run_vflow(cfg: Config, endpoint: str, folder: Path, job: str, deadline: float) -> ChainResult:
    chain = Chain(cfg, endpoint, folder, deadline)
    try:

        def start(name: str) -> Worker:
            return chain.start(
                name, job, min_workers=1, max_workers=cfg.max_workers, checkpoint=None
            )

        a = start("a")
        chain.wait_for("warm-up steps", ran(a, cfg.warmup))
        samples: list[Sample] = []
        for name, leaves in (("b", "sigterm"), ("c", "crash")):
            joiner = start(name)
            chain.wait_for(f"{name}'s steps", ran(joiner, cfg.settle))
            samples += grow_samples(a, joiner)
            if leaves == "sigterm":
                sigterm = time.time()
                joiner.proc.send_signal(signal.SIGTERM)
                code = chain.wait_exit(joiner, f"{name} to leave")
                if code != 0:
                    raise BenchError(f"{name} left with status {code}:\n{joiner.stderr_tail()}")
                end = joiner.log.last_step + cfg.settle
                chain.wait_for("steps after the shrink", reached([a], end))
                samples += shrink_samples(a, joiner, sigterm)
            else:
                joiner.proc.send_signal(signal.SIGUSR1)
                code = chain.wait_exit(joiner, f"{name} to crash")
                if code != -signal.SIGKILL:
                    raise BenchError(f"{name} ended with status {code}, not SIGKILL")
                end = joiner.log.last_step + 1 + cfg.settle
                chain.wait_for("steps after the crash", reached([a], end))
                samples.append(crash_sample(a, joiner))
        a.proc.send_signal(signal.SIGTERM)
        code = chain.wait_exit(a, "the last worker to leave")
        if code != 0:
            raise BenchError(f"a left with status {code}:\n{a.stderr_tail()}")
        ends = a.log.marks.get("events", [])
        return ChainResult(
            "vflow",
            samples,
            whole_chain(chain.workers),
            step_intervals(chain.workers),
            events=ends[0]["events"] if ends else [],
        )
    finally:
        chain.kill_all()


def run_restart(cfg: Config, endpoint: str, folder: Path, job: str, deadline: float) -> ChainResult:
    chain = Chain(cfg, endpoint, folder, deadline)
    checkpoint = folder / "checkpoint.pt"
    phase = {"n": 0}
    try:

        def start_set(count: int) -> list[Worker]:
            phase["n"] += 1
            return [
                chain.start(
                    f"p{phase['n']}w{i}",
                    f"{job}-p{phase['n']}",
                    min_workers=count,
                    max_workers=count,
                    checkpoint=checkpoint,
                )
                for i in range(count)
            ]

        current = start_set(1)
        chain.wait_for("warm-up steps", ran(current[0], cfg.warmup))
        samples: list[Sample] = []
        for event, count in (("grow", 2), ("shrink", 1), ("grow", 2), ("crash", 1)):
            if event == "crash":
                victim = current[-1]
                victim.proc.send_signal(signal.SIGUSR1)
                chain.wait_exit(victim, "the victim's crash")
                t_event = victim.log.stamp("kill")
            else:
                t_event = time.time()
            old = current
            chain.stop(old)
            stopped = time.time()
            current = start_set(count)
            new = current
            target = max(w.log.last_step for w in old) + cfg.settle
            chain.wait_for(f"steps after the {event} restart", reached(new, target))
            samples.append(restart_sample(event, t_event, stopped, old, new))
        chain.stop(current)
        saves = [float(m["seconds"]) for w in chain.workers for m in w.log.marks.get("saved", [])]
        return ChainResult(
            "restart",
            samples,
            whole_chain(chain.workers),
            step_intervals(chain.workers),
            saves_s=saves,
        )
    finally:
        chain.kill_all()


# ---- results ---------------------------------------------------------------------------------

PHASES = (
    ("detection", "detected"),
    ("stopped", "old stopped"),
    ("imports", "imports done"),
    ("formed", "group formed"),
    ("built", "executor built"),
    ("state", "state in"),
    ("first step", "first step"),
    ("recomputed", "recomputed"),
)


def _median_or_none(values: Sequence[float]) -> float | None:
    return median(values) if values else None


def _phase_medians(samples: Sequence[Sample]) -> dict[str, float]:
    names = {name for s in samples for name in s.phases}
    return {
        name: median([s.phases[name] for s in samples if name in s.phases])
        for name, _ in PHASES
        if name in names
    }


def summarise(cfg: Config, repeats: int, chains: Sequence[ChainResult]) -> dict[str, Any]:
    vflow_samples = [s for c in chains if c.path == "vflow" for s in c.samples]
    restart_samples = [s for c in chains if c.path == "restart" for s in c.samples]
    rows = []
    for key, label, restart_event in ROWS:
        mine = [s for s in vflow_samples if s.event == key]
        theirs = [s for s in restart_samples if s.event == restart_event]
        if len(mine) != len(theirs) or not mine:
            raise BenchError(f"{key}: {len(mine)} vflow samples but {len(theirs)} restart ones")
        ratios = [m.seconds / t.seconds for m, t in zip(mine, theirs, strict=True)]
        row: dict[str, Any] = {
            "key": key,
            "event": label,
            "vflow_s": [s.seconds for s in mine],
            "restart_s": [s.seconds for s in theirs],
            "vflow_median_s": median([s.seconds for s in mine]),
            "restart_median_s": median([s.seconds for s in theirs]),
            "ratios": ratios,
            "ratio": median(ratios),
            "steps_lost": [s.lost for s in mine],
            "recomputed_steps": [s.lost for s in theirs],
            "vflow_phases_s": _phase_medians(mine),
            "restart_phases_s": _phase_medians(theirs),
            "vflow_batches": [[s.before, s.first] for s in mine],
            "restart_batches": [[s.before, s.first] for s in theirs],
        }
        missed = []
        if row["ratio"] > TARGET_RATIO:
            missed.append("ratio")
        if any(row["steps_lost"]):
            missed.append("steps lost")
        target = f"<= {TARGET_RATIO:g} x restart, 0 lost"
        if key == "shrink":
            target += f", <= {TARGET_SHRINK_S:g} s"
            if row["vflow_median_s"] > TARGET_SHRINK_S:
                missed.append(f"{TARGET_SHRINK_S:g} s")
        if key == "shrink-sigterm":
            detection = median([s.phases["detection"] for s in mine])
            row["detection_s"] = detection
            row["shrink_limit_s"] = TARGET_SHRINK_S + detection
            target += f", <= {TARGET_SHRINK_S:g} s + detection"
            if row["vflow_median_s"] > row["shrink_limit_s"]:
                missed.append(f"{TARGET_SHRINK_S:g} s + detection")
        row["target"] = target
        row["missed"] = missed
        row["verdict"] = "met" if not missed else "MISSED (" + ", ".join(missed) + ")"
        rows.append(row)

    def pooled(path: str) -> dict[str, Any]:
        intervals: dict[int, list[float]] = {}
        for c in chains:
            if c.path == path:
                for n, values in c.step_s.items():
                    intervals.setdefault(n, []).extend(values)
        checks = [c.check for c in chains if c.path == path]
        return {
            "step_s": {str(n): median(v) for n, v in sorted(intervals.items())},
            "whole_chain": {k: sum(c[k] for c in checks) for k in checks[0]},
        }

    events: dict[str, list[float]] = {}
    for c in chains:
        for e in c.events:
            events.setdefault(e["reason"], []).append(e["seconds"])
    saves = [s for c in chains for s in c.saves_s]
    return {
        "benchmark": "elastic",
        "model": cfg.mlp.name,
        "params": cfg.mlp.params,
        "workers": WORKERS,
        "repeats": repeats,
        "config": asdict(cfg),
        "poll_s": POLL_S,
        "target_ratio": TARGET_RATIO,
        "target_shrink_s": TARGET_SHRINK_S,
        "rows": rows,
        "vflow": pooled("vflow"),
        "restart": pooled("restart"),
        "elastic_event_seconds": {k: median(v) for k, v in events.items()},
        "checkpoint_save_s": _median_or_none(saves),
        "samples": [{"path": c.path, **asdict(s)} for c in chains for s in c.samples],
    }


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _range(values: Sequence[int]) -> str:
    if not values:
        return "-"
    mid = median(values)
    text = f"{mid:g}"
    return text if min(values) == max(values) else f"{text} ({min(values)}-{max(values)})"


def print_results(r: dict[str, Any]) -> None:
    cfg = r["config"]
    n = len(r["rows"][0]["vflow_s"])
    print(
        f"\nresults: medians over {r['repeats']} repetition(s) ({n} sample(s) per row; grow "
        "happens twice per chain); ratio = median of the per-repetition ratios vflow / restart"
    )
    print(
        format_table(
            [
                "event",
                "vflow s",
                "restart s",
                "ratio",
                "steps lost",
                "recomputed steps",
                "target",
                "verdict",
            ],
            [
                [
                    row["event"],
                    _s(row["vflow_median_s"]),
                    _s(row["restart_median_s"]),
                    f"{row['ratio']:.3f}",
                    str(sum(row["steps_lost"])),
                    _range(row["recomputed_steps"]),
                    row["target"],
                    row["verdict"],
                ]
                for row in r["rows"]
            ],
        )
    )
    k = cfg["checkpoint_every"]
    print(
        f"\nhow each column is measured (wall clock, time.time(); the benchmark polls every "
        f"{r['poll_s'] * 1e3:.0f} ms):\n"
        "  grow, from joiner start: the benchmark's stamp right before it starts the joiner "
        "process -> the first step\n"
        "    completed by the 2-worker set (the later of the two workers' commit stamps of "
        "the joiner's first global batch)\n"
        "  grow, from WAITING step: the commit of the last 1-worker step, whose signal words "
        "carry WAITING -> the same end\n"
        "  shrink, from LEAVE step: the completion of the step whose signal words carry "
        "LEAVE -> the survivor's first step alone\n"
        "  shrink, from SIGTERM: the benchmark's SIGTERM to the leaver -> the same end "
        "(detection + shrink)\n"
        "  crash, from SIGKILL: the victim's stamp right before it SIGKILLs itself in the "
        "backward of a step -> the survivor's\n"
        "    first step alone (the failed step, computed again)\n"
        "  restart s: the same event (grow and shrink: the moment the benchmark, as "
        "torchrun's agent with instant detection,\n"
        "    decides to act, right after the triggering step's commit; crash: the same kill "
        "stamp, the exit seen within one poll)\n"
        "    -> SIGKILL every worker -> fresh processes (import torch + vflow) -> a new "
        "rendezvous (new job id, min = max workers)\n"
        f"    -> build the executor -> vflow.load the checkpoint (vflow.save every K = {k} "
        "steps) -> the first step completed\n"
        "  steps lost (vflow, summed over samples) and recomputed steps (restart, median "
        "(min-max)): |s_f - (s_b + 1)|, with s_b\n"
        "    the highest global batch committed before the event and s_f the new worker "
        "set's first; a step in flight at the\n"
        "    event is computed again on both paths and counted on neither"
    )
    print(
        f"\ntargets: every vflow event <= {r['target_ratio']:g} x the restart path (1/5), "
        f"0 steps lost; shrink <= {r['target_shrink_s']:g} s after detection "
        f"(from SIGTERM: <= {r['target_shrink_s']:g} s + detection, detection = SIGTERM -> "
        "end of the step carrying LEAVE)"
    )
    shrink = next(row for row in r["rows"] if row["key"] == "shrink-sigterm")
    print(
        f"shrink detection (median): {shrink['detection_s']:.3f} s; allowance from SIGTERM "
        f"{shrink['shrink_limit_s']:.3f} s"
    )

    print("\nwhere the time goes: median seconds from the event at which each stage was done")
    breakdown = []
    for row in r["rows"]:
        for path in ("vflow", "restart"):
            if path == "restart" and row["key"] in ("grow-waiting", "shrink-sigterm"):
                continue  # the same restart samples as the row before
            phases = row[f"{path}_phases_s"]
            if not phases:
                continue
            label = row["event"] if path == "vflow" else row["event"].split(",")[0]
            breakdown.append([f"{path}: {label}"] + [_s(phases.get(name)) for name, _ in PHASES])
    print(format_table(["path: event", *(title for _, title in PHASES)], breakdown))
    print(
        "  detected: crash: the survivor's step raised CollectiveError; shrink: the step "
        "carrying LEAVE completed\n"
        "  old stopped: every old worker SIGKILLed and reaped; imports done: the new "
        "processes (the last of them) imported torch\n"
        "    and vflow; group formed: its first rendezvous round completed and its process "
        "group built (make_executor called)\n"
        "  executor built: model, optimizer and Executor built in make_executor (the "
        "process's first torch.optim optimizer imports\n"
        "    torch._dynamo, about a second; a vflow joiner's Executor receives the state "
        "while it is constructed)\n"
        "  state in: restart: vflow.load done; vflow grow: the joiner's first step began "
        "(the state received from the running worker)\n"
        "  recomputed: the restarted set committed the last batch committed before the "
        "event (recomputation done)"
    )
    events = r["elastic_event_seconds"]
    if events:
        print(
            "ElasticJob.events on the running worker, Event.seconds (the cause seen -> the "
            "new worker set ready), medians: "
            + ", ".join(f"{k} {v:.2f} s" for k, v in sorted(events.items()))
        )
    for path in ("vflow", "restart"):
        p = r[path]
        steps = ", ".join(f"{n} worker(s) {v * 1e3:.1f} ms" for n, v in p["step_s"].items())
        w = p["whole_chain"]
        print(
            f"{path} chains: steady step {steps}; global batches {w['batches']} over all "
            f"chains, {w['missing']} never committed, {w['repeated']} committed again, "
            f"{w['partial']} committed by part of a worker set"
        )
    if r["checkpoint_save_s"] is not None:
        print(f"restart path: vflow.save median {r['checkpoint_save_s']:.3f} s per checkpoint")


# ---- headline records for the suite's summary (vflow/bench/records.py) ----


def headline_records(r: dict[str, Any]) -> list[dict[str, Any]]:
    """Per event, the vflow seconds against the restart path's, paired by repetition
    (target <= 1/5), and the shrink against its 1 s budget."""
    m = bench_records.measurement
    config = r["model"]
    out = []
    for row in r["rows"]:
        out.append(
            bench_records.headline(
                "elastic",
                f"elastic/{config}/{row['key']}",
                f"{config}: {row['event']} / restart",
                vflow=m(row["vflow_s"], label="vflow.elastic"),
                baseline=m(row["restart_s"], label="stop + restart from checkpoint"),
                paired=True,
                target=bench_records.target("<=", TARGET_RATIO),
                stated_ratio=row["ratio"],
            )
        )
    shrink = next(row for row in r["rows"] if row["key"] == "shrink")
    out.append(
        bench_records.headline(
            "elastic",
            f"elastic/{config}/shrink-budget",
            f"{config}: shrink 2->1 after detection / {TARGET_SHRINK_S:g} s",
            vflow=m(shrink["vflow_s"], label="vflow.elastic"),
            limit=m(
                [TARGET_SHRINK_S],
                label=f"{TARGET_SHRINK_S:g} s",
                note="the shrink target's budget, not a measured limit",
            ),
            compare="vflow/limit",
            target=bench_records.target("<=", 1.0),
        )
    )
    return out


# ---- main ----------------------------------------------------------------------------------


def start_store() -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "vflow", "rendezvous", "--port", "0"],
        stdout=subprocess.PIPE,
        text=True,
        env=_worker_env(),
    )
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], 60)
    endpoint = proc.stdout.readline().strip() if ready else ""
    if not endpoint:
        proc.kill()
        proc.wait()
        raise BenchError("python -m vflow rendezvous printed no address within 60 s")
    return proc, endpoint


def stop_store(proc: subprocess.Popen[str]) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def measure(cfg: Config, repeats: int, folder: Path, deadline: float) -> list[ChainResult]:
    store, endpoint = start_store()
    chains: list[ChainResult] = []
    try:
        for rep in range(repeats):
            # Alternating which path goes first spreads slow drift over both.
            order = ("vflow", "restart") if rep % 2 == 0 else ("restart", "vflow")
            for path in order:
                job = f"bench{os.getpid()}-{path}-{rep}"
                run = run_vflow if path == "vflow" else run_restart
                started = time.monotonic()
                result = run(cfg, endpoint, folder / f"{path}-{rep}", job, deadline)
                chains.append(result)
                samples = ", ".join(f"{s.event} {s.seconds:.2f} s" for s in result.samples)
                print(
                    f"repetition {rep + 1}/{repeats}, {path} chain "
                    f"({time.monotonic() - started:.0f} s): {samples}",
                    flush=True,
                )
    finally:
        stop_store(store)
    return chains


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_output_args(parser, quick="1 repetition, small model (CI smoke test)")
    add_process_args(parser, per="worker", timeout_s=TIMEOUT_S)
    parser.add_argument(
        "--repeats", type=int, default=None, help="repetitions of both chains (default 3, 1 quick)"
    )
    add_mlp_args(parser)
    parser.add_argument("--virtual-nodes", type=int, default=4, help="V (default 4)")
    parser.add_argument("--deterministic", action="store_true", help="deterministic=True executors")
    parser.add_argument(
        "--checkpoint-every",
        type=int,
        default=10,
        metavar="K",
        help="the restart path's workers call vflow.save every K steps (default 10)",
    )
    parser.add_argument(
        "--settle",
        type=int,
        default=8,
        help="steps each worker set commits before the next event (default 8: with K = 10 "
        "the events fall at different distances from the last checkpoint)",
    )
    parser.add_argument(
        "--warmup",
        type=int,
        default=None,
        help="steps before the first event (default K + 3: the restart path has a "
        "checkpoint to load from the first event on)",
    )
    parser.add_argument(
        "--keep-logs",
        type=Path,
        default=None,
        metavar="DIR",
        help="keep the workers' logs and stderr in DIR (default: a temporary folder)",
    )
    parser.add_argument(
        "--collective-timeout",
        type=float,
        default=10.0,
        help="ElasticJob timeout_s (default 10, ElasticJob's default)",
    )
    parser.add_argument(
        "--last-call", type=float, default=1.0, help="ElasticJob last_call_s (default 1.0)"
    )
    parser.add_argument(
        "--keep-alive", type=float, default=0.5, help="ElasticJob keep_alive_s (default 0.5)"
    )
    parser.add_argument(
        "--keep-alive-attempts",
        type=int,
        default=4,
        help="ElasticJob keep_alive_attempts (default 4)",
    )
    parser.add_argument(
        "--max-workers",
        type=int,
        default=WORKERS,
        help=f"the vflow job's max_workers (default {WORKERS}: a round of {WORKERS} "
        "completes without waiting for the last call)",
    )
    args = parser.parse_args(argv)
    positive = (
        "repeats",
        "threads",
        "hidden",
        "layers",
        "batch_size",
        "checkpoint_every",
        "settle",
        "warmup",
        "keep_alive_attempts",
    )
    if problem := size_problem(args, processes=WORKERS, per="worker", positive=positive):
        parser.error(problem)
    if args.max_workers < WORKERS:
        parser.error(f"--max-workers must be >= {WORKERS}")
    mlp, batch_size = mlp_of(args)
    cfg = Config(
        hidden=mlp.hidden,
        layers=mlp.layers,
        batch_size=batch_size,
        virtual_nodes=args.virtual_nodes,
        threads=args.threads,
        deterministic=args.deterministic,
        warmup=args.warmup or args.checkpoint_every + 3,
        settle=args.settle,
        checkpoint_every=args.checkpoint_every,
        timeout_s=args.collective_timeout,
        last_call_s=args.last_call,
        keep_alive_s=args.keep_alive,
        keep_alive_attempts=args.keep_alive_attempts,
        max_workers=args.max_workers,
        wait_s=120.0,
    )
    repeats = args.repeats or (1 if args.quick else 3)
    session = open_process_session(
        args,
        "vflow benchmark: elastic events (vflow.elastic.ElasticJob) vs stop + restart from a "
        "checkpoint, 2 Gloo workers on localhost",
        threads=cfg.threads,
        workers=WORKERS,
        backend="gloo",
        threads_per_worker=cfg.threads,
    )
    print(
        f"{WORKERS} worker processes x {cfg.threads} torch thread(s) on {usable_cpus()} usable "
        f"CPUs; model {cfg.mlp.name} ({cfg.mlp.params:,} parameters), V = {cfg.virtual_nodes}, "
        f"B = {cfg.batch_size}, SGD(lr=0.01, momentum=0.9), deterministic={cfg.deterministic}"
    )
    print(
        f"ElasticJob settings (both paths): keep_alive_s={cfg.keep_alive_s:g}, "
        f"keep_alive_attempts={cfg.keep_alive_attempts}, last_call_s={cfg.last_call_s:g}, "
        f"timeout_s={cfg.timeout_s:g}; vflow job min_workers=1, "
        f"max_workers={cfg.max_workers}; restarted jobs min_workers = max_workers = their "
        "worker count"
    )
    print(
        f"events after {cfg.warmup} warm-up steps, then every {cfg.settle} new steps of each "
        f"worker set; restart path: vflow.save every K = {cfg.checkpoint_every} steps; "
        f"{repeats} repetition(s)",
        flush=True,
    )
    deadline = time.monotonic() + TIMEOUT_S.of(args, "timeout")
    with tempfile.TemporaryDirectory(prefix="vflow-elastic-") as tmp:
        folder = args.keep_logs or Path(tmp)
        try:
            chains = measure(cfg, repeats, folder, deadline)
            record = summarise(cfg, repeats, chains)
        except BenchError as e:
            raise SystemExit(f"benchmark failed: {e}") from None
    print_results(record)
    return session.finish([record, *headline_records(record)])


if __name__ == "__main__":
    sys.exit(main())
