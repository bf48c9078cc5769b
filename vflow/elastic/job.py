"""Elastic training: workers join, leave and crash while the job runs, and nothing is
lost or repeated.

``ElasticJob`` runs a training function in long-lived worker processes. Membership
comes from torch.distributed.elastic's rendezvous (vflow.elastic.rendezvous); each membership
round gets a fresh process group, and the executor moves onto it with
``Executor.reconfigure``. B and V never change, so neither does the training: every
global batch is computed exactly once, by whichever workers are there, and in
deterministic mode the run is bitwise the run of the same job on fixed hardware.

Usage, in every worker process (started alone it trains alone; started while the job
runs, it joins)::

    def make_executor(group, timeout):
        model, optimizer = build()  # the same initial state on every worker
        return vflow.Executor(model, optimizer, loss_fn, V, seed,
                              process_group=group, timeout=timeout, deterministic=True)

    sampler = vflow.VNBatchSampler(len(dataset), B, seed=seed)

    def train_step(ex, step):  # step: the global batch index, from the step count
        sampler.bind(ex)  # follows this step's executor: its plan and rank
        indices, size = sampler.step_indices(step)
        return ex.step(dataset[indices], global_batch_size=size)

    job = vflow.elastic.ElasticJob("127.0.0.1:29400", "my-job")
    ex = job.run(make_executor, train_step, steps=1000)

Note [Elastic state machine]
Every worker runs the same loop; all decisions are taken at step boundaries and from
values every member holds, so members never disagree on what happens next.

BUILD  the worker builds its executor alone, before it asks to join (Note [Joining
       ahead]). → KNOCK if the job has started, else ROUND
KNOCK  the worker asks the running worker set to take it in and waits for its answer
       (Note [Joining a running job]); then as ROUND, on the set it was let into.
ROUND  ``next_round`` (the job's start, or a fallback) until the rendezvous completes
       a round; build its process group; every worker moves its executor onto it
       (``reconfigure(catch_up=True)``, ``newcomer=True`` for a worker that has not
       trained in the job): newcomers receive the state (Note [Joining a worker set]).
       Newcomers the members refuse leave with JoinRefused, and the others form the set
       again without them (Note [Refusing newcomers]); a worker failing while the set
       forms is dropped as in a crash (RECOVER; newcomers are not waited for). A round
       without any member of a job that has started is refused and retried (the members
       are still on their way), so newcomers never start the job over: a round of
       newcomers starts the job only by claiming its record, which a running or
       restored job holds (Note [Fencing a job], vflow/elastic/record.py). → TRAIN
TRAIN  each step's signal word says whether the worker sees workers waiting to join
       (WAITING) and whether it was asked to leave (LEAVE), read as late as the step
       can send it; the words travel in the step's statistics (``Executor.signal``), so
       every member reads all of them at the same step. After the step:
       - any LEAVE: leavers leave the rendezvous and return; the others shrink to a
         group of the same round without them (no new round) → TRAIN; when fewer
         than ``min_workers`` remain, they wait for workers to knock;
       - else any WAITING: the members let in the workers that knocked, within the
         round (grow; Note [Joining a running job]), or, when only the rendezvous'
         wait list has workers (they came before the job started), → ROUND;
       - the job's record names another worker set (Note [Fencing a job]): this set
         trains no further step and stops with its checkpoint;
       - a CollectiveError (a peer died, hung past ``timeout_s``, or the group broke)
         → RECOVER (crash). The failed step changed nothing on a worker that raised
         (the executor's contract), and the data position is the step count, so the
         same global batch is computed again under the new plan. A member that
         committed the step while another did not is ahead; catch_up makes the others
         receive its state.
RECOVER the survivors form their worker set again within the round (Note [Recovering
       within the round]) → TRAIN; a worker left out of it (it answered too late) →
       KNOCK, and comes back as a grow; out of attempts → ROUND (all of them).
DONE   ``steps`` reached: the rendezvous is closed (late joiners return None).

Note [Joining ahead]
Building a model, its optimizer and an Executor takes seconds in a fresh process (the
first optimizer imports torch._dynamo), more with CUDA or a big model. A worker does
it before it asks to join, on a group of its own (``single_group``), so the
members' stall for a grow is one agreement and the state's broadcast, and a worker
slow to start never holds up a round. Its executor then joins with
``reconfigure(newcomer=True)``, which is what constructing it on the round's group
would have done.

Note [Recovering within the round]
Gloo cannot cancel a collective, and a survivor blocked on another survivor (not on
the dead worker) would wait for ``timeout_s``. But a Gloo group's connections close
when its last reference goes: so a worker that sees a collective fail first drops its
group (``Executor.abort_group``), which makes every peer blocked on it fail at once,
and so on, until every survivor has seen the failure. Then, in the round's store:

1. each survivor writes ``recover<G>/alive/<rank>`` (G: how many worker sets the round
   has had, the same on all members), whose value is where it answers probes;
2. it waits until every other worker of the set has either answered or stopped
   beating (Note [Beats], vflow/elastic/rendezvous.py), up to ``timeout_s``;
   newcomers of a set that was forming are not waited for;
3. it probes every other survivor (Note [Probing a peer], vflow/world/network.py) and
   writes whom it reached to ``recover<G>/reach/<rank>``, then waits for the others'
   rows as in 2. A group breaks as surely over a cut between two survivors as over a
   dead one, and after a partition both ends still answer: without this step they would
   form the same broken set again and again;
4. the first survivor to get there writes the decision to ``recover<G>/decision`` with
   compare-and-set: the survivors in the set's order, each kept if it and every one
   kept before it reach each other (``_connected``); every survivor adopts what is
   there, so all agree even when they saw different answers;
5. the ranks of the decision form the next group of the round and ``reconfigure``
   onto it with ``catch_up``, then redo the failed step.

A survivor not in the decision (it answered after it was made, or it is cut off from a
worker kept before it) asks to join again (Note [Joining a running job]) and comes back
as a grow once it reaches every member; a newcomer not in it raises JoinRefused. A
failure during steps 1-5 starts them again on the next G, up to ``max_recoveries``
times, then the worker falls back to a new round. No rendezvous round forms, so a
crash costs neither the heartbeat expiry nor the last call. Probing costs a round trip
per pair when all is well, and the probe's timeout (0.5 s) when a pair is cut.

Fewer than ``min_workers`` after a failure: the members wait up to ``join_timeout_s``
for a worker to knock, then raise RuntimeError, after writing ``checkpoint`` (if
given) with ``vflow.runtime.save_local``.

Note [Joining a running job]
A rendezvous round costs a grow the last call and the handler's polling (it syncs once a
second, hard-wired in torch's DynamicRendezvousHandler: 1.1-1.9 s measured here), and
every member must take part. Once a job has started (it has a record: Note [Fencing a
job], vflow/elastic/record.py), a newcomer does not use the rendezvous; it knocks:

0. it probes the members the set's lowest member published (``vflow/<job>/members``)
   and waits until it reaches them all (Note [Probing a peer], vflow/world/network.py):
   a worker cut off from one of them would only break the set it joins;
1. it takes a ticket, ``add("knocks", 1)`` under ``vflow/<job>``, and waits for the
   key ``admit/<ticket>`` (or for the job's record to say it finished);
2. the members' pollers count the knocks not answered yet (whose knockers still beat)
   with the rendezvous' wait list, and a member that sees any sets WAITING in its
   current step's signal word, so that all of them act after the same step, when their
   set has room (``max_workers``, V);
3. the members agree on whom to let in by compare-and-set on ``admit<G>/<step>`` in
   the round's store (the first member's view wins), write every ticket's answer (the
   round, the new set's ranks, its number G + 1) and raise the answered counter;
4. newcomers and members form the new set as in ROUND (newcomers take negative ranks
   in the round, never used before in it, from a counter in the round's store: the
   round's own ranks are >= 0; the decision carries them), with refusals and failures
   handled the same way.

A member stalls for one agreement, a group's creation and the state's broadcast
(0.04 s in tests/elastic/test_job.py's grows). A worker let in this way is not a
participant of the rendezvous' round: its heartbeats say nothing of it (its beats
do), and in a fallback round it joins from the wait list. A worker that knocked and
died while it waited is passed over (Note [Knockers beat too],
vflow/elastic/rendezvous.py); one that died in the last GONE_AFTER_S before its answer
costs the members the group's creation timeout (``timeout_s``).

Note [The store during a round]
Training needs no store: the step's collectives run over the group's own connections,
and no step takes a lock or makes a request that waits on the store (the signal words
read what the poller last saw), so a worker set trains on while the store is down or
silent (the poller's requests fail on their own thread). A change of the worker set
needs it. A dead store process fails every request at once (TCPStore: "Connection
reset by peer"); a silent one (its host's link down, a partition) fails each request
within ``store_timeout_s`` (Note [A store that goes silent], vflow/world/store.py), and
the main thread's requests never queue behind the poller's (Note [Two connections to
the store], vflow/elastic/rendezvous.py). So a recovery, a shrink or a new round that
meets an unreachable store writes ``checkpoint`` (if given) and raises RuntimeError
naming the store within ``store_timeout_s`` of its first request (after a crash: the
collective's ``timeout_s`` to notice it, then that); ``vflow.load`` resumes from that
file in a new job. A store that comes back at the same address, restarted or not, is
found by the poller, which re-registers the job there (Note [Restarts of the store],
vflow/elastic/rendezvous.py): a change of the worker set after that works again.

Note [Saying what a recovery does]
A lost worker is what an elastic job is for, not an error: the ``vflow`` logger says at
WARNING what happened and what the job does about it ("worker lost during step 77;
re-forming the worker set"), and at INFO how it ended once the new worker set is ready
("redoing step 77 with 2 workers (1 lost)": the lost are the old worker set's size less
the members found in the new round). The raw CollectiveError (Gloo's "Connection closed
by peer", the group's name) goes to DEBUG only. A timeout is named only when one expired:
the error says "timed out" only then (Note [Saying what failed] in csrc/comm.cpp), and a
dead peer closes its connections long before any timeout.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import signal
import threading
import time
import warnings
from collections.abc import Callable
from datetime import timedelta
from typing import Any, NoReturn

import torch.distributed as dist

from vflow.elastic.rendezvous import (
    GONE_AFTER_S,
    Rendezvous,
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousGracefulExitError,
    RendezvousStateError,
    RendezvousTimeoutError,
    Round,
    parse_endpoint,
    round_group,
    single_group,
)
from vflow.runtime import checkpoint as checkpoint_io
from vflow.runtime.executor import Executor
from vflow.runtime.results import StepResult
from vflow.world import network
from vflow.world.group import CollectiveError, World, failure_words
from vflow.world.membership import RefusedNewcomers

__all__ = ["LEAVE", "WAITING", "ElasticJob", "Event", "JoinRefused"]

WAITING = 1  # signal bit: this worker sees workers waiting to join
LEAVE = 2  # signal bit: this worker leaves after this step

# How often a recovering worker looks at the others' answers and beats.
_RECOVERY_POLL_S = 0.02

MakeExecutor = Callable[[dist.ProcessGroup, float], Executor]
TrainStep = Callable[[Executor, int], StepResult]

_log = logging.getLogger("vflow")


@dataclasses.dataclass(frozen=True)
class Event:
    """One change of the worker set, as this worker saw it.

    step: the step count when the new worker set took over (the next step it runs).
    round: the rendezvous round.
    workers: the worker count from then on.
    reason: "start", "grow", "leave", "crash" or "finish".
    seconds: from the moment this worker saw the cause (the step that carried the
      signal, or the failed collective) to the new worker set being ready.
    """

    step: int
    round: int
    workers: int
    reason: str
    seconds: float


@dataclasses.dataclass(frozen=True)
class _Outcome:
    reason: str  # "done", "grow", "crash", "left", "few"
    seen: float  # time.monotonic() when this worker saw it
    workers: int = 0  # the size of this worker's worker set then (0: not a member yet)
    failed_step: int | None = None  # the step that raised CollectiveError, if one did
    evicted: bool = False  # the rendezvous dropped this worker: it asks to join again
    left_out: bool = False  # the survivors of a failure went on without this worker


@dataclasses.dataclass(frozen=True)
class _Workers:
    """This worker's worker set within a round: the round ranks in it, and how many sets
    the round has had before (every member counts the same: the sets change at the same
    steps on all of them), which names the set's group and its recovery keys."""

    round: Round
    ranks: list[int]
    generation: int = 0

    @property
    def name(self) -> str:
        return f"set{self.generation}"

    def without(self, ranks: list[int]) -> _Workers:
        return self.successor([r for r in self.ranks if r not in ranks])

    def successor(self, ranks: list[int]) -> _Workers:
        return _Workers(self.round, list(ranks), self.generation + 1)


