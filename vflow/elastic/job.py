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

This module is the state machine; the protocols it drives live beside it and never
import it: the admission of newcomers (vflow/elastic/admission.py), the survivors'
agreement after a crash (vflow/elastic/agreement.py), the worker sets' process groups
(vflow/elastic/groups.py), and what a worker says, records and saves when it cannot go
on (vflow/elastic/reporting.py).

Note [Elastic state machine]
Every worker runs the same loop; all decisions are taken at step boundaries and from
values every member holds, so members never disagree on what happens next.

BUILD  the worker builds its executor alone, before it asks to join (Note [Joining
       ahead]). → KNOCK if the job runs, RESUME if it is suspended, else ROUND
RESUME the worker loads the suspended job's checkpoint into its executor and joins a
       round of the job's next generation (Note [Suspending a job]) → ROUND
KNOCK  the worker asks the running worker set to take it in and waits for its answer
       (Note [Joining a running job], vflow/elastic/admission.py); then as ROUND, on
       the set it was let into.
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
       (WAITING), whether it was asked to leave (LEAVE) and whether it was asked to
       suspend the job (SUSPEND), read as late as the step can send it; the words
       travel in the step's statistics (``Executor.signal``), so every member reads all
       of them at the same step. After the step:
       - any SUSPEND: the whole worker set stops at this step, its state saved once
         and the job's record suspended → SUSPENDED (Note [Suspending a job]);
       - any LEAVE: leavers leave the rendezvous and return; the others shrink to a
         group of the same round without them (no new round) → TRAIN; when fewer
         than ``min_workers`` remain, they wait for workers to knock;
       - else any WAITING: the members let in the workers that knocked, within the
         round (grow; Note [Joining a running job], vflow/elastic/admission.py), or,
         when only the rendezvous' wait list has workers (they came before the job
         started), → ROUND;
       - the job's record names another worker set (Note [Fencing a job]): this set
         trains no further step and stops with its checkpoint;
       - a CollectiveError (a peer died, hung past ``timeout_s``, or the group broke)
         → RECOVER (crash). The failed step changed nothing on a worker that raised
         (the executor's contract), and the data position is the step count, so the
         same global batch is computed again under the new plan. A member that
         committed the step while another did not is ahead; catch_up makes the others
         receive its state.
RECOVER the survivors form their worker set again within the round (Note [Recovering
       within the round], vflow/elastic/agreement.py) → TRAIN; a worker left out of it
       (it answered too late) → KNOCK, and comes back as a grow; out of attempts →
       ROUND (all of them).
DONE   ``steps`` reached: the rendezvous is closed (late joiners return None).
SUSPENDED the job's state is in its checkpoint and its record says suspended at this
       step; the rendezvous is closed (joiners return None, with ``job.suspended``);
       ``run`` returns the executor with ``job.suspended``. Workers started later from
       the checkpoint resume it (RESUME).

Note [Suspending a job]
A whole job stops with its state saved, and starts again later from it under the same
job id, on any number of workers, as if it had never stopped: Slurm's preemption,
``--requeue`` and time limits, or a preemptive scheduler. ``suspend()`` (or SIGUSR1,
with ``handle_sigterm``) sets SUSPEND in this worker's next signal word; after the step
in which any member's word has it, every member stops at that same step:

1. Rank 0 of the worker set writes the state to its ``checkpoint`` (``save_local``,
   vflow.save's atomic write: a temporary file, fsync, rename, fsync of the directory)
   and broadcasts whether it succeeded, so that after that collective every member
   knows the file is in place, or that it is not. One writer rather than every rank
   writing the same bytes: the state is written once whatever N (a thousand ranks
   rewriting one file on a shared filesystem would send a thousand copies through its
   server, their renames racing), and only rank 0 needs a path. The cost: on
   node-local disks the file is on rank 0's node only, and a worker that resumes
   elsewhere needs a copy, the rule vflow.load already has; a stale copy is caught
   there, the record saying which step the file must hold.
2. Each member marks the job's record suspended at the step count, compare-and-set
   from its lineage's running record, all proposing the same bytes (Note [Fencing a
   job], vflow/elastic/record.py); on a journaled store it waits until the journal
   holds it. That write is the suspension: before it the job runs (a failure in
   between leaves a running job with its checkpoint written and its workers gone, as
   if all had crashed), after it the job is suspended, even if a member then fails.
3. Each member shuts the generation's rendezvous down (Note [Resumed generations],
   vflow/elastic/rendezvous.py): workers waiting on its wait list, and knocking ones,
   which read the record, return None with ``job.suspended`` set. ``run`` returns the
   executor on every member, with ``job.suspended`` and the event "suspend".

On the way: a peer lost during the save's broadcast is a crash, and since every member
read the SUSPEND bit and keeps asking, the set re-formed without it suspends after its
next step; a save that fails (rank 0 without ``checkpoint``, a full disk) is logged at
ERROR on every member, the request is dropped, and the job trains on; a store that
cannot be reached while the record is written raises RuntimeError, as for any change of
the worker set (Note [The store during a round], vflow/elastic/reporting.py).

