"""vflow.elastic.admission: newcomers let into a running job (Note [Joining a running
job]), the knockers' and the members' sides against a store in this process, whose keys
the tests read. Knockers are real ``Rendezvous.knock`` calls (threads, and one process
that is killed); members are handles adopted into a round, whose pollers beat and watch
the knockers as a training set's do. Moving executors onto the grown set needs process
groups and executors: tests/elastic/test_job.py runs that part."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch.distributed as dist

from tests.support.rendezvous import local_store, until
from vflow.elastic.admission import let_in
from vflow.elastic.groups import WorkerSet
from vflow.elastic.rendezvous import Rendezvous

JOB = "admission"
ROUND = f"vflow/{JOB}/boot/round0"  # a round's key prefix, as next_round names it
REPO_ROOT = Path(__file__).resolve().parents[2]
KNOCK_S = 30.0


def _members(worker: Callable[[], Rendezvous], count: int) -> list[tuple[Rendezvous, WorkerSet]]:
    """The ``count`` members of a running worker set: round ranks 0.. of round 0."""
    handles = [worker() for _ in range(count)]
    ranks = list(range(count))
    return [(h, WorkerSet(h.adopt(ROUND, 0, rank), ranks)) for rank, h in enumerate(handles)]


def _counter(store: dist.Store, name: str) -> int:
    return int(store.add(f"vflow/{JOB}/{name}", 0))


def _answer(store: dist.Store, ticket: int) -> dict[str, object]:
    return dict(json.loads(store.get(f"vflow/{JOB}/admit/{ticket}")))


def test_several_knockers_are_let_in_at_once_by_one_decision() -> None:
    """Steps 1-3: three workers knock; the members' decision, keyed by the step, is the
    first member's view (a second member that saw only one knock adopts it); each
    knocker gets its own new round rank in the grown set, and the answered counter
    covers them all."""
    with local_store(JOB) as (store, worker):
        (first, set0), (second, set1) = _members(worker, 2)
        # Nobody knocked: the set stays as it is.
        assert let_in(first, set0, 6, []) is set0
        assert json.loads(store.get(f"{ROUND}/vflow/admit0/6"))["tickets"] == []
        with ThreadPoolExecutor(3) as pool:
            knocks = [pool.submit(worker().knock, KNOCK_S) for _ in range(3)]
            until("three knocks", lambda: first.pending(8) == [1, 2, 3])
            until("the members' pollers counting them", lambda: second.waiting() == 3)
            grown = let_in(first, set0, 7, first.pending(8))
            adopted = let_in(second, set1, 7, [1])
            answers = [k.result(timeout=KNOCK_S) for k in knocks]
        decision = json.loads(store.get(f"{ROUND}/vflow/admit0/7"))
        assert decision["tickets"] == [1, 2, 3] and decision["round"] is False
        newcomers = decision["ranks"]
        assert len(set(newcomers)) == 3 and all(r < 0 for r in newcomers)
        assert grown is not None and adopted is not None
        assert grown.ranks == adopted.ranks == [0, 1, *newcomers]
        assert grown.generation == adopted.generation == 1
        by_ticket = {a["ticket"]: a for a in answers}
        assert sorted(by_ticket) == [1, 2, 3]
        for ticket, rank in zip(decision["tickets"], newcomers, strict=True):
            answer = by_ticket[ticket]
            assert answer["rank"] == rank and answer["ranks"] == grown.ranks
            assert answer["newcomers"] == newcomers and answer["generation"] == 1
            assert (answer["prefix"], answer["round"]) == (ROUND, 0)
        assert _counter(store, "answered") == 3
        assert first.pending(8) == [] and second.pending(8) == []


def test_knockers_beyond_the_sets_room_are_let_in_after_a_later_step() -> None:
    """A set with room for two of three knockers lets the first two in; the grown set
    lets the third in after its next step, with a round rank not used before."""
    with local_store(JOB) as (store, worker):
        ((member, workers),) = _members(worker, 1)
        with ThreadPoolExecutor(3) as pool:
            knocks = [pool.submit(worker().knock, KNOCK_S) for _ in range(3)]
            until("three knocks", lambda: member.pending(8) == [1, 2, 3])
            grown = let_in(member, workers, 4, member.pending(2))
            assert grown is not None and len(grown.ranks) == 3
            assert member.pending(8) == [3]
            last = let_in(member, grown, 5, member.pending(8))
            answers = {a["ticket"]: a for a in (k.result(timeout=KNOCK_S) for k in knocks)}
        assert last is not None and last.generation == 2
        assert last.ranks[:3] == grown.ranks and len(set(last.ranks)) == 4
        assert answers[3]["rank"] == last.ranks[3] and answers[3]["ranks"] == last.ranks
        assert json.loads(store.get(f"{ROUND}/vflow/admit1/5"))["tickets"] == [3]
        assert _counter(store, "answered") == 3


# A knocker in a process of its own, to be killed while it waits for its answer.
_KNOCKER = (
    "import sys\n"
    "from tests.support.rendezvous import worker_rendezvous\n"
    "worker_rendezvous(sys.argv[1], sys.argv[2]).knock(600.0)\n"
)


def test_a_knocker_that_died_while_it_waited_is_not_let_in() -> None:
    """Note [Knockers beat too]: a knocker killed while it waits stops beating on its
    ticket; the members' pollers, which counted it while it beat, pass it over, the
    live knocker after it is let in alone, and the dead one's ticket is answered
    "again"."""
    with local_store(JOB) as (store, worker):
        ((member, workers),) = _members(worker, 1)
        command = [sys.executable, "-c", _KNOCKER, f"127.0.0.1:{store.port}", JOB]
        doomed = subprocess.Popen(command, cwd=REPO_ROOT)
        try:
            until("the knocker's ticket", lambda: _counter(store, "knocks") == 1, timeout=120)
            until("its beats", lambda: _counter(store, "knock/1/beat") >= 2)
            until("the member counting it", lambda: member.waiting() == 1)
            doomed.kill()
            doomed.wait(timeout=30)
            with ThreadPoolExecutor(1) as pool:
                knock = pool.submit(worker().knock, KNOCK_S)
                until("the live knock", lambda: _counter(store, "knocks") == 2)
                until("the dead knocker passed over", lambda: member.pending(8) == [2])
                until("the member counting one knocker", lambda: member.waiting() == 1)
                grown = let_in(member, workers, 3, member.pending(8))
                answer = knock.result(timeout=KNOCK_S)
        finally:
            if doomed.poll() is None:
                doomed.kill()
                doomed.wait(timeout=30)
        assert answer["ticket"] == 2
        assert grown is not None and grown.ranks == [0, answer["rank"]]
        assert _answer(store, 1) == {"again": True}
        assert _counter(store, "answered") == 2


def test_a_knocker_passed_over_while_it_lived_knocks_again_and_is_let_in_later() -> None:
    """Note [Knockers beat too]: when the members let a later ticket in, a skipped
    ticket is answered "again"; its knocker, alive after all (stopped, starved), takes
    a new ticket instead of joining, and the set lets it in after a later step."""
    with local_store(JOB) as (store, worker):
        ((member, workers),) = _members(worker, 1)
        with ThreadPoolExecutor(2) as pool:
            early = pool.submit(worker().knock, KNOCK_S)
            until("the first ticket", lambda: _counter(store, "knocks") == 1)
            late = pool.submit(worker().knock, KNOCK_S)
            until("the second ticket", lambda: _counter(store, "knocks") == 2)
            # This member's view passed ticket 1 over, as when its knocker's beats stood
            # still for GONE_AFTER_S.
            grown = let_in(member, workers, 3, [2])
            assert late.result(timeout=KNOCK_S)["ticket"] == 2
            assert _answer(store, 1) == {"again": True}
            until("the skipped knocker's new ticket", lambda: _counter(store, "knocks") == 3)
            assert not early.done()
            assert member.pending(8) == [3]
            assert grown is not None
            last = let_in(member, grown, 4, member.pending(8))
            answer = early.result(timeout=KNOCK_S)
        assert answer["ticket"] == 3 and answer["generation"] == 2
        assert last is not None and answer["rank"] == last.ranks[-1]
        assert last.ranks[:2] == grown.ranks
        assert _counter(store, "answered") == 3
