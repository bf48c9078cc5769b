"""vflow.elastic.agreement: the survivors' agreement on who is left after a crash (Note
[Recovering within the round], steps 1-4), against a store in this process whose keys
the tests read, with survivors that are real handles adopted into a round (their
pollers beat, their probes answer). Step 5, the agreed set's group and the executors'
move onto it, needs process groups and executors: tests/elastic/test_job.py runs it."""

from __future__ import annotations

import json
import socket
import time
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch.distributed as dist

from tests.support.rendezvous import local_store, until
from vflow.elastic.agreement import (
    LeftOut,
    Recovery,
    _put,
    _Reader,
    _said,
    _say,
    _watched,
    connected,
)
from vflow.elastic.groups import Groups, WorkerSet, next_member
from vflow.elastic.rendezvous import BROKEN, GONE_AFTER_S
from vflow.elastic.reporting import Reporter
from vflow.world import network
from vflow.world.store import RequestCounts

JOB = "agreement"
ROUND = f"vflow/{JOB}/boot/round0"  # a round's key prefix, as next_round names it
KEYS = f"{ROUND}/vflow/recover0"  # the first agreement's keys in the round


def _recovery(timeout_s: float, gone_after_s: float = GONE_AFTER_S) -> Recovery:
    """One worker's Recovery; its groups and report serve only after the agreement."""
    report = Reporter(
        JOB,
        "127.0.0.1:1",
        [],
        checkpoint=None,
        min_workers=1,
        join_timeout_s=timeout_s,
        timeout_s=timeout_s,
    )
    return Recovery(
        Groups("gloo", timeout_s, None),
        report,
        timeout_s=timeout_s,
        max_recoveries=3,
        gone_after_s=gone_after_s,
    )


def _rows(store: dist.Store, step: str) -> dict[Any, Any]:
    """The answers of the first agreement's ``step`` ("alive", "reach"), by rank: a line
    each in the step's index (Note [An agreement's requests]), and under "gone" the
    ranks found gone (Note [A verdict said once])."""
    key = f"{KEYS}/{step}"
    rows: dict[Any, Any] = {"gone": set()}
    for line in store.get(f"{key}/index").decode().splitlines():
        first, second = json.loads(line)
        if first == "gone":
            rows["gone"].add(second)
        else:
            rows[first] = second
    return rows


def test_survivors_agree_without_a_member_that_dies_during_the_agreement() -> None:
    """Of a set of four, 3 died before the agreement, and 2 says it is alive (step 1),
    then dies before saying whom it reaches (step 3). 0 and 1, each on its own, wait
    for 2's row until its beats stop, not for the timeout, and adopt one decision: 0
    and 1. 2, stopped rather than dead, answers after the decision: it is left out."""
    with local_store(JOB) as (store, worker):
        handles = [worker() for _ in range(3)]
        sets = [WorkerSet(h.adopt(ROUND, 0, rank), [0, 1, 2, 3]) for rank, h in enumerate(handles)]
        _say(sets[2].round.store, "vflow/recover0/alive", 2, handles[2].probe_endpoint)
        handles[2].close()  # its poller stops beating, its probe stops answering
        start = time.monotonic()
        with ThreadPoolExecutor(2) as pool:
            agreeing = [pool.submit(_recovery(30.0).agree, handles[r], sets[r], ()) for r in (0, 1)]
            agreed = [a.result(timeout=60) for a in agreeing]
        assert time.monotonic() - start < 15  # not the 30 s timeout
        assert [s.ranks for s in agreed] == [[0, 1], [0, 1]]
        assert [s.generation for s in agreed] == [1, 1]
        assert json.loads(store.get(f"{KEYS}/decision")) == [0, 1]
        alive = _rows(store, "alive")
        assert sorted(r for r in alive if r != "gone") == [0, 1, 2]  # 3 never answered
        # 2 answered, then died: 1 found it gone and watched 3 past it (Note [Each silent
        # worker watched once]); 3 found gone by one, taken by the other.
        assert alive["gone"] == {2, 3}
        reach = _rows(store, "reach")
        assert reach[0] == reach[1] == [2] and 2 not in reach  # each missed 2, dead
        assert reach["gone"] == {2}
        with pytest.raises(LeftOut):
            _recovery(30.0).agree(handles[2], sets[2], ())
        assert json.loads(store.get(f"{KEYS}/decision")) == [0, 1]


