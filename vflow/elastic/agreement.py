"""The survivors' agreement after a crash: who is left, in the round's store, and their
new worker set (``Recovery``, Note [Recovering within the round]).

The state machine (vflow/elastic/job.py) and the admission of newcomers
(vflow/elastic/admission.py, when a set that was forming breaks) use this module; it
uses vflow/elastic/groups.py and vflow/elastic/reporting.py, never them.

Note [Recovering within the round]
Gloo cannot cancel a collective, and a survivor blocked on another survivor (not on
the dead worker) would wait for ``timeout_s``. But a Gloo group's connections close
when its last reference goes: so a worker that sees a collective fail first drops its
group (``Executor.abort_group``), which makes every peer blocked on it fail at once,
and so on; a survivor that this never reaches is told (Note [A survivor blocked on
survivors]). Then, in the round's store:

1. each survivor appends its rank and where it answers probes to ``recover<G>/alive``
   (G: how many worker sets the round has had, the same on all members);
2. it waits until every other worker of the set has either answered or is gone (its
   probe refuses connections, or its beats stopped for ``gone_after_s``: Note [Beats],
   vflow/elastic/rendezvous.py), up to ``timeout_s``;
   newcomers of a set that was forming are not waited for;
3. it probes every other survivor (Note [Probing a peer], vflow/world/network.py) and
   says whom it missed under ``recover<G>/reach``, then waits for the others' rows
   as in 2. A group breaks as surely over a cut between two survivors as over a dead
   one, and after a partition both ends still answer: without this step they would
   form the same broken set again and again;
4. the first survivor to get there writes the decision to ``recover<G>/decision`` with
   compare-and-set: the survivors in the set's order, each kept if it and every one
   kept before it reach each other (``connected``); every survivor adopts what is
   there, so all agree even when they saw different answers;
5. the ranks of the decision form the next group of the round and ``reconfigure``
   onto it with ``catch_up``, then redo the failed step.

A survivor not in the decision (it answered after it was made, or it is cut off from a
worker kept before it) asks to join again (Note [Joining a running job],
vflow/elastic/admission.py) and comes back as a grow once it reaches every member; a
newcomer not in it raises JoinRefused. A failure during steps 1-5 starts them again on
the next G, up to ``max_recoveries`` times, then the worker falls back to a new round.
No rendezvous round forms, so a crash costs neither the heartbeat expiry nor the last
call. Probing costs a round trip per pair when all is well, and the probe's timeout
(0.5 s) when a pair is cut.

Note [A survivor blocked on survivors]
The failure spreads only along pending transfers: a survivor whose transfers with
the failed workers had completed, blocked on another survivor that is blocked too,
would wait for ``timeout_s`` (measured at 16 and 32 workers with 3 killed: the ring
failed one hop every 0.25 s, then stopped, and half the set waited 10 s). So a
survivor sends "broken <set>" on the probe (Note [Probing a peer],
vflow/world/network.py) of each worker it watches (Note [Each silent worker watched
once]) that has not answered, as soon as it watches it, once. That worker's probe
interrupts its waits on the set's group (``World.interrupt``, Note [Interrupting a
wait] in csrc/interrupt.cpp), its step fails, and it answers. The set's group broke for
good (one of its collectives failed), so interrupting a worker that was about to fail
anyway, or that had not reached the collective yet, changes nothing but the time; a
message naming an older set is ignored. A worker whose probe refuses the message is
dead (Note [Beats], vflow/elastic/rendezvous.py) and is found gone at once, without
waiting SUSPECT_S for its beats to stand still. It costs a connection per worker a
survivor watches before it answered, and one more for each that refused: O(N log N)
connections over a set of N whose survivors arrive in random order, O(N) when they
fail together. (Telling only the workers that had not answered SUSPECT_S later sent
fewer messages, and cost every crash those 0.2 s: at 8 light members an agreement took
0.25 s, against 0.05 s now; benchmarks/store_load.py.)

Note [An agreement's requests]
Each answer of a step (``alive``, ``reach``) is a line of JSON appended to the step's
index; its writer then raises the step's counter (``_put``), so that the index holds at
least as many answers as the counter says. A survivor waiting on the others reads the
counter each poll and, when it moved, the index, parsing only what was appended since
its last read (``_Reader``); then the beats of the workers it watches (Note [Each
silent worker watched once]), one ``check`` and one ``multi_get`` (Rendezvous.beats).
So a poll is one request when nothing changed and four at most when something did,
whatever N. The answers are short (a probe endpoint, or whom a survivor missed: empty
when all is well, where a list of those reached would grow with N^2), so the index
of a thousand answers is some 25 KB, and it is read whole only when it grew: at 1,024
workers that is cheaper for the store than looking up each answer as a key of its own
(a ``multi_get`` of 1,024 keys costs about 12 times a ``get`` of 6 KB here, and a
thousand survivors each reading a thousand answers made the store the bottleneck of
the agreement). The poll's period grows with the set beyond _SET_POLLS_PER_S * POLL_S
workers (50), so that a whole set's polls stay at _SET_POLLS_PER_S a second
(2,500-7,500 requests a second to the store at most, however many workers;
benchmarks/store_load.py measures what the store serves here), at the cost of a
longer agreement in sets that large. Survivors poll rather than block in the store's
``wait`` until an answer comes, for a ``wait`` with a timeout is unsafe to poll with:
with torch 2.13, 1-3 % of the waits that timed out (5-20 ms) took 5 s longer, with
the libuv server as with the other.

Fewer than ``min_workers`` after a failure: the members wait up to ``join_timeout_s``
for a worker to knock, then raise RuntimeError, after writing ``checkpoint`` (if
given) with ``vflow.runtime.save_local``.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from vflow.elastic.groups import AnyExecutor, Groups, WorkerSet, publish
from vflow.elastic.rendezvous import BROKEN, GONE_AFTER_S, SUSPECT_S, Rendezvous
from vflow.elastic.replicas import Layout, Workers
from vflow.elastic.reporting import Reporter
from vflow.world import network
from vflow.world.group import CollectiveError

__all__ = ["PARTNERLESS", "POLL_S", "TOO_LATE", "LeftOut", "Recovery", "connected", "set_poll_s"]

# How often a worker waiting on the others looks at the store: a recovering one at their
# answers and beats, the members waiting for a newcomer at the knocks.
POLL_S = 0.02
# A whole worker set's polls a second during an agreement (Note [An agreement's requests]).
_SET_POLLS_PER_S = 2500

_log = logging.getLogger("vflow")


TOO_LATE = "it answered after they had agreed on who is left"
PARTNERLESS = "its replica lost a stage; it waits for a worker of that stage to pair with"


class LeftOut(Exception):
    """The survivors of a failure agreed on a worker set without this worker (it
    answered too late, or its pipeline replica lost a stage: Note [Replicas as members],
    vflow/elastic/replicas.py): it asks to join again (Note [Joining a running job],
    vflow/elastic/admission.py). Its message says why."""

    def __init__(self, why: str = TOO_LATE) -> None:
        super().__init__(why)


class Recovery:
    """Note [Recovering within the round], one worker's part: ``groups`` makes the new
    set's group, ``report`` names a lost store; every wait on the others is bounded by
    ``timeout_s``, and at most ``max_recoveries`` agreements in a row are tried; a
    worker whose probe refuses, or whose beats stood still for ``gone_after_s``, is gone
    (Note [Beats], vflow/elastic/rendezvous.py)."""

    def __init__(
        self,
        groups: Groups,
        report: Reporter,
        *,
        timeout_s: float,
        max_recoveries: int,
        gone_after_s: float = GONE_AFTER_S,
        reachable: Callable[[list[str]], list[bool]] = network.reachable,
        refused: Callable[[list[str]], list[bool]] = network.refused,
        tell: Callable[[list[str], str], list[bool]] = network.tell,
        layout: Layout | None = None,
    ) -> None:
        # A pipelined job's survivors keep whole replicas (Note [Replicas as members],
        # vflow/elastic/replicas.py).
        self.layout: Layout = Workers() if layout is None else layout
        self.groups = groups
        self.report = report
        self.timeout_s = timeout_s
        self.max_recoveries = max_recoveries
        self.gone_after_s = gone_after_s
        # Which probe endpoints this worker reaches, and which refuse (Note [Probing a
        # peer]); the protocol simulator (benchmarks/store_load.py) stands in for the
        # first.
        self.reachable = reachable
        self.refused = refused
        self.tell = tell
        self.agreed_at: float | None = None  # time.monotonic() of the last decision

    def recover(
        self, rdzv: Rendezvous, workers: WorkerSet, ex: AnyExecutor, newcomers: tuple[int, ...]
    ) -> WorkerSet | None:
        """The survivors of a failed collective form their worker set again in the same
        round; returns it, or None when they could not within ``max_recoveries``
        attempts (then a new round). Raises LeftOut when the others went on without
        this worker."""
        self.groups.abort(ex)
        try:
            return self._reform(rdzv, workers, ex, newcomers)
        except dist.DistError as e:
            self.report.store_lost(ex, e, "the survivors of a failure agreed on who is left")

    def _reform(
        self, rdzv: Rendezvous, workers: WorkerSet, ex: AnyExecutor, newcomers: tuple[int, ...]
    ) -> WorkerSet | None:
        """An agreement and the agreed set's group, again on the next agreement's keys
        when a worker fails while the group forms, up to ``max_recoveries`` times."""
        rnd = workers.round
        for attempt in range(self.max_recoveries):
            workers = self.agree(rdzv, workers, newcomers)
            group = None
            try:
                group = self.groups.make(rnd, workers.name, workers.ranks)
                self.groups.move(ex, group)
                publish(rdzv, ex, workers)
                return workers
            except CollectiveError as e:
                if group is not None:
                    self.groups.discard(group)
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

    def agree(self, rdzv: Rendezvous, workers: WorkerSet, newcomers: tuple[int, ...]) -> WorkerSet:
        """Steps 1-4 of Note [Recovering within the round]: the survivors of
        ``workers`` agree on who is left (``newcomers`` are not waited for); returns the
        next worker set. Raises LeftOut when it goes on without this worker."""
        rnd = workers.round
        store = rnd.store
        prefix = f"vflow/recover{workers.generation}"
        _say(store, f"{prefix}/alive", rnd.rank, rdzv.probe_endpoint)
        waited_for = [r for r in workers.ranks if r not in newcomers]
        alive = self._answers(rdzv, workers, f"{prefix}/alive", waited_for, tell_broken=True)
        survivors = [r for r in workers.ranks if r in alive]
        missed = self._reach(rdzv, workers, prefix, {r: str(alive[r]) for r in survivors})
        proposal = connected([r for r in workers.ranks if r in missed], missed)
        decided = json.loads(store.compare_set(f"{prefix}/decision", "", json.dumps(proposal)))
        self.agreed_at = time.monotonic()
        # Whole replicas of the survivors: a survivor whose replica lost a stage is left
        # out, as one that answered too late.
        if rnd.rank not in decided:
            raise LeftOut
        kept = self.layout.shape(rnd, decided)
        if rnd.rank not in kept:
            raise LeftOut(PARTNERLESS)
        return workers.successor(kept)

    def _answers(
        self,
        rdzv: Rendezvous,
        workers: WorkerSet,
        key: str,
        waited_for: list[int],
        tell_broken: bool = False,
    ) -> dict[int, Any]:
        """What the workers of ``workers`` said under ``key`` (``_say``), once every
        worker of ``waited_for`` has either said or is gone (its probe refuses, or its
        beats stopped: Note [Beats], vflow/elastic/rendezvous.py), within ``timeout_s``.
        Others (newcomers) are not waited for: one that has not answered when the others
        are settled is left out (a slow joiner never stalls the job). ``tell_broken``:
        a watched worker that has not answered is told at once that the set broke, and
        found gone if its probe refuses (Note [A survivor blocked on survivors])."""
        store = workers.round.store
        poll = set_poll_s(len(workers.ranks))
        deadline = time.monotonic() + self.timeout_s
        reader = _Reader(store, key, workers.ranks)
        last: dict[int, tuple[int, float]] = {}
        probed: dict[int, float] = {}
        told: set[int] = set()
        refused: list[int] = []  # told, and their probes refused: dead (filled by a thread)
        pending = set(waited_for)
        watched: list[int] | None = None
        while True:
            said, gone = reader.read()
            if reader.fresh or watched is None:  # work only when an answer came
                pending.difference_update(reader.fresh)
                # Note [Each silent worker watched once]
                watched = _watched(workers.ranks, workers.round.rank, said, gone, pending)
            now = time.monotonic()
            if pending:
                for r, beat in rdzv.beats(watched).items():
                    if r not in last:  # Note [The next worker's beats]
                        seen = rdzv.beat_seen(r)
                        last[r] = seen if seen is not None and seen[0] == beat else (beat, now)
                    elif last[r][0] != beat:
                        last[r] = (beat, now)
                found = [r for r in watched if now - last[r][1] >= self.gone_after_s]
                found += [r for r in set(refused) if r in pending and r not in found]
                found += self._refusing(rdzv, watched, last, probed, now, found)
                for r in found:  # Note [A verdict said once]
                    _put(store, key, [_GONE, r])
                if pending.issubset(found):
                    return said
                if tell_broken:
                    quiet = [r for r in watched if r in pending and r not in told]
                    if quiet:
                        told.update(quiet)
                        self._tell_broken(rdzv, workers, quiet, refused)
            if not pending or now > deadline:
                return said
            time.sleep(poll)

    def _tell_broken(
        self, rdzv: Rendezvous, workers: WorkerSet, ranks: list[int], refused: list[int]
    ) -> None:
        """Sends "broken <set>" to the probes of ``ranks`` (Note [A survivor blocked on
        survivors]) from a thread of its own, for a silent host's connection attempt
        must not hold up this worker's polls; appends to ``refused`` those whose probe
        then refuses connections (their process is gone: Note [Beats])."""
        endpoints = rdzv.probes(ranks)
        asked = [r for r in ranks if r in endpoints]

        def tell() -> None:
            delivered = self.tell([endpoints[r] for r in asked], f"{BROKEN} {workers.key}")
            missed = [r for r, ok in zip(asked, delivered, strict=True) if not ok]
            if missed:
                dead = self.refused([endpoints[r] for r in missed])
                refused.extend(r for r, d in zip(missed, dead, strict=True) if d)

        if asked:
            threading.Thread(target=tell, name="vflow-tell-broken", daemon=True).start()

    def _refusing(
        self,
        rdzv: Rendezvous,
        pending: list[int],
        last: dict[int, tuple[int, float]],
        probed: dict[int, float],
        now: float,
        found: list[int],
    ) -> list[int]:
        """The workers of ``pending`` (those this worker watches) whose beats stood
        still for SUSPECT_S and whose probe refuses (Note [Beats]): dead. Each is asked
        at most once per SUSPECT_S (``probed``: when it was last asked)."""
        suspects = [
            r
            for r in pending
            if r not in found
            and now - last[r][1] >= SUSPECT_S
            and now - probed.get(r, -SUSPECT_S) >= SUSPECT_S
        ]
        if not suspects:
            return []
        probed.update((r, now) for r in suspects)
        endpoints = rdzv.probes(suspects)
        asked = [r for r in suspects if r in endpoints]
        answers = self.refused([endpoints[r] for r in asked])
        return [r for r, dead in zip(asked, answers, strict=True) if dead]

    def _reach(
        self, rdzv: Rendezvous, workers: WorkerSet, prefix: str, endpoints: dict[int, str]
    ) -> dict[int, list[int]]:
        """Note [Recovering within the round], step 3: whom each survivor failed to
        reach (Note [Probing a peer], vflow/world/network.py), for those that said;
        ``endpoints``: the survivors' probe endpoints."""
        me = workers.round.rank
        others = [r for r in endpoints if r != me]
        found = self.reachable([endpoints[r] for r in others])
        # Whom it missed, not whom it reached: a row is empty when all is well, where a
        # list of the reached would make the step's answers grow with N^2.
        mine = [r for r, ok in zip(others, found, strict=True) if not ok]
        _say(workers.round.store, f"{prefix}/reach", me, mine)
        said = self._answers(rdzv, workers, f"{prefix}/reach", list(endpoints))
        return {r: [int(k) for k in row] for r, row in said.items()}