Resuming: a worker whose first look at the record finds the job suspended loads its own
``checkpoint`` into the executor it built (a missing path or file, or a file at another
step than the record's, is a RuntimeError naming the job, the step and the path) and
joins a round of the job's next generation. That generation's first round claims the
record back, compare-and-set from the suspended record, so that exactly one round
wins, as a new lineage; its workers, all holding the checkpoint's state, form the set
as members (their step counts are checked to agree, and no state is sent). Workers
coming later knock, or join from the wait list, and receive the state as usual. B, V
and the data position (the step count) are the job's, so it goes on bitwise as if
never stopped, on any number of workers. A worker that was waiting to join the
suspended generation (it had knocked, or been in a round) does not carry on into the
next one: it returns None, told that the job is suspended.

Note [Joining ahead]
Building a model, its optimizer and an Executor takes seconds in a fresh process (the
first optimizer imports torch._dynamo), more with CUDA or a big model. A worker does
it before it asks to join, on a group of its own (``single_group``), so the
members' stall for a grow is one agreement and the state sent to the newcomers, and a worker
slow to start never holds up a round. Its executor then joins with
``reconfigure(newcomer=True)``, which is what constructing it on the round's group
would have done.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import signal
import threading
import time
import warnings
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from vflow.elastic import record as records
from vflow.elastic.admission import Admission, JoinRefused, RoundRefused
from vflow.elastic.agreement import PARTNERLESS, LeftOut, Recovery
from vflow.elastic.groups import (
    AnyExecutor,
    Groups,
    WorkerSet,
    choose_interface,
    prepare_nccl,
    publish,
)
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
    single_group,
)
from vflow.elastic.replicas import Layout, Replicas, Workers
from vflow.elastic.reporting import (
    Event,
    Reporter,
    say_left_out,
    say_nobody_joined,
    say_recovered,
)
from vflow.pipeline.executor import PipelineExecutor
from vflow.pipeline.grid import ProcessGrid
from vflow.runtime import checkpoint as checkpoint_io
from vflow.runtime.executor import Executor
from vflow.runtime.results import StepResult
from vflow.world import network
from vflow.world.devices import local_gpu
from vflow.world.group import CollectiveError, World

__all__ = ["LEAVE", "SUSPEND", "WAITING", "ElasticJob", "Event", "JoinRefused"]

_UNCAPPED = 1 << 30  # the rendezvous' bound when max_workers is V (known later)
WAITING = 1  # signal bit: this worker sees workers waiting to join
LEAVE = 2  # signal bit: this worker leaves after this step
SUSPEND = 4  # signal bit: the whole job stops after this step, saved (Note [Suspending a job])

# make_executor(group, timeout_s), or with stages > 1 make_executor(grid, timeout_s).
MakeExecutor = Callable[[Any, float], AnyExecutor]
TrainStep = Callable[[Any, int], StepResult]

_log = logging.getLogger("vflow")


@dataclasses.dataclass(frozen=True)
class _Outcome:
    # "start", "resume", "done", "grow", "crash", "left", "few", "suspend" (this set
    # saves and stops) or "suspended" (the others of this set did, while it was out)
    reason: str
    seen: float  # time.monotonic() when this worker saw it
    workers: int = 0  # the size of this worker's worker set then (0: not a member yet)
    failed_step: int | None = None  # the step that raised CollectiveError, if one did
    evicted: bool = False  # the rendezvous dropped this worker: it asks to join again
    left_out: bool = False  # the survivors of a failure went on without this worker


@dataclasses.dataclass(frozen=True)
class _Protocols:
    """What the state machine drives during one ``run``, made from the job's settings
    when the run starts."""

    groups: Groups
    report: Reporter
    recovery: Recovery
    admission: Admission