def test_a_newcomer_of_a_set_that_was_forming_is_not_waited_for() -> None:
    """Step 2: the survivors of a set that broke while it formed do not wait for its
    newcomers: one that lives (it beats) but does not answer is left out at once. A
    member that lives and does not answer is waited for, up to ``timeout_s``."""
    with local_store(JOB) as (store, worker):
        member, newcomer = worker(), worker()
        rnd = member.adopt(ROUND, 0, 0)
        newcomer.adopt(ROUND, 0, -1)  # its poller beats in the round; it never answers
        until("the newcomer's beats", lambda: member.beats([-1])[-1] > 1)
        start = time.monotonic()
        agreed = _recovery(30.0).agree(member, WorkerSet(rnd, [0, -1]), (-1,))
        assert time.monotonic() - start < 15  # not the 30 s timeout
        assert agreed.ranks == [0] and json.loads(store.get(f"{KEYS}/decision")) == [0]
        start = time.monotonic()
        waited = _recovery(2.0).agree(member, WorkerSet(rnd, [0, -1], generation=1), ())
        assert time.monotonic() - start >= 2.0
        assert waited.ranks == [0] and waited.generation == 2
        assert json.loads(store.get(f"{ROUND}/vflow/recover1/decision")) == [0]


def test_survivors_agree_on_a_set_whose_every_pair_reaches_each_other() -> None:
    """Step 3: after a partition between 1 and 2 (both reach 0), the set keeps 0 and
    the first of them; a one-way cut counts as a cut; with everybody reaching
    everybody, nobody is left out."""
    full: dict[int, list[int]] = {0: [], 1: [], 2: []}  # whom each missed
    assert connected([0, 1, 2], full) == [0, 1, 2]
    cut = {0: [], 1: [2], 2: [1]}
    assert connected([0, 1, 2], cut) == [0, 1]
    one_way = {0: [], 1: [], 2: [1]}
    assert connected([0, 1, 2], one_way) == [0, 1]
    assert connected(list(range(1000)), {r: [] for r in range(1000)}) == list(range(1000))
    assert connected([2, 1, 0], cut) == [2, 0]  # the set's order decides


def test_a_survivors_requests_per_poll_do_not_grow_with_the_set() -> None:
    """Note [An agreement's requests]: a poll reads the answers' counter, and when it
    moved the index, which holds the answers; the beats of the workers watched are one
    request after a check: for a set of 3 as for a set of 40. A beat key the store lost
    (a restart) is made, not waited for. An answer appended but not yet counted (its
    writer between its requests) is read at once, and once only."""
    with local_store(JOB) as (_store, worker):
        counts = RequestCounts()
        me = worker(counts)
        rnd = me.adopt(ROUND, 0, 0)
        for size in (3, 40):
            ranks = list(range(size))
            key = f"vflow/size{size}/alive"
            for r in ranks:
                _say(rnd.store, key, r, f"127.0.0.1:{r + 1}")
            reader = _Reader(rnd.store, key, ranks)
            before = counts.total("main")
            said, gone = reader.read()
            assert sorted(said) == ranks and not gone
            assert counts.total("main") - before == 2  # counter, index
            before = counts.total("main")
            assert reader.read()[0] == said and counts.total("main") - before == 1
            for r in ranks:
                rnd.store.set(f"beat/{r}", str(r + 1))
            before = counts.total("main")
            assert me.beats(ranks[1:]) == {r: r + 1 for r in ranks[1:]}  # 0 beats itself
            assert counts.total("main") - before == 2  # check + multi_get
        before = counts.total("main")
        assert me.beats([1000]) == {1000: 0}  # never beat: made at 0, not waited for
        assert counts.total("main") - before == 2  # check + add
        key = "vflow/half-written/alive"
        _say(rnd.store, key, 0, "a")
        rnd.store.append(f"{key}/index", json.dumps([1, "b"]) + "\n")  # 1 has not counted it
        reader = _Reader(rnd.store, key, [0, 1, 2])
        assert reader.read()[0] == {0: "a", 1: "b"}
        rnd.store.add(f"{key}/n", 1)  # 1 counts it: nothing new
        _say(rnd.store, key, 2, "c")
        assert reader.read()[0] == {0: "a", 1: "b", 2: "c"} and reader.fresh == [2]


