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

ROUND  ``next_round`` (join, or re-join after an event) until the rendezvous completes
       a round; build its process group; a member checks the worker set
       (``reconfigure(catch_up=True)``), a newcomer builds its executor on it and
       receives the state (Note [Joining a worker set]). A round without any member of
       a job that has started is refused and retried (the members are still on their
       way), so newcomers never start the job over. → TRAIN; a collective failure here
       → ROUND again (a second failure during recovery).
TRAIN  before each step the worker's signal word says whether it sees workers waiting
       to join (WAITING) and whether it was asked to leave (LEAVE); the words travel in
       the step's statistics (``Executor.signal``), so every member reads all of them
       at the same step. After the step:
       - any LEAVE: leavers leave the rendezvous and return; the others shrink to a
         group of the same round without them (no new round) → TRAIN, or → ROUND when
         fewer than ``min_workers`` remain;
       - else any WAITING → ROUND (grow);
       - a CollectiveError (a peer died, hung past ``timeout_s``, or the group broke)
         → ROUND (crash). The failed step changed nothing on a worker that raised (the
         executor's contract), and the data position is the step count, so the same
         global batch is computed again under the new plan. A member that committed
         the step while another did not is ahead; catch_up makes the others receive
         its state.
DONE   ``steps`` reached: the rendezvous is closed (late joiners return None).

Fewer than ``min_workers`` after a failure: ROUND waits up to ``join_timeout_s`` for
joiners, then raises RuntimeError, after writing ``checkpoint`` (if given) with
``vflow.runtime.save_local``.

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
import logging
import math
import signal
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from vflow.elastic.rendezvous import (
    Rendezvous,
    RendezvousClosedError,
    RendezvousGracefulExitError,
    RendezvousTimeoutError,
    Round,
    parse_endpoint,
    round_group,
)
from vflow.runtime import checkpoint as checkpoint_io
from vflow.runtime.executor import Executor
from vflow.runtime.results import StepResult
from vflow.world.group import CollectiveError, World, failure_words

__all__ = ["LEAVE", "WAITING", "ElasticJob", "Event"]

WAITING = 1  # signal bit: this worker sees workers waiting to join
LEAVE = 2  # signal bit: this worker leaves after this step

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
            worker (SIGSTOP, a wedged host) stalls the others before they drop it.
            Gloo cannot abort a collective, so this is the only way a hang ends; keep it
            a few times the longest step.
        join_timeout_s: how long a round may take to form, e.g. while waiting for
            joiners after falling below ``min_workers``. It does not bound a newcomer's
            wait while the running job has no place for it.
        last_call_s: once a round has ``min_workers``, how long it waits for more.
        keep_alive_s / keep_alive_attempts: heartbeat period and the missed heartbeats
            after which a worker counts as dead; their product bounds crash recovery
            from below (Note [Rounds without restarts], vflow/elastic/rendezvous.py).
        store_timeout_s: bound on reaching the store.
        max_recoveries: failed rounds in a row before giving up.
        checkpoint: a file path; when the job cannot go on (too few workers), this
            worker writes its state there before raising.
        handle_sigterm: SIGTERM asks this worker to leave after its current step (only
            when ``run`` is called from the main thread).
        backend: "gloo" (CPU) or "nccl" (one GPU per worker).
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
    ) -> None:
        parse_endpoint(rendezvous)
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
        (pass ``process_group=group, timeout=timeout_s``); it runs once, in the first
        round this worker joins, and must build the same initial state on every worker.
        ``train_step(ex, step)`` runs exactly one ``ex.step`` on global batch ``step``
        (the data position is the step count: see ``VNBatchSampler.step_indices``) and
        returns its StepResult. It must not catch vflow.CollectiveError."""
        if not callable(make_executor):
            raise TypeError(f"make_executor must be callable, got {type(make_executor).__name__}")
        if not callable(train_step):
            raise TypeError(f"train_step must be callable, got {type(train_step).__name__}")
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise ValueError(f"steps must be an int >= 0, got {steps!r}")
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
        ex: Executor | None = None
        outcome = _Outcome("start", time.monotonic())
        failures = 0
        while True:
            if ex is None and self._leave.is_set():
                _log.info("vflow elastic: asked to leave job %r before joining it", self.job_id)
                rdzv.close()
                return None
            try:
                rnd = rdzv.next_round()
            except (RendezvousClosedError, RendezvousGracefulExitError):
                # Graceful exit: the job closed while this worker was on the wait list.
                if ex is None:
                    _log.info(
                        "vflow elastic: job %r finished before this worker joined", self.job_id
                    )
                    rdzv.close()
                    return None
                raise RuntimeError(
                    f"the rendezvous of job {self.job_id!r} was closed while this worker still "
                    f"had steps to run (step {ex.step_count} of {steps})"
                ) from None
            except RendezvousTimeoutError as e:
                self._give_up(ex, e)
            try:
                ex, members = self._form(rnd, ex, make_executor)
            except (CollectiveError, _RoundRefused) as e:
                failures += 1
                if failures > self.max_recoveries:
                    raise RuntimeError(
                        f"job {self.job_id!r}: {failures} rounds in a row failed to form a worker "
                        f"set; the last error: {e}"
                    ) from e
                if isinstance(e, _RoundRefused):
                    _log.log(e.level, "vflow elastic: %s; forming the next round", e)
                else:
                    who, why = self._lost_words(e)
                    _log.warning(
                        "vflow elastic: %s while round %d formed%s; re-forming the worker set",
                        who,
                        rnd.number,
                        why,
                    )
                    _log.debug("vflow elastic: round %d: %s", rnd.number, e)
                outcome = dataclasses.replace(outcome, reason="crash")
                continue
            failures = 0
            if outcome.reason == "crash" and outcome.workers:
                self._say_recovered(outcome, ex, members)
            self._record(outcome, ex, rnd.number)
            outcome = self._train(rdzv, rnd, ex, train_step, steps)
            if outcome.reason == "done":
                self._record(outcome, ex, rnd.number)
                rdzv.finish()
                return ex
            if outcome.reason == "left":
                rdzv.leave()
                _log.info("vflow elastic: left job %r at step %d", self.job_id, ex.step_count)
                return ex

    def _form(
        self, rnd: Round, ex: Executor | None, make_executor: MakeExecutor
    ) -> tuple[Executor, int]:
        """This worker's executor on the round's group, and how many of the round's
        workers were members of the job before it."""
        group = self._group(rnd, "main", None)
        world = World(group, timedelta(seconds=self.timeout_s))
        started_key = f"vflow/{self.job_id}/started"
        mine = [int(ex is not None), 0 if ex is None else ex.virtual_nodes]
        rows = world.gather_ints(mine, "checking the round's members", None)
        members = [rank for rank, (member, _) in enumerate(rows) if member]
        if not members and self._job_store().check([started_key]):
            # The job's members are still on their way to this round (or gone): never
            # start a running job over (Note [Elastic state machine]).
            raise _RoundRefused(
                f"round {rnd.number} of job {self.job_id!r} has no member of the running job "
                "(they are on their way to a later round)",
                logging.INFO,
            )
        virtual_nodes = rows[members[0]][1] if members else world.size
        if world.size > virtual_nodes:
            # Every worker needs a VN: newcomers beyond V are refused (they end with this
            # error), and the round is formed again without them.
            newcomers = [rank for rank in range(world.size) if rank not in members]
            refused = newcomers[virtual_nodes - len(members) :]
            if world.rank in refused:
                raise RuntimeError(
                    f"job {self.job_id!r} runs V={virtual_nodes} virtual nodes, at most one "
                    f"worker each, and has {len(members)} worker(s): this worker is not "
                    "needed (pass max_workers <= V to make extra workers wait instead)"
                )
            raise _RoundRefused(
                f"round {rnd.number} of job {self.job_id!r} has {world.size} workers for "
                f"V={virtual_nodes}; the workers beyond V were refused (keep max_workers <= V)",
                logging.WARNING,
            )
        if ex is None:
            ex = make_executor(group, self.timeout_s)
            if not isinstance(ex, Executor):
                raise TypeError(
                    f"make_executor must return a vflow.Executor, got {type(ex).__name__}"
                )
        else:
            ex.reconfigure(group, timeout=self.timeout_s, catch_up=True)
        self._job_store().set(started_key, b"1")
        return ex, len(members)

    def _group(self, rnd: Round, name: str, ranks: list[int] | None) -> dist.ProcessGroup:
        start = time.monotonic()
        try:
            return round_group(
                rnd, timedelta(seconds=self.timeout_s), backend=self.backend, name=name, ranks=ranks
            )
        except RuntimeError as e:  # a peer that never connected: dead or hung
            outcome = failure_words(str(e), time.monotonic() - start, self.timeout_s)
            raise CollectiveError(
                f"creating the process group of round {rnd.number} ({name}) {outcome}: {e}"
            ) from e

    def _job_store(self) -> dist.Store:
        if self._rendezvous is None:
            raise RuntimeError("ElasticJob is not running")
        return self._rendezvous.store

    def _train(
        self, rdzv: Rendezvous, rnd: Round, ex: Executor, train_step: TrainStep, steps: int
    ) -> _Outcome:
        round_ranks = list(range(rnd.world_size))  # group rank -> rank in the round
        shrinks = 0
        while ex.step_count < steps:
            if rdzv.evicted():
                _log.warning(
                    "vflow elastic: this worker's heartbeats lapsed and round %d dropped it; "
                    "re-forming the worker set",
                    rnd.number,
                )
                return _Outcome("crash", time.monotonic(), ex.world_size)
            word = (WAITING if rdzv.waiting() else 0) | (LEAVE if self._leave.is_set() else 0)
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
                return _Outcome("crash", time.monotonic(), ex.world_size, step)
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
                    return _Outcome("left", seen)
                round_ranks = [rr for r, rr in enumerate(round_ranks) if r not in leavers]
                shrinks += 1
                try:
                    group = self._group(rnd, f"shrink{shrinks}", round_ranks)
                    ex.reconfigure(group, timeout=self.timeout_s, catch_up=True)
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
                    return _Outcome("crash", seen, len(round_ranks))
                self._record(_Outcome("leave", seen), ex, rnd.number)
                if ex.world_size < self.min_workers:
                    return _Outcome("few", time.monotonic(), ex.world_size)
                continue
            if any(w & WAITING for w in result.signals):
                return _Outcome("grow", seen, ex.world_size)
        return _Outcome("done", time.monotonic())

    def _lost_words(self, error: CollectiveError) -> tuple[str, str]:
        """Who failed, and why when it was a timeout (Note [Saying what a recovery
        does]): a collective that timed out cannot tell a hung worker from a lost one
        (a survivor may wait on another survivor that already left for the next round)."""
        if "timed out" in str(error):
            return "worker hung or lost", f" (no answer within the {self.timeout_s:g} s timeout)"
        return "worker lost", ""

    def _say_recovered(self, outcome: _Outcome, ex: Executor, members: int) -> None:
        lost = max(0, outcome.workers - members)
        workers = f"{ex.world_size} worker{'s' if ex.world_size != 1 else ''}"
        if lost:
            workers += f" ({lost} lost)"
        if outcome.failed_step is None:
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

    def _give_up(self, ex: Executor | None, error: Exception) -> None:
        saved = ""
        if ex is not None and self.checkpoint is not None:
            checkpoint_io.save_local(self.checkpoint, ex)
            saved = f"; this worker's state (step {ex.step_count}) is in {self.checkpoint!r}"
        raise RuntimeError(
            f"job {self.job_id!r}: fewer than min_workers={self.min_workers} workers for "
            f"{self.join_timeout_s:g} s (no round formed){saved}"
        ) from error


def _positive(value: Any) -> bool:
    return (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(value)
        and value > 0
    )
