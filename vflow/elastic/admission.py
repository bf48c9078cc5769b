"""Newcomers into a running elastic job: a newcomer's knock, the members letting it in,
and every worker moving onto the set it joins (``Admission``, Note [Joining a running
job]). The knock's other half, the tickets and answers in the store, is
``Rendezvous.knock``, ``pending`` and ``answer`` (vflow/elastic/rendezvous.py).

The state machine (vflow/elastic/job.py) uses this module; it uses
vflow/elastic/agreement.py (a set that breaks while it forms recovers as after a
crash), vflow/elastic/groups.py and vflow/elastic/reporting.py, never job.py.

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
2. the set's lowest member counts the tickets not answered yet, with the rendezvous'
   wait list (Note [One member watches the door], vflow/elastic/rendezvous.py), once
   no new one came for the last call (Note [A window for joiners]), and sets WAITING
   in its current step's signal word, so that all members act after the same step,
   when their set has room (``max_workers``, V);
3. the members agree on whom to offer a place by compare-and-set on
   ``admit<G>/<step>`` in the round's store (the first member's view wins: the oldest
   tickets, as many as there is room), offer it to each ticket and raise the answered
   counter; each knocker acknowledges, and the members agree on the ones that did
   within ACK_S (Note [Knockers acknowledge], vflow/elastic/rendezvous.py) by
   compare-and-set on ``admit<G>/<step>/in``; every offered ticket gets its final
   answer (the round, the new set's ranks, its number G + 1; or "again");
4. newcomers and members form the new set as in ROUND (newcomers take negative ranks
   in the round, never used before in it, from a counter in the round's store: the
   round's own ranks are >= 0; the decision carries them), with refusals and failures
   handled the same way.

A member stalls for one agreement, a group's creation and the state sent to the newcomers
(0.04 s in tests/elastic/test_job.py's grows). A worker let in this way is not a
participant of the rendezvous' round: its heartbeats say nothing of it (its beats
do), and in a fallback round it joins from the wait list. A worker that knocked and
died while it waited never acknowledges and is never let in; one that died after its
acknowledgement costs the members the group's creation timeout (``timeout_s``).
"""

from __future__ import annotations

import json
import logging
import time

import torch.distributed as dist

from vflow.elastic.agreement import PARTNERLESS, POLL_S, LeftOut, Recovery, set_poll_s
from vflow.elastic.groups import AnyExecutor, Groups, SetGroup, WorkerSet, publish
from vflow.elastic.rendezvous import (
    ACK_S,
    Rendezvous,
    RendezvousConnectionError,
    RendezvousStateError,
    RendezvousTimeoutError,
)
from vflow.elastic.replicas import Layout, Workers
from vflow.elastic.reporting import Reporter
from vflow.world.group import CollectiveError
from vflow.world.membership import RefusedNewcomers

__all__ = ["Admission", "JoinRefused", "RoundRefused", "let_in", "newcomer_ranks"]

_log = logging.getLogger("vflow")


class JoinRefused(RuntimeError):
    """This worker cannot join the running job: it differs from the members (settings,
    V, model, optimizer state), it was not needed (more workers than V), or it did not
    join within the join deadline. The job goes on without it."""


class RoundRefused(Exception):
    """A round that formed but cannot train (no member of the running job in it, or more
    workers than V): nobody failed, the members form the next one. ``level``: how loudly
    to log it."""

    def __init__(self, message: str, level: int) -> None:
        super().__init__(message)
        self.level = level


