"""What an elastic worker says about the changes of its worker set, the record it keeps
of them (``Event``), and how it gives up: with its state in the job's checkpoint and a
RuntimeError saying why (``Reporter``).

The state machine (vflow/elastic/job.py) and the protocols (vflow/elastic/admission.py,
vflow/elastic/agreement.py) use this module; it uses none of them.

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
import logging
import time
from typing import NoReturn

from vflow.elastic.groups import AnyExecutor
from vflow.runtime import checkpoint as checkpoint_io
from vflow.world.group import CollectiveError

__all__ = ["Event", "Reporter", "say_left_out", "say_nobody_joined", "say_recovered"]

_log = logging.getLogger("vflow")


@dataclasses.dataclass(frozen=True)
class Event:
    """One change of the worker set, as this worker saw it.

    step: the step count when the new worker set took over (the next step it runs).
    round: the rendezvous round.
    workers: the worker count from then on.
    reason: "start", "grow", "leave", "crash" or "finish"; "suspend" when the job was
      suspended (Note [Suspending a job], vflow/elastic/job.py), "resume" when this
      worker's set resumed it.
    seconds: from the moment this worker saw the cause (the step that carried the
      signal, or the failed collective) to the new worker set being ready.
    agreed_s: for a crash, from the failed collective to the survivors' decision (Note
      [Recovering within the round], vflow/elastic/agreement.py): the part of
      ``seconds`` spent agreeing, before the group's creation; None otherwise.
    """

    step: int
    round: int
    workers: int
    reason: str
    seconds: float
    agreed_s: float | None = None


class Reporter:
    """One worker's account of job ``job_id`` on the store at ``endpoint``: it appends
    an Event to ``events`` per change of the worker set, names what failed, and gives up
    with its state in ``checkpoint`` (a file path, or None: nothing is written).
    ``min_workers``, ``join_timeout_s`` and ``timeout_s`` are the job's, for the words."""

    def __init__(
        self,
        job_id: str,
        endpoint: str,
        events: list[Event],
        *,
        checkpoint: str | None,
        min_workers: int,
        join_timeout_s: float,
        timeout_s: float,
    ) -> None:
        self.job_id = job_id
        self.endpoint = endpoint
        self.events = events
        self.checkpoint = checkpoint
        self.min_workers = min_workers
        self.join_timeout_s = join_timeout_s
        self.timeout_s = timeout_s

    def record(
        self,
        reason: str,
        seen: float,
        ex: AnyExecutor,
        round_number: int,
        agreed: float | None = None,
    ) -> None:
        """The Event of a change whose cause this worker saw at ``seen``
        (``time.monotonic()``) and that ended with ``ex`` on its new worker set;
        ``reason``: the state machine's ("done", "few" or an Event's reason); ``agreed``:
        when the survivors' decision came (a crash)."""
        # "few": the leave was recorded when it happened; this round brought joiners.
        reason = {"done": "finish", "few": "grow"}.get(reason, reason)
        event = Event(
            ex.step_count,
            round_number,
            ex.world_size,
            reason,
            time.monotonic() - seen,
            None if agreed is None else agreed - seen,
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

    def lost_words(self, error: CollectiveError) -> tuple[str, str]:
        """Who failed, and why when it was a timeout (Note [Saying what a recovery
        does]): a collective that timed out cannot tell a hung worker from a lost one
        (a survivor may wait on another survivor that already left for the next round)."""
        if "timed out" in str(error):
            return "worker hung or lost", f" (no answer within the {self.timeout_s:g} s timeout)"
        if "interrupted: " in str(error):  # Note [A survivor blocked on survivors]
            return "worker lost", " (the others said so: this worker waited on a live peer)"
        return "worker lost", ""

    def store_lost(self, ex: AnyExecutor | None, error: Exception, doing: str) -> NoReturn:
        """Note [The store during a round]."""
        self.save_and_raise(
            ex,
            error,
            f"the rendezvous store at {self.endpoint} cannot be reached while {doing} "
            f"({type(error).__name__}: {error})",
            " (pass checkpoint= to keep a worker's state when this happens)",
        )

    def give_up(self, ex: AnyExecutor | None, error: Exception) -> NoReturn:
        self.save_and_raise(
            ex,
            error,
            f"fewer than min_workers={self.min_workers} workers for "
            f"{self.join_timeout_s:g} s (no round formed)",
            "",
        )

    def save_and_raise(
        self, ex: AnyExecutor | None, error: Exception, what: str, unsaved: str
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


def say_left_out(why: object) -> None:
    """``why``: the LeftOut raised, whose message says why."""
    _log.warning(
        "vflow elastic: the others went on without this worker (%s); joining the job again", why
    )


def say_recovered(
    ex: AnyExecutor, members: int, workers: int, failed_step: int | None, left_out: bool
) -> None:
    """How a change after a failure ended (Note [Saying what a recovery does]): ``ex``
    on its new worker set, which has ``members`` of the job's members; ``workers``: the
    size of this worker's set when it saw the failure; ``failed_step``: the step that
    raised, if one did; ``left_out``: whether the others had gone on without it."""
    lost = 0 if left_out else max(0, workers - members)
    size = f"{ex.world_size} worker{'s' if ex.world_size != 1 else ''}"
    if lost:
        size += f" ({lost} lost)"
    if left_out:
        _log.info("vflow elastic: joined again at step %d with %s", ex.step_count, size)
    elif failed_step is None:
        _log.info("vflow elastic: going on at step %d with %s", ex.step_count, size)
    elif ex.step_count == failed_step:
        _log.info("vflow elastic: redoing step %d with %s", ex.step_count, size)
    else:
        # A member committed the failed step before the group broke; the others
        # received its state (catch_up).
        _log.info(
            "vflow elastic: step %d was committed before the failure; going on at step %d with %s",
            failed_step,
            ex.step_count,
            size,
        )


def say_nobody_joined(ex: AnyExecutor) -> None:
    # Every newcomer was refused or failed: the worker set did not change.
    _log.info(
        "vflow elastic: nobody joined; going on at step %d with the same %d worker(s)",
        ex.step_count,
        ex.world_size,
    )
