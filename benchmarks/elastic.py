"""Elastic training: vflow.elastic.ElasticJob against torchrun itself, on the same
events (a worker joins, a node leaves, a worker gets SIGTERM, is killed in its
backward, is stopped) of the same job, at 2 and 4 workers, timed from the workers'
own logs with the same definitions on both sides.

Both sides train distributed.py's benchmark MLP (12 x Linear(1024, 1024) by default)
on the same synthetic data with SGD(lr=0.01, momentum=0.9), one Gloo worker process
per node on localhost, one torch thread each:

* vflow: ``benchmarks/_elastic_worker.py`` processes run ``ElasticJob`` against a
  ``python -m vflow rendezvous`` store (one per chain). ElasticJob's settings are its
  defaults unless an option says otherwise: ``timeout_s=10``, ``last_call_s=1``,
  ``keep_alive_s=0.5`` x ``keep_alive_attempts=4``; ``min_workers=1``,
  ``max_workers`` = the chain's worker count N. Nothing is checkpointed: the members
  keep their state through every event.
* torchrun: ``benchmarks/_torchrun_baseline.py`` runs one ``torchrun`` agent per node
  (``--nnodes=1:N --nproc-per-node=1``, c10d rendezvous on a store that lives for the
  whole chain) over ``benchmarks/_torchrun_worker.py``: plain DDP, rank 0 writes a
  checkpoint every K steps, and every failure or membership change restarts every
  worker from the last checkpoint. Two profiles (``_torchrun_baseline.PROFILES``):
  ``default`` (torchrun's and torch's defaults: last call 30 s, a node dead after 3 x
  5 s without heartbeat, Gloo timeout 30 min) and ``tuned``, as aggressive as its
  documented options allow: last_call_timeout=1, keep_alive_interval=1,
  keep_alive_max_attempt=3 (not 2: with 2, on torch 2.13, a lone node's heartbeat
  looked expired right after its round, it stopped beating and a joiner trained a
  second copy of the job beside it, a split brain), --shutdown-timeout 1 and a 10 s
  Gloo timeout (ElasticJob's default timeout_s). Every agent runs with
  ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: without it, on torch 2.13, a restarted
  worker group reads stale connection data from the agent's store and every restart
  failed in init_process_group ("Connection refused"): torchrun never recovered from
  any event. (Also ``GLOO_SOCKET_IFNAME=lo`` and ``OMP_NUM_THREADS`` = the threads.)

Checkpoints: every K = 10 steps, a checkpoint every second or two here, about the
least a torchrun job can lose (one write of this model's 100 MB state takes about
0.1 s), and K = 100, a realistic one: a job checkpoints every few minutes, not every
second, because each write stalls training and a big model's checkpoint takes seconds
to minutes to write; with this model's 0.1-0.3 s steps, 100 steps are 10-30 s. The
default runs are default:10, tuned:10 and tuned:100 (``--torchrun``): what K changes is
the recomputation after a restart, the same work for either profile, and the default
profile's own costs are measured at K = 10 (default:100 adds about 20 min).

Every event fires K/2 steps after a checkpoint, the expected loss of an event at a
random time: at a step s with s % K = K/2, at least ``--settle`` steps after the
previous event's new group began, not before that group is back at the highest step
completed before it began, and never before step K + K/2 (so that there is a
checkpoint to load). The vflow chains fire by the same rule with K = 10 (or a smaller
K run): without a checkpoint, the phase only spaces their events.

Each chain starts N workers (N - 1 when its first event is a grow) and fires its events
in this order: leave (N -> N-1), grow (N-1 -> N), term, crash, stop. Every event but a
grow hits a job of N workers: where the job is smaller before one (vflow after term,
crash or stop; either side after a leave not followed by a grow), one more worker
joins first ("restore", measured but not a row). The events:

* grow: a new node starts (vflow: a worker process; torchrun: an agent) and the job
  grows from N-1 to N workers. vflow: the joiner builds its executor, then knocks (a
  ticket in the store); the members see it at their next step, agree within the round,
  form a group and send it the state (Note [Joining a running job],
  vflow/elastic/admission.py), without a rendezvous round. torchrun: a new rendezvous round,
  every worker restarted from the checkpoint; ``--nnodes=1:N``, so the round completes
  without waiting for the last call.
* leave: SIGTERM to a node, what a user does to take one away. vflow: the worker (the
  node is the worker), which leaves after its current step (ElasticJob's handler);
  torchrun: its agent, which stops its worker and exits without leaving the
  rendezvous (it never closes it on a signal), so the others wait for its heartbeat to
  expire and then for the last call: like a node loss. N -> N-1.
* term: SIGTERM to a worker process. vflow: the same as leave; torchrun: the agent
  restarts the whole group at N (a failure, counted in --max-restarts).
* crash: SIGUSR1 to a worker, which SIGKILLs itself in the backward of its next step
  (its stamp right before the kill is the event time). vflow: the survivors drop the
  broken group, agree in the store on who is left (a dead worker's beats stop for
  0.4 s) and redo the step, N -> N-1, within the rendezvous round; torchrun: the
  agents restart the group at N from the checkpoint.
* stop: SIGSTOP to a worker. vflow: the survivors wait ElasticJob's ``timeout_s``
  (10 s), then go on without it (N -> N-1); torchrun: the survivors block in the
  allreduce until the Gloo timeout (default profile: 30 min, so it does not recover
  within the event deadline; it runs in the first repetition only), then the agents
  restart the group, and the stopped worker's agent kills it after a fixed 30 s grace.
  No target: it measures the timeouts.

Measured per event (the definitions of ``benchmarks/_torchrun_baseline.py``, applied
by the same code to both sides' logs; a step is completed by a worker group when every
rank of it has committed it; the new group is the first one formed after the event at
the size after it):

* stall: per surviving member (a node in the job before and after), the longest gap
  between two consecutive steps it committed that ends after the event, up to its
  first step in the new group; the table gives the worst member's.
* recovery: from the event to the new group's first completed step (vflow: the
  survivors' redone step; torchrun: the restarted group's first step, a recomputed
  one). For the grow, from the new node's start.
* steps recomputed: with s_b the highest step completed before the new group began and
  c the step it began with, s_b - c + 1 (steps skipped: c - s_b - 1); their time, from
  the new group's begin to its completion of s_b.
* overhead: (T - t_e) - (P(T) - P(t_e)) x m(n): the wall time from the event t_e to the
  next event T (or to the chain's last step) beyond steady training at the size after
  it, with P(t) the highest step completed by t and m(n) the median step time at n
  workers: lost and repeated work, restarts and the joiner's start-up included. It
  can come out below 0: after a grow the job trains on at N-1 workers while the joiner
  starts, counted at m(N) (with a model too small to scale, N-1 workers step faster);
  and it carries the noise of m(n) times the segment's steps.
* back at training (vflow crash, 4 workers): per survivor, from the kill to the start
  of its first step in the new group.
* the whole vflow run: every global batch 0..max committed by a whole worker set
  exactly once: missing, repeated and partial (committed by part of a set) counts.

Targets (printed, not asserted): for grow, leave, term and crash, vflow's stall and
overhead <= 1/5 of torchrun's with the default profile and <= 1/2 with the tuned one
(median of the per-repetition ratios, against every K run); 0 steps recomputed and 0
skipped on the vflow side; at 4 workers, every survivor of a crash back at training
within 1.5 s of the kill. Repetitions alternate the order of the sides.

``--quick`` (what ``benchmarks/run.py`` runs by default): 2 workers, 1 repetition, a
smaller model, only grow and crash, tuned torchrun only at K = 10: 30-40 s on 2
cores. ``--help`` prints an estimate of the full run's length; ``--timeout`` bounds it,
``--event-timeout`` bounds every wait (an event that has not recovered by then is
reported as such).

Run ``python benchmarks/elastic.py --help`` for options.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import _torchrun_baseline as trb
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

WORKER = Path(__file__).resolve().with_name("_elastic_worker.py")
EVENTS = ("leave", "grow", "term", "crash", "stop")  # the order of a chain
TARGETED = ("grow", "leave", "term", "crash")
TARGET = {"default": 0.2, "tuned": 0.5}  # vflow / torchrun, stall and overhead
TARGET_BACK_S = 1.5  # every survivor of a 4-worker crash back at training
BACK_WORKERS = 4
TIMEOUT_S = Default(full=2 * 3600.0, quick=240.0)
EVENT_TIMEOUT_S = Default(full=90.0, quick=60.0)
ABOUT = {
    "grow": "a node starts and joins: N-1 -> N",
    "leave": "SIGTERM to a node (vflow: its worker; torchrun: its agent): N -> N-1",
    "term": "SIGTERM to a worker process (vflow: = leave; torchrun: group restart)",
    "crash": "the worker SIGKILLs itself in a backward (torchrun: group restart)",
    "stop": "SIGSTOP to a worker (torchrun: group restart after the Gloo timeout)",
}


@dataclass(frozen=True)
class TorchrunRun:
    """One torchrun configuration of the comparison: a profile and a checkpoint period."""

    profile: str
    checkpoint_every: int

    @property
    def label(self) -> str:
        return f"torchrun {self.profile} K={self.checkpoint_every}"


def parse_torchrun(text: str) -> TorchrunRun:
    """``PROFILE:K``, e.g. ``tuned:10``."""
    profile, _, k = text.partition(":")
    if profile not in trb.PROFILES or not k.isdigit() or int(k) < 2:
        raise argparse.ArgumentTypeError(
            f"expected PROFILE:K with PROFILE in {', '.join(trb.PROFILES)} and K >= 2, got {text!r}"
        )
    return TorchrunRun(profile, int(k))


FULL_TORCHRUN = (TorchrunRun("default", 10), TorchrunRun("tuned", 10), TorchrunRun("tuned", 100))
QUICK_TORCHRUN = (TorchrunRun("tuned", 10),)


@dataclass(frozen=True)
class Config:
    hidden: int
    layers: int
    batch_size: int
    virtual_nodes: int
    threads: int
    deterministic: bool
    workers: tuple[int, ...]
    events: tuple[str, ...]
    torchrun: tuple[TorchrunRun, ...]
    repeats: int
    settle: int
    tail: int
    event_timeout_s: float
    timeout_s: float
    default_stop_every_repeat: bool
    # ElasticJob's settings
    collective_timeout_s: float
    last_call_s: float
    keep_alive_s: float
    keep_alive_attempts: int

    @property
    def mlp(self) -> Mlp:
        return Mlp(self.hidden, self.layers)

    @property
    def vflow_k(self) -> int:
        """The checkpoint period whose phase the vflow chains' events follow (vflow has
        no checkpoint: it only spaces the events, as on the torchrun side)."""
        return min(
            (t.checkpoint_every for t in self.torchrun if t.checkpoint_every < 10), default=10
        )


# ---- the chains --------------------------------------------------------------------------


def size_after(side: str, kind: str, size: int) -> int:
    """The worker count after an event: an elastic job loses the worker (nothing
    restarts it); torchrun restarts a failed or stopped worker."""
    if kind == "grow":
        return size + 1
    if side == "vflow" or kind in trb.SHRINKS:
        return size - 1
    return size


def chain_events(kinds: Sequence[str], workers: int, side: str) -> tuple[int, list[trb.Event]]:
    """The workers a chain starts with and its events: ``kinds`` in EVENTS' order (a
    grow without a leave first), every event but a grow at ``workers`` (a restore
    before it where the job is smaller), a grow at ``workers`` - 1."""
    order = [k for k in EVENTS if k in kinds]
    if "grow" in order and "leave" not in order:
        order.remove("grow")
        order.insert(0, "grow")
    start = workers - 1 if order and order[0] == "grow" else workers
    size, events = start, []
    for kind in order:
        if kind != "grow" and size < workers:
            events.append(trb.Event("grow", 0, restore=True))
            size += 1
        events.append(trb.Event(kind, 0))
        size = size_after(side, kind, size)
    return start, events


def first_event_step(k: int) -> int:
    """No event before step K + K/2: the torchrun side has a checkpoint to load."""
    return k + k // 2


@dataclass(frozen=True)
class JobSettings:
    """What a vflow worker process needs besides the chain's Settings."""

    virtual_nodes: int
    deterministic: bool
    collective_timeout_s: float
    last_call_s: float
    keep_alive_s: float
    keep_alive_attempts: int


