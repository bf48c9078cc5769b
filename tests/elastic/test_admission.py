"""vflow.elastic.admission: newcomers let into a running job (Note [Joining a running
job]), the knockers' and the members' sides against a store in this process, whose keys
the tests read. Knockers are real ``Rendezvous.knock`` calls (threads, and processes
that are killed or stopped); members are handles adopted into a round, whose pollers
beat, and the lowest of which watches the door, as a training set's do. Moving
executors onto the grown set needs process groups and executors:
tests/elastic/test_job.py runs that part."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch.distributed as dist

from tests.support.rendezvous import local_store, until
from vflow.elastic.admission import let_in
from vflow.elastic.groups import WorkerSet
from vflow.elastic.rendezvous import ACK_S, Rendezvous

JOB = "admission"
ROUND = f"vflow/{JOB}/boot/round0"  # a round's key prefix, as next_round names it
REPO_ROOT = Path(__file__).resolve().parents[2]
KNOCK_S = 30.0


def _members(worker: Callable[[], Rendezvous], count: int) -> list[tuple[Rendezvous, WorkerSet]]:
    """The ``count`` members of a running worker set: round ranks 0.. of round 0."""
    handles = [worker() for _ in range(count)]
    ranks = list(range(count))
    for rank, h in enumerate(handles):
        h.watch(rank == 0)  # as groups.publish has it
    return [(h, WorkerSet(h.adopt(ROUND, 0, rank), ranks)) for rank, h in enumerate(handles)]


def _counter(store: dist.Store, name: str) -> int:
    return int(store.add(f"vflow/{JOB}/{name}", 0))


def _answer(store: dist.Store, ticket: int) -> dict[str, object]:
    """The members' final answer to ``ticket`` (Note [Knockers acknowledge])."""
    return dict(json.loads(store.get(f"vflow/{JOB}/admit/{ticket}/in")))


def _knocker(store: dist.TCPStore) -> subprocess.Popen[bytes]:
    """A knocker in a process of its own, to be killed or stopped while it waits."""
    command = [sys.executable, "-c", _KNOCKER, f"127.0.0.1:{store.port}", JOB]
    return subprocess.Popen(command, cwd=REPO_ROOT)


_KNOCKER = (
    "import sys\n"
    "from tests.support.rendezvous import worker_rendezvous\n"
    "worker_rendezvous(sys.argv[1], sys.argv[2]).knock(600.0)\n"
)


def test_several_knockers_are_let_in_at_once_by_one_decision() -> None:
    """Steps 1-3: three workers knock; only the lowest member watches the door and
    reports them once the window has passed; the members' decisions, keyed by the
    step, are the first member's view (a second member that saw one ticket adopts
    them); each knocker acknowledges its offer and gets its own new round rank in the
    grown set, and the answered counter covers them all."""
    with local_store(JOB) as (store, worker):
        (first, set0), (second, set1) = _members(worker, 2)
        # Nobody knocked: the set stays as it is.
        assert let_in(first, set0, 6, []) is set0
        assert json.loads(store.get(f"{ROUND}/vflow/admit0/6"))["tickets"] == []
        with ThreadPoolExecutor(3) as pool:
            knocks = [pool.submit(worker().knock, KNOCK_S) for _ in range(3)]
            until("three knocks", lambda: first.pending(8) == [1, 2, 3])
            until("the watching member counting them", lambda: first.waiting() == 3)
            assert second.waiting() == 0  # it does not watch
            grown = let_in(first, set0, 7, first.pending(8))
            adopted = let_in(second, set1, 7, [1])
            answers = [k.result(timeout=KNOCK_S) for k in knocks]
        decision = json.loads(store.get(f"{ROUND}/vflow/admit0/7"))
        assert decision["tickets"] == [1, 2, 3] and decision["round"] is False
        final = json.loads(store.get(f"{ROUND}/vflow/admit0/7/in"))
        assert final["tickets"] == [1, 2, 3]
        newcomers = final["ranks"]
        assert len(set(newcomers)) == 3 and all(r < 0 for r in newcomers)
        assert grown is not None and adopted is not None
        assert grown.ranks == adopted.ranks == [0, 1, *newcomers]
        assert grown.generation == adopted.generation == 1
        assert sorted(store.get(f"vflow/{JOB}/acks/1").decode().strip(",").split(",")) == [
            "1",
            "2",
            "3",
        ]
        by_ticket = {a["ticket"]: a for a in answers}
        assert sorted(by_ticket) == [1, 2, 3]
        for ticket, rank in zip(final["tickets"], newcomers, strict=True):
            answer = by_ticket[ticket]
            assert answer["rank"] == rank and answer["ranks"] == grown.ranks
            assert answer["newcomers"] == newcomers and answer["generation"] == 1
            assert (answer["prefix"], answer["round"]) == (ROUND, 0)
        assert _counter(store, "answered") == 3
        assert first.pending(8) == [] and second.pending(8) == []