def set_poll_s(workers: int) -> float:
    """How often each of ``workers`` looks at the store while they wait on each other
    (Note [An agreement's requests])."""
    return max(POLL_S, workers / _SET_POLLS_PER_S)


def _say(store: dist.Store, key: str, rank: int, value: object) -> None:
    """Adds ``rank``'s ``value`` to the answers under ``key`` (Note [An agreement's
    requests])."""
    _put(store, key, [rank, value])


def _put(store: dist.Store, key: str, row: list[Any]) -> None:
    """An answer under ``key`` (Note [An agreement's requests]): a line appended to the
    step's index, then the step's counter raised."""
    store.append(f"{key}/index", json.dumps(row) + "\n")
    store.add(f"{key}/n", 1)


class _Reader:
    """One worker's reading of the answers under a key (Note [An agreement's
    requests]): each read asks for the counter and, when it moved, for the index, and
    parses the answers appended since the last read."""

    def __init__(self, store: dist.Store, key: str, ranks: list[int]) -> None:
        self.store = store
        self.key = key
        self.ranks = set(ranks)
        self.count = 0
        self.parsed = 0  # how much of the index has been parsed (it only grows)
        self.said: dict[int, Any] = {}
        self.gone: set[int] = set()
        self.fresh: list[int] = []  # the ranks the last read found said or gone

    def read(self) -> tuple[dict[int, Any], set[int]]:
        """The answers of the workers of ``ranks`` so far, and those of them found gone
        (Note [A verdict said once])."""
        self.fresh = []
        count = int(self.store.add(f"{self.key}/n", 0))
        if count == self.count:
            return self.said, self.gone
        self.count = count
        index = self.store.get(f"{self.key}/index")
        # Whole lines only: an append is atomic, so the index ends with a newline.
        new = index[self.parsed :]
        self.parsed = len(index)
        if not new.strip():
            return self.said, self.gone
        # One parse for all: a thousand answers cost one json.loads, not a thousand.
        rows = json.loads(b"[" + b",".join(new.strip().split(b"\n")) + b"]")
        for first, second in rows:
            if first == _GONE:
                if int(second) not in self.gone:
                    self.gone.add(int(second))
                    self.fresh.append(int(second))
            elif first in self.ranks and int(first) not in self.said:
                self.said[int(first)] = second
                self.fresh.append(int(first))
        return self.said, self.gone