class VflowChain(trb._Chain):
    """A chain of ElasticJob workers, driven and read as _torchrun_baseline drives and
    reads torchrun's (the same rule for when an event fires, the same analysis): each
    worker is one node, started by the benchmark, and its files hold one process's
    part of one worker set (benchmarks/_elastic_worker.py)."""

    counted = ("grow", "crash", "leave", "term")

    def __init__(
        self, events: Sequence[trb.Event], s: trb.Settings, run_dir: Path, job: JobSettings
    ) -> None:
        super().__init__(events, s, run_dir)
        self.job_settings = job
        self.endpoint = ""
        self.job = f"vflow-bench-{os.getpid()}-{int(time.time() * 1000) % 10**8}"
        self.exit_codes: dict[str, int | None] = {}
        self.knock_at: Path | None = None  # the gate of the joiners being started

    def size_after(self, kind: str, size: int) -> int:
        return size_after("vflow", kind, size)

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        # The workers import the vflow this script imported, whatever else is installed.
        root = str(Path(vflow.__file__).resolve().parent.parent)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        env.update(OMP_NUM_THREADS=str(self.s.threads), PYTHONUNBUFFERED="1")
        return env

    def start_store(self) -> None:
        self.store = subprocess.Popen(
            [sys.executable, "-m", "vflow", "rendezvous", "--port", "0"],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=self.env(),
            start_new_session=True,
            preexec_fn=trb._die_with_parent,
        )
        assert self.store.stdout is not None
        ready, _, _ = select.select([self.store.stdout], [], [], 60.0)
        self.endpoint = self.store.stdout.readline().decode().strip() if ready else ""
        if not self.endpoint:
            raise trb._Abort("python -m vflow rendezvous printed no address within 60 s")

    def agent_command(self, name: str) -> list[str]:
        s, j = self.s, self.job_settings
        return [
            sys.executable,
            str(WORKER),
            *("--rdzv", self.endpoint, "--job", self.job),
            *("--log-path", str(self.run_dir / name)),
            *("--hidden", str(s.hidden), "--layers", str(s.layers)),
            *("--batch-size", str(s.batch_size), "--virtual-nodes", str(j.virtual_nodes)),
            *("--threads", str(s.threads), "--steps", str(self.steps_arg())),
            *("--min-workers", str(s.min_workers), "--max-workers", str(self.max_workers)),
            *("--timeout", f"{j.collective_timeout_s:g}", "--last-call", f"{j.last_call_s:g}"),
            *("--keep-alive", f"{j.keep_alive_s:g}"),
            *("--keep-alive-attempts", str(j.keep_alive_attempts)),
            *(["--deterministic"] if j.deterministic else []),
            *(["--knock-at", str(self.knock_at)] if self.knock_at is not None else []),
        ]

    def fire(self, event: trb.Event, size: int) -> tuple[str, float, int]:
        if event.kind == "grow" and event.count > 1:
            return self.grow_together(event, size)
        if event.kind == "grow":
            return super().fire(event, size)
        after = self.size_after_event(event, size)
        agents = self.targets(event)
        names = "+".join(a.name for a in agents)
        for agent in agents:
            agent.gone = True  # every other event takes the worker out of the job for good
        if event.kind == "crash":
            if len(agents) == 1:
                os.kill(agents[0].proc.pid, signal.SIGUSR1)
            else:
                # A signal each could reach them in different steps, and each death
                # would be a failure of its own: they are told the step to die in.
                step = self.crash_step()
                for agent in agents:
                    path = self.run_dir / f"{agent.name}.crash"
                    path.with_suffix(".tmp").write_text(json.dumps({"step": step}))
                    path.with_suffix(".tmp").replace(path)

            def killed() -> float | None:
                stamps = [self.kill_stamp(a.name) for a in agents]
                return None if None in stamps else min(s for s in stamps if s is not None)

            return names, self.wait_for("crash", killed, 60.0), after
        sig = {
            "leave": signal.SIGTERM,
            "term": signal.SIGTERM,
            "stop": signal.SIGSTOP,
            "node-loss": signal.SIGKILL,
        }[event.kind]
        t = time.time()
        for agent in agents:
            os.kill(agent.proc.pid, sig)
        return names, t, after

    def grow_together(self, event: trb.Event, size: int) -> tuple[str, float, int]:
        """A grow of several workers that knock at once: started together, each waits
        after building its executor (--knock-at) until all have, and the event is the
        word to knock. Started and left to knock when ready, they would knock over the
        seconds their imports take on a busy machine: a test of process start-up, not
        of how the members take in workers that arrive together."""
        self.knock_at = self.run_dir / f"knock-{len(self.fired)}"
        try:
            agents = [self.start_agent() for _ in range(event.count)]
        finally:
            self.knock_at, gate = None, self.knock_at
        names = [a.name for a in agents]

        def built() -> bool:
            done = {p.node for p in self.logs.procs.values() if "built" in p.stamps}
            return all(name in done for name in names)

        what = f"the {len(names)} joiners to build their executors"
        self.wait_for(what, built, self.s.event_timeout_s)
        t = time.time()
        gate.write_text("")
        return "+".join(names), t, self.size_after_event(event, size)

    def kill_stamp(self, node: str) -> float | None:
        """When ``node``'s worker killed itself (each process dies once: any file of
        it may hold the stamp)."""
        procs = self.logs.procs.values()
        return min(
            (p.stamps["kill"] for p in procs if p.node == node and "kill" in p.stamps), default=None
        )

    def crash_step(self) -> int:
        """A step no worker has begun yet, however far the workers are past what this
        controller last read of their logs: 3 steps on, or 0.5 s of steps if more."""
        self.logs.poll()
        done = sorted((t, s) for g in self.logs.groups() for s, t in g.completions().items())
        high = max((s for _, s in done), default=-1)
        recent = [b[0] - a[0] for a, b in itertools.pairwise(done[-6:])]
        step_s = median(recent) if recent else 0.5
        return high + max(3, math.ceil(0.5 / max(step_s, 1e-3)))

    def finish(self) -> None:
        """The end: the stopped worker is killed, the others get SIGTERM and leave
        after their current step; every worker that left must exit with status 0."""
        for a in self.agents:
            if a.gone and a.proc.poll() is None:  # stopped (SIGSTOP)
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(a.proc.pid, signal.SIGKILL)
        live = [a for a in self.agents if not a.gone]
        for a in live:
            a.proc.send_signal(signal.SIGTERM)
        until = time.monotonic() + self.s.exit_timeout_s
        while time.monotonic() < until and any(a.proc.poll() is None for a in self.agents):
            time.sleep(self.s.poll_s)
        self.exit_codes = {a.name: a.proc.poll() for a in self.agents}
        leaves = [f for f in self.fired if f.event.kind in ("leave", "term")]
        left = {name for f in leaves for name in f.node.split("+")}
        bad = [a for a in self.agents if (a.name in left or not a.gone) and a.proc.poll() != 0]
        if bad:
            raise trb._Abort(
                "worker(s) did not leave cleanly: "
                + "; ".join(f"{a.name}: {a.proc.poll()}\n{self.tail(a)}" for a in bad)
            )

    def result(self, wall_s: float, error: str | None, log_dir: str | None) -> trb.RunResult:
        self.logs.poll()
        r = super().result(wall_s, error, log_dir)
        process = {p.node: p for p in self.logs.procs.values() if p.path.name.endswith(".p.jsonl")}
        for fired, e in zip(self.fired, r.events):
            # The new worker set's stamps are its first step's start ("begin") and
            # completion; a grow's joiners also logged their imports and executors,
            # built before they asked to join (the last joiner's).
            phases = {k: v for k, v in e.phases_s.items() if k in ("begin", "step")}
            joiners = [process[n] for n in fired.node.split("+") if n in process]
            if e.kind == "grow" and joiners and e.recovered:
                for stamp in ("ready", "built"):
                    # Joiners that knock together (grow_together) were ready before.
                    if all(j.stamps.get(stamp, -math.inf) >= fired.t for j in joiners):
                        phases[stamp] = max(j.stamps[stamp] for j in joiners) - fired.t
            e.phases_s = phases
        events = {}
        for path in sorted(self.run_dir.glob("*.p.jsonl")):
            for line in path.read_text(encoding="utf-8").splitlines():
                if line.strip() and "events" in (rec := json.loads(line)):
                    events[path.name.split(".")[0]] = rec["events"]
        r.extra = {"exit_codes": self.exit_codes, "elastic_events": events}
        if error is not None:
            # What each worker said (its stderr: ElasticJob's warnings, a traceback).
            r.extra["output_tails"] = {a.name: self.tail(a, 25) for a in self.agents}
        return r