def test_each_silent_worker_is_watched_by_the_survivor_before_it() -> None:
    """Note [Each silent worker watched once]: a survivor watches the workers after it
    in the set's order up to the next survivor, and that one while pending workers
    follow it; past a survivor found gone; around the ring. Once only the dead are left
    to find, only their watchers are watched, and they watch them: one request a poll
    for the others."""
    order = [0, 1, 2, 3, 4, 5]
    said = {0: "", 3: "", 4: ""}
    pending = {1, 2, 5}
    assert _watched(order, 0, said, set(), pending) == [1, 2]  # 3 has nobody to watch
    assert _watched(order, 3, said, set(), pending) == [4]  # 4 watches 5
    assert _watched(order, 4, said, set(), pending) == [5, 0]  # 0 watches 1 and 2
    assert _watched(order, 0, said, {3}, pending) == [1, 2, 4]  # 3 answered, then died
    assert _watched(order, 0, {0: ""}, set(), {1, 2, 3, 4, 5}) == [1, 2, 3, 4, 5]
    assert _watched([2, 0, 1], 1, {1: "", 0: ""}, set(), {2}) == [2]  # the set's order
    everyone_but_2 = {r: "" for r in order if r != 2}
    assert [_watched(order, r, everyone_but_2, set(), {2}) for r in everyone_but_2] == [
        [1],
        [2],
        [],
        [],
        [],
    ]


def test_a_survivor_takes_an_earlier_survivors_verdict_that_a_worker_is_gone() -> None:
    """Note [A verdict said once]: a survivor that finds a worker's beats still says so
    under the answers' key; a survivor arriving later takes its word at once instead of
    watching the beats for gone_after_s itself."""
    with local_store(JOB) as (_store, worker):
        me, other = worker(), worker()
        rnd = me.adopt(ROUND, 0, 0)
        other.adopt(ROUND, 0, 1)  # beats: a survivor that answered
        workers = WorkerSet(rnd, [0, 2, 1])  # 0 watches 2 (and 1, the next survivor)
        first, second = "vflow/first/alive", "vflow/second/alive"
        for key in (first, second):
            _say(rnd.store, key, 0, "a")
            _say(rnd.store, key, 1, "b")
        # 2 never beat: the first survivor finds it gone after gone_after_s and says so.
        start = time.monotonic()
        looked = _recovery(30.0, gone_after_s=0.5)._answers(me, workers, first, [0, 1, 2])
        assert sorted(looked) == [0, 1] and time.monotonic() - start >= 0.5
        assert _said(rnd.store, first, [0, 1, 2])[1] == {2}
        # A later survivor with a long verdict time takes the word already said.
        _put(rnd.store, second, ["gone", 2])
        start = time.monotonic()
        taken = _recovery(30.0, gone_after_s=20.0)._answers(me, workers, second, [0, 1, 2])
        assert sorted(taken) == [0, 1] and time.monotonic() - start < 5.0