def _said(store: dist.Store, key: str, ranks: list[int]) -> tuple[dict[int, Any], set[int]]:
    """All the answers under ``key`` of the workers of ``ranks``, and those of them
    found gone."""
    return _Reader(store, key, ranks).read()


def _watched(
    order: list[int], me: int, said: dict[int, Any], gone: set[int], pending: set[int]
) -> list[int]:
    """Note [Each silent worker watched once]: the workers whose beats ``me`` watches:
    the ``pending`` ones after it in the set's ``order`` (around the ring) up to the
    next worker that answered and is not gone, and that worker too while a pending one
    follows it before the next that answered."""
    between, next_answered = _up_to_next_answer(order, me, said, gone)
    watched = [r for r in between if r in pending]
    if next_answered is not None:
        theirs, _ = _up_to_next_answer(order, next_answered, said, gone)
        if any(r in pending for r in theirs):
            watched.append(next_answered)
    return watched


def _up_to_next_answer(
    order: list[int], start: int, said: dict[int, Any], gone: set[int]
) -> tuple[list[int], int | None]:
    """The workers after ``start`` in ``order`` (around the ring) before the next one
    that answered and is not gone, and that one (None when there is none)."""
    at = order.index(start)
    between = []
    for step in range(1, len(order)):
        r = order[(at + step) % len(order)]
        if r in said and r not in gone:
            return between, r
        between.append(r)
    return between, None