class Admission:
    """Note [Joining a running job], one worker's part, as a newcomer (``knock``) and as
    a member (``admit``), and the move of every worker onto a new set (``join_set``).
    ``groups`` makes the sets' groups, ``recovery`` re-forms a set that broke while it
    formed, ``report`` names a lost store or gives up. The job's ``job_id``,
    ``max_workers``, ``join_timeout_s`` and ``max_recoveries`` bound it and go into its
    errors; ``groups`` holds the join deadline; ``layout`` makes whole replicas of a
    pipelined job's sets (Note [Replicas as members], vflow/elastic/replicas.py)."""

    def __init__(
        self,
        groups: Groups,
        recovery: Recovery,
        report: Reporter,
        *,
        job_id: str,
        max_workers: int,
        join_timeout_s: float,
        max_recoveries: int,
        layout: Layout,
    ) -> None:
        self.layout = layout
        self.groups = groups
        self.recovery = recovery
        self.report = report
        self.job_id = job_id
        self.max_workers = max_workers
        self.join_timeout_s = join_timeout_s
        self.max_recoveries = max_recoveries

    def knock(
        self, rdzv: Rendezvous, ex: AnyExecutor, member: bool
    ) -> tuple[WorkerSet, int] | None:
        """Asks the running worker set to take this worker in; returns the set it joined
        and how many members it had, or None when the job finished first."""
        try:
            answer = rdzv.knock(
                self.join_timeout_s, None if self.layout.stages == 1 else self.layout.stage
            )
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
            self.report.store_lost(ex if member else None, e, "asking to join the running job")
        if answer is None:
            return None
        rnd = rdzv.adopt(str(answer["prefix"]), int(answer["round"]), int(answer["rank"]))
        self.layout.announce(rnd)
        if answer.get("record") is not None:
            rdzv.joined(answer["record"])
        workers = WorkerSet(rnd, list(answer["ranks"]), int(answer["generation"]))
        newcomers = tuple(answer["newcomers"])
        joined = self.join_set(rdzv, workers, ex, member, newcomers)
        if joined is None:
            raise RoundRefused(
                f"the worker set of job {self.job_id!r} failed to form {self.max_recoveries} times",
                logging.WARNING,
            )
        return joined, len(joined.ranks) - len(newcomers)

    def admit(
        self, rdzv: Rendezvous, workers: WorkerSet, ex: AnyExecutor, wait: bool
    ) -> WorkerSet | None:
        """The members' side: lets the workers that knocked into the worker set; returns
        the set (``workers`` itself when nobody knocked after all), or None when workers
        wait on the rendezvous' wait list instead (they need a new round). With ``wait``
        (too few workers), it waits for one up to ``join_timeout_s``."""
        room = self.capacity(ex) - len(workers.ranks)
        deadline = time.monotonic() + self.join_timeout_s
        attempt = 0
        try:
            while True:
                tickets = rdzv.pending(max(room, 0) * self.layout.stages)
                if tickets or not wait:
                    grown = let_in(
                        rdzv, workers, ex.step_count, tickets, attempt, room, self.layout
                    )
                    # Waiting, a decision that let nobody in (the knockers did not
                    # acknowledge) is followed by another: every member counts the same.
                    if not wait or grown is not workers:
                        break
                    attempt += 1
                if time.monotonic() > deadline:
                    self.report.give_up(ex, TimeoutError("no worker asked to join"))
                time.sleep(POLL_S)
        except dist.DistError as e:
            self.report.store_lost(ex, e, "letting a new worker in")
        if grown is None or grown is workers:
            return grown
        newcomers = tuple(grown.ranks[len(workers.ranks) :])
        _log.info(
            "vflow elastic: %d worker(s) asked to join; taking them in at step %d",
            len(newcomers),
            ex.step_count,
        )
        return self.join_set(rdzv, grown, ex, True, newcomers)

    def capacity(self, ex: AnyExecutor) -> int:
        """The most workers a set may have: ``max_workers``, and a VN for each replica."""
        return min(self.max_workers, ex.virtual_nodes * self.layout.stages)

    def waiting(self, rdzv: Rendezvous, room: int) -> bool:
        """Whether workers wait who could join now (this member watches the door: Note
        [One member watches the door], vflow/elastic/rendezvous.py): with pipelines,
        knockers that make a whole replica, or a replica's worth on the wait list (Note
        [Replicas as members])."""
        if not rdzv.waiting():
            return False
        stages = self.layout.stages
        if stages == 1:
            return True
        tickets = rdzv.pending(max(room, 0) * stages)
        chosen = self.layout.choose(self.layout.ticket_stages(rdzv.job_store, tickets), room)
        return bool(chosen) or rdzv.wait_list() >= stages

    def join_set(
        self,
        rdzv: Rendezvous,
        workers: WorkerSet,
        ex: AnyExecutor,
        member: bool,
        newcomers: tuple[int, ...],
        group: SetGroup | None = None,
    ) -> WorkerSet | None:
        """Moves ``ex`` onto ``workers`` (every one of them calls this; ``group``: theirs
        if already built); returns the set it ended on, or None when a failure while it
        formed could not be recovered from within the round (a new round). Newcomers that
        the members refuse (Note [Refusing newcomers], vflow/world/membership.py) or that
        fail while the set forms are left out, and the members go on without them; a
        refused newcomer raises JoinRefused, a member left out LeftOut."""
        rnd = workers.round
        while True:
            failed = False
            try:
                # A newcomer that died after its answer never connects: the group's
                # creation times out, a failure like any other while the set forms.
                if group is None:
                    group = self.groups.make(rnd, workers.name, workers.ranks, bool(newcomers))
                self.groups.move(ex, group, newcomer=not member)
                publish(rdzv, ex, workers)
                break
            except RefusedNewcomers as e:
                refused = [workers.ranks[r] for r in e.ranks]
                if rnd.rank in refused:
                    raise JoinRefused(f"job {self.job_id!r}: {e}") from None
                _log.warning("vflow elastic: %s; going on without them", e)
                workers = workers.without(refused)
                kept = self.layout.shape(rnd, workers.ranks)
                if rnd.rank not in kept:
                    # A replica lost a refused newcomer's stage (Note [Replicas as members]).
                    if rnd.rank in newcomers:
                        raise JoinRefused(
                            f"job {self.job_id!r}: {e}; this worker's replica lost a stage with "
                            "them"
                        ) from None
                    raise LeftOut(PARTNERLESS) from None
                workers = WorkerSet(workers.round, kept, workers.generation)
            except CollectiveError as e:
                _log.warning(
                    "vflow elastic: a worker failed while the worker set formed; the others "
                    "re-form it without that worker"
                )
                _log.debug("vflow elastic: round %d: %s", rnd.number, e)
                failed = True
            # Before any wait: the group's connections close only with its last reference.
            if group is not None:
                self.groups.discard(group)
            group = None
            if failed:
                too_late = JoinRefused(
                    f"job {self.job_id!r}: this worker did not join the worker set within the "
                    f"join deadline ({self.groups.deadline_words(len(workers.ranks))}); the "
                    "members went on without it"
                )
                try:
                    recovered = self.recovery.recover(rdzv, workers, ex, newcomers)
                except LeftOut:
                    if rnd.rank in newcomers:
                        raise too_late from None
                    raise
                if recovered is None and rnd.rank in newcomers:
                    raise too_late
                return recovered
        return workers