def chain_settings(
    cfg: Config,
    profile: trb.Profile,
    k: int,
    workers: int,
    start: int,
    folder: Path | None,
    **side: Any,
) -> trb.Settings:
    """One chain's settings, the same for both sides but for the profile, K and
    ``side``'s own (torchrun's restarts, vflow's exit wait)."""
    return trb.Settings(
        profile=profile,
        workers=start,
        checkpoint_every=k,
        min_workers=1,
        max_workers=workers,
        hidden=cfg.hidden,
        layers=cfg.layers,
        batch_size=cfg.batch_size,
        threads=cfg.threads,
        event_timeout_s=cfg.event_timeout_s,
        keep_dir=folder,
        tail_steps=cfg.tail,
        settle_steps=cfg.settle,
        event_phase=k // 2,
        **side,
    )


def _with_first_step(events: list[trb.Event], k: int) -> list[trb.Event]:
    if not events:
        return events
    first = trb.Event(events[0].kind, first_event_step(k), restore=events[0].restore)
    return [first, *events[1:]]


def run_vflow(cfg: Config, workers: int, deadline: float, folder: Path | None) -> trb.RunResult:
    start, events = chain_events(cfg.events, workers, "vflow")
    events = _with_first_step(events, cfg.vflow_k)
    settings = chain_settings(
        cfg, trb.Profile("vflow"), cfg.vflow_k, workers, start, folder, exit_timeout_s=30.0
    )
    s = replace(settings, timeout_s=_left(deadline))
    job = JobSettings(
        cfg.virtual_nodes,
        cfg.deterministic,
        cfg.collective_timeout_s,
        cfg.last_call_s,
        cfg.keep_alive_s,
        cfg.keep_alive_attempts,
    )

    def make(ev: Sequence[trb.Event], st: trb.Settings, run_dir: Path) -> trb._Chain:
        return VflowChain(ev, st, run_dir, job)

    return trb.run_chain(events, s, make)