# Note [Each silent worker watched once]
# A survivor that read the beats of every worker it still waits for would read N of
# them a poll at first (the survivors arrive over a step), N^2 at the store across the
# set. Instead each worker watches only the workers after it in the set's order (a
# ring) up to the next worker that answered, and that one too while it has workers of
# its own to watch: every worker that has not answered is watched by the nearest
# survivor before it that did, and every survivor that watches someone by the one
# before it. A worker that answered and then died (or whose poller starved) is found
# gone by the one before it, whose watch then reaches past it to the workers it
# watched. A survivor that watches nobody needs no watcher: its death leaves nobody
# unwatched, and it answered (the agreement's next part waits for it again). So near
# the end, when only the dead are left to find, all but their watchers poll the
# answers' counter alone, one request. Survivors that read the answers at different
# moments see fewer answers, never more, so their watches overlap rather than leave a
# gap (a stale view sees more workers pending: it watches more, never less); a worker
# changing watchers starts its verdict's clock over, which costs at most one
# gone_after_s. A verdict on a worker that answered excludes nobody (it answered); it
# only moves the watch. So the beats read per poll over the whole set are those of the
# workers waited for plus at most one per survivor, O(N), where every survivor reading
# every waited-for worker's beats would read O(N^2).

# Note [A verdict said once]
# Survivors reach the agreement over as long as a step takes (each fails when it reaches
# the failed step's collective), and each judges a beat still only on its own clock: a
# survivor that arrives a second after the crash would watch the dead worker's beats
# for another gone_after_s although the others found it gone long before. So a
# survivor that finds a worker gone says so under the same key as the answers, and the
# others take its word: an agreement waits gone_after_s after the first survivor to
# look, not after the last. A live worker that has not answered, found gone by a
# survivor (its poller starved), counts as gone for all of them, as it would have for
# that survivor's decision alone.
_GONE = "gone"


def connected(order: list[int], missed: dict[int, list[int]]) -> list[int]:
    """The workers of ``order`` taken one by one, each kept if neither it nor any worker
    kept before it missed the other (``missed``: whom each failed to reach): a worker set
    whose every pair can talk (Note [Recovering within the round]). Linear in the
    workers and the misses, not in the pairs: a thousand survivors that all reach each
    other cost a thousand steps."""
    apart: dict[int, set[int]] = {r: set() for r in order}
    for r, row in missed.items():
        for k in row:
            if r in apart and k in apart:
                apart[r].add(k)
                apart[k].add(r)
    kept: list[int] = []
    taken: set[int] = set()
    for r in order:
        if not apart[r] & taken:
            kept.append(r)
            taken.add(r)
    return kept