def let_in(
    rdzv: Rendezvous,
    workers: WorkerSet,
    step: int,
    tickets: list[int],
    attempt: int = 0,
    room: int | None = None,
    layout: Layout | None = None,
) -> WorkerSet | None:
    """Step 3 of Note [Joining a running job], after ``step``: the members of
    ``workers`` agree on whom to let in (``tickets``: the unanswered tickets this member
    sees, oldest first; ``room``: how many workers the set may take, default all of
    ``tickets``; ``layout``: whole replicas of a pipeline, Note [Replicas as members];
    default every worker on its own) and answer the knockers; returns
    the grown set, ``workers`` itself when nobody comes in, or None when only the
    rendezvous' wait list has workers (they need a new round). ``attempt``: how many
    decisions after the same step came before this one (every member counts the same)."""
    rnd = workers.round
    job = rdzv.job_store
    layout = Workers() if layout is None else layout
    room = len(tickets) if room is None else room
    stages = layout.ticket_stages(job, tickets)
    chosen = layout.choose(stages, room)
    offer = [tickets[i] for i in chosen]
    # Older than the newest offered and not offered (their replica is not whole yet):
    # the answered counter moves past them, so they are told to knock again.
    passed = [t for t in tickets if offer and t < max(offer) and t not in offer]
    # One decision for all members, whatever each one saw: whom to offer a place, or
    # whether only the rendezvous' wait list has workers (they need a round). Its key
    # names the step, which all members act after: a set that let nobody in after one
    # step may let someone in after a later one.
    proposal = {
        "tickets": offer,
        "stages": [stages[i] for i in chosen],
        "again": passed,
        "round": not offer and rdzv.wait_list() >= layout.stages,
    }
    key = f"vflow/admit{workers.generation}/{step}" + (f".{attempt}" if attempt else "")
    decision = json.loads(rnd.store.compare_set(key, "", json.dumps(proposal)))
    offered = [int(t) for t in decision["tickets"]]
    if not offered:
        return None if decision["round"] else workers
    stage_of = dict(zip(offered, decision["stages"], strict=True))
    # Note [Knockers acknowledge]: tickets are never taken twice in a job's store, so
    # the first offered one names the acknowledgements' key.
    acks = f"acks/{offered[0]}"
    # The member whose view won writes the offers: one write for the set.
    write = decision == proposal
    if write and decision["again"]:
        job.multi_set(
            [f"admit/{t}" for t in decision["again"]],
            [json.dumps({"again": True})] * len(decision["again"]),
        )
    rdzv.offer(offered, acks, write=write)
    # The writer's window decides; the others' is longer (Note [Knockers acknowledge]).
    window = ACK_S if write else 2 * ACK_S
    acked = rdzv.acknowledged(acks, offered, set_poll_s(len(workers.ranks)), window_s=window)
    # The acknowledged ones may no longer make whole replicas: those left over knock again.
    acked = [acked[i] for i in layout.choose([stage_of[t] for t in acked], room)]
    proposal = {
        "tickets": acked,
        "ranks": newcomer_ranks(rnd.store, workers.ranks, len(acked)),
        "stages": [stage_of[t] for t in acked],
    }
    final = json.loads(rnd.store.compare_set(f"{key}/in", "", json.dumps(proposal)))
    decided = [int(t) for t in final["tickets"]]
    newcomers = [int(r) for r in final["ranks"]]
    layout.tell(rnd, newcomers, [int(s) for s in final["stages"]])
    grown = workers.successor(layout.shape(rnd, workers.ranks + newcomers)) if decided else workers
    answer = {
        "round": rnd.number,
        "prefix": rnd.prefix,
        "ranks": grown.ranks,
        "generation": grown.generation,
        "record": rdzv.lineage,
        "newcomers": newcomers,
    }
    rank_of = dict(zip(decided, newcomers, strict=True))
    rdzv.answer(
        offered,
        [dict(answer, rank=rank_of[t]) if t in rank_of else {"again": True} for t in offered],
    )
    return grown


def newcomer_ranks(store: dist.Store, ranks: list[int], count: int) -> list[int]:
    """Round ranks for ``count`` newcomers: negative (the round's own ranks are >= 0),
    never used before in the round, handed out by a counter in the round's store. A
    counter behind the set's own ranks (the store restarted and forgot it) first jumps
    past them."""
    used = int(store.add("vflow/newcomers", 0))
    behind = max(0, -min([0, *ranks]) - used)
    top = int(store.add("vflow/newcomers", behind + count))
    return [-(top - i) for i in range(count)]