def run_torchrun(
    cfg: Config,
    run: TorchrunRun,
    workers: int,
    kinds: Sequence[str],
    deadline: float,
    folder: Path | None,
) -> trb.RunResult:
    start, events = chain_events(kinds, workers, "torchrun")
    events = _with_first_step(events, run.checkpoint_every)
    settings = chain_settings(
        cfg,
        trb.PROFILES[run.profile],
        run.checkpoint_every,
        workers,
        start,
        folder,
        max_restarts=20,
    )
    s = replace(settings, timeout_s=_left(deadline))
    return trb.run_chain(events, s)


def _left(deadline: float) -> float:
    return max(1.0, deadline - time.monotonic())


# ---- samples -------------------------------------------------------------------------------


@dataclass
class Sample:
    """One event of one chain, as the table uses it."""

    repeat: int
    side: str  # "vflow" or a TorchrunRun label
    workers: int
    kind: str
    sizes: str  # "2->1"
    recovered: bool
    stall_s: float | None  # the worst surviving member's
    recovery_s: float | None
    recomputed: int | None
    skipped: int | None
    recompute_s: float | None
    overhead_s: float | None
    resumed_s: float | None  # the last surviving member back at training
    first_step_s: float | None  # the last surviving member's first step committed
    phases_s: dict[str, float] = field(default_factory=dict)


def samples_of(repeat: int, side: str, workers: int, result: trb.RunResult) -> list[Sample]:
    out = []
    for e in result.events:
        if e.restore:
            continue
        skipped = None
        if e.checkpoint_step is not None and e.last_step_before is not None:
            skipped = max(0, e.checkpoint_step - e.last_step_before - 1)
        out.append(
            Sample(
                repeat=repeat,
                side=side,
                workers=workers,
                kind=e.kind,
                sizes=f"{e.size_before}->{e.size_after}",
                recovered=e.recovered,
                stall_s=max(e.stall_s.values()) if e.stall_s else None,
                recovery_s=e.recovery_s,
                recomputed=e.recomputed_steps,
                skipped=skipped,
                recompute_s=e.recompute_s,
                overhead_s=e.overhead_s,
                resumed_s=max(e.resumed_s.values()) if e.resumed_s else None,
                first_step_s=max(e.first_step_s.values()) if e.first_step_s else None,
                phases_s=dict(e.phases_s),
            )
        )
    return out


@dataclass
class Chain:
    """One chain's result, as the run keeps it."""

    repeat: int
    workers: int
    side: str
    result: trb.RunResult
    seconds: float


def describe(chain: Chain) -> str:
    parts = []
    for e in chain.result.events:
        name = "restore" if e.restore else e.kind
        if not e.recovered:
            parts.append(f"{name} {e.size_before}->{e.size_after}: not recovered")
            continue
        stall = max(e.stall_s.values()) if e.stall_s else None
        parts.append(
            f"{name} {e.size_before}->{e.size_after}: stall {_s(stall)} s, recovery "
            f"{_s(e.recovery_s)} s, recomputed {e.recomputed_steps}, overhead "
            f"{_s(e.overhead_s)} s"
        )
    text = "; ".join(parts)
    if chain.result.error:
        text += f"; stopped: {chain.result.error.splitlines()[0]}"
    return text