def test_a_dead_workers_refusing_probe_is_a_verdict_and_a_silent_one_waits_gone_after_s() -> None:
    """Note [Beats]: a worker whose beats stood still for SUSPECT_S and whose probe
    refuses connections is dead, and found gone without waiting gone_after_s; one whose
    probe still accepts (a stopped process, a host behind a slow link) is gone only once
    its beats stood still for gone_after_s."""
    with local_store(JOB) as (_store, worker):
        me, other = worker(), worker()
        rnd = me.adopt(ROUND, 0, 0)
        other.adopt(ROUND, 0, 1)  # beats: a survivor that answered
        workers = WorkerSet(rnd, [0, 2, 1])  # 0 watches 2 (and 1, the next survivor)
        dead = socket.socket()
        dead.bind(("127.0.0.1", 0))
        dead_port = dead.getsockname()[1]
        dead.close()  # nothing listens there: a refusal, as from a killed worker's probe
        silent = network.ProbeListener("127.0.0.1")  # accepts, never beats
        try:
            first, second = "vflow/first/alive", "vflow/second/alive"
            for key in (first, second):
                _say(rnd.store, key, 0, me.probe_endpoint)
                _say(rnd.store, key, 1, other.probe_endpoint)
            # Without the refusal, 2 would be waited for until the 60 s timeout and never
            # said gone: gone_after_s is out of reach.
            rnd.store.set("probe/2", f"127.0.0.1:{dead_port}")
            looked = _recovery(60.0, gone_after_s=1e6)._answers(me, workers, first, [0, 1, 2])
            assert sorted(looked) == [0, 1]
            assert _said(rnd.store, first, [0, 1, 2])[1] == {2}
            rnd.store.set("probe/2", silent.endpoint)
            start = time.monotonic()
            looked = _recovery(60.0, gone_after_s=1.0)._answers(me, workers, second, [0, 1, 2])
            assert sorted(looked) == [0, 1] and time.monotonic() - start >= 1.0
            assert _said(rnd.store, second, [0, 1, 2])[1] == {2}
        finally:
            silent.close()


def test_a_worker_silent_since_before_the_failure_is_judged_without_waiting_again() -> None:
    """Note [The next worker's beats]: a member's poller reads the beats of the member
    after it, so a survivor that watches a worker whose beats stopped well before the
    agreement (a silent host: the collective took timeout_s to fail) finds it gone at
    once, not gone_after_s after it began to look; a survivor whose poller did not read
    them waits gone_after_s."""
    with local_store(JOB) as (_store, worker):
        me, other, peer = worker(), worker(), worker()
        rnd = me.adopt(ROUND, 0, 0)
        other.adopt(ROUND, 0, 1)  # beats: a survivor that answered
        peer.adopt(ROUND, 0, 2)
        workers = WorkerSet(rnd, [0, 2, 1])  # 0 watches 2 (and 1, the next survivor)
        assert next_member(workers) == 2
        assert next_member(WorkerSet(rnd, [0])) is None
        me.watch(False, next_member(workers))
        until("the poller reading 2's beats", lambda: (me.beat_seen(2) or (0, 0.0))[0] > 1)
        assert me.beat_seen(1) is None  # it reads one worker's beats only
        silent = network.ProbeListener("127.0.0.1")  # accepts: no refusal to go by
        try:
            peer.close()  # its beats stop
            rnd.store.set("probe/2", silent.endpoint)
            first, second = "vflow/first/alive", "vflow/second/alive"
            for key in (first, second):
                _say(rnd.store, key, 0, me.probe_endpoint)
                _say(rnd.store, key, 1, other.probe_endpoint)
            time.sleep(4.5)  # the poller reads every second: still for 3.4 s at least
            seen = me.beat_seen(2)
            assert seen is not None and time.monotonic() - seen[1] >= 2.0
            start = time.monotonic()
            looked = _recovery(60.0, gone_after_s=2.0)._answers(me, workers, first, [0, 1, 2])
            assert sorted(looked) == [0, 1] and time.monotonic() - start < 2.0
            assert _said(rnd.store, first, [0, 1, 2])[1] == {2}
            me.watch(False, None)  # the poller no longer reads them: a fresh clock
            assert me.beat_seen(2) is None
            start = time.monotonic()
            looked = _recovery(60.0, gone_after_s=2.0)._answers(me, workers, second, [0, 1, 2])
            assert sorted(looked) == [0, 1] and time.monotonic() - start >= 2.0
        finally:
            silent.close()