class _LeftOut(Exception):
    """The survivors of a failure agreed on a worker set without this worker (it
    answered too late): it asks to join again (Note [Joining a running job])."""


class JoinRefused(RuntimeError):
    """This worker cannot join the running job: it differs from the members (settings,
    V, model, optimizer state), it was not needed (more workers than V), or it did not
    join within the join deadline. The job goes on without it."""


class _RoundRefused(Exception):
    """A round that formed but cannot train (no member of the running job in it, or more
    workers than V): nobody failed, the members form the next one. ``level``: how loudly
    to log it."""

    def __init__(self, message: str, level: int) -> None:
        super().__init__(message)
        self.level = level


class ElasticJob:
    """One worker's part of an elastic job; see the module docstring.

    Args:
        rendezvous: ``"HOST:PORT"`` of the store that ``python -m vflow rendezvous``
            hosts (one store serves many jobs).
        job_id: names the job on that store; every worker of the job passes the same.
        min_workers / max_workers: bounds on the worker count. A round forms once
            ``min_workers`` are there (after the last call); beyond ``max_workers``,
            workers wait (without a time limit) until a place is free or the job ends.
            Keep ``max_workers <= V``: every worker needs a VN, so a round with more
            workers than V refuses the newcomers beyond V (they raise RuntimeError).
        timeout_s: bound on every collective of the job's groups: how long a hung
            worker (SIGSTOP, a wedged host) stalls the others before they drop it, and
            the join deadline: a newcomer that has not joined within it is left out.
            Keep it a few times the longest step.
        join_timeout_s: how long a round may take to form, e.g. while waiting for
            joiners after falling below ``min_workers``. It does not bound a newcomer's
            wait while the running job has no place for it.
        last_call_s: once a round has ``min_workers``, how long it waits for more.
        keep_alive_s / keep_alive_attempts: heartbeat period and the missed heartbeats
            after which the rendezvous counts a worker as dead (Note [Rounds without
            restarts], vflow/elastic/rendezvous.py); crash recovery does not wait for
            them (Note [Recovering within the round]).
        store_timeout_s: bound on reaching the store, and on any request to a store
            that went silent (Note [The store during a round]).
        max_recoveries: how many times in a row the survivors of a failure may fail
            to re-form their worker set within the round (then they form a new round),
            and rounds may fail to form (then ``run`` gives up).
        checkpoint: a file path; when the job cannot go on (too few workers, the store
            lost during a change of the worker set), this worker writes its state there
            before raising.
        handle_sigterm: SIGTERM asks this worker to leave after its current step (only
            when ``run`` is called from the main thread).
        backend: "gloo" (CPU) or "nccl" (one GPU per worker).
        interface: the network interface the worker's collectives use (Gloo's, and
            NCCL's unless ``NCCL_SOCKET_IFNAME`` is set); default: ``GLOO_SOCKET_IFNAME``
            if set, else the interface that reaches the store (Note [The interface that
            reaches the store], vflow/world/network.py). ``self.interface`` is the one
            chosen.

    The rendezvous' host must resolve and the interface exist: a ValueError naming
    either is raised here, before anything is started.
    """

    def __init__(
        self,
        rendezvous: str,
        job_id: str,
        *,
        min_workers: int = 1,
        max_workers: int = 64,
        timeout_s: float = 10.0,
        join_timeout_s: float = 600.0,
        last_call_s: float = 1.0,
        keep_alive_s: float = 0.5,
        keep_alive_attempts: int = 4,
        store_timeout_s: float = 30.0,
        max_recoveries: int = 20,
        checkpoint: str | None = None,
        handle_sigterm: bool = True,
        backend: str = "gloo",
        interface: str | None = None,
    ) -> None:
        host, port = parse_endpoint(rendezvous)
        if not isinstance(job_id, str) or not job_id or any(c.isspace() for c in job_id):
            raise ValueError(f"job_id must be a non-empty string without spaces, got {job_id!r}")
        for name, value in (
            ("min_workers", min_workers),
            ("max_workers", max_workers),
            ("keep_alive_attempts", keep_alive_attempts),
            ("max_recoveries", max_recoveries),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if max_workers < min_workers:
            raise ValueError(
                f"max_workers must be >= min_workers ({min_workers}), got {max_workers}"
            )
        for name, value in (
            ("timeout_s", timeout_s),
            ("join_timeout_s", join_timeout_s),
            ("keep_alive_s", keep_alive_s),
            ("store_timeout_s", store_timeout_s),
        ):
            if not _positive(value):
                raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
        if _positive(keep_alive_s) and keep_alive_s * keep_alive_attempts < 2.0:
            # torch's handler polls the rendezvous once a second, heartbeat included.
            raise ValueError(
                "keep_alive_s * keep_alive_attempts must be >= 2 s (the rendezvous polls "
                f"once a second), got {keep_alive_s} * {keep_alive_attempts}"
            )
        if not (_positive(last_call_s) or last_call_s == 0):
            raise ValueError(f"last_call_s must be a finite number >= 0, got {last_call_s!r}")
        if checkpoint is not None and not isinstance(checkpoint, str):
            raise TypeError(f"checkpoint must be a file path or None, got {checkpoint!r}")
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
        network.resolve(host, "rendezvous")
        self.interface, self._gloo_interface = _interface(host, port, interface)
        self.rendezvous = rendezvous
        self.job_id = job_id
        self.min_workers = min_workers
        self.max_workers = max_workers
        self.timeout_s = float(timeout_s)
        self.join_timeout_s = float(join_timeout_s)
        self.last_call_s = float(last_call_s)
        self.keep_alive_s = float(keep_alive_s)
        self.keep_alive_attempts = keep_alive_attempts
        self.store_timeout_s = float(store_timeout_s)
        self.max_recoveries = max_recoveries
        self.checkpoint = checkpoint
        self.handle_sigterm = handle_sigterm
        self.backend = backend
        self.events: list[Event] = []
        self._nccl_group: dist.ProcessGroup | None = None
        self._leave = threading.Event()
        self._rendezvous: Rendezvous | None = None

    def leave(self) -> None:
        """Asks this worker to leave after its current step (safe from a signal
        handler or another thread); the others go on without it."""
        self._leave.set()

    def waiting(self) -> int:
        """Workers waiting to join, as this worker last saw them (0 outside ``run``)."""
        return 0 if self._rendezvous is None else self._rendezvous.waiting()

    def run(
        self, make_executor: MakeExecutor, train_step: TrainStep, steps: int
    ) -> Executor | None:
        """Trains until the job has taken ``steps`` steps; returns this worker's executor
        (every worker's holds the same state), or None when the job finished before this
        worker could join. Returns early, with the executor, when this worker left.

        ``make_executor(group, timeout_s)`` builds this worker's Executor on ``group``
        (pass ``process_group=group, timeout=timeout_s``); it runs once, before this
        worker asks to join, with a group of this worker alone (Note [Joining ahead]),
        and must build the same model, optimizer and settings on every worker. A worker
        that the job's members refuse (other settings, V or model, a state it cannot
        load, or too slow to join: past ``timeout_s``) raises JoinRefused naming why;
        the job goes on without it.
        ``train_step(ex, step)`` runs exactly one ``ex.step`` on global batch ``step``
        (the data position is the step count: see ``VNBatchSampler.step_indices``) and
        returns its StepResult. It must not catch vflow.CollectiveError."""
        if not callable(make_executor):
            raise TypeError(f"make_executor must be callable, got {type(make_executor).__name__}")
        if not callable(train_step):
            raise TypeError(f"train_step must be callable, got {type(train_step).__name__}")
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise ValueError(f"steps must be an int >= 0, got {steps!r}")
        if self.backend == "nccl":
            # NCCL reads it when its first communicator is made.
            os.environ.setdefault("NCCL_SOCKET_IFNAME", self.interface)
            _prepare_nccl()
        # Installed first, so that SIGTERM while connecting means "leave", not death.
        previous = None
        if self.handle_sigterm and threading.current_thread() is threading.main_thread():
            previous = signal.signal(signal.SIGTERM, lambda *_: self._leave.set())
        try:
            self._rendezvous = Rendezvous(
                self.rendezvous,
                self.job_id,
                min_workers=self.min_workers,
                max_workers=self.max_workers,
                join_timeout_s=self.join_timeout_s,
                last_call_s=self.last_call_s,
                keep_alive_s=self.keep_alive_s,
                keep_alive_attempts=self.keep_alive_attempts,
                store_timeout_s=self.store_timeout_s,
                probe_address=network.interface_address(self.interface),
            )
            _log.info(
                "vflow elastic: job %r on the store at %s; collectives on interface %s",
                self.job_id,
                self.rendezvous,
                self.interface,
            )
            try:
                return self._run(self._rendezvous, make_executor, train_step, steps)
            except BaseException:
                self._rendezvous.leave()
                raise
        finally:
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)
            self._rendezvous = None

    # ---- the state machine (Note [Elastic state machine]) --------------------------

    def _run(
        self, rdzv: Rendezvous, make_executor: MakeExecutor, train_step: TrainStep, steps: int
    ) -> Executor | None:
        ex = self._build(make_executor)
        member = False  # whether ex has trained in this job (Note [Joining ahead])
        outcome = _Outcome("start", time.monotonic())
        failures = 0
        need_round = False  # a new round, even if the job runs (a fallback)
        while True:
            if not member and self._leave.is_set():
                _log.info("vflow elastic: asked to leave job %r before joining it", self.job_id)
                rdzv.close()
                return None
            if need_round or not self._started():
                try:
                    joined = self._round(rdzv, ex, member)
                except _LeftOut:
                    self._say_left_out()
                    outcome = dataclasses.replace(outcome, reason="crash", left_out=True)
                    need_round = False
                    continue
                except (CollectiveError, _RoundRefused) as e:
                    failures += 1
                    if failures > self.max_recoveries:
                        raise RuntimeError(
                            f"job {self.job_id!r}: {failures} rounds in a row failed to form a "
                            f"worker set; the last error: {e}"
                        ) from e
                    if isinstance(e, _RoundRefused):
                        _log.log(e.level, "vflow elastic: %s; forming the next round", e)
                    else:
                        who, why = self._lost_words(e)
                        _log.warning(
                            "vflow elastic: %s while a round formed%s; re-forming the worker set",
                            who,
                            why,
                        )
                        _log.debug("vflow elastic: forming a round: %s", e)
                    outcome = dataclasses.replace(outcome, reason="crash")
                    need_round = True
                    continue
            else:
                try:
                    joined = self._knock(rdzv, ex, member)
                except _LeftOut:
                    self._say_left_out()
                    continue
                except _RoundRefused as e:
                    _log.log(e.level, "vflow elastic: %s; forming the next round", e)
                    need_round = True
                    continue
            if joined is None:
                if not member:
                    _log.info(
                        "vflow elastic: job %r finished before this worker joined", self.job_id
                    )
                    rdzv.close()
                    return None
                # It was out of the worker set (left out, dropped) and asked to join
                # again: the job is done, by the others, and this worker's state is old.
                _log.warning(
                    "vflow elastic: job %r finished while this worker was out of its worker "
                    "set (this worker stopped at step %d of %d; the others' state is the job's)",
                    self.job_id,
                    ex.step_count,
                    steps,
                )
                rdzv.close()
                return None
            workers, members = joined
            member, failures, need_round = True, 0, False
            rnd = workers.round
            if outcome.reason == "crash" and outcome.workers:
                self._say_recovered(outcome, ex, members)
            if outcome.reason == "grow" and ex.world_size == outcome.workers:
                _say_nobody_joined(ex)
            else:
                self._record(outcome, ex, rnd.number)
            while True:
                outcome, workers = self._train(rdzv, workers, ex, train_step, steps)
                if outcome.reason in ("grow", "few"):
                    try:
                        grown = self._admit(rdzv, workers, ex, wait=outcome.reason == "few")
                    except _LeftOut:
                        self._say_left_out()
                        outcome = dataclasses.replace(outcome, reason="crash", left_out=True)
                        break
                    if grown is None:
                        need_round = True  # only the rendezvous' wait list: a new round
                        break
                    if len(grown.ranks) > len(workers.ranks):
                        self._record(dataclasses.replace(outcome, reason="grow"), ex, rnd.number)
                    elif grown is not workers:
                        _say_nobody_joined(ex)
                    workers = grown
                    continue
                if outcome.reason != "crash" or outcome.evicted:
                    break
                try:
                    recovered = self._recover(rdzv, workers, ex, newcomers=())
                except _LeftOut:
                    self._say_left_out()
                    outcome = dataclasses.replace(outcome, left_out=True)
                    break
                if recovered is None:
                    need_round = True  # out of attempts: all of them form a new round
                    break
                workers = recovered
                self._say_recovered(outcome, ex, ex.world_size)
                self._record(outcome, ex, rnd.number)
                if ex.world_size < self.min_workers:
                    try:
                        grown = self._admit(rdzv, workers, ex, wait=True)
                    except _LeftOut:
                        self._say_left_out()
                        outcome = dataclasses.replace(outcome, left_out=True)
                        break
                    if grown is None:
                        need_round = True
                        break
                    workers = grown
                    self._record(_Outcome("grow", time.monotonic()), ex, rnd.number)
            if outcome.reason == "done":
                self._record(outcome, ex, rnd.number)
                rdzv.finish()
                return ex
            if outcome.reason == "left":
                rdzv.leave()
                _log.info("vflow elastic: left job %r at step %d", self.job_id, ex.step_count)
                return ex

    def _round(self, rdzv: Rendezvous, ex: Executor, member: bool) -> tuple[_Workers, int] | None:
        """A new rendezvous round and the worker set it forms (the job's start, or a
        fallback: Note [Elastic state machine]); None when the job finished first.
        Raises CollectiveError or _RoundRefused when the set failed to form."""
        try:
            rnd = rdzv.next_round()
        except (RendezvousClosedError, RendezvousGracefulExitError):
            return None
        except RendezvousTimeoutError as e:
            self._give_up(ex if member else None, e)
        except (RendezvousConnectionError, RendezvousStateError, dist.DistError) as e:
            self._store_lost(ex if member else None, e, "joining the next round")
        return self._form(rdzv, rnd, ex, member)

    def _knock(self, rdzv: Rendezvous, ex: Executor, member: bool) -> tuple[_Workers, int] | None:
        """Note [Joining a running job]: asks the running worker set to take this worker
        in; returns the set it joined and how many members it had, or None when the job
        finished first."""
        try:
            answer = rdzv.knock(self.join_timeout_s)
        except RendezvousTimeoutError as e:
            why = (
                str(e)
                if "cannot reach" in str(e)
                else f"its worker set is full: max_workers={self.max_workers}, at most V "
                "workers; or it is not training"
            )
            raise JoinRefused(
                f"job {self.job_id!r} did not take this worker in within join_timeout_s="
                f"{self.join_timeout_s:g} s ({why})"
            ) from None
        except (RendezvousConnectionError, RendezvousStateError, dist.DistError) as e:
            self._store_lost(ex if member else None, e, "asking to join the running job")
        if answer is None:
            return None
        rnd = rdzv.adopt(str(answer["prefix"]), int(answer["round"]), int(answer["rank"]))
        if answer.get("record") is not None:
            rdzv.joined(answer["record"])
        workers = _Workers(rnd, list(answer["ranks"]), int(answer["generation"]))
        newcomers = tuple(answer["newcomers"])
        joined = self._join_set(rdzv, workers, ex, member, newcomers)
        if joined is None:
            raise _RoundRefused(
                f"the worker set of job {self.job_id!r} failed to form {self.max_recoveries} times",
                logging.WARNING,
            )
        return joined, len(joined.ranks) - len(newcomers)

    def _admit(
        self, rdzv: Rendezvous, workers: _Workers, ex: Executor, wait: bool
    ) -> _Workers | None:
        """Note [Joining a running job], the members' side: lets the workers that
        knocked into the worker set; returns the set (``workers`` itself when nobody
        knocked after all), or None when workers wait on the rendezvous' wait list
        instead (they need a new round). With ``wait`` (too few workers), it waits for
        one up to ``join_timeout_s``."""
        rnd = workers.round
        room = min(self.max_workers, ex.virtual_nodes) - len(workers.ranks)
        deadline = time.monotonic() + self.join_timeout_s
        try:
            tickets = rdzv.pending(room)
            while wait and not tickets:
                if time.monotonic() > deadline:
                    self._give_up(ex, TimeoutError("no worker asked to join"))
                time.sleep(_RECOVERY_POLL_S)
                tickets = rdzv.pending(room)
            # One decision for all members, whatever each one saw: who comes in, or
            # whether only the rendezvous' wait list has workers (they need a round).
            # Its key names the step, which all members act after: a set that let nobody
            # in after one step may let someone in after a later one.
            ranks = _newcomer_ranks(rnd.store, workers.ranks, len(tickets))
            proposal = {
                "tickets": tickets,
                "ranks": ranks,
                "round": not tickets and rdzv.wait_list() > 0,
            }
            key = f"vflow/admit{workers.generation}/{ex.step_count}"
            decision = json.loads(rnd.store.compare_set(key, "", json.dumps(proposal)))
            decided = [int(t) for t in decision["tickets"]]
            if not decided:
                return None if decision["round"] else workers
            newcomers = [int(r) for r in decision["ranks"]]
            grown = workers.successor(workers.ranks + newcomers)
            answer = {
                "round": rnd.number,
                "prefix": rnd.prefix,
                "ranks": grown.ranks,
                "generation": grown.generation,
                "record": rdzv.lineage,
                "newcomers": newcomers,
            }
            rdzv.answer(decided, [dict(answer, rank=r) for r in newcomers])
        except dist.DistError as e:
            self._store_lost(ex, e, "letting a new worker in")
        _log.info(
            "vflow elastic: %d worker(s) asked to join; taking them in at step %d",
            len(decided),
            ex.step_count,
        )
        return self._join_set(rdzv, grown, ex, True, tuple(newcomers))

    def _build(self, make_executor: MakeExecutor) -> Executor:
        """Note [Joining ahead]: the executor, built before this worker asks to join."""
        with warnings.catch_warnings():
            # plan="auto" warns that one process has nothing to plan: this one will have.
            warnings.filterwarnings("ignore", message="plan='auto' on a single process")
            ex = make_executor(single_group(timedelta(seconds=self.timeout_s)), self.timeout_s)
        if not isinstance(ex, Executor):
            raise TypeError(f"make_executor must return a vflow.Executor, got {type(ex).__name__}")
        return ex

    def _form(
        self, rdzv: Rendezvous, rnd: Round, ex: Executor, member: bool
    ) -> tuple[_Workers, int]:
        """Moves ``ex`` onto the round's worker set; returns it, and how many of the
        round's workers were members of the job before it. Newcomers that the members
        refuse (Note [Refusing newcomers], vflow/world/membership.py) or that fail while
        the set forms are left out, and the members go on without them; a refused
        newcomer raises JoinRefused."""
        workers = _Workers(rnd, list(range(rnd.world_size)))
        group = self._group(rnd, workers.name, None)
        world = World(group, timedelta(seconds=self.timeout_s))
        mine = [int(member), ex.virtual_nodes]
        rows = world.gather_ints(mine, "checking the round's members", None)
        del world
        members = [rank for rank, (is_member, _) in enumerate(rows) if is_member]
        virtual_nodes = rows[members[0]][1] if members else ex.virtual_nodes
        if rnd.world_size > virtual_nodes:
            # Every worker needs a VN: newcomers beyond V are refused (they end with this
            # error), and the round is formed again without them.
            newcomers = [rank for rank in range(rnd.world_size) if rank not in members]
            refused = newcomers[virtual_nodes - len(members) :]
            if rnd.rank in refused:
                raise JoinRefused(
                    f"job {self.job_id!r} runs V={virtual_nodes} virtual nodes, at most one "
                    f"worker each, and has {len(members)} worker(s): this worker is not "
                    "needed (pass max_workers <= V to make extra workers wait instead)"
                )
            raise _RoundRefused(
                f"round {rnd.number} of job {self.job_id!r} has {rnd.world_size} workers for "
                f"V={virtual_nodes}; the workers beyond V were refused (keep max_workers <= V)",
                logging.WARNING,
            )
        claimed = None
        if not members:
            # A new job, unless another worker set holds its record: the job's members
            # are on their way to a later round, or gone, or the store restarted and
            # they re-registered it. Never start a running job over (Note [Fencing a
            # job], vflow/elastic/record.py).
            try:
                claimed = rdzv.claim(rnd.prefix)
            except (dist.DistError, RendezvousConnectionError) as e:
                self._store_lost(None, e, "starting the job")
            if claimed["lineage"] != rnd.prefix:
                raise _RoundRefused(
                    f"round {rnd.number} of job {self.job_id!r} has no member of the running "
                    "job (they are on their way to a later round)",
                    logging.INFO,
                )
        elif rdzv.lineage is None:
            current = rdzv.record()
            if current is not None:
                rdzv.joined(current)
        newcomers = tuple(r for r in workers.ranks if r not in members)
        joined = self._join_set(rdzv, workers, ex, member, newcomers, group)
        if joined is None:
            if claimed is not None:  # nobody trained: the next round claims it again
                rdzv.release(rnd.prefix)
            raise _RoundRefused(
                f"the worker set of round {rnd.number} of job {self.job_id!r} failed to form "
                f"{self.max_recoveries} times",
                logging.WARNING,
            )
        return joined, len(members)

    def _join_set(
        self,
        rdzv: Rendezvous,
        workers: _Workers,
        ex: Executor,
        member: bool,
        newcomers: tuple[int, ...],
        group: dist.ProcessGroup | None = None,
    ) -> _Workers | None:
        """Moves ``ex`` onto ``workers`` (every one of them calls this; ``group``: theirs
        if already built); returns the set it ended on, or None when a failure while it
        formed could not be recovered from within the round (a new round). Newcomers that
        the members refuse (Note [Refusing newcomers], vflow/world/membership.py) or that
        fail while the set forms are left out, and the members go on without them; a
        refused newcomer raises JoinRefused, a member left out _LeftOut."""
        rnd = workers.round
        while True:
            failed = False
            try:
                # A newcomer that died after its answer never connects: the group's
                # creation times out, a failure like any other while the set forms.
                if group is None:
                    group = self._group(rnd, workers.name, workers.ranks)
                self._move(ex, group, newcomer=not member)
                self._publish(rdzv, ex, workers)
                break
            except RefusedNewcomers as e:
                refused = [workers.ranks[r] for r in e.ranks]
                if rnd.rank in refused:
                    raise JoinRefused(f"job {self.job_id!r}: {e}") from None
                _log.warning("vflow elastic: %s; going on without them", e)
                workers = workers.without(refused)
            except CollectiveError as e:
                _log.warning(
                    "vflow elastic: a worker failed while the worker set formed; the others "
                    "re-form it without that worker"
                )
                _log.debug("vflow elastic: round %d: %s", rnd.number, e)
                failed = True
            # Before any wait: the group's connections close only with its last reference.
            if group is not None:
                self._discard(group)
            group = None
            if failed:
                too_late = JoinRefused(
                    f"job {self.job_id!r}: this worker did not join the worker set within the "
                    f"join deadline (timeout_s={self.timeout_s:g} s); the members went on "
                    "without it"
                )
                try:
                    recovered = self._recover(rdzv, workers, ex, newcomers)
                except _LeftOut:
                    if rnd.rank in newcomers:
                        raise too_late from None
                    raise
                if recovered is None and rnd.rank in newcomers:
                    raise too_late
                return recovered
        return workers

    def _recover(
        self, rdzv: Rendezvous, workers: _Workers, ex: Executor, newcomers: tuple[int, ...]
    ) -> _Workers | None:
        """Note [Recovering within the round]: the survivors of a failed collective form
        their worker set again in the same round; returns it, or None when they could
        not within ``max_recoveries`` attempts (then a new round). Raises _LeftOut when
        the others went on without this worker."""
        self._nccl_group = None
        ex.abort_group()
        try:
            return self._agree(rdzv, workers, ex, newcomers)
        except dist.DistError as e:
            self._store_lost(ex, e, "the survivors of a failure agreed on who is left")

    def _agree(
        self, rdzv: Rendezvous, workers: _Workers, ex: Executor, newcomers: tuple[int, ...]
    ) -> _Workers | None:
        rnd = workers.round
        store = rnd.store
        for attempt in range(self.max_recoveries):
            prefix = f"vflow/recover{workers.generation}"
            store.set(f"{prefix}/alive/{rnd.rank}", rdzv.probe_endpoint)
            waited_for = [r for r in workers.ranks if r not in newcomers]
            survivors = self._answers(rdzv, workers, f"{prefix}/alive", waited_for)
            reach = self._reach(rdzv, workers, prefix, survivors)
            proposal = _connected([r for r in workers.ranks if r in reach], reach)
            decided = json.loads(store.compare_set(f"{prefix}/decision", "", json.dumps(proposal)))
            if rnd.rank not in decided:
                raise _LeftOut
            workers = workers.successor(decided)
            group = None
            try:
                group = self._group(rnd, workers.name, workers.ranks)
                self._move(ex, group)
                self._publish(rdzv, ex, workers)
                return workers
            except CollectiveError as e:
                if group is not None:
                    self._discard(group)
                group = None
                _log.warning(
                    "vflow elastic: a worker failed while the survivors re-formed the worker "
                    "set (attempt %d); trying again",
                    attempt + 1,
                )
                _log.debug("vflow elastic: recovery: %s", e)
                ex.abort_group()
            newcomers = ()
        return None

    def _answers(
        self, rdzv: Rendezvous, workers: _Workers, prefix: str, waited_for: list[int]
    ) -> list[int]:
        """The workers of ``workers`` that wrote ``prefix/<rank>``, in the set's order,
        once every worker of ``waited_for`` has either written or is gone (its beats
        stopped: Note [Beats], vflow/elastic/rendezvous.py), within ``timeout_s``. Others
        (newcomers) are not waited for: one that has not answered when the others are
        settled is left out (a slow joiner never stalls the job)."""
        store = workers.round.store
        deadline = time.monotonic() + self.timeout_s
        last: dict[int, tuple[int, float]] = {}
        while True:
            answered = [r for r in workers.ranks if store.check([f"{prefix}/{r}"])]
            pending = [r for r in waited_for if r not in answered]
            now = time.monotonic()
            if pending:
                for r, beat in rdzv.beats(pending).items():
                    if r not in last or last[r][0] != beat:
                        last[r] = (beat, now)
                pending = [r for r in pending if now - last[r][1] < GONE_AFTER_S]
            if not pending or now > deadline:
                return answered
            time.sleep(_RECOVERY_POLL_S)

    def _reach(
        self, rdzv: Rendezvous, workers: _Workers, prefix: str, survivors: list[int]
    ) -> dict[int, list[int]]:
        """Note [Recovering within the round], step 3: which survivors each survivor
        reaches (Note [Probing a peer], vflow/world/network.py), for those that said."""
        store, me = workers.round.store, workers.round.rank
        others = [r for r in survivors if r != me]
        endpoints = [store.get(f"{prefix}/alive/{r}").decode() for r in others]
        mine = [me] + [r for r, ok in zip(others, network.reachable(endpoints)) if ok]
        store.set(f"{prefix}/reach/{me}", json.dumps(mine))
        said = self._answers(rdzv, workers, f"{prefix}/reach", survivors)
        return {r: json.loads(store.get(f"{prefix}/reach/{r}")) for r in said}

    @staticmethod
    def _publish(rdzv: Rendezvous, ex: Executor, workers: _Workers) -> None:
        """The set's lowest member says who is in it, for knockers to probe (Note
        [Probing a peer], vflow/world/network.py); training goes on without the store."""
        if ex.rank == 0:
            try:
                rdzv.publish_members(workers.ranks)
            except dist.DistError:
                pass

    def _move(self, ex: Executor, group: dist.ProcessGroup, newcomer: bool = False) -> None:
        """``ex`` onto ``group`` (Note [Joining a worker set]); on NCCL, the group it
        leaves is shut down (Note [NCCL rounds])."""
        ex.reconfigure(group, timeout=self.timeout_s, catch_up=True, newcomer=newcomer)
        if self.backend == "nccl":
            previous, self._nccl_group = self._nccl_group, group
            if previous is not None:
                previous.shutdown()

    def _discard(self, group: dist.ProcessGroup) -> None:
        """A group that will not be used: NCCL's communicators need an abort (Note [NCCL
        rounds]); Gloo's sockets close with the last reference."""
        if self.backend == "nccl":
            group.abort()

    def _group(self, rnd: Round, name: str, ranks: list[int] | None) -> dist.ProcessGroup:
        start = time.monotonic()
        try:
            return round_group(
                rnd,
                timedelta(seconds=self.timeout_s),
                backend=self.backend,
                name=name,
                ranks=ranks,
                interface=self._gloo_interface,
            )
        except RuntimeError as e:  # a peer that never connected: dead or hung
            outcome = failure_words(str(e), time.monotonic() - start, self.timeout_s)
            raise CollectiveError(
                f"creating the process group of round {rnd.number} ({name}) {outcome}: {e}"
            ) from e

    def _started(self) -> bool:
        """Whether the job has a record (Note [Fencing a job], vflow/elastic/record.py):
        then newcomers knock."""
        if self._rendezvous is None:
            raise RuntimeError("ElasticJob is not running")
        try:
            return self._rendezvous.record() is not None
        except dist.DistError:
            return False  # the store lost: next_round says so

    def _train(
        self,
        rdzv: Rendezvous,
        workers: _Workers,
        ex: Executor,
        train_step: TrainStep,
        steps: int,
    ) -> tuple[_Outcome, _Workers]:
        """Trains on ``workers`` until an event; returns it and the worker set then
        (smaller after leaves)."""
        rnd = workers.round
        while ex.step_count < steps:
            fenced = rdzv.fenced()
            if fenced is not None:
                self._save_and_raise(
                    ex,
                    RuntimeError("fenced"),
                    f"the store at {self.rendezvous} gives the job to another worker set "
                    f"(record {fenced}) that claimed it while this set could not reach the "
                    f"store; this worker set stopped at step {ex.step_count} (Note [Fencing a "
                    "job] in vflow/elastic/record.py)",
                    "",
                )
            if rdzv.evicted():
                _log.warning(
                    "vflow elastic: this worker's heartbeats lapsed and round %d dropped it; "
                    "re-forming the worker set",
                    rnd.number,
                )
                # Its group goes at once (Note [Recovering within the round]): a peer
                # still blocked on it fails now, not at its timeout.
                self._nccl_group = None
                ex.abort_group()
                return _Outcome("crash", time.monotonic(), ex.world_size, evicted=True), workers
            # A full worker set does not look at who waits (they wait for a place).
            room = len(workers.ranks) < min(self.max_workers, ex.virtual_nodes)

            def word(room: bool = room) -> int:
                # Read by the step as late as it can send it: a knock or a SIGTERM
                # that arrives during its forward passes acts after this step.
                waiting = WAITING if room and rdzv.waiting() else 0
                return waiting | (LEAVE if self._leave.is_set() else 0)

            ex.signal(word)
            step = ex.step_count
            try:
                result = train_step(ex, step)
            except CollectiveError as e:
                who, why = self._lost_words(e)
                _log.warning(
                    "vflow elastic: %s during step %d%s; re-forming the worker set", who, step, why
                )
                _log.debug("vflow elastic: step %d: %s", step, e)
                return _Outcome("crash", time.monotonic(), ex.world_size, step), workers
            if not isinstance(result, StepResult) or ex.step_count != step + 1:
                raise RuntimeError(
                    "train_step(ex, step) must run exactly one ex.step(...) and return its "
                    f"StepResult; got {type(result).__name__} with the step count going from "
                    f"{step} to {ex.step_count}"
                )
            seen = time.monotonic()
            leavers = [r for r, w in enumerate(result.signals) if w & LEAVE]
            if leavers:
                if ex.rank in leavers:
                    return _Outcome("left", seen), workers
                workers = workers.without([workers.ranks[r] for r in leavers])
                try:
                    group = self._group(rnd, workers.name, workers.ranks)
                    self._move(ex, group)
                except CollectiveError as e:
                    who, why = self._lost_words(e)
                    _log.warning(
                        "vflow elastic: %s while the others shrank the worker set after step "
                        "%d%s; re-forming it",
                        who,
                        step,
                        why,
                    )
                    _log.debug("vflow elastic: shrinking after step %d: %s", step, e)
                    return _Outcome("crash", seen, len(workers.ranks)), workers
                self._publish(rdzv, ex, workers)
                self._record(_Outcome("leave", seen), ex, rnd.number)
                if ex.world_size < self.min_workers:
                    return _Outcome("few", time.monotonic(), ex.world_size), workers
                continue
            if any(w & WAITING for w in result.signals):
                return _Outcome("grow", seen, ex.world_size), workers
        return _Outcome("done", time.monotonic()), workers

    @staticmethod
    def _say_left_out() -> None:
        _log.warning(
            "vflow elastic: the others went on without this worker (it answered after they "
            "had agreed on who is left); joining the job again"
        )

    def _lost_words(self, error: CollectiveError) -> tuple[str, str]:
        """Who failed, and why when it was a timeout (Note [Saying what a recovery
        does]): a collective that timed out cannot tell a hung worker from a lost one
        (a survivor may wait on another survivor that already left for the next round)."""
        if "timed out" in str(error):
            return "worker hung or lost", f" (no answer within the {self.timeout_s:g} s timeout)"
        return "worker lost", ""

    def _say_recovered(self, outcome: _Outcome, ex: Executor, members: int) -> None:
        lost = 0 if outcome.left_out else max(0, outcome.workers - members)
        workers = f"{ex.world_size} worker{'s' if ex.world_size != 1 else ''}"
        if lost:
            workers += f" ({lost} lost)"
        if outcome.left_out:
            _log.info("vflow elastic: joined again at step %d with %s", ex.step_count, workers)
        elif outcome.failed_step is None:
            _log.info("vflow elastic: going on at step %d with %s", ex.step_count, workers)
        elif ex.step_count == outcome.failed_step:
            _log.info("vflow elastic: redoing step %d with %s", ex.step_count, workers)
        else:
            # A member committed the failed step before the group broke; the others
            # received its state (catch_up).
            _log.info(
                "vflow elastic: step %d was committed before the failure; going on at step "
                "%d with %s",
                outcome.failed_step,
                ex.step_count,
                workers,
            )

    def _record(self, outcome: _Outcome, ex: Executor, round_number: int) -> None:
        # "few": the leave was recorded when it happened; this round brought joiners.
        reason = {"done": "finish", "few": "grow"}.get(outcome.reason, outcome.reason)
        event = Event(
            ex.step_count, round_number, ex.world_size, reason, time.monotonic() - outcome.seen
        )
        self.events.append(event)
        _log.info(
            "vflow elastic: step %d, round %d, %d worker(s), %s, %.2f s",
            event.step,
            event.round,
            event.workers,
            event.reason,
            event.seconds,
        )

    def _store_lost(self, ex: Executor | None, error: Exception, doing: str) -> NoReturn:
        """Note [The store during a round]."""
        self._save_and_raise(
            ex,
            error,
            f"the rendezvous store at {self.rendezvous} cannot be reached while {doing} "
            f"({type(error).__name__}: {error})",
            " (pass checkpoint= to keep a worker's state when this happens)",
        )

    def _give_up(self, ex: Executor | None, error: Exception) -> NoReturn:
        self._save_and_raise(
            ex,
            error,
            f"fewer than min_workers={self.min_workers} workers for "
            f"{self.join_timeout_s:g} s (no round formed)",
            "",
        )

    def _save_and_raise(
        self, ex: Executor | None, error: Exception, what: str, unsaved: str
    ) -> NoReturn:
        """The job cannot go on for this worker: writes its state to ``checkpoint`` (if
        given, and if it has trained in the job) and raises a RuntimeError saying
        ``what`` happened and where the state is (``unsaved``: what to say when it was
        not written)."""
        saved = unsaved
        if ex is not None and self.checkpoint is not None:
            checkpoint_io.save_local(self.checkpoint, ex)
            saved = f"; this worker's state (step {ex.step_count}) is in {self.checkpoint!r}"
        raise RuntimeError(f"job {self.job_id!r}: {what}{saved}") from error