def measure(cfg: Config, folder: Path | None) -> tuple[list[Chain], list[str]]:
    """Every chain of the run; and what was skipped for want of time."""
    deadline = time.monotonic() + cfg.timeout_s
    chains: list[Chain] = []
    skipped: list[str] = []
    for rep in range(cfg.repeats):
        for n in cfg.workers:
            sides: list[TorchrunRun | None] = [None, *cfg.torchrun]
            if rep % 2 == 1:  # alternating the order spreads slow drift over both sides
                sides.reverse()
            for run in sides:
                label = "vflow" if run is None else run.label
                what = f"repetition {rep + 1}/{cfg.repeats}, {n} workers, {label}"
                if deadline - time.monotonic() < 30:
                    skipped.append(what)
                    print(f"{what}: skipped (the run's --timeout is spent)", flush=True)
                    continue
                kinds = list(cfg.events)
                if (
                    run is not None
                    and run.profile == "default"
                    and rep > 0
                    and not cfg.default_stop_every_repeat
                    and "stop" in kinds
                ):
                    # torch's 30-minute Gloo timeout: it cannot recover within the
                    # event deadline; the first repetition shows it.
                    kinds.remove("stop")
                sub = None if folder is None else folder / f"r{rep}-n{n}"
                started = time.monotonic()
                if run is None:
                    result = run_vflow(cfg, n, deadline, sub)
                else:
                    result = run_torchrun(cfg, run, n, kinds, deadline, sub)
                chain = Chain(rep, n, label, result, time.monotonic() - started)
                chains.append(chain)
                print(f"{what} ({chain.seconds:.0f} s): {describe(chain)}", flush=True)
                if run is None and result.error:
                    # What it measured until then stays; the run's status will be 1.
                    print(f"vflow chain failed: {result.error}", flush=True)
                    for node, tail in result.extra.get("output_tails", {}).items():
                        print(f"  worker {node}'s output, last lines:\n{tail}", flush=True)
    return chains, skipped


# ---- results ---------------------------------------------------------------------------------


