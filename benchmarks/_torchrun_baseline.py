"""The real torchrun baseline of benchmarks/elastic.py: one chain of events (grow, a
node leaving, a worker or a whole node dying, a worker stopped) played against an
elastic job run by torchrun itself, timed from the workers' own logs.

One torchrun agent per worker, all on loopback::

    torchrun --nnodes=MIN:MAX --nproc-per-node=1 --rdzv-backend=c10d
        --rdzv-endpoint=127.0.0.1:PORT --rdzv-id=JOB --rdzv-conf=is_host=0,...
        --max-restarts=K --local-addr=127.0.0.1 benchmarks/_torchrun_worker.py ...

with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (without it, on torch 2.13, a restarted
worker group reads stale connection data from the agent's store: here every restart
failed in ``init_process_group`` with "Connection refused", again and again;
``Settings.share_store`` shows it),
``GLOO_SOCKET_IFNAME=lo`` and ``OMP_NUM_THREADS`` = the worker's threads. The
rendezvous store (the c10d backend's TCPStore) is by default a separate process that
lives for the whole run, so that any agent can be killed; ``store="agent"`` makes the
first agent host it, torchrun's usual single-machine set-up, which only survives
events that spare that agent (the default target of an event is the newest node).
The workers (benchmarks/_torchrun_worker.py) train with plain DDP and resume from a
checkpoint that rank 0 writes every K steps; every failure or membership change makes
torchrun stop every worker, run a new rendezvous round and start fresh processes.
Every node waiting in a rendezvous polls the store once a second (``_delay(1)``
between syncs), so a new round takes a second or two even when every node is back.

Profiles (``PROFILES``):

* ``default``: torchrun's defaults: ``last_call_timeout`` 30 s, ``keep_alive_interval``
  5 s x ``keep_alive_max_attempt`` 3 (a node is dead after 15 s without heartbeat),
  ``--shutdown-timeout`` 30 s, ``--monitor-interval`` 0.1 s, and torch's Gloo
  collective timeout (30 min).
* ``tuned``: ``last_call_timeout=1`` (the rendezvous options are integers and the
  timeouts must be positive: 1 s is the least), ``keep_alive_interval=1`` (the least
  whole second), ``keep_alive_max_attempt=3`` (a node is dead after 3 s without
  heartbeat), ``--shutdown-timeout 1`` (how long an agent that got SIGTERM waits for
  its worker; restarts wait 30 s whatever it says, see ``stop``) and a 10 s Gloo
  timeout in ``init_process_group`` (ElasticJob's default ``timeout_s``), without
  which a stopped worker hangs its peers for 30 minutes. ``--monitor-interval`` stays
  0.1 s.
  Why not 2 attempts (2 s, vflow's ElasticJob default 0.5 s x 4): right after a round
  completes, a node's last heartbeat is the one its join loop wrote (that loop polls
  once a second) and its new keep-alive timer first fires one interval later; its
  heartbeat, read from the store, was up to 1.95 s old here. A node whose own
  heartbeat looks expired removes itself from the state it keeps (``_sanitize``) and
  from then on never sends another one (``_should_keep_alive`` finds no entry). With
  2 attempts that happened to a lone node (min 1, max 2) and a joining node then
  found no live participant, opened a new round alone and trained a second copy of
  the job next to the first (split brain; torch 2.13). 1 attempt is accepted too and
  would fail the same way, sooner.

Events (``Event(kind, at_step, node)``; ``node`` names an agent, "a", "b", ... "z",
"aa", ... in start order (``node_name``); by default the newest live one; ``count``:
a grow of several nodes started at once, or in a chain that allows it (``counted``)
another event on the several newest). An event fires once a step >= ``at_step`` has
been completed by a worker group formed after the previous event, at the size that
event left. ``--nnodes`` is ``1:MAX`` with MAX = the starting workers plus the chain's
grows: a rendezvous round that reaches MAX nodes completes at once, one with fewer
waits ``last_call_timeout`` for more (so a chain with a grow makes its other events
slower by that much, and a job that starts with fewer than MAX nodes starts that much
later).

* ``grow``: start one more agent (a new node); the job grows by one.
* ``leave``: SIGTERM to the node's agent. torchrun stops its worker and exits without
  leaving the rendezvous (it never closes it on a signal, so that the job can go on),
  so the other nodes wait for its heartbeat to expire: the job shrinks by one.
* ``term``: SIGTERM to the node's worker process: it dies, its agent restarts the
  whole group (a failure, counted in ``--max-restarts``) at the same size.
* ``crash``: SIGUSR1 to the node's worker, which kills itself with SIGKILL in the
  backward of its next step; the event time is its own stamp right before the kill.
  Same size after.
* ``node-loss``: SIGKILL to the node's agent and its worker at once; shrinks by one.
* ``stop``: SIGSTOP to the node's worker. Its peers block in the allreduce until the
  Gloo timeout, then fail; the agents restart the group, and the stopped worker's
  agent sends it SIGTERM (held while it is stopped) and SIGKILL 30 s later: a restart
  stops workers with a fixed 30 s grace (``LocalElasticAgent._stop_workers`` calls
  ``_shutdown()`` without ``--shutdown-timeout``, which only applies when the agent
  itself is signalled). Same size after.

Definitions (seconds; a step is *completed* by a worker group when every rank of the
group has committed it, at the latest of their stamps; the *new group* of an event is
the first worker group whose processes all started after the event and whose size is
the size after the event):

* recovery: from the event to the new group's first completed step.
* stall, per surviving member (a node in the old and the new group): the longest gap
  between two consecutive steps it committed (any step numbers, recomputed ones
  included) that ends after the event, up to its first step in the new group.
* steps recomputed: with s_b the highest step completed before the new group's first
  process started (for a kill, the last step before the event; after a grow, the old
  group trains on until torchrun stops it) and c the step the new group began with
  (the step it loaded from the checkpoint, 0 without one), s_b - c + 1. Their time:
  from the new group's begin (the latest of its members' first-step stamps) to its
  completion of step s_b. Recovery ends with the first of these steps, so the two
  overlap by one step.
* per surviving member, ``resumed_s`` and ``first_step_s``: from the event to the
  start ("begin") and the completion of its first step in the new group.
* median step time m(n): the median gap between the completions of steps s - 1 and s
  by the same worker group of size n, without each group's first two completions
  (DDP rebuilds its buckets after the first iteration) and without gaps that overlap an
  event's window (from the event to its recovery).
* overhead, per event: (T - t_e) - (P(T) - P(t_e)) x m(n), with t_e the event, T the
  next event (or the completion of the last step), P(t) the highest step completed by
  time t (progress: a recomputed step does not advance it) and n the size after the
  event: the wall time the event cost beyond steady training at the new size, lost
  work, restarts and the joiner's start-up included. The run's overhead is that sum
  plus the same difference from the first completed step to the first event, which
  is not zero: the median does not see the first steps nor the checkpoint writes
  (one step in K pays ``RunResult.checkpoint_s``), and every segment pays those too.

Open-ended runs (``Settings.tail_steps``, how benchmarks/elastic.py runs this): the
workers get no step limit; an event's ``at_step`` is a lower bound, and it fires at
the first step >= ``settle_steps`` past the first step of the group formed after the
previous event and no sooner than the highest step completed before that group began
(the loss recomputed), and with ``event_phase`` set at a step s with s % K =
event_phase (K/2: half a checkpoint period after a checkpoint); the run ends once the
last group has completed ``tail_steps`` steps past that highest step or its first, by
killing every process. benchmarks/elastic.py
drives its ElasticJob workers with a subclass of the same driver (``_Chain``: its
``size_after``, ``fire``, ``finish`` and ``result``) and reads them with the same
``analyse``: the vflow worker writes one log file per worker set it trains in, in this
format, so that both sides are measured by one piece of code.

The run is bounded: every wait has a deadline (``Settings.event_timeout_s`` for a
start-up, an event or a recovery, ``Settings.timeout_s`` for the whole run), and at the
end, on error too, every process of the run is killed with SIGKILL: the agents' process
groups, the store, and whatever /proc shows with the run's directory in its command
line (the workers run in sessions of their own, and outlive an agent that is killed).

API: ``run_chain(events, settings[, make_chain]) -> RunResult`` (``RunResult.events``:
one ``EventResult`` per fired event; ``RunResult.error`` says why a run stopped early,
and what was measured until then is still there: the overhead of every event whose
segment ended); ``analyse(...)`` (the definitions, on any grouped logs);
``parse_event("crash@15:b") -> Event``;
``format_result(result) -> str``; ``PROFILES``. ``python
benchmarks/_torchrun_baseline.py --help`` runs one chain from the command line.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import itertools
import json
import os
import select
import shutil
import signal
import socket
import statistics
import string
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any, TypeVar

WORKER = Path(__file__).resolve().with_name("_torchrun_worker.py")
KINDS = ("grow", "leave", "term", "crash", "node-loss", "stop")
SHRINKS = ("leave", "node-loss")
POLL_S = 0.02


def node_name(index: int) -> str:
    """The name of the ``index``-th node started (0: "a"): a .. z, then aa, ab, ...
    (no dot: a log file's node is its name up to the first dot)."""
    letters = string.ascii_lowercase
    name = ""
    index += 1
    while index:
        index, digit = divmod(index - 1, len(letters))
        name = letters[digit] + name
    return name


@dataclass(frozen=True)
class Profile:
    """torchrun's settings for one run (None: torchrun's or torch's default)."""

    name: str
    rdzv_conf: tuple[tuple[str, int], ...] = ()
    monitor_interval_s: float | None = None
    shutdown_timeout_s: int | None = None
    pg_timeout_s: float | None = None  # the worker's init_process_group timeout


DEFAULT = Profile("default")
TUNED = Profile(
    "tuned",
    rdzv_conf=(("last_call_timeout", 1), ("keep_alive_interval", 1), ("keep_alive_max_attempt", 3)),
    shutdown_timeout_s=1,
    pg_timeout_s=10.0,
)
PROFILES = {p.name: p for p in (DEFAULT, TUNED)}


@dataclass(frozen=True)
class Event:
    kind: str
    at_step: int
    node: str | None = None  # None: the newest live node (grow: always a new one)
    # A grow that only brings a job back to its size after it lost a worker
    # (benchmarks/elastic.py's vflow chains, where nothing restarts a lost worker): it
    # is measured like any event, but it is not one of the chain's compared events.
    restore: bool = False
    # Nodes the event hits at once: a grow starts that many, a crash kills that many
    # in the same step (the newest live nodes; ``node`` names one only with count 1).
    count: int = 1


@dataclass(frozen=True)
class Settings:
    profile: Profile = DEFAULT
    workers: int = 2  # agents started at the beginning
    steps: int = 60
    checkpoint_every: int = 10
    max_restarts: int = 10
    min_workers: int = 1
    max_workers: int | None = None  # None: workers + the chain's grows
    store: str = "separate"  # or "agent": the first agent hosts the rendezvous store
    share_store: bool = False  # True: leave TORCH_DISABLE_SHARE_RDZV_TCP_STORE unset
    hidden: int = 1024
    layers: int = 12
    batch_size: int = 128
    threads: int = 1
    timeout_s: float = 600.0
    event_timeout_s: float = 120.0
    exit_timeout_s: float = 20.0  # for the agents to exit after the last step
    keep_dir: Path | None = None  # keep the run's logs there (a new subfolder)
    agent_log_level: str | None = None  # LOGLEVEL of the agents (torchrun's: WARNING)
    # Open-ended runs (benchmarks/elastic.py): with tail_steps set, the workers get no
    # step limit and the run ends, by killing every process, once the group formed
    # after the last event has completed tail_steps steps past its first (``steps``
    # is then unused). An event fires no sooner than settle_steps past the first step
    # of the group formed after the previous event, and with event_phase set only at
    # a step s with s % checkpoint_every == event_phase: its at_step is a lower bound.
    tail_steps: int | None = None
    settle_steps: int = 0
    event_phase: int | None = None
    # How often the controller reads the logs and checks its processes: every read
    # opens every log file, which with tens of workers is CPU the workers lack.
    poll_s: float = POLL_S


@dataclass
class EventResult:
    kind: str
    at_step: int
    node: str
    t_event: float  # time.time() of the event
    progress_at_event: int  # P(t_e): the highest step completed before the event
    size_before: int
    size_after: int
    recovered: bool
    recovery_s: float | None = None
    stall_s: dict[str, float] = field(default_factory=dict)
    last_step_before: int | None = None  # s_b
    checkpoint_step: int | None = None  # c
    recomputed_steps: int | None = None
    recompute_s: float | None = None
    overhead_s: float | None = None
    # Seconds from the event to the new group's phases (the latest member's stamp, but
    # "exec": the first process start): exec, ready (imports), group
    # (init_process_group), built, loaded, begin, step (first completion).
    phases_s: dict[str, float] = field(default_factory=dict)
    # Per surviving member (as stall_s), seconds from the event to its first step in
    # the new group: when that step began ("back at training") and when it committed it.
    resumed_s: dict[str, float] = field(default_factory=dict)
    first_step_s: dict[str, float] = field(default_factory=dict)
    restore: bool = False  # Event.restore


@dataclass
class RunResult:
    profile: str
    settings: dict[str, Any]
    events: list[EventResult]
    wall_s: float  # the whole run: store start to the last process killed
    startup_s: float | None  # first agent start to the first completed step
    step_s: dict[int, float]  # m(n) per worker count n
    overhead_s: float | None
    checkpoint_s: float | None  # median seconds of one checkpoint write (rank 0)
    steps_completed: int  # distinct steps completed
    steps_repeated: int  # completions of a step completed before
    missing_steps: list[int]
    error: str | None
    log_dir: str | None
    # Steps that some rank of a worker group committed and another rank of that group
    # did not (a group stopped or broken in the middle of the step's commits).
    partial_steps: list[int] = field(default_factory=list)
    end_step: int | None = None  # the step whose completion ended the run
    extra: dict[str, Any] = field(default_factory=dict)  # what a _Chain subclass adds


class _Abort(RuntimeError):
    """The chain cannot go on (a wait timed out, an agent failed)."""


# ---- the workers' logs --------------------------------------------------------------


@dataclass
class _Proc:
    """One worker process, from its log."""

    node: str
    path: Path
    pid: int = -1
    rank: int = -1
    restart: int = -1
    world: int = 0
    master: str = ""
    stamps: dict[str, float] = field(default_factory=dict)
    loaded_step: int | None = None
    begin_step: int | None = None
    kill_step: int | None = None
    commits: list[tuple[int, float]] = field(default_factory=list)
    saves: list[float] = field(default_factory=list)  # seconds per checkpoint write
    # ElasticJob.events of a vflow worker, as its last line lists them (the torchrun
    # worker writes none).
    events: list[dict[str, Any]] = field(default_factory=list)
    _offset: int = 0

    def read(self) -> None:
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return
        end = data.rfind(b"\n") + 1  # a line still being written waits for the next poll
        self._offset += end
        for line in data[:end].decode().splitlines():
            if line.strip():
                self._add(json.loads(line))

    def _add(self, rec: dict[str, Any]) -> None:
        if "t" in rec:
            self.commits.append((int(rec["step"]), float(rec["t"])))
            return
        for key in ("exec", "ready", "group", "built", "loaded", "begin", "kill", "end"):
            if key in rec:
                self.stamps.setdefault(key, float(rec[key]))
        if "exec" in rec:
            self.pid, self.rank, self.restart = rec["pid"], rec["rank"], rec["restart"]
            self.world, self.master = rec["workers"], rec["master"]
        if "loaded" in rec:
            self.loaded_step = int(rec["step"])
        if "begin" in rec:
            self.begin_step = int(rec["step"])
        if "kill" in rec:
            self.kill_step = int(rec["step"])
        if "saved" in rec:
            self.saves.append(float(rec["seconds"]))
        if "events" in rec:
            self.events = list(rec["events"])


@dataclass
class _Group:
    """One worker group: the processes of one rendezvous round (same MASTER_PORT)."""

    key: str
    world: int
    procs: list[_Proc]

    @property
    def start(self) -> float:
        return min(p.stamps.get("exec", float("inf")) for p in self.procs)

    @property
    def nodes(self) -> set[str]:
        return {p.node for p in self.procs}

    def completions(self) -> dict[int, float]:
        """step -> completion time, for the steps every rank committed."""
        by_step: dict[int, dict[int, float]] = {}
        for p in self.procs:
            for step, t in p.commits:
                by_step.setdefault(step, {})[p.rank] = t
        return {s: max(ts.values()) for s, ts in by_step.items() if len(ts) == self.world}

    def latest(self, phase: str) -> float | None:
        stamps = [p.stamps.get(phase) for p in self.procs]
        if len(self.procs) < self.world or any(s is None for s in stamps):
            return None
        return max(s for s in stamps if s is not None)


class _Logs:
    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.procs: dict[Path, _Proc] = {}

    def poll(self) -> None:
        for path in self.run_dir.glob("*.jsonl"):
            if path not in self.procs:
                self.procs[path] = _Proc(node=path.name.split(".")[0], path=path)
        for proc in self.procs.values():
            proc.read()

    def groups(self) -> list[_Group]:
        by_key: dict[str, list[_Proc]] = {}
        for p in self.procs.values():
            if p.master:
                by_key.setdefault(p.master, []).append(p)
        groups = [_Group(k, ps[0].world, ps) for k, ps in by_key.items()]
        return sorted(groups, key=lambda g: g.start)

    def current_proc(self, node: str) -> _Proc | None:
        mine = [p for p in self.procs.values() if p.node == node and "exec" in p.stamps]
        return max(mine, key=lambda p: p.stamps["exec"], default=None)


# ---- processes ---------------------------------------------------------------------


def _die_with_parent() -> None:
    # Agents are killed if this process dies without its cleanup (SIGKILL).
    with contextlib.suppress(Exception):
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def _pids_of(marker: str) -> list[int]:
    """Live processes whose command line contains ``marker`` (the run's directory)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        if marker.encode() in cmdline and _alive(int(entry)):
            found.append(int(entry))
    return found


def _signal(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, sig)


_STORE_CODE = (
    "import sys, time\n"
    "from torch.distributed import TCPStore\n"
    "store = TCPStore(sys.argv[1], int(sys.argv[2]), is_master=True, wait_for_workers=False,\n"
    "                 multi_tenant=True)\n"
    "print(store.port, flush=True)\n"
    "while True:\n"
    "    time.sleep(3600)\n"
)


def _torchrun() -> list[str]:
    script = Path(sys.executable).with_name("torchrun")
    return [str(script)] if script.exists() else [sys.executable, "-m", "torch.distributed.run"]


_T = TypeVar("_T")


@dataclass(frozen=True)
class _Fired:
    event: Event
    node: str
    t: float  # the event's time.time()
    before: int  # workers before and after
    after: int


@dataclass
class _Agent:
    name: str
    proc: subprocess.Popen[bytes]
    started: float
    output: Path
    gone: bool = False  # left or killed on purpose


class _Chain:
    """The processes of one run and the controller's loop over them.

    benchmarks/elastic.py drives its vflow chains with a subclass (its workers are the
    "agents", one process per node), so that both sides fire their events by the same
    rule and are read by the same analysis; what differs is how a process starts,
    how an event is carried out and what it does to the worker count (``size_after``).
    benchmarks/faults.py runs torchrun's agents on namespace hosts with another, whose
    events (``kinds``) include network faults.
    """

    kinds: tuple[str, ...] = KINDS
    # The kinds whose events may hit several nodes at once (Event.count).
    counted: tuple[str, ...] = ("grow",)

    def __init__(self, events: Sequence[Event], s: Settings, run_dir: Path) -> None:
        self.events = list(events)
        self.s = s
        self.run_dir = run_dir
        self.logs = _Logs(run_dir)
        # In the command line of every process of the run (the store's argument, the
        # paths inside the run's directory that agents and workers get), and in no
        # other's: the trailing slash keeps another run's directory from matching.
        self.marker = f"{run_dir}/"
        self.agents: list[_Agent] = []
        self.store: subprocess.Popen[bytes] | None = None
        self.port = 0
        self.job = f"vflow-trb-{os.getpid()}-{int(time.time() * 1000) % 10**8}"
        grows = sum(e.count for e in self.events if e.kind == "grow")
        self.max_workers = s.max_workers or s.workers + grows
        self.fired: list[_Fired] = []
        self.first_agent_t: float | None = None
        self.deadline = time.monotonic() + s.timeout_s
        self._outputs: list[IO[bytes]] = []
        # The step whose completion ends the run: the last step, or in an open-ended
        # run (Settings.tail_steps) fixed once the last event's new group began.
        self.end_step: int | None = None if s.tail_steps is not None else s.steps - 1

    def size_after(self, kind: str, size: int) -> int:
        """The worker count after an event of ``kind``: torchrun restarts a failed or
        stopped worker, and only a node that goes away shrinks the job."""
        return size + 1 if kind == "grow" else size - 1 if kind in SHRINKS else size

    def size_after_event(self, event: Event, size: int) -> int:
        """``size_after`` once per node the event hits."""
        for _ in range(event.count):
            size = self.size_after(event.kind, size)
        return size

    def steps_arg(self) -> int:
        """The step limit the workers get (none, in effect, in an open-ended run)."""
        return self.s.steps if self.s.tail_steps is None else 10**9

    def due_step(self, event: Event, first: int, high: int = -1) -> int:
        """The step whose completion fires ``event``, once the current group began at
        ``first`` (Settings: settle_steps, event_phase), and not before it is back at
        ``high``, the highest step completed before it began: an event never hits a
        group still recomputing the loss of the previous one (after a grow, torchrun's
        old group trains on until it is stopped)."""
        lo = max(event.at_step, first + self.s.settle_steps, high)
        if self.s.event_phase is None:
            return lo
        return lo + (self.s.event_phase - lo) % self.s.checkpoint_every

    # -- set-up --

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        if self.s.share_store:
            env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)
        else:
            env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        env.update(
            GLOO_SOCKET_IFNAME=self.interface,
            OMP_NUM_THREADS=str(self.s.threads),
            PYTHONUNBUFFERED="1",
        )
        if self.s.agent_log_level is not None:
            env["LOGLEVEL"] = self.s.agent_log_level
        return env

    # Where the processes run (benchmarks/faults.py puts them on namespace hosts): the
    # address the store listens on, a node's address, the interface its collectives
    # use, and the command line that runs ``argv`` where node ``name`` is.
    interface = "lo"

    def store_address(self) -> str:
        return "127.0.0.1"

    def address(self, name: str) -> str:
        return "127.0.0.1"

    def launch(self, name: str, argv: list[str]) -> list[str]:
        return argv

    def start_store(self, port: int = 0) -> None:
        if self.s.store == "agent":
            self.port = _free_port()
            return
        argv = [sys.executable, "-c", _STORE_CODE, self.store_address(), str(port), self.marker]
        self.store = subprocess.Popen(
            self.launch("store", argv),
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )
        assert self.store.stdout is not None
        ready, _, _ = select.select([self.store.stdout], [], [], 60.0)
        line = self.store.stdout.readline() if ready else b""
        if not line.strip().isdigit():
            raise _Abort("the rendezvous store did not start within 60 s")
        self.port = int(line)

    def agent_command(self, name: str) -> list[str]:
        p = self.s.profile
        host = self.s.store == "agent" and not self.agents
        conf = ",".join(f"{k}={v}" for k, v in (("is_host", int(host)), *p.rdzv_conf))
        cmd = [
            *_torchrun(),
            f"--nnodes={self.s.min_workers}:{self.max_workers}",
            "--nproc-per-node=1",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={self.store_address()}:{self.port}",
            f"--rdzv-id={self.job}",
            f"--rdzv-conf={conf}",
            f"--max-restarts={self.s.max_restarts}",
            f"--local-addr={self.address(name)}",
        ]
        if p.monitor_interval_s is not None:
            cmd.append(f"--monitor-interval={p.monitor_interval_s:g}")
        if p.shutdown_timeout_s is not None:
            cmd.append(f"--shutdown-timeout={p.shutdown_timeout_s}")
        cmd += [
            str(WORKER),
            *("--log-path", str(self.run_dir / f"{name}.r{{restart}}.p{{pid}}.jsonl")),
            *("--checkpoint", str(self.run_dir / "checkpoint.pt")),
            *("--checkpoint-every", str(self.s.checkpoint_every)),
            *("--steps", str(self.steps_arg())),
            *("--hidden", str(self.s.hidden), "--layers", str(self.s.layers)),
            *("--batch-size", str(self.s.batch_size), "--threads", str(self.s.threads)),
        ]
        if p.pg_timeout_s is not None:
            cmd += ["--pg-timeout", f"{p.pg_timeout_s:g}"]
        return cmd

    def start_agent(self) -> _Agent:
        name = node_name(len(self.agents))
        output = self.run_dir / f"agent-{name}.out"
        out = open(output, "wb")
        self._outputs.append(out)
        started = time.time()
        proc = subprocess.Popen(
            self.launch(name, self.agent_command(name)),
            stdout=out,
            stderr=subprocess.STDOUT,
            env=self.env(),
            start_new_session=True,  # its own process group: one killpg ends it
            preexec_fn=_die_with_parent,
        )
        agent = _Agent(name, proc, started, output)
        self.agents.append(agent)
        if self.first_agent_t is None:
            self.first_agent_t = started
        return agent

    # -- the loop --

    def poll(self) -> None:
        self.logs.poll()
        for a in self.agents:
            rc = a.proc.poll()
            if rc is not None and not a.gone and rc != 0:
                raise _Abort(f"agent {a.name} exited with {rc}:\n{self.tail(a)}")
        if self.agents and all(a.proc.poll() is not None for a in self.agents):
            if not self.finished():
                raise _Abort("every agent exited before the last step")
        if time.monotonic() > self.deadline:
            raise _Abort(f"the run took longer than {self.s.timeout_s:g} s")

    def tail(self, agent: _Agent, lines: int = 15) -> str:
        try:
            text = agent.output.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def wait_for(self, what: str, done: Callable[[], _T | None], timeout_s: float) -> _T:
        until = time.monotonic() + timeout_s
        while True:
            self.poll()
            value = done()
            if value:
                return value
            if time.monotonic() > until:
                raise _Abort(f"no {what} within {timeout_s:g} s")
            time.sleep(self.s.poll_s)

    def completions_after(self, t: float, size: int) -> list[tuple[int, float]]:
        """Completions by groups of ``size`` whose processes all started after ``t``."""
        out = []
        for g in self.logs.groups():
            if g.world == size and g.start > t:
                out += list(g.completions().items())
        return out

    def finished(self) -> bool:
        if self.end_step is None:
            return False
        t, size = (self.fired[-1].t, self.fired[-1].after) if self.fired else (0.0, self.s.workers)
        return any(s >= self.end_step for s, _ in self.completions_after(t, size))

    def target(self, event: Event) -> _Agent:
        if event.node is not None:
            for a in self.agents:
                if a.name == event.node and not a.gone:
                    return a
            raise _Abort(f"no live node {event.node!r} for {event}")
        live = [a for a in self.agents if not a.gone]
        return live[-1]

    def targets(self, event: Event) -> list[_Agent]:
        """The ``event.count`` nodes an event hits: ``target``'s with count 1, else the
        newest live ones."""
        if event.count == 1:
            return [self.target(event)]
        live = [a for a in self.agents if not a.gone]
        if len(live) < event.count:
            raise _Abort(f"{len(live)} live node(s) for {event}")
        return live[-event.count :]

    def worker_pid(self, agent: _Agent) -> int:
        proc = self.logs.current_proc(agent.name)
        if proc is None or not _alive(proc.pid):
            raise _Abort(f"node {agent.name} has no live worker")
        return proc.pid

    def fire(self, event: Event, size: int) -> tuple[str, float, int]:
        """Carries out ``event``; returns the node ("+"-joined for several), the event
        time and the new size."""
        after = self.size_after_event(event, size)
        if event.kind == "grow":
            agents = [self.start_agent() for _ in range(event.count)]
            return "+".join(a.name for a in agents), agents[0].started, after
        agent = self.target(event)
        if event.kind == "leave":
            t = time.time()
            _signal(agent.proc.pid, signal.SIGTERM)
            agent.gone = True
            return agent.name, t, after
        if event.kind == "node-loss":
            pid = self.worker_pid(agent)
            t = time.time()
            with contextlib.suppress(ProcessLookupError):
                os.killpg(agent.proc.pid, signal.SIGKILL)
            _signal(pid, signal.SIGKILL)
            agent.gone = True
            return agent.name, t, after
        pid = self.worker_pid(agent)
        if event.kind == "crash":
            _signal(pid, signal.SIGUSR1)
            proc = self.logs.current_proc(agent.name)
            assert proc is not None

            def killed() -> float | None:
                return proc.stamps.get("kill")

            return agent.name, self.wait_for("crash", killed, 60.0), after
        t = time.time()
        _signal(pid, signal.SIGTERM if event.kind == "term" else signal.SIGSTOP)
        return agent.name, t, after

    def drive(self) -> None:
        self.start_store()
        for _ in range(self.s.workers):
            self.start_agent()
        size, since = self.s.workers, 0.0

        def began(since: float = since, size: int = size) -> list[tuple[int, float]]:
            return self.completions_after(since, size)

        first = min(s for s, _ in self.wait_for("first step", began, self.budget()))
        high = -1
        for event in self.events:
            at = self.due_step(event, first, high)

            def due(since: float = since, size: int = size, at: int = at) -> bool:
                return any(s >= at for s, _ in self.completions_after(since, size))

            self.wait_for(f"step {at} before {event.kind}", due, self.budget())
            before = size
            node, since, size = self.fire(event, size)
            self.fired.append(_Fired(event, node, since, before, size))

            def back(since: float = since, size: int = size) -> list[tuple[int, float]]:
                return self.completions_after(since, size)

            done = self.wait_for(f"recovery from {event.kind} of {node}", back, self.budget())
            self.recovered(self.fired[-1])
            first = min(s for s, _ in done)
            began = min(t for _, t in done)
            high = max(
                (s for g in self.logs.groups() for s, t in g.completions().items() if t < began),
                default=-1,
            )
        if self.s.tail_steps is not None:
            # Past the recomputation of the last event's loss: its overhead is all in.
            self.end_step = max(first, high) + self.s.tail_steps
        self.wait_for(f"step {self.end_step}", self.finished, self.budget(whole=True))
        self.finish()
        self.logs.poll()

    def recovered(self, fired: _Fired) -> None:
        """Called once the group formed after ``fired`` has completed a step: a subclass
        measures what it wants there (benchmarks/elastic_scale.py: the workers' memory)."""

    def finish(self) -> None:
        """After the last step: torchrun's agents exit once every group member finished
        (its exit barrier); an open-ended run just ends (cleanup kills it)."""
        if self.s.tail_steps is not None:
            return
        until = time.monotonic() + self.s.exit_timeout_s
        while time.monotonic() < until and any(a.proc.poll() is None for a in self.agents):
            time.sleep(self.s.poll_s)

    def budget(self, whole: bool = False) -> float:
        left = self.deadline - time.monotonic()
        return left if whole else min(left, self.s.event_timeout_s)

    def result(self, wall_s: float, error: str | None, log_dir: str | None) -> RunResult:
        """What the logs say (after cleanup; the logs are still there)."""
        return _analyse(self, wall_s, error, log_dir)

    # -- clean-up --

    def cleanup(self) -> None:
        """SIGKILL every process of the run and reap the ones this process started."""
        for a in self.agents:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(a.proc.pid, signal.SIGKILL)
        if self.store is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.store.pid, signal.SIGKILL)
        until = time.monotonic() + 10.0
        while True:
            self.logs.poll()
            # Workers live in sessions of their own, and an agent killed first leaves
            # its worker behind: every process of the run has the run's directory in
            # its command line (its log path and checkpoint, or the agent's copy of
            # them), which also spares a reused pid of a logged worker.
            pids = _pids_of(self.marker)
            for pid in pids:
                _signal(pid, signal.SIGKILL)
            for child in [a.proc for a in self.agents] + ([self.store] if self.store else []):
                with contextlib.suppress(subprocess.TimeoutExpired):
                    child.wait(timeout=0.5)
            if not pids or time.monotonic() > until:
                break
            time.sleep(0.1)
        for out in self._outputs:
            out.close()
        if self.store is not None and self.store.stdout is not None:
            self.store.stdout.close()


# ---- analysis ----------------------------------------------------------------------


def _progress(groups: Sequence[_Group]) -> list[tuple[float, int]]:
    """(t, P(t)) at every completion: the highest step completed by then."""
    events = sorted((t, s) for g in groups for s, t in g.completions().items())
    out, best = [], -1
    for t, s in events:
        best = max(best, s)
        out.append((t, best))
    return out


def _progress_at(progress: Sequence[tuple[float, int]], t: float) -> int:
    best = -1
    for when, p in progress:
        if when > t:
            break
        best = p
    return best


def _step_times(
    groups: Sequence[_Group], windows: Sequence[tuple[float, float]]
) -> dict[int, float]:
    gaps: dict[int, list[float]] = {}
    for g in groups:
        done = g.completions()
        first_two = set(sorted(done)[:2])
        for s in done:
            if s - 1 not in done or s in first_two or s - 1 in first_two:
                continue
            lo, hi = done[s - 1], done[s]
            if any(lo < w_hi and hi > w_lo for w_lo, w_hi in windows):
                continue
            gaps.setdefault(g.world, []).append(hi - lo)
    return {n: statistics.median(v) for n, v in sorted(gaps.items())}


def _analyse_event(
    fired: _Fired,
    groups: Sequence[_Group],
    procs: Sequence[_Proc],
    progress: Sequence[tuple[float, int]],
) -> EventResult:
    event, node, t_e, before, after = fired.event, fired.node, fired.t, fired.before, fired.after
    result = EventResult(
        kind=event.kind,
        at_step=event.at_step,
        node=node,
        t_event=t_e,
        progress_at_event=_progress_at(progress, t_e),
        size_before=before,
        size_after=after,
        recovered=False,
        restore=event.restore,
    )
    new = next((g for g in groups if g.start > t_e and g.world == after and g.completions()), None)
    if new is None:
        return result
    done = new.completions()
    first = min(done.values())
    result.recovered = True
    result.recovery_s = first - t_e
    phases = {"exec": new.start}
    for phase in ("ready", "group", "built", "loaded", "begin"):
        stamp = new.latest(phase)
        if stamp is not None:
            phases[phase] = stamp
    phases["step"] = first
    result.phases_s = {k: v - t_e for k, v in phases.items()}
    old_nodes = {g_node for g in groups if g.start < t_e for g_node in g.nodes}
    for member in sorted(new.nodes & old_nodes):
        times = sorted(t for p in procs if p.node == member for _, t in p.commits)
        mine = [p for p in new.procs if p.node == member]
        end = min(t for p in mine for _, t in p.commits)
        gaps = [b - a for a, b in itertools.pairwise(times) if b > t_e and a < end]
        if gaps:
            result.stall_s[member] = max(gaps)
        result.first_step_s[member] = end - t_e
        begins = [p.stamps["begin"] for p in mine if "begin" in p.stamps]
        if begins:
            result.resumed_s[member] = min(begins) - t_e
    earlier = [s for g in groups for s, t in g.completions().items() if t < new.start]
    if earlier:
        s_b = max(earlier)
        # c: the step the new group began with (torchrun: the checkpoint it loaded, or
        # 0 without one; an elastic worker set: the step after the last it completed).
        begun = [p.begin_step for p in new.procs if p.begin_step is not None]
        loaded = [p.loaded_step for p in new.procs if p.loaded_step is not None]
        c = min(begun) if begun else loaded[0] if loaded else 0
        result.last_step_before, result.checkpoint_step = s_b, c
        result.recomputed_steps = max(0, s_b - c + 1)
        begin = new.latest("begin")
        if result.recomputed_steps == 0:
            result.recompute_s = 0.0
        elif s_b in done and begin is not None:
            result.recompute_s = done[s_b] - begin
    return result


def _partial_steps(groups: Sequence[_Group]) -> list[int]:
    """Steps some rank of a group committed and another rank of the same group did not."""
    partial = set()
    for g in groups:
        ranks: dict[int, set[int]] = {}
        for p in g.procs:
            for step, _ in p.commits:
                ranks.setdefault(step, set()).add(p.rank)
        partial |= {s for s, r in ranks.items() if len(r) < g.world}
    return sorted(partial)


def analyse(
    *,
    profile: str,
    settings: dict[str, Any],
    groups: Sequence[_Group],
    procs: Sequence[_Proc],
    fired: Sequence[_Fired],
    start_size: int,
    end_step: int | None,
    first_start_t: float | None,
    wall_s: float,
    error: str | None,
    log_dir: str | None,
) -> RunResult:
    """The module docstring's definitions, applied to one run's worker groups (the
    processes' logs, grouped) and the events fired in it; the same code reads
    benchmarks/elastic.py's vflow chains."""
    progress = _progress(groups)
    events = [_analyse_event(f, groups, procs, progress) for f in fired]
    windows = [
        (e.t_event, e.t_event + (e.recovery_s if e.recovery_s is not None else float("inf")))
        for e in events
    ]
    step_s = _step_times(groups, windows)
    all_done = [s for g in groups for s in g.completions()]
    distinct = set(all_done)
    first_t = min((t for g in groups for t in g.completions().values()), default=None)
    startup = None
    if first_t is not None and first_start_t is not None:
        startup = first_t - first_start_t
    # Overhead per segment: from each event (the first segment: from the first
    # completion) to the next event or to the completion of the last step. A segment
    # whose end is missing (the run stopped early) or whose size has no step time has
    # none, and then neither has the run.
    # The last group's completion of the end step: an earlier group may have completed
    # the same step before an event made it recompute it.
    end_t = max(
        (t for g in groups for s, t in g.completions().items() if s == end_step),
        default=None,
    )
    total: float | None = None
    if first_t is not None:
        starts = [(first_t, start_size)] + [(e.t_event, e.size_after) for e in events]
        ends: list[float | None] = [e.t_event for e in events] + [end_t]
        costs: list[float | None] = []
        for (lo, size), hi in zip(starts, ends):
            m = step_s.get(size)
            if hi is None or m is None:
                costs.append(None)
                continue
            costs.append((hi - lo) - (_progress_at(progress, hi) - _progress_at(progress, lo)) * m)
        for e, cost in zip(events, costs[1:]):
            e.overhead_s = cost
        if error is None and all(c is not None for c in costs):
            total = sum(c for c in costs if c is not None)
    saves = [d for p in procs for d in p.saves]
    return RunResult(
        profile=profile,
        settings=settings,
        events=events,
        wall_s=wall_s,
        startup_s=startup,
        step_s=step_s,
        overhead_s=total,
        checkpoint_s=statistics.median(saves) if saves else None,
        steps_completed=len(distinct),
        steps_repeated=len(all_done) - len(distinct),
        missing_steps=sorted(set(range(max(distinct, default=-1) + 1)) - distinct),
        error=error,
        log_dir=log_dir,
        partial_steps=_partial_steps(groups),
        end_step=end_step,
    )


def _analyse(chain: _Chain, wall_s: float, error: str | None, log_dir: str | None) -> RunResult:
    settings = asdict(chain.s)
    settings["profile"] = chain.s.profile.name
    settings["max_workers"] = chain.max_workers
    settings["keep_dir"] = str(chain.s.keep_dir) if chain.s.keep_dir else None
    return analyse(
        profile=chain.s.profile.name,
        settings=settings,
        groups=chain.logs.groups(),
        procs=list(chain.logs.procs.values()),
        fired=chain.fired,
        start_size=chain.s.workers,
        end_step=chain.end_step,
        first_start_t=chain.first_agent_t,
        wall_s=wall_s,
        error=error,
        log_dir=log_dir,
    )


# ---- entry points -------------------------------------------------------------------


def parse_event(text: str) -> Event:
    """``KIND@STEP`` or ``KIND@STEP:NODE``, e.g. ``crash@15`` or ``leave@20:b``."""
    kind, _, rest = text.partition("@")
    step, _, node = rest.partition(":")
    if kind not in KINDS or not step.isdigit():
        raise ValueError(f"an event is KIND@STEP[:NODE] with KIND in {KINDS}, got {text!r}")
    return Event(kind, int(step), node or None)


def check_chain(
    events: Sequence[Event],
    s: Settings,
    size_after: Callable[[str, int], int],
    kinds: Sequence[str] = KINDS,
    counted: Sequence[str] = ("grow",),
) -> None:
    """ValueError when ``events`` cannot run as one chain under ``s`` (``size_after``:
    the worker count an event leaves; ``kinds``: the events the chain can fire;
    ``counted``: those that may hit several nodes at once)."""
    if s.workers < 1 or s.checkpoint_every < 1 or s.store not in ("separate", "agent"):
        raise ValueError(f"bad settings: {s}")
    if s.tail_steps is not None and (s.tail_steps < 1 or s.settle_steps < 0):
        raise ValueError(f"bad settings: {s}")
    if s.event_phase is not None and not 0 <= s.event_phase < s.checkpoint_every:
        raise ValueError(f"event_phase must be in 0..{s.checkpoint_every - 1}: {s}")
    size, last = s.workers, -1
    for e in events:
        if e.kind not in kinds:
            raise ValueError(f"unknown event kind {e.kind!r}")
        if s.tail_steps is None and (e.at_step <= last or e.at_step >= s.steps - 1):
            raise ValueError(f"events must be at increasing steps below {s.steps - 1}: {e}")
        if e.at_step < 0:
            raise ValueError(f"an event's step must be >= 0: {e}")
        if e.count < 1 or (e.count > 1 and (e.kind not in counted or e.node is not None)):
            raise ValueError(f"this chain cannot hit {e.count} nodes at once: {e}")
        last = e.at_step
        for _ in range(e.count):
            size = size_after(e.kind, size)
        if size < max(s.min_workers, 1):
            raise ValueError(f"{e} leaves fewer than min_workers={s.min_workers} workers")


@contextlib.contextmanager
def _run_dir(keep: Path | None, name: str) -> Iterator[Path]:
    if keep is not None:
        keep.mkdir(parents=True, exist_ok=True)
        yield Path(tempfile.mkdtemp(prefix=f"{name}-", dir=keep)).resolve()
        return
    path = Path(tempfile.mkdtemp(prefix=f"vflow-chain-{name}-")).resolve()
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


ChainFactory = Callable[[Sequence[Event], Settings, Path], _Chain]


def run_chain(
    events: Sequence[Event], settings: Settings, make_chain: ChainFactory = _Chain
) -> RunResult:
    """Runs one chain of ``events`` against torchrun (see the module docstring) and
    returns what the workers' logs say about each event. A chain that cannot go on (a
    deadline, an agent that failed) returns early with ``error`` set; every process
    of the run is gone when this returns or raises. ``make_chain``: another driver
    (benchmarks/elastic.py's vflow chains), run and read the same way."""
    with _run_dir(settings.keep_dir, settings.profile.name) as run_dir:
        chain = make_chain(events, settings, run_dir)
        check_chain(events, settings, chain.size_after, chain.kinds, chain.counted)
        start = time.time()
        error: str | None = None
        try:
            chain.drive()
        except _Abort as e:
            error = str(e)
        finally:
            chain.cleanup()
        wall = time.time() - start
        log_dir = str(run_dir) if settings.keep_dir is not None else None
        return chain.result(wall, error, log_dir)


def _fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def format_result(r: RunResult) -> str:
    """A few lines per run: the step times, then one line per event."""
    steps = ", ".join(f"{n} workers {1000 * m:.0f} ms" for n, m in r.step_s.items())
    lines = [
        f"torchrun, profile {r.profile}: wall {r.wall_s:.1f} s, start-up {_fmt(r.startup_s)} s, "
        f"median step {steps or '-'}, checkpoint {_fmt(r.checkpoint_s)} s; "
        f"overhead {_fmt(r.overhead_s)} s; "
        f"{r.steps_completed} steps completed, {r.steps_repeated} repeated"
        + (f", missing {r.missing_steps}" if r.missing_steps else "")
    ]
    for e in r.events:
        stall = ", ".join(f"{k} {v:.2f}" for k, v in e.stall_s.items()) or "-"
        phases = " ".join(f"{k} {v:.2f}" for k, v in e.phases_s.items())
        lines.append(
            f"  {e.kind}@{e.at_step} of {e.node} ({e.size_before}->{e.size_after}): "
            f"recovery {_fmt(e.recovery_s)} s, stall {stall} s, recomputed "
            f"{e.recomputed_steps if e.recomputed_steps is not None else '-'} steps "
            f"(checkpoint {e.checkpoint_step}, last {e.last_step_before}) in "
            f"{_fmt(e.recompute_s)} s, "
            f"overhead {_fmt(e.overhead_s)} s"
        )
        lines.append(f"      new group, s after the event: {phases or '-'}")
    if r.error:
        lines.append(f"  stopped early: {r.error}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", choices=[*PROFILES, "both"], default="tuned")
    parser.add_argument("--workers", type=int, default=2, help="agents at the start (2)")
    parser.add_argument("--max-workers", type=int, default=None)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--checkpoint-every", type=int, default=10)
    parser.add_argument(
        "--event",
        action="append",
        type=parse_event,
        default=[],
        help=f"KIND@STEP[:NODE], repeatable, KIND in {', '.join(KINDS)}",
    )
    parser.add_argument("--store", choices=["separate", "agent"], default="separate")
    parser.add_argument("--share-store", action="store_true", help="torch 2.13's default")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=600.0, help="whole run (s)")
    parser.add_argument("--event-timeout", type=float, default=120.0, help="each wait (s)")
    parser.add_argument("--keep", type=Path, default=None, help="keep the logs under DIR")
    parser.add_argument("--agent-log-level", default=None, help="e.g. INFO, DEBUG")
    parser.add_argument("--json", type=Path, default=None, help="write the results to PATH")
    args = parser.parse_args(argv)
    # A SIGTERM to this CLI still runs run_chain's clean-up.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    profiles = list(PROFILES.values()) if args.profile == "both" else [PROFILES[args.profile]]
    results = []
    for profile in profiles:
        settings = Settings(
            profile=profile,
            workers=args.workers,
            steps=args.steps,
            checkpoint_every=args.checkpoint_every,
            max_workers=args.max_workers,
            store=args.store,
            share_store=args.share_store,
            hidden=args.hidden,
            layers=args.layers,
            batch_size=args.batch_size,
            threads=args.threads,
            timeout_s=args.timeout,
            event_timeout_s=args.event_timeout,
            keep_dir=args.keep,
            agent_log_level=args.agent_log_level,
        )
        result = run_chain(args.event, settings)
        print(format_result(result), flush=True)
        results.append(asdict(result))
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    return 0 if all(r["error"] is None for r in results) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