def _newcomer_ranks(store: dist.Store, ranks: list[int], count: int) -> list[int]:
    """Round ranks for ``count`` newcomers: negative (the round's own ranks are >= 0),
    never used before in the round, handed out by a counter in the round's store. A
    counter behind the set's own ranks (the store restarted and forgot it) first jumps
    past them."""
    used = int(store.add("vflow/newcomers", 0))
    behind = max(0, -min([0, *ranks]) - used)
    top = int(store.add("vflow/newcomers", behind + count))
    return [-(top - i) for i in range(count)]


def _connected(order: list[int], reach: dict[int, list[int]]) -> list[int]:
    """The workers of ``order`` taken one by one, each kept if it and every worker kept
    before it reach each other: a worker set whose every pair can talk (Note
    [Recovering within the round])."""
    kept: list[int] = []
    for r in order:
        if all(k in reach[r] and r in reach[k] for k in kept):
            kept.append(r)
    return kept


def _say_nobody_joined(ex: Executor) -> None:
    # Every newcomer was refused or failed: the worker set did not change.
    _log.info(
        "vflow elastic: nobody joined; going on at step %d with the same %d worker(s)",
        ex.step_count,
        ex.world_size,
    )


# Note [NCCL rounds]
# Every worker set of a job gets its own group, hence its own NCCL communicators, which
# (unlike Gloo's sockets) outlive the group's last Python reference: ElasticJob shuts a
# set's group down once the executor has moved on, and aborts it after a failure
# (Executor.abort_group). NCCL's watchdog by default (TORCH_NCCL_ASYNC_ERROR_HANDLING=3)
# kills the process when a collective fails or times out, before vflow could recover:
# an elastic job asks it to clean up only (2), unless the user chose otherwise. None of
# this has run here: it needs one GPU per worker (docs/design.md, Limits).
_NCCL_ERROR_HANDLING = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
_nccl_said = False