def _med(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return median(present) if present else None


def _pairs(
    mine: Sequence[Sample], theirs: Sequence[Sample], attr: str
) -> tuple[list[float], list[float]]:
    """The values of ``attr`` of the repetitions both sides have (and recovered in)."""
    by_rep = {s.repeat: s for s in theirs if getattr(s, attr) is not None}
    v, b = [], []
    for s in mine:
        other = by_rep.get(s.repeat)
        if other is not None and getattr(s, attr) is not None:
            v.append(float(getattr(s, attr)))
            b.append(float(getattr(other, attr)))
    return v, b


def whole_run(chains: Sequence[Chain]) -> dict[str, int]:
    """The vflow chains together: global batches, and how many were never completed,
    completed again, or committed by part of a worker set."""
    check = {"chains": 0, "batches": 0, "missing": 0, "repeated": 0, "partial": 0}
    for c in chains:
        if c.side != "vflow":
            continue
        r = c.result
        check["chains"] += 1
        check["batches"] += r.steps_completed + len(r.missing_steps)
        check["missing"] += len(r.missing_steps)
        check["repeated"] += r.steps_repeated
        check["partial"] += len(r.partial_steps)
    return check


def summarise(cfg: Config, chains: Sequence[Chain], skipped: Sequence[str]) -> dict[str, Any]:
    samples = [s for c in chains for s in samples_of(c.repeat, c.side, c.workers, c.result)]
    sides = ["vflow", *(t.label for t in cfg.torchrun)]
    rows = []
    for n in cfg.workers:
        for kind in [k for k in EVENTS if k in cfg.events]:
            for side in sides:
                mine = [s for s in samples if (s.workers, s.kind, s.side) == (n, kind, side)]
                if not mine:
                    continue
                ok = [s for s in mine if s.recovered]
                phases = sorted({k for s in ok for k in s.phases_s})
                rows.append(
                    {
                        "workers": n,
                        "event": kind,
                        "side": side,
                        "sizes": mine[0].sizes,
                        "samples": len(mine),
                        "recovered": len(ok),
                        "stall_s": _med([s.stall_s for s in ok]),
                        "recovery_s": _med([s.recovery_s for s in ok]),
                        "recomputed": _med([s.recomputed for s in ok]),
                        "skipped": _med([s.skipped for s in ok]),
                        "recompute_s": _med([s.recompute_s for s in ok]),
                        "overhead_s": _med([s.overhead_s for s in ok]),
                        "resumed_s": _med([s.resumed_s for s in ok]),
                        "phases_s": {k: _med([s.phases_s.get(k) for s in ok]) for k in phases},
                        "values": [asdict(s) for s in mine],
                    }
                )
    targets = []
    for n in cfg.workers:
        for kind in [k for k in EVENTS if k in cfg.events and k in TARGETED]:
            mine = [s for s in samples if (s.workers, s.kind, s.side) == (n, kind, "vflow")]
            for run in cfg.torchrun:
                theirs = [s for s in samples if (s.workers, s.kind, s.side) == (n, kind, run.label)]
                if not mine or not theirs:
                    continue
                limit = TARGET[run.profile]
                entry: dict[str, Any] = {
                    "workers": n,
                    "event": kind,
                    "against": run.label,
                    "profile": run.profile,
                    "checkpoint_every": run.checkpoint_every,
                    "target": limit,
                }
                missed, unknown = [], []
                for measure_name in ("stall_s", "overhead_s"):
                    v, b = _pairs(mine, theirs, measure_name)
                    key = measure_name.removesuffix("_s")
                    entry[f"{key}_vflow_s"], entry[f"{key}_torchrun_s"] = v, b
                    if not v:
                        entry[f"{key}_ratio"] = None
                        unknown.append(key)
                        continue
                    if any(x <= 0 for x in b):
                        entry[f"{key}_ratio"] = None
                        unknown.append(f"{key} (torchrun's <= 0)")
                        continue
                    ratio = bench_records.paired_ratio(v, b)
                    entry[f"{key}_ratio"] = ratio
                    if ratio > limit:
                        missed.append(key)
                not_back = [s for s in theirs if not s.recovered]
                if not_back:
                    entry["torchrun_not_recovered"] = len(not_back)
                entry["missed"] = missed
                entry["verdict"] = (
                    "MISSED (" + ", ".join(missed) + ")"
                    if missed
                    else "n/a (" + ", ".join(unknown) + ")"
                    if unknown
                    else "met"
                )
                targets.append(entry)
    exact = []
    for n in cfg.workers:
        for kind in [k for k in EVENTS if k in cfg.events]:
            mine = [s for s in samples if (s.workers, s.kind, s.side) == (n, kind, "vflow")]
            if mine:
                recomputed = [s.recomputed for s in mine]
                skipped_steps = [s.skipped for s in mine]
                bad = any(x != 0 for x in recomputed + skipped_steps)
                exact.append(
                    {
                        "workers": n,
                        "event": kind,
                        "recomputed": recomputed,
                        "skipped": skipped_steps,
                        "verdict": "MISSED" if bad else "met",
                    }
                )
    back = None
    crashes = [
        s for s in samples if (s.workers, s.kind, s.side) == (BACK_WORKERS, "crash", "vflow")
    ]
    if crashes:
        values = [s.resumed_s for s in crashes]
        worst = max((v for v in values if v is not None), default=None)
        back = {
            "workers": BACK_WORKERS,
            "resumed_s": values,
            "first_step_s": [s.first_step_s for s in crashes],
            "worst_s": worst,
            "target_s": TARGET_BACK_S,
            "verdict": "met" if worst is not None and worst <= TARGET_BACK_S else "MISSED",
        }
    events: dict[str, list[float]] = {}
    for c in chains:
        for node_events in c.result.extra.get("elastic_events", {}).values():
            for e in node_events:
                if e["reason"] != "start":
                    events.setdefault(e["reason"], []).append(e["seconds"])
    step_s: dict[str, dict[str, float]] = {}
    for side in sides:
        pooled: dict[int, list[float]] = {}
        for c in chains:
            if c.side == side:
                for k, v in c.result.step_s.items():
                    pooled.setdefault(int(k), []).append(v)
        step_s[side] = {str(k): median(v) for k, v in sorted(pooled.items())}
    return {
        "benchmark": "elastic",
        "model": cfg.mlp.name,
        "params": cfg.mlp.params,
        "config": {
            **asdict(cfg),
            "torchrun": [asdict(t) for t in cfg.torchrun],
            "profiles": {
                name: asdict(p) for name, p in trb.PROFILES.items() if name in _profiles(cfg)
            },
            "torchrun_env": {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"},
        },
        "rows": rows,
        "targets": targets,
        "exactly_once": exact,
        "crash_back": back,
        "vflow_whole_run": whole_run(chains),
        "elastic_event_seconds": {k: median(v) for k, v in sorted(events.items())},
        "step_s": step_s,
        "skipped_chains": list(skipped),
        "vflow_errors": [
            f"repetition {c.repeat + 1}, {c.workers} workers: {c.result.error}"
            for c in chains
            if c.side == "vflow" and c.result.error
        ],
        "chains": [
            {"repeat": c.repeat, "workers": c.workers, "side": c.side, "seconds": c.seconds}
            | {"result": asdict(c.result)}
            for c in chains
        ],
    }


def _profiles(cfg: Config) -> list[str]:
    return sorted({t.profile for t in cfg.torchrun})


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _steps(value: float | None) -> str:
    return "-" if value is None else f"{value:g}"


def _cell(row: dict[str, Any], key: str, timeout_s: float) -> str:
    if row["recovered"] == 0:
        # Not recovered within the event deadline: the stall and the recovery are longer.
        return f"> {timeout_s:g}" if key in ("stall_s", "recovery_s") else "-"
    text = _s(row[key]) if key.endswith("_s") else _steps(row[key])
    if row["recovered"] < row["samples"]:
        text += f" ({row['recovered']}/{row['samples']})"
    return text


PHASES = (
    ("exec", "processes started"),
    ("ready", "imports done"),
    ("group", "group formed"),
    ("built", "executor built"),
    ("loaded", "checkpoint loaded"),
    ("begin", "first step began"),
    ("step", "first step done"),
)


def print_results(r: dict[str, Any]) -> None:
    cfg = r["config"]
    timeout = cfg["event_timeout_s"]
    print(
        f"\nresults: medians over {cfg['repeats']} repetition(s); stall = the worst "
        "surviving member's; overhead = wall time beyond steady training at the new size"
    )
    print(
        format_table(
            [
                "N",
                "event",
                "side",
                "workers",
                "stall s",
                "recovery s",
                "recomputed",
                "recompute s",
                "overhead s",
            ],
            [
                [
                    str(row["workers"]),
                    row["event"],
                    row["side"],
                    row["sizes"],
                    _cell(row, "stall_s", timeout),
                    _cell(row, "recovery_s", timeout),
                    _cell(row, "recomputed", timeout),
                    _cell(row, "recompute_s", timeout),
                    _cell(row, "overhead_s", timeout),
                ]
                for row in r["rows"]
            ],
        )
    )
    if any(row["recovered"] < row["samples"] for row in r["rows"]):
        print(
            f"  > {timeout:g}: not recovered within the event deadline ({timeout:g} s, "
            "--event-timeout); (k/n): recovered in k of n repetitions, medians of those"
        )
    if r["targets"]:
        print(
            "\ntargets: vflow / torchrun, stall and overhead (median of the per-repetition "
            "ratios): <= 1/5 of the default profile, <= 1/2 of the tuned one"
        )
        print(
            format_table(
                ["N", "event", "against", "stall ratio", "overhead ratio", "target", "verdict"],
                [
                    [
                        str(t["workers"]),
                        t["event"],
                        t["against"],
                        "-" if t["stall_ratio"] is None else f"{t['stall_ratio']:.3f}",
                        "-" if t["overhead_ratio"] is None else f"{t['overhead_ratio']:.3f}",
                        f"<= {t['target']:g}",
                        t["verdict"],
                    ]
                    for t in r["targets"]
                ],
            )
        )
    if r["exactly_once"]:
        print(
            "\nvflow, steps recomputed / skipped per event (every repetition; target 0 / 0): "
            + ", ".join(
                f"{e['workers']} workers {e['event']} {e['recomputed']}/{e['skipped']} "
                f"({e['verdict']})"
                for e in r["exactly_once"]
            )
        )
    w = r["vflow_whole_run"]
    verdict = "met" if w["missing"] == w["repeated"] == w["partial"] == 0 else "MISSED"
    print(
        f"vflow whole run ({w['chains']} chains): {w['batches']} global batches, "
        f"{w['missing']} never committed, {w['repeated']} committed again, {w['partial']} "
        f"committed by part of a worker set (target 0, 0, 0: {verdict})"
    )
    back = r["crash_back"]
    if back is not None:
        print(
            f"vflow {back['workers']}-worker crash: the last survivor back at training "
            f"(began its first step in the new worker set) {_list(back['resumed_s'])} s after "
            f"the kill, its first step done {_list(back['first_step_s'])} s (target every "
            f"survivor <= {back['target_s']:g} s: {back['verdict']})"
        )
    print("\nwhere the time goes: median seconds from the event to each stage of the new group")
    table = []
    for row in r["rows"]:
        phases = row["phases_s"]
        if phases:
            table.append(
                [str(row["workers"]), row["event"], row["side"]]
                + [_s(phases.get(name)) for name, _ in PHASES]
            )
    print(format_table(["N", "event", "side", *(title for _, title in PHASES)], table))
    print(
        "  vflow: a grow's joiner imports and builds its executor before it asks to join; "
        '"first step began" is the new worker set\'s\n'
        "  first step (the state received); torchrun: every stage of the restarted "
        'processes (the latest member\'s stamp; "processes started": the first)'
    )
    events = r["elastic_event_seconds"]
    if events:
        print(
            "ElasticJob.events (the cause seen -> the new worker set ready), medians over "
            "the workers: " + ", ".join(f"{k} {v:.2f} s" for k, v in events.items())
        )
    for side, steps in r["step_s"].items():
        text = ", ".join(f"{n} worker(s) {v * 1e3:.0f} ms" for n, v in steps.items())
        print(f"steady step, {side}: {text or '-'}")
    for what in r["skipped_chains"]:
        print(f"skipped for want of time: {what}")
    for error in r["vflow_errors"]:
        print(f"VFLOW CHAIN FAILED: {error}")


def _list(values: Sequence[float | None]) -> str:
    return ", ".join(_s(v) for v in values)


# ---- headline records for the suite's summary (vflow/bench/records.py) ----


def headline_records(r: dict[str, Any]) -> list[dict[str, Any]]:
    """Per targeted event and worker count, vflow's stall and overhead against each
    torchrun profile at its smallest K (paired by repetition; <= 0.2 default, <= 0.5
    tuned); a 4-worker crash's slowest survivor against 1.5 s."""
    m = bench_records.measurement
    model = r["model"]
    smallest: dict[str, int] = {}
    for t in r["targets"]:
        smallest[t["profile"]] = min(smallest.get(t["profile"], 10**9), t["checkpoint_every"])
    out = []
    for t in r["targets"]:
        if t["checkpoint_every"] != smallest[t["profile"]]:
            continue
        for key in ("stall", "overhead"):
            v, b = t[f"{key}_vflow_s"], t[f"{key}_torchrun_s"]
            if not v or any(x <= 0 for x in v + b):
                continue  # a record's seconds are > 0: the table has the ratio
            out.append(
                bench_records.headline(
                    "elastic",
                    f"elastic/{model}/{t['workers']}w/{t['event']}/{key}/{t['profile']}"
                    f"-k{t['checkpoint_every']}",
                    f"{model}, {t['workers']} workers: {t['event']} {key} / {t['against']}",
                    vflow=m(v, label="vflow.elastic"),
                    baseline=m(b, label=t["against"]),
                    paired=True,
                    target=bench_records.target("<=", t["target"]),
                    stated_ratio=t[f"{key}_ratio"],
                )
            )
    back = r["crash_back"]
    if back is not None and back["worst_s"] is not None and None not in back["resumed_s"]:
        # "Every survivor": the slowest of every repetition, not a median.
        out.append(
            bench_records.headline(
                "elastic",
                f"elastic/{model}/{back['workers']}w/crash/back",
                f"{model}, {back['workers']} workers: crash, slowest survivor back / "
                f"{back['target_s']:g} s",
                vflow=m(
                    [back["worst_s"]],
                    label="vflow.elastic",
                    note="the slowest survivor of all repetitions, back at training",
                ),
                limit=m(
                    [back["target_s"]],
                    label=f"{back['target_s']:g} s",
                    note="the target's budget, not a measured limit",
                ),
                compare="vflow/limit",
                target=bench_records.target("<=", 1.0),
            )
        )
    return out


# ---- main ----------------------------------------------------------------------------------

# For the estimate in --help: seconds from an event to its recovery, per worker count
# n, and the full model's step (mlp 12x1024), fitted to runs on a 2-core machine
# (benchmarks/README.md); torchrun's default profile waits its heartbeat expiry and last
# call after a leave, and its SIGSTOP the event deadline.
_EST_RECOVERY_S = {
    "vflow": {"grow": (1.0, 1.0), "leave": (0, 0.2), "term": (0, 0.2), "crash": (0, 0.25),
              "stop": (10.5, 0.1)},
    "tuned": {"grow": (1.0, 2.2), "leave": (2.0, 2.0), "term": (0.5, 2.0), "crash": (0.5, 2.0),
              "stop": (40.0, 2.5)},
    "default": {"grow": (1.0, 2.5), "leave": (42.0, 3.0), "term": (0.5, 2.2),
                "crash": (0.5, 2.2), "stop": (0, 0.0)},
}  # fmt: skip
_EST_STEP_S = {2: 0.12, 4: 0.26}
_EST_START_S = 3.0  # per worker: processes start and import torch


def estimate_s(cfg: Config) -> float:
    """A rough length of the run (seconds), from a 2-core machine's timings: per chain,
    its start, every event's recovery, the steps until the next event fires (the
    recomputation included) and the steps before the first and after the last."""
    scale = cfg.mlp.params / Mlp(1024, 12).params
    total = 0.0
    for rep in range(cfg.repeats):
        for n in cfg.workers:
            step = _EST_STEP_S.get(n, 0.065 * n) * scale
            runs: list[tuple[str, int, list[str]]] = [("vflow", cfg.vflow_k, list(cfg.events))]
            for t in cfg.torchrun:
                kinds = list(cfg.events)
                if t.profile == "default" and "stop" in kinds:
                    if rep > 0 and not cfg.default_stop_every_repeat:
                        kinds.remove("stop")
                    else:
                        total += cfg.event_timeout_s
                runs.append((t.profile, t.checkpoint_every, kinds))
            for side, k, kinds in runs:
                _, events = chain_events(kinds, n, "vflow" if side == "vflow" else "torchrun")
                total += _EST_START_S * n + (first_event_step(k) + cfg.tail) * step
                for e in events:
                    fixed, per_worker = _EST_RECOVERY_S[side][e.kind]
                    recovery = fixed + per_worker * n
                    # Steps until the next event fires: a vflow set goes on from where
                    # it was, settle steps and about K/2 more; a torchrun group resumes
                    # at a checkpoint c and fires at the first c + K/2 + i K past
                    # settle steps and past the old group's last step (K/2 on, and
                    # after a grow also what it trained while the joiner started).
                    wait = cfg.settle + k / 2
                    if side != "vflow":
                        behind = k // 2 + (recovery / step if e.kind == "grow" else 0)
                        lo = max(cfg.settle, int(behind))
                        wait = lo + (k // 2 - lo) % k
                    total += recovery + wait * step
    return total


def config_of(args: argparse.Namespace) -> Config:
    mlp, batch_size = mlp_of(args)
    quick = args.quick
    return Config(
        hidden=mlp.hidden,
        layers=mlp.layers,
        batch_size=batch_size,
        virtual_nodes=args.virtual_nodes,
        threads=args.threads,
        deterministic=args.deterministic,
        workers=tuple(args.workers or ((2,) if quick else (2, 4))),
        events=tuple(args.events or (("grow", "crash") if quick else EVENTS)),
        torchrun=tuple(args.torchrun or (QUICK_TORCHRUN if quick else FULL_TORCHRUN)),
        repeats=args.repeats or (1 if quick else 3),
        settle=args.settle,
        tail=args.tail,
        event_timeout_s=EVENT_TIMEOUT_S.of(args, "event_timeout"),
        timeout_s=TIMEOUT_S.of(args, "timeout"),
        default_stop_every_repeat=args.default_stop_every_repeat,
        collective_timeout_s=args.collective_timeout,
        last_call_s=args.last_call,
        keep_alive_s=args.keep_alive,
        keep_alive_attempts=args.keep_alive_attempts,
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_output_args(
        parser,
        quick="2 workers, 1 repetition, mlp 4x512, grow and crash only, torchrun tuned "
        "K=10 only (CI smoke test, 30-40 s)",
    )
    add_process_args(parser, per="worker", timeout_s=TIMEOUT_S)
    parser.add_argument(
        "--repeats", type=int, default=None, help="repetitions of every chain (default 3, 1 quick)"
    )
    parser.add_argument(
        "--workers",
        type=int,
        nargs="+",
        default=None,
        metavar="N",
        help="worker counts N (default 2 4; 2 quick)",
    )
    parser.add_argument(
        "--events",
        nargs="+",
        choices=EVENTS,
        default=None,
        help=f"the events (default {' '.join(EVENTS)}; grow crash quick)",
    )
    parser.add_argument(
        "--torchrun",
        nargs="+",
        type=parse_torchrun,
        default=None,
        metavar="PROFILE:K",
        help="torchrun runs: profile (default, tuned) and checkpoint period K (default "
        + " ".join(f"{t.profile}:{t.checkpoint_every}" for t in FULL_TORCHRUN)
        + "; tuned:10 quick)",
    )
    add_mlp_args(parser)
    parser.add_argument("--virtual-nodes", type=int, default=4, help="V (default 4)")
    parser.add_argument("--deterministic", action="store_true", help="deterministic=True executors")
    parser.add_argument(
        "--settle",
        type=int,
        default=10,
        help="steps of the new group before the next event may fire (default 10)",
    )
    parser.add_argument(
        "--tail", type=int, default=10, help="steps after the last event's new group (10)"
    )
    parser.add_argument(
        "--event-timeout",
        type=float,
        default=None,
        help=f"bound on every wait: an event not recovered by then is reported so "
        f"({EVENT_TIMEOUT_S.text()})",
    )
    parser.add_argument(
        "--default-stop-every-repeat",
        action="store_true",
        help="run torchrun's default-profile SIGSTOP in every repetition (default: the "
        "first only; it waits for torch's 30-minute Gloo timeout, past any deadline)",
    )
    parser.add_argument(
        "--keep-logs",
        type=Path,
        default=None,
        metavar="DIR",
        help="keep every chain's logs in DIR (default: temporary folders)",
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
    return parser


def _full_estimate_text() -> str:
    args = _parser().parse_args([])
    cfg = config_of(args)
    quick = config_of(_parser().parse_args(["--quick"]))
    chains = cfg.repeats * len(cfg.workers) * (1 + len(cfg.torchrun))
    return (
        f"length: the full run ({chains} chains: {cfg.repeats} repetitions x "
        f"{'/'.join(map(str, cfg.workers))} workers x vflow + "
        f"{', '.join(t.label for t in cfg.torchrun)}) takes about "
        f"{estimate_s(cfg) / 60:.0f} min on a quiet 2-core machine (a rough estimate from "
        f"its timings; a busy one takes longer; --timeout bounds it); --quick about "
        f"{estimate_s(quick) / 60:.1f} min"
    )


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    parser.epilog = _full_estimate_text()
    args = parser.parse_args(argv)
    positive = (
        "repeats",
        "threads",
        "hidden",
        "layers",
        "batch_size",
        "settle",
        "tail",
        "keep_alive_attempts",
    )
    cfg = config_of(args)
    most = max(cfg.workers)
    if problem := size_problem(args, processes=most, per="worker", positive=positive):
        parser.error(problem)
    if min(cfg.workers) < 2:
        parser.error("--workers must be >= 2 (a grow goes from N-1 workers, a leave to N-1)")
    session = open_process_session(
        args,
        "vflow benchmark: elastic events, vflow.elastic.ElasticJob vs torchrun, Gloo workers "
        "on localhost",
        threads=cfg.threads,
        workers=list(cfg.workers),
        backend="gloo",
        threads_per_worker=cfg.threads,
    )
    print(
        f"{'/'.join(map(str, cfg.workers))} worker processes x {cfg.threads} torch thread(s) "
        f"on {usable_cpus()} usable CPUs; model {cfg.mlp.name} ({cfg.mlp.params:,} "
        f"parameters), B = {cfg.batch_size}, SGD(lr=0.01, momentum=0.9); vflow V = "
        f"{cfg.virtual_nodes}, deterministic={cfg.deterministic}"
    )
    print(
        f"vflow: ElasticJob timeout_s={cfg.collective_timeout_s:g}, "
        f"last_call_s={cfg.last_call_s:g}, keep_alive_s={cfg.keep_alive_s:g}, "
        f"keep_alive_attempts={cfg.keep_alive_attempts}, min_workers=1, max_workers=N; "
        "no checkpoint"
    )
    for name in _profiles(cfg):
        p = trb.PROFILES[name]
        conf = ", ".join(f"{k}={v}" for k, v in p.rdzv_conf) or "torchrun's defaults"
        print(
            f"torchrun {name}: --nnodes=1:N, rdzv-conf {conf}; --shutdown-timeout "
            f"{p.shutdown_timeout_s if p.shutdown_timeout_s is not None else 'default (30)'}"
            f"; Gloo timeout {f'{p.pg_timeout_s:g} s' if p.pg_timeout_s else 'default (30 min)'}"
        )
    print(
        "torchrun env: TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (without it torch 2.13's "
        "restarted workers read stale connection data from the agent's store and never "
        "recover), GLOO_SOCKET_IFNAME=lo; runs: "
        + ", ".join(t.label for t in cfg.torchrun)
        + "; the tuned profile's keep_alive_max_attempt is 3, not 2: 2 splits the job in two "
        "on torch 2.13"
    )
    print(
        f"events: {', '.join(k for k in EVENTS if k in cfg.events)}; each fires at a step "
        f"s with s % K = K/2 (vflow: K = {cfg.vflow_k}), >= {cfg.settle} steps after the "
        f"previous event's new group began; {cfg.tail} steps after the last; "
        f"{cfg.repeats} repetition(s); every wait bounded by {cfg.event_timeout_s:g} s"
    )
    for kind in [k for k in EVENTS if k in cfg.events]:
        print(f"  {kind}: {ABOUT[kind]}")
    print(
        f"estimated length: about {estimate_s(cfg) / 60:.1f} min (--timeout {cfg.timeout_s:g} s)",
        flush=True,
    )
    chains, skipped = measure(cfg, args.keep_logs)
    record = summarise(cfg, chains, skipped)
    print_results(record)
    status = session.finish([record, *headline_records(record)])
    if record["vflow_errors"]:
        print(f"benchmark failed: {len(record['vflow_errors'])} vflow chain(s) failed")
        return 1
    return status


if __name__ == "__main__":
    sys.exit(main())