def test_a_worker_that_beats_but_does_not_answer_is_told_its_set_broke_once() -> None:
    """Note [A survivor blocked on survivors]: the survivor that watches a worker which
    still beats but has not answered tells it, once, that its set broke; that worker's
    rendezvous interrupts its waits on that set only. The "reach" step tells nobody
    (whoever it waits for has answered already)."""
    with local_store(JOB) as (_store, worker):
        me, other = worker(), worker()
        rnd = me.adopt(ROUND, 0, 0)
        theirs = WorkerSet(other.adopt(ROUND, 0, 1), [0, 1])
        workers = WorkerSet(rnd, [0, 1])
        key = f"{KEYS}/alive"
        told: list[float] = []
        # The blocked collective fails, and the worker answers.
        answering = _World(told, lambda: _say(theirs.round.store, key, 1, other.probe_endpoint))
        other.interrupt_on_broken(theirs.key, answering.interrupt)
        assert theirs.key == workers.key == f"{ROUND}/set0"
        # A message naming another set (an older one) is ignored.
        assert network.tell([other.probe_endpoint], f"{BROKEN} {ROUND}/set7") == [True]
        _say(rnd.store, key, 0, me.probe_endpoint)
        start = time.monotonic()
        said = _recovery(60.0)._answers(me, workers, key, [0, 1], tell_broken=True)
        assert sorted(said) == [0, 1]
        assert len(told) == 1
        assert time.monotonic() - start < GONE_AFTER_S  # not judged gone: it answered
        # Waiting on a worker that beats and never answers tells nobody without
        # tell_broken; the wait ends at timeout_s.
        reach = f"{KEYS}/reach"
        _say(rnd.store, reach, 0, [])
        said = _recovery(1.0)._answers(me, workers, reach, [0, 1])
        assert sorted(said) == [0] and len(told) == 1
        # The executor's World is held weakly: a group dropped after a failure must
        # close its connections at once (Note [Recovering within the round]).
        world = _World(told, lambda: None)
        held = weakref.ref(world)
        other.interrupt_on_broken(theirs.key, world.interrupt)
        del world
        assert held() is None
        assert network.tell([other.probe_endpoint], f"{BROKEN} {theirs.key}") == [True]
        time.sleep(0.5)
        assert len(told) == 1


class _World:
    """Stands in for vflow.world.World: what a broken set's message calls."""

    def __init__(self, told: list[float], then: Callable[[], None]) -> None:
        self.told = told
        self.then = then

    def interrupt(self) -> None:
        self.told.append(time.monotonic())
        self.then()


def test_a_worker_whose_probe_refuses_the_message_is_gone_though_its_beats_move() -> None:
    """Note [A survivor blocked on survivors]: a watched worker that has not answered
    and whose probe refuses the message is dead (Note [Beats]): found gone on that
    refusal, said once, without waiting for its beats to stand still (here they keep
    moving) or for gone_after_s."""
    with local_store(JOB) as (_store, worker):
        me, other = worker(), worker()
        rnd = me.adopt(ROUND, 0, 0)
        other.adopt(ROUND, 0, 1)
        workers = WorkerSet(rnd, [0, 1])
        other.close()  # its probe refuses from now on
        stop = False

        def beat() -> None:
            while not stop:
                rnd.store.add("beat/1", 1)
                time.sleep(0.02)

        key = f"{KEYS}/alive"
        _say(rnd.store, key, 0, me.probe_endpoint)
        with ThreadPoolExecutor(1) as pool:
            beating = pool.submit(beat)
            try:
                # The beats move when the survivor asks (a call found gone on the
                # refusal may return before they move again, on a loaded machine).
                deadline = time.monotonic() + 10
                while me.beats([1])[1] < 2:
                    assert time.monotonic() < deadline and not beating.done()
                    time.sleep(0.01)
                said = _recovery(5.0, gone_after_s=1e6)._answers(
                    me, workers, key, [0, 1], tell_broken=True
                )
                assert not beating.done()  # still beating when found gone
            finally:
                stop = True
            beating.result()
        assert sorted(said) == [0]
        assert _rows(rnd.store, "alive") == {0: me.probe_endpoint, "gone": {1}}