def test_twenty_knockers_at_once_are_let_in_by_one_grow() -> None:
    """No limit on the tickets followed: twenty workers knocking at once are one
    decision and one grown set of 21, each acknowledged, with twenty distinct ranks."""
    with local_store(JOB) as (store, worker):
        ((member, workers),) = _members(worker, 1)
        with ThreadPoolExecutor(20) as pool:
            knocks = [pool.submit(worker().knock, KNOCK_S) for _ in range(20)]
            until("twenty knocks", lambda: member.pending(64) == list(range(1, 21)))
            until("the member counting them", lambda: member.waiting() == 20)
            grown = let_in(member, workers, 2, member.pending(64))
            answers = [k.result(timeout=KNOCK_S) for k in knocks]
        assert grown is not None and grown.generation == 1 and len(set(grown.ranks)) == 21
        assert sorted(a["rank"] for a in answers) == sorted(grown.ranks[1:])
        assert all(a["ranks"] == grown.ranks for a in answers)
        assert _counter(store, "answered") == 20 and member.pending(64) == []


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
        assert json.loads(store.get(f"{ROUND}/vflow/admit1/5/in"))["tickets"] == [3]
        assert _counter(store, "answered") == 3


def test_a_knocker_that_died_while_it_waited_is_never_let_in() -> None:
    """Note [Knockers acknowledge]: a knocker killed while it waits is offered a place
    with the live one that knocked after it, never acknowledges, and is answered
    "again"; the live one comes in alone, and the members waited about ACK_S for the
    dead one, not a group's creation timeout."""
    with local_store(JOB) as (store, worker):
        ((member, workers),) = _members(worker, 1)
        doomed = _knocker(store)
        try:
            until("the knocker's ticket", lambda: _counter(store, "knocks") == 1, timeout=120)
            doomed.kill()
            doomed.wait(timeout=30)
            with ThreadPoolExecutor(1) as pool:
                knock = pool.submit(worker().knock, KNOCK_S)
                until("the live knock", lambda: member.pending(8) == [1, 2])
                start = time.monotonic()
                grown = let_in(member, workers, 3, member.pending(8))
                waited = time.monotonic() - start
                answer = knock.result(timeout=KNOCK_S)
        finally:
            if doomed.poll() is None:
                doomed.kill()
                doomed.wait(timeout=30)
        assert answer["ticket"] == 2
        assert grown is not None and grown.ranks == [0, answer["rank"]]
        assert _answer(store, 1) == {"again": True}
        assert json.loads(store.get(f"{ROUND}/vflow/admit0/3/in"))["tickets"] == [2]
        assert _counter(store, "answered") == 2
        assert waited >= ACK_S  # it waited for the dead one's acknowledgement


def test_a_knocker_stopped_past_its_offer_knocks_again_and_is_let_in_later() -> None:
    """A knocker that was alive but did not acknowledge in time (stopped, starved) is
    answered "again" and takes a new ticket once it runs; the set lets it in after a
    later step."""
    with local_store(JOB) as (store, worker):
        ((member, workers),) = _members(worker, 1)
        slow = _knocker(store)
        try:
            until("the knocker's ticket", lambda: _counter(store, "knocks") == 1, timeout=120)
            slow.send_signal(signal.SIGSTOP)
            same = let_in(member, workers, 3, member.pending(8))
            assert same is workers  # nobody acknowledged
            assert _answer(store, 1) == {"again": True}
            slow.send_signal(signal.SIGCONT)
            until("its new ticket", lambda: member.pending(8) == [2])
            grown = let_in(member, workers, 4, member.pending(8))
            assert grown is not None and len(grown.ranks) == 2
            assert slow.wait(timeout=KNOCK_S) == 0  # its knock returned: it is in
        finally:
            if slow.poll() is None:
                slow.send_signal(signal.SIGCONT)
                slow.kill()
                slow.wait(timeout=30)
        assert json.loads(store.get(f"{ROUND}/vflow/admit0/4/in"))["tickets"] == [2]
        assert _counter(store, "answered") == 2


def test_a_member_waits_for_an_offer_written_late_before_its_window_starts() -> None:
    """Note [Knockers acknowledge]: a member that reaches the acknowledgements long
    before the member that writes the offer has written it (a loaded host) counts its
    window from when it sees the offer, so the knocker, which acknowledges once it sees
    the offer, is found acknowledged; a window counted from the member's own start would
    have closed empty, and its view, proposed first, would have answered "again"."""
    window = 0.5
    with local_store(JOB) as (store, worker):
        ((member, _), (writer, _)) = _members(worker, 2)
        knocker = _knocker(store)
        try:
            until("the knocker's ticket", lambda: _counter(store, "knocks") == 1, timeout=120)
            with ThreadPoolExecutor(1) as pool:
                acked = pool.submit(member.acknowledged, "acks/1", [1], 0.02, window_s=window)
                time.sleep(3 * window)  # the writer is late: past a window from the start
                assert not acked.done()
                writer.offer([1], "acks/1", write=True)
                assert acked.result(timeout=KNOCK_S) == [1]
        finally:
            knocker.kill()
            knocker.wait(timeout=30)


def test_a_member_gives_up_on_an_offer_never_written() -> None:
    """The member that was to write the offer died before it did: the others wait
    ``offer_s`` for the offer, then propose nobody."""
    offer_s = 0.5
    with local_store(JOB) as (_, worker):
        ((member, _),) = _members(worker, 1)
        start = time.monotonic()
        assert member.acknowledged("acks/9", [9], 0.02, window_s=0.1, offer_s=offer_s) == []
        assert time.monotonic() - start >= offer_s