def _prepare_nccl() -> None:
    global _nccl_said
    chosen = os.environ.setdefault(_NCCL_ERROR_HANDLING, "2")
    if _nccl_said:
        return
    _nccl_said = True
    _log.warning(
        "vflow elastic on NCCL: untested on several GPUs (vflow's tests run Gloo); "
        "%s=%s%s; see docs/design.md, Limits",
        _NCCL_ERROR_HANDLING,
        chosen,
        ""
        if chosen in ("0", "2")
        else " makes NCCL's watchdog kill a worker whose collective fails, before vflow "
        "can recover: set it to 2",
    )


def _interface(host: str, port: int, interface: str | None) -> tuple[str, str | None]:
    """Note [The interface that reaches the store] (vflow/world/network.py): the
    interface the job's collectives use, and the one to give Gloo (None when
    ``GLOO_SOCKET_IFNAME`` chooses: Gloo reads it itself, lists of names included)."""
    if interface is not None:
        return network.check_interface(interface, "interface"), interface
    chosen = os.environ.get("GLOO_SOCKET_IFNAME", "")
    if chosen:
        names = [network.check_interface(n, "GLOO_SOCKET_IFNAME") for n in chosen.split(",")]
        return names[0], None
    try:
        name = network.route_interface(host, port)[0]
    except RuntimeError as e:
        raise ValueError(f"rendezvous: {e}") from None
    return name, name


def _positive(value: Any) -> bool:
    return (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(value)
        and value > 0
    )