class ElasticJob:
    """One worker's part of an elastic job; see the module docstring.

    Args:
        rendezvous: ``"HOST:PORT"`` of the store that ``python -m vflow rendezvous``
            hosts (one store serves many jobs).
        job_id: names the job on that store; every worker of the job passes the same.
        min_workers / max_workers: bounds on the worker count. A round forms once
            ``min_workers`` are there (after the last call); beyond ``max_workers``,
            workers wait (without a time limit) until a place is free or the job ends.
            ``min_workers`` defaults to 1 (``stages``, one replica, for a pipelined
            job); ``max_workers`` defaults to V (every worker needs a VN: a round with more
            workers than V refuses the newcomers beyond V, which raise RuntimeError).
        timeout_s: bound on every collective of the job's groups: how long a hung
            worker (SIGSTOP, a wedged host) stalls the others before they drop it.
            Keep it a few times the longest step; it does not grow with the workers.
        group_timeout_s: bound on creating a worker set's process group (Note
            [Bounds that grow with the set], vflow/elastic/groups.py); None (default):
            ``max(timeout_s, N * N / 10,000)`` seconds for a set of N workers, since
            creating a Gloo group costs every pair of workers a store request.
        join_deadline_s: how long the members wait for newcomers to connect to the
            grown set's group; a newcomer that has not joined within it is left out
            (JoinRefused) and the members go on. None (default): the group bound of
            the grown set.
        gone_after_s: a worker whose beats stood still this long is gone for the
            survivors of a failure (Note [Beats], vflow/elastic/rendezvous.py): a
            stopped worker or a host gone silent. A killed one is found sooner, its
            probe refusing connections. Longer: fewer live workers dropped when a
            host or the store is slow; shorter: a silent host costs less.
        join_timeout_s: how long a round may take to form, e.g. while waiting for
            joiners after falling below ``min_workers``. It does not bound a newcomer's
            wait while the running job has no place for it.
        last_call_s: once a round has ``min_workers``, how long it waits for more.
        keep_alive_s / keep_alive_attempts: heartbeat period and the missed heartbeats
            after which the rendezvous counts a worker as dead (Note [Rounds without
            restarts], vflow/elastic/rendezvous.py); crash recovery does not wait for
            them (Note [Recovering within the round], vflow/elastic/agreement.py).
        store_timeout_s: bound on reaching the store, and on any request to a store
            that went silent (Note [The store during a round],
            vflow/elastic/reporting.py).
        max_recoveries: how many times in a row the survivors of a failure may fail
            to re-form their worker set within the round (then they form a new round),
            and rounds may fail to form (then ``run`` gives up).
        checkpoint: a file path; when the job cannot go on (too few workers, the store
            lost during a change of the worker set), this worker writes its state there
            before raising. A suspended job's state is saved there by rank 0, and a
            worker started for a suspended job resumes it from there (Note [Suspending
            a job]): ``suspend`` needs it.
        handle_sigterm: SIGTERM asks this worker to leave after its current step, and
            SIGUSR1 asks the whole job to suspend (``suspend``; without ``checkpoint``
            it is logged and ignored), while ``run`` runs (only when it is called from
            the main thread; SIGUSR1 only where the program left it at its default
            action: a handler of the program's own stays, and ``suspend`` remains).
        backend: "gloo" (CPU) or "nccl" (one GPU per worker).
        gpu: with ``backend="nccl"``, the index of the visible GPU this worker uses,
            made its current device when ``run`` starts, before ``make_executor`` (build
            the model on ``self.device``). None (default): the launcher's,
            ``LOCAL_RANK`` (torchrun) or ``SLURM_LOCALID`` (Slurm), else the first
            visible (Note [A worker's GPU], vflow/world/devices.py).
        interface: the network interface the worker's collectives use (Gloo's, and
            NCCL's unless ``NCCL_SOCKET_IFNAME`` is set); default: ``GLOO_SOCKET_IFNAME``
            if set, else the interface that reaches the store (Note [The interface that
            reaches the store], vflow/world/network.py). ``self.interface`` is the one
            chosen.
        stages / stage: a pipelined job (Note [Replicas as members],
            vflow/elastic/replicas.py): every worker is one process of a replica of
            ``stages`` stages and holds ``stage`` for its whole life; ``make_executor``
            gets that stage's detached grid and builds a ``vflow.PipelineExecutor`` on
            it, and the worker sets are whole replicas, a process whose replica lost a
            stage waiting until a worker of that stage comes. ``min_workers`` and
            ``max_workers`` count processes (default ``max_workers``: V replicas).
            Suspending, and so ``checkpoint``, are not built for pipelines.

    The rendezvous' host must resolve and the interface exist: a ValueError naming
    either is raised here, before anything is started.
    """

    def __init__(
        self,
        rendezvous: str,
        job_id: str,
        *,
        min_workers: int | None = None,
        max_workers: int | None = None,
        timeout_s: float = 10.0,
        group_timeout_s: float | None = None,
        join_deadline_s: float | None = None,
        gone_after_s: float = GONE_AFTER_S,
        join_timeout_s: float = 600.0,
        last_call_s: float = 1.0,
        keep_alive_s: float = 0.5,
        keep_alive_attempts: int = 4,
        store_timeout_s: float = 30.0,
        max_recoveries: int = 20,
        checkpoint: str | None = None,
        handle_sigterm: bool = True,
        backend: str = "gloo",
        gpu: int | None = None,
        interface: str | None = None,
        stages: int = 1,
        stage: int | None = None,
    ) -> None:
        host, port = parse_endpoint(rendezvous)
        if isinstance(stages, bool) or not isinstance(stages, int) or stages < 1:
            raise ValueError(f"stages must be an int >= 1, got {stages!r}")
        if min_workers is None:
            min_workers = stages  # a replica
        elif isinstance(min_workers, int) and 1 <= min_workers < stages:
            raise ValueError(
                f"min_workers must be >= stages={stages} (a replica's processes), got {min_workers}"
            )
        if stages > 1:
            if isinstance(stage, bool) or not isinstance(stage, int) or not 0 <= stage < stages:
                raise ValueError(
                    f"stage must be this worker's stage, an int in [0, {stages}), with "
                    f"stages={stages}; got {stage!r}"
                )
            if checkpoint is not None:
                raise ValueError(
                    f"checkpoint={checkpoint!r} with stages={stages}: suspending a pipelined "
                    "job, and saving its state when it cannot go on, are not built; pass "
                    "checkpoint=None (a pipeline's state saves per stage with "
                    "vflow.pipeline.save)"
                )
        elif stage not in (None, 0):
            raise ValueError(f"stage={stage!r} needs stages > 1 (a pipelined job)")
        if not isinstance(job_id, str) or not job_id or any(c.isspace() for c in job_id):
            raise ValueError(f"job_id must be a non-empty string without spaces, got {job_id!r}")
        for name, value in (
            ("min_workers", min_workers),
            ("max_workers", 1 if max_workers is None else max_workers),
            ("keep_alive_attempts", keep_alive_attempts),
            ("max_recoveries", max_recoveries),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if max_workers is not None and max_workers < min_workers:
            raise ValueError(
                f"max_workers must be >= min_workers ({min_workers}), got {max_workers}"
            )
        for name, value in (
            ("timeout_s", timeout_s),
            ("group_timeout_s", 1.0 if group_timeout_s is None else group_timeout_s),
            ("join_deadline_s", 1.0 if join_deadline_s is None else join_deadline_s),
            ("gone_after_s", gone_after_s),
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
        if gpu is not None:
            if isinstance(gpu, bool) or not isinstance(gpu, int) or gpu < 0:
                raise ValueError(f"gpu must be an int >= 0 or None, got {gpu!r}")
            if backend != "nccl":
                raise ValueError(f"gpu={gpu} needs backend='nccl' (Gloo runs on the CPU)")
        network.resolve(host, "rendezvous")
        self.interface, self._gloo_interface = choose_interface(host, port, interface)
        self.rendezvous = rendezvous
        self.job_id = job_id
        self.min_workers = min_workers
        self.max_workers = max_workers
        self.timeout_s = float(timeout_s)
        self.group_timeout_s = None if group_timeout_s is None else float(group_timeout_s)
        self.join_deadline_s = None if join_deadline_s is None else float(join_deadline_s)
        self.gone_after_s = float(gone_after_s)
        self.join_timeout_s = float(join_timeout_s)
        self.last_call_s = float(last_call_s)
        self.keep_alive_s = float(keep_alive_s)
        self.keep_alive_attempts = keep_alive_attempts
        self.store_timeout_s = float(store_timeout_s)
        self.max_recoveries = max_recoveries
        self.checkpoint = checkpoint
        self.handle_sigterm = handle_sigterm
        self.backend = backend
        self.gpu = gpu
        # Where the executor's model lives: the CPU, or with NCCL this worker's GPU,
        # known once ``run`` chose it.
        self.device = torch.device("cpu")
        self.stages = stages
        self.stage = stage if stages > 1 else None
        self._layout: Layout = Workers() if self.stage is None else Replicas(stages, self.stage)
        self.events: list[Event] = []
        self._leave = threading.Event()
        self._suspend = threading.Event()
        # Whether the last ``run`` ended with the job suspended (this worker's set
        # suspended it, or it was told while it waited to join), and at which step.
        self.suspended = False
        self.suspended_step: int | None = None
        self._rendezvous: Rendezvous | None = None
        # Kept across runs: on NCCL it holds the group the executor a run returned is
        # on, which the next run shuts down once that executor moves on (Note [NCCL
        # rounds], vflow/elastic/groups.py).
        self._groups: Groups | None = None

    def leave(self) -> None:
        """Asks this worker to leave after its current step (safe from a signal
        handler or another thread); the others go on without it."""
        self._leave.set()

    def suspend(self) -> None:
        """Asks the whole job to stop after the current step, its state saved in the
        checkpoint, to be resumed later (Note [Suspending a job]); safe from a signal
        handler or another thread. Every worker's ``run`` returns at the same step with
        ``suspended`` set. Raises ValueError, asking nothing, when this job has no
        ``checkpoint`` or its directory does not exist."""
        refusal = self._suspend_refusal()
        if refusal is not None:
            raise ValueError(refusal)
        self._suspend.set()

    def _suspend_refusal(self) -> str | None:
        """Why this worker cannot ask to suspend the job, or None."""
        if self.checkpoint is None:
            return (
                f"job {self.job_id!r} cannot be suspended without a checkpoint: pass "
                "checkpoint= (--checkpoint), the file its state is saved to and resumed from"
            )
        directory = os.path.dirname(os.path.abspath(self.checkpoint))
        if not os.path.isdir(directory):
            return (
                f"job {self.job_id!r} cannot be suspended: the directory {directory!r} of its "
                f"checkpoint={self.checkpoint!r} does not exist"
            )
        return None

    def _suspend_on_signal(self, *_: Any) -> None:
        refusal = self._suspend_refusal()
        if refusal is not None:
            _log.error("vflow elastic: SIGUSR1 ignored: %s", refusal)
            return
        self._suspend.set()

    def waiting(self) -> int:
        """Workers waiting to join, as this worker last saw them: only the worker set's
        rank 0 watches for them (Note [One member watches the door],
        vflow/elastic/rendezvous.py), so this is 0 on the others (the set learns of them
        from rank 0 in the next step) and outside ``run``: pace on rank 0 alone."""
        return 0 if self._rendezvous is None else self._rendezvous.waiting()

    def run(
        self, make_executor: MakeExecutor, train_step: TrainStep, steps: int
    ) -> AnyExecutor | None:
        """Trains until the job has taken ``steps`` steps; returns this worker's executor
        (every worker's holds the same state), or None when the job finished before this
        worker could join. Returns early, with the executor, when this worker left, and
        on every worker when the job was suspended (``suspended`` is then True, and
        ``suspended_step`` the step; a worker told while it waited to join returns None
        with them). A job found suspended is resumed from ``checkpoint`` (Note
        [Suspending a job]): without it, or with the file missing or at another step,
        this raises RuntimeError naming the job, the step and the path.

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
            prepare_nccl()
            # Note [A worker's GPU]: before any group, which binds its rank to the device.
            index = local_gpu() if self.gpu is None else self.gpu
            if index >= torch.cuda.device_count():
                raise ValueError(
                    f"gpu={index}: this process sees {torch.cuda.device_count()} GPU(s)"
                )
            torch.cuda.set_device(index)
            self.device = torch.device("cuda", index)
        self.suspended, self.suspended_step = False, None
        # Installed first, so that SIGTERM while connecting means "leave", not death.
        previous: dict[int, Any] = {}
        if self.handle_sigterm and threading.current_thread() is threading.main_thread():
            previous[signal.SIGTERM] = signal.signal(signal.SIGTERM, lambda *_: self._leave.set())
            # Not on Windows; and a program that gave SIGUSR1 a use of its own keeps it.
            if hasattr(signal, "SIGUSR1") and signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL:
                previous[signal.SIGUSR1] = signal.signal(signal.SIGUSR1, self._suspend_on_signal)
        try:
            self._rendezvous = Rendezvous(
                self.rendezvous,
                self.job_id,
                min_workers=self.min_workers,
                # The default, V, is known once the executor is built (in _run); the
                # members' admission applies it, the round's bound stays open till then.
                max_workers=_UNCAPPED if self.max_workers is None else self.max_workers,
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
            for signum, handler in previous.items():
                if handler is not None:
                    signal.signal(signum, handler)
            self._rendezvous = None

    def _protocols(self, max_workers: int) -> _Protocols:
        """The protocols of one ``run``, on the job's settings as they are when it
        starts."""
        if self._groups is None:
            self._groups = Groups(
                self.backend, self.timeout_s, self._gloo_interface, stages=self.stages
            )
        groups = self._groups
        groups.timeout_s = self.timeout_s
        groups.group_timeout_s = self.group_timeout_s
        groups.join_deadline_s = self.join_deadline_s
        report = Reporter(
            self.job_id,
            self.rendezvous,
            self.events,
            checkpoint=self.checkpoint,
            min_workers=self.min_workers,
            join_timeout_s=self.join_timeout_s,
            timeout_s=self.timeout_s,
        )
        recovery = Recovery(
            groups,
            report,
            timeout_s=self.timeout_s,
            max_recoveries=self.max_recoveries,
            gone_after_s=self.gone_after_s,
            layout=self._layout,
        )
        admission = Admission(
            groups,
            recovery,
            report,
            job_id=self.job_id,
            max_workers=max_workers,
            join_timeout_s=self.join_timeout_s,
            max_recoveries=self.max_recoveries,
            layout=self._layout,
        )
        return _Protocols(groups, report, recovery, admission)

    # ---- the state machine (Note [Elastic state machine]) --------------------------

    def _run(
        self,
        rdzv: Rendezvous,
        make_executor: MakeExecutor,
        train_step: TrainStep,
        steps: int,
    ) -> AnyExecutor | None:
        ex = self._build(make_executor)
        # Known only now: the default max_workers is V, the executor's.
        max_workers = (
            ex.virtual_nodes * self.stages if self.max_workers is None else self.max_workers
        )
        if max_workers < self.min_workers:
            raise ValueError(
                f"max_workers defaults to V={max_workers}, below min_workers="
                f"{self.min_workers}: pass max_workers, or a smaller min_workers"
            )
        p = self._protocols(max_workers)
        member = False  # whether ex has trained in this job (Note [Joining ahead])
        # Whether ex holds the suspended job's state, loaded from the checkpoint, and
        # whether this worker has asked to join (a round, a knock): Note [Suspending a job].
        resumed = tried = False
        outcome = _Outcome("start", time.monotonic())
        failures = 0
        need_round = False  # a new round, even if the job runs (a fallback)
        while True:
            if not member and self._leave.is_set():
                _log.info("vflow elastic: asked to leave job %r before joining it", self.job_id)
                rdzv.close()
                return None
            record = self._record(rdzv)
            if record is not None and record["state"] == "suspended":
                if not member and not tried:
                    self._resume(ex, record)
                    resumed = True
                    outcome = _Outcome("resume", time.monotonic())
                # Its first look found the job suspended, or its generation's round
                # failed to form: the next generation's round (Note [Resumed
                # generations], vflow/elastic/rendezvous.py). Else it was waiting to join
                # the generation that was suspended.
                if not (resumed and rdzv.use_resumes(records.resumes(record) + 1)):
                    return self._told_suspended(rdzv, record, ex if member else None)
                need_round = True
            elif record is not None and not member:
                rdzv.use_resumes(records.resumes(record))
            tried = True
            if need_round or record is None:
                try:
                    joined = self._round(rdzv, p, ex, member, resumed)
                except LeftOut as e:
                    say_left_out(e)
                    outcome = dataclasses.replace(outcome, reason="crash", left_out=True)
                    need_round = False
                    continue
                except (CollectiveError, RoundRefused) as e:
                    failures += 1
                    if failures > self.max_recoveries:
                        raise RuntimeError(
                            f"job {self.job_id!r}: {failures} rounds in a row failed to form a "
                            f"worker set; the last error: {e}"
                        ) from e
                    if isinstance(e, RoundRefused):
                        _log.log(e.level, "vflow elastic: %s; forming the next round", e)
                    else:
                        who, why = p.report.lost_words(e)
                        _log.warning(
                            "vflow elastic: %s while a round formed%s; re-forming the worker set",
                            who,
                            why,
                        )
                        _log.debug("vflow elastic: forming a round: %s", e)
                    if outcome.reason != "resume":
                        outcome = dataclasses.replace(outcome, reason="crash")
                    need_round = True
                    continue
            else:
                try:
                    joined = p.admission.knock(rdzv, ex, member)
                except LeftOut as e:
                    say_left_out(e)
                    continue
                except RoundRefused as e:
                    _log.log(e.level, "vflow elastic: %s; forming the next round", e)
                    need_round = True
                    continue
            if joined is None:
                record = self._record(rdzv)
                if record is not None and record["state"] == "suspended":
                    return self._told_suspended(rdzv, record, ex if member else None)
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
            member, resumed, failures, need_round = True, False, 0, False
            rnd = workers.round
            if outcome.reason == "crash" and outcome.workers:
                say_recovered(ex, members, outcome.workers, outcome.failed_step, outcome.left_out)
            if outcome.reason == "grow" and ex.world_size == outcome.workers:
                say_nobody_joined(ex)
            else:
                p.report.record(outcome.reason, outcome.seen, ex, rnd.number)
            while True:
                outcome, workers = self._train(rdzv, p, workers, ex, train_step, steps)
                if outcome.reason == "suspend":
                    try:
                        if self._save_suspended(ex):
                            break
                        continue  # not saved: the job trains on
                    except CollectiveError as e:
                        who, why = p.report.lost_words(e)
                        _log.warning(
                            "vflow elastic: %s while the job's state was saved to suspend it "
                            "after step %d%s; re-forming the worker set (it suspends after its "
                            "next step)",
                            who,
                            ex.step_count - 1,
                            why,
                        )
                        _log.debug("vflow elastic: saving to suspend: %s", e)
                        outcome = _Outcome("crash", time.monotonic(), ex.world_size)
                if outcome.reason in ("grow", "few"):
                    try:
                        grown = p.admission.admit(rdzv, workers, ex, wait=outcome.reason == "few")
                    except LeftOut as e:
                        say_left_out(e)
                        outcome = dataclasses.replace(outcome, reason="crash", left_out=True)
                        break
                    if grown is None:
                        need_round = True  # only the rendezvous' wait list: a new round
                        break
                    if len(grown.ranks) > len(workers.ranks):
                        p.report.record("grow", outcome.seen, ex, rnd.number)
                    elif grown is not workers:
                        say_nobody_joined(ex)
                    workers = grown
                    continue
                if outcome.reason != "crash" or outcome.evicted:
                    break
                try:
                    recovered = p.recovery.recover(rdzv, workers, ex, newcomers=())
                except LeftOut as e:
                    say_left_out(e)
                    outcome = dataclasses.replace(outcome, left_out=True)
                    break
                if recovered is None:
                    need_round = True  # out of attempts: all of them form a new round
                    break
                workers = recovered
                say_recovered(
                    ex, ex.world_size, outcome.workers, outcome.failed_step, outcome.left_out
                )
                p.report.record(outcome.reason, outcome.seen, ex, rnd.number, p.recovery.agreed_at)
                if ex.world_size < self.min_workers:
                    try:
                        grown = p.admission.admit(rdzv, workers, ex, wait=True)
                    except LeftOut as e:
                        say_left_out(e)
                        outcome = dataclasses.replace(outcome, left_out=True)
                        break
                    if grown is None:
                        need_round = True
                        break
                    workers = grown
                    p.report.record("grow", time.monotonic(), ex, rnd.number)
            if outcome.reason == "done":
                p.report.record(outcome.reason, outcome.seen, ex, rnd.number)
                rdzv.finish()
                return ex
            if outcome.reason == "left":
                rdzv.leave()
                _log.info("vflow elastic: left job %r at step %d", self.job_id, ex.step_count)
                return ex
            if outcome.reason == "suspend":
                self._mark_suspended(rdzv, p, ex, outcome, rnd.number)
                return ex
            if outcome.reason == "suspended":
                fenced = rdzv.fenced()
                assert fenced is not None
                _log.warning(
                    "vflow elastic: job %r was suspended at step %d by the rest of its worker "
                    "set while this worker was out of it (this worker stopped at step %d)",
                    self.job_id,
                    fenced["step"],
                    ex.step_count,
                )
                self.suspended, self.suspended_step = True, int(fenced["step"])
                rdzv.close()
                return ex

    # ---- Note [Suspending a job] ------------------------------------------------------

    def _resume(self, ex: AnyExecutor, record: records.Record) -> None:
        """Loads the suspended job's state (its record: ``record``) from this worker's
        checkpoint into ``ex``; a RuntimeError naming the job, the step and the path
        when it cannot."""
        step = int(record["step"])
        path = self.checkpoint
        what = f"job {self.job_id!r} on the store at {self.rendezvous} was suspended at step {step}"
        if path is None:
            raise RuntimeError(
                f"{what}; this worker resumes it from its checkpoint, and has none: pass "
                "checkpoint= (--checkpoint), the path of the file the job's rank 0 saved"
            )
        if not os.path.isfile(path):
            raise RuntimeError(
                f"{what}; its checkpoint is expected at {path!r} (this worker's checkpoint=), "
                "which does not exist: the job's rank 0 saved it at its own checkpoint path "
                "(copy it here, or pass that path)"
            )
        try:
            checkpoint_io.load(path, ex)
        except (OSError, ValueError, RuntimeError) as e:
            raise RuntimeError(f"{what}; its checkpoint {path!r} could not be loaded: {e}") from e
        if ex.step_count != step:
            raise RuntimeError(
                f"{what}, but its checkpoint {path!r} holds step {ex.step_count} (a stale "
                "copy, or another job's file?): it cannot be resumed from there"
            )
        _log.info("vflow elastic: resuming job %r at step %d from %s", self.job_id, step, path)

    def _save_suspended(self, ex: AnyExecutor) -> bool:
        """Step 1 of Note [Suspending a job]: rank 0 writes the state to its checkpoint
        and every member learns whether it did (a broadcast; CollectiveError when a peer
        is lost). When it did not, every member drops the request and says so."""
        error: Exception | None = None
        if ex.rank == 0:
            try:
                if self.checkpoint is None:
                    raise ValueError("rank 0 of the worker set has no checkpoint= to save it to")
                checkpoint_io.save_local(self.checkpoint, ex)
            except Exception as e:
                error = e
        flag = torch.tensor([1.0 if error is None else 0.0], dtype=torch.float64)
        ex.world.broadcast_from(0, [flag], "saving the job's state to suspend it", ex.step_count)
        if float(flag) == 1.0:
            return True
        self._suspend.clear()
        _log.error(
            "vflow elastic: job %r could not be suspended after step %d: %s; it trains on",
            self.job_id,
            ex.step_count - 1,
            f"{type(error).__name__}: {error}"
            if error is not None
            else "rank 0 could not write its checkpoint (its log says why)",
        )
        return False

    def _mark_suspended(
        self, rdzv: Rendezvous, p: _Protocols, ex: AnyExecutor, outcome: _Outcome, number: int
    ) -> None:
        """Steps 2 and 3 of Note [Suspending a job], once the state is saved."""
        step = ex.step_count
        try:
            record = rdzv.suspend(step)
        except (dist.DistError, RendezvousConnectionError) as e:
            p.report.store_lost(ex, e, f"marking the job suspended at step {step}")
        if record is None or record["state"] != "suspended" or record.get("step") != step:
            p.report.save_and_raise(
                ex,
                RuntimeError("fenced"),
                f"the store at {self.rendezvous} gives the job to another worker set (record "
                f"{record}), so this worker set could not suspend it at step {step} (Note "
                "[Fencing a job] in vflow/elastic/record.py)",
                "",
            )
        self._suspend.clear()
        self.suspended, self.suspended_step = True, step
        p.report.record("suspend", outcome.seen, ex, number)
        where = f"in {self.checkpoint!r}" if ex.rank == 0 else "in rank 0's checkpoint"
        _log.info(
            "vflow elastic: job %r suspended at step %d with %d worker(s), its state %s; "
            "start workers with the same job id and checkpoint to resume it",
            self.job_id,
            step,
            ex.world_size,
            where,
        )

    def _told_suspended(
        self, rdzv: Rendezvous, record: records.Record, ex: AnyExecutor | None
    ) -> None:
        """The job was suspended while this worker waited to join it (``ex``: a member
        out of its worker set, else None): ``run`` returns None, with ``suspended``."""
        self.suspended, self.suspended_step = True, int(record["step"])
        if ex is None:
            _log.info(
                "vflow elastic: job %r was suspended at step %d before this worker joined it; "
                "start workers with its checkpoint to resume it",
                self.job_id,
                self.suspended_step,
            )
        else:
            _log.warning(
                "vflow elastic: job %r was suspended at step %d while this worker was out of "
                "its worker set (this worker stopped at step %d; the checkpoint holds the "
                "job's state)",
                self.job_id,
                self.suspended_step,
                ex.step_count,
            )
        rdzv.close()

    def _round(
        self, rdzv: Rendezvous, p: _Protocols, ex: AnyExecutor, member: bool, resumed: bool
    ) -> tuple[WorkerSet, int] | None:
        """A new rendezvous round and the worker set it forms (the job's start, or a
        fallback: Note [Elastic state machine]); None when the job finished first.
        Raises CollectiveError or RoundRefused when the set failed to form."""
        try:
            rnd = rdzv.next_round()
        except (RendezvousClosedError, RendezvousGracefulExitError):
            return None
        except RendezvousTimeoutError as e:
            p.report.give_up(ex if member else None, e)
        except (RendezvousConnectionError, RendezvousStateError, dist.DistError) as e:
            p.report.store_lost(ex if member else None, e, "joining the next round")
        self._layout.announce(rnd)
        return self._form(rdzv, p, rnd, ex, member, resumed)

    def _build(self, make_executor: MakeExecutor) -> AnyExecutor:
        """Note [Joining ahead]: the executor, built before this worker asks to join; a
        pipeline's stage on a detached grid (Note [Building a stage ahead],
        vflow/pipeline/executor.py)."""
        if self.stages > 1:
            assert self.stage is not None
            ex = make_executor(ProcessGrid.detached(self.stages, self.stage), self.timeout_s)
            if not isinstance(ex, PipelineExecutor):
                raise TypeError(
                    f"with stages={self.stages}, make_executor(grid, timeout_s) must return a "
                    f"vflow.PipelineExecutor on that grid, got {type(ex).__name__}"
                )
            if ex.grid.stages != self.stages or ex.grid.stage != self.stage:
                raise ValueError(
                    f"make_executor(grid, timeout_s) must build its PipelineExecutor on the grid "
                    f"it is given (stage {self.stage} of {self.stages}), got stage "
                    f"{ex.grid.stage} of {ex.grid.stages}"
                )
            return ex
        with warnings.catch_warnings():
            # plan="auto" warns that one process has nothing to plan: this one will have.
            warnings.filterwarnings("ignore", message="plan='auto' on a single process")
            ex = make_executor(single_group(timedelta(seconds=self.timeout_s)), self.timeout_s)
        if not isinstance(ex, Executor):
            raise TypeError(f"make_executor must return a vflow.Executor, got {type(ex).__name__}")
        return ex

    def _form(
        self,
        rdzv: Rendezvous,
        p: _Protocols,
        rnd: Round,
        ex: AnyExecutor,
        member: bool,
        resumed: bool,
    ) -> tuple[WorkerSet, int]:
        """Moves ``ex`` onto the round's worker set; returns it, and how many of the
        round's workers were members of the job before it. Newcomers that the members
        refuse (Note [Refusing newcomers], vflow/world/membership.py) or that fail while
        the set forms are left out, and the members go on without them; a refused
        newcomer raises JoinRefused. ``resumed``: ``ex`` holds the suspended job's state
        (Note [Suspending a job]): in a round without members, such workers resume the
        job as its members."""
        try:
            ranks = self._layout.shape(rnd, list(range(rnd.world_size)))
        except dist.DistError as e:  # a worker of the round died before it said its stage
            raise CollectiveError(
                f"round {rnd.number} of job {self.job_id!r}: a worker never said which stage "
                f"it holds: {e}"
            ) from e
        if rnd.rank not in ranks:
            # Its stage has more workers in the round than another (Note [Replicas as
            # members]): it knocks once the others hold the job's record.
            self._await_record(rdzv)
            raise LeftOut(PARTNERLESS)
        workers = WorkerSet(rnd, ranks)
        group = p.groups.make(rnd, workers.name, None if self.stages == 1 else ranks)
        world = World(p.groups.world_group(group), timedelta(seconds=self.timeout_s))
        mine = [int(member), ex.virtual_nodes, int(resumed)]
        rows = world.gather_ints(mine, "checking the round's members", None)
        del world
        members = [ranks[i] for i, (is_member, _, _) in enumerate(rows) if is_member]
        virtual_nodes = rows[ranks.index(members[0])][1] if members else ex.virtual_nodes
        if len(ranks) > virtual_nodes * self.stages:
            # Every worker (replica) needs a VN: newcomers beyond V are refused (they end
            # with this error), and the round is formed again without them.
            newcomers = [rank for rank in ranks if rank not in members]
            refused = newcomers[virtual_nodes * self.stages - len(members) :]
            if rnd.rank in refused:
                raise JoinRefused(
                    f"job {self.job_id!r} runs V={virtual_nodes} virtual nodes, at most one "
                    f"worker each, and has {len(members)} worker(s): this worker is not "
                    "needed (pass max_workers <= V to make extra workers wait instead)"
                )
            raise RoundRefused(
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
                p.report.store_lost(None, e, "starting the job")
            if claimed["lineage"] != rnd.prefix:
                raise RoundRefused(
                    f"round {rnd.number} of job {self.job_id!r} has no member of the running "
                    "job (they are on their way to a later round)",
                    logging.INFO,
                )
        elif rdzv.lineage is None:
            current = rdzv.record()
            if current is not None:
                rdzv.joined(current)
        # A round resuming a suspended job: the workers that loaded its checkpoint hold
        # the job's state, as members would.
        holders = members or [ranks[i] for i, (_, _, loaded) in enumerate(rows) if loaded]
        newcomers = tuple(r for r in workers.ranks if r not in holders)
        joined = p.admission.join_set(
            rdzv, workers, ex, member or rnd.rank in holders, newcomers, group
        )
        if joined is None:
            if claimed is not None:  # nobody trained: the next round claims it again
                rdzv.release(rnd.prefix)
            raise RoundRefused(
                f"the worker set of round {rnd.number} of job {self.job_id!r} failed to form "
                f"{self.max_recoveries} times",
                logging.WARNING,
            )
        return joined, len(members)

    def _await_record(self, rdzv: Rendezvous) -> None:
        """Until the job has a record (its workers started it), up to ``join_timeout_s``:
        a worker left out of the job's first round then knocks rather than asking for
        another round, which would stop the others."""
        deadline = time.monotonic() + self.join_timeout_s
        while self._record(rdzv) is None and time.monotonic() < deadline:
            time.sleep(0.1)

    def _record(self, rdzv: Rendezvous) -> records.Record | None:
        """The job's record (Note [Fencing a job], vflow/elastic/record.py): with one,
        newcomers knock, or resume a suspended job; None also when the store cannot be
        reached (next_round says so)."""
        try:
            return rdzv.record()
        except dist.DistError:
            return None

    def _train(
        self,
        rdzv: Rendezvous,
        p: _Protocols,
        workers: WorkerSet,
        ex: AnyExecutor,
        train_step: TrainStep,
        steps: int,
    ) -> tuple[_Outcome, WorkerSet]:
        """Trains on ``workers`` until an event; returns it and the worker set then
        (smaller after leaves)."""
        rnd = workers.round
        while ex.step_count < steps:
            fenced = rdzv.fenced()
            mine = rdzv.lineage
            if (
                fenced is not None
                and fenced["state"] == "suspended"
                and mine is not None
                and fenced["lineage"] == mine["lineage"]
            ):
                # The others suspended the job while this worker recovered without them.
                return _Outcome("suspended", time.monotonic()), workers
            if fenced is not None:
                p.report.save_and_raise(
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
                # Its group goes at once (Note [Recovering within the round],
                # vflow/elastic/agreement.py): a peer still blocked on it fails now, not
                # at its timeout.
                p.groups.abort(ex)
                return _Outcome("crash", time.monotonic(), ex.world_size, evicted=True), workers
            # A full worker set does not look at who waits (they wait for a place).
            room = p.admission.capacity(ex) - len(workers.ranks)

            def word(room: int = room) -> int:
                # Read by the step as late as it can send it: a knock or a SIGTERM
                # that arrives during its forward passes acts after this step.
                waiting = WAITING if room > 0 and p.admission.waiting(rdzv, room) else 0
                leave = LEAVE if self._leave.is_set() else 0
                return waiting | leave | (SUSPEND if self._suspend.is_set() else 0)

            ex.signal(word)
            step = ex.step_count
            try:
                result = train_step(ex, step)
            except CollectiveError as e:
                who, why = p.report.lost_words(e)
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
            if any(w & SUSPEND for w in result.signals):
                # Every member asks from now on: should the save fail for a lost peer,
                # the set re-formed without it suspends after its next step.
                self._suspend.set()
                return _Outcome("suspend", seen, ex.world_size), workers
            leavers = [r for r, w in enumerate(result.signals) if w & LEAVE]
            if leavers:
                if ex.rank in leavers:
                    return _Outcome("left", seen), workers
                workers = workers.without([workers.ranks[r] for r in leavers])
                kept = self._layout.shape(rnd, workers.ranks)
                if rnd.rank not in kept:
                    # Its replica lost a stage with the leavers (Note [Replicas as
                    # members]): out of the set, it knocks until a worker of that stage
                    # comes.
                    _log.info(
                        "vflow elastic: this worker's replica lost a stage to the workers "
                        "leaving after step %d; it waits to join again",
                        step,
                    )
                    p.groups.abort(ex)
                    return _Outcome("crash", seen, len(kept), evicted=True, left_out=True), workers
                workers = WorkerSet(rnd, kept, workers.generation)
                try:
                    group = p.groups.make(rnd, workers.name, workers.ranks)
                    p.groups.move(ex, group)
                except CollectiveError as e:
                    who, why = p.report.lost_words(e)
                    _log.warning(
                        "vflow elastic: %s while the others shrank the worker set after step "
                        "%d%s; re-forming it",
                        who,
                        step,
                        why,
                    )
                    _log.debug("vflow elastic: shrinking after step %d: %s", step, e)
                    return _Outcome("crash", seen, len(workers.ranks)), workers
                publish(rdzv, ex, workers)
                p.report.record("leave", seen, ex, rnd.number)
                if ex.world_size < self.min_workers:
                    return _Outcome("few", time.monotonic(), ex.world_size), workers
                continue
            if any(w & WAITING for w in result.signals):
                return _Outcome("grow", seen, ex.world_size), workers
        return _Outcome("done", time.monotonic()), workers


def _positive(value: Any) -> bool:
    return (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(value)
        and value > 0
    )
