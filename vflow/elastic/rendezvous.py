"""Membership rounds of an elastic job, from torch.distributed.elastic's rendezvous.

vflow does not run a membership protocol of its own. It uses the engine torchrun uses,
``DynamicRendezvousHandler`` over the c10d store backend (join, keep-alive heartbeats,
last call, min/max nodes, the wait list), but inside long-lived worker processes: a new
round re-forms the worker set without restarting anybody (Note [Rounds without
restarts]). The store lives in a process of its own, ``python -m vflow rendezvous``
(``serve``/``main`` here), so that no worker's death takes it down.

Note [Rounds without restarts]
How the handler behaves, and what this module adds to use it from running workers:

* A round is *complete* once it has ``min_nodes`` participants and the last call has
  passed (or ``max_nodes`` joined at once). It stays complete while any participant
  remains: ``next_rendezvous`` first removes the caller from it, and the round moves
  on (``round += 1``, incomplete) only when the last participant has left, by itself
  or because its keep-alive heartbeats stopped for ``keep_alive_s x
  keep_alive_attempts`` (a crashed or hung worker). Until then, callers wait on the
  wait list. So re-forming the group needs *every* live member to call
  ``next_round``; a dead one is dropped only by its heartbeat expiry, which is why
  vflow.elastic forms rounds only to start a job (or as a fallback) and changes a
  running worker set within its round (Note [Recovering within the round], Note
  [Joining a running job], vflow/elastic/job.py).
* A process that wants in while a round is complete sits on the wait list.
  ``num_nodes_waiting()`` reads it, but costs a store round trip, so a poller thread
  reads it in the background and ``waiting()`` returns the last count at no cost; the
  members agree on when to act by exchanging it in a step's statistics (vflow.elastic).
  The poller and ``next_round`` never use the handler at the same time.
* Each round's store (``Round.store``) is the backend store under the prefix
  ``vflow/<job>/round<N>``; process groups of the round live under further prefixes of
  it (``round_group``), so keys of an old round never meet a new round.

Note [Two connections to the store]
A TCPStore client sends one request at a time. Creating a process group waits on the
store for every peer's address, up to the collective timeout when a peer died; on the
connection that also carries the handler's heartbeats and the beats, that wait would
starve them, and the rendezvous would drop this live worker. So the rounds' stores
(groups, recovery keys) use a connection of their own.
* torchrun's agent makes the round's rank 0 host a TCP store for the workers
  (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE`` unset). vflow's store is the rendezvous
  store itself, so that sharing is switched off: a worker never hosts anything others
  depend on. The handler still publishes a bootstrap address under each round's
  prefix (rank 0 writes, the others read); that is why every member must call
  ``next_round`` promptly, and why a probe that let only the newcomer call it timed out.
* Leaving without ending the job uses the handler's exit operation (the first half
  of ``next_rendezvous``) and stops the heartbeats; ``shutdown()`` would close the
  rendezvous for everybody, so it is called only when the job is finished.

The c10d store has no authentication: anybody who can reach its port can read and
write the job's keys. ``serve`` listens on loopback only unless told otherwise (Note
[Stores listen only where asked] in vflow/world/store.py).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousGracefulExitError,
    RendezvousStateError,
    RendezvousTimeoutError,
)
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    DynamicRendezvousHandler,
    RendezvousTimeout,
    _RendezvousExitOp,
)

from vflow.world.store import format_endpoint, host_store

__all__ = [
    "Rendezvous",
    "RendezvousClosedError",
    "RendezvousConnectionError",
    "RendezvousGracefulExitError",
    "RendezvousStateError",
    "RendezvousTimeoutError",
    "Round",
    "main",
    "parse_endpoint",
    "round_group",
    "serve",
    "single_group",
]

# Note [Beats]
# The handler's keep-alive heartbeats tell the rendezvous that a worker is gone only
# after keep_alive_s x keep_alive_attempts (2 s at least: it polls once a second). Crash
# recovery within a round (vflow.elastic) needs to know sooner which of its peers are
# gone, so the poller also adds 1 to a counter of this worker's in the round's store
# every _POLL_S: a worker whose counter has not moved for GONE_AFTER_S is dead or
# stopped. A live worker's poller needs the GIL for a moment every _POLL_S, which the
# step's compute releases, so GONE_AFTER_S is several polls. It is most of what a crash
# costs the survivors (benchmarks/elastic.py: 0.4 s of a 0.7 s stall); a live worker
# wrongly judged gone is only left out and comes back as a grow, so the verdict is
# made quick rather than certain.
_POLL_S = 0.1
GONE_AFTER_S = 0.4

# Note [Knockers beat too]
# A worker waiting for its answer (Rendezvous.knock) beats on its ticket every _POLL_S,
# and the members' pollers follow the unanswered tickets' beats: a ticket whose knocker
# stopped beating for GONE_AFTER_S counts neither as waiting nor among the tickets to
# let in, so a knocker that died while it waited (for a place in a full job, say) does
# not make the members wait for its connection until their timeout. Letting in a later
# ticket answers the skipped ones with "again": a knocker judged gone while it lived
# (stopped, starved) takes a new ticket. One that dies after the members last looked
# at its beats still costs them the group's creation timeout.
_KNOCKS, _ANSWERED = "knocks", "answered"  # counters of tickets
_KNOCK_POLL_S = 0.02  # a knocking worker looks for its answer this often
_TICKETS_WATCHED = 16  # unanswered tickets whose knockers' beats the poller follows
_CLOSED_POLL_S = 0.5  # and whether the job has finished, this often


def parse_endpoint(endpoint: object, name: str = "rendezvous") -> tuple[str, int]:
    """``"HOST:PORT"`` as (host, port), or a ValueError naming ``name``."""
    if not isinstance(endpoint, str):
        raise TypeError(f"{name} must be a 'HOST:PORT' string, got {type(endpoint).__name__}")
    host, sep, port_text = endpoint.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ValueError(f"{name} must be 'HOST:PORT' with a port in 1..65535, got {endpoint!r}")
    return host, int(port_text)


def serve(host: str = "127.0.0.1", port: int = 0) -> dist.TCPStore:
    """Hosts a c10d TCPStore for elastic jobs, listening on ``host:port`` only (port 0:
    any free port); ``store.host`` is the address it listens on. The store has no
    authentication; keep it on loopback or a trusted network (Note [Stores listen only
    where asked], vflow/world/store.py). OSError naming ``host:port`` if it cannot."""
    return host_store(host, port, timeout=datetime.timedelta(seconds=60))


def main(argv: list[str]) -> int:
    """``python -m vflow rendezvous``: hosts the store until SIGTERM or SIGINT."""
    parser = argparse.ArgumentParser(
        prog="python -m vflow rendezvous",
        description=(
            "Host the rendezvous store of elastic vflow jobs (workers: vflow.elastic). "
            "Prints the 'HOST:PORT' it listens on as its first line and runs until SIGTERM or "
            "Ctrl-C. The c10d store has no authentication: anyone who reaches the port can "
            "read and change the jobs' state, so it listens only on the --host address "
            "(loopback by default). Workers on other machines need that address and port "
            "reachable."
        ),
    )
    parser.add_argument(
        "--host",
        default="127.0.0.1",
        help="the one address to listen on: IPv4, IPv6 or a hostname (default 127.0.0.1)",
    )
    parser.add_argument("--port", type=int, default=0, help="port (default: any free port)")
    args = parser.parse_args(argv)
    try:
        store = serve(args.host, args.port)
    except OSError as e:  # names the host and port already
        print(f"python -m vflow rendezvous: {e}", file=sys.stderr)
        return 1
    except (RuntimeError, ValueError) as e:
        print(
            f"python -m vflow rendezvous: cannot listen on "
            f"{format_endpoint(args.host, args.port)}: {e}",
            file=sys.stderr,
        )
        return 1
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    # The address it listens on (a hostname resolved), so the line is what workers need.
    print(format_endpoint(store.host, store.port), flush=True)
    while not stop.wait(0.5):
        pass
    return 0


@dataclass(frozen=True)
class Round:
    """One completed round: this worker's rank, the worker count and the round's store."""

    number: int
    rank: int
    world_size: int
    store: dist.Store


def round_group(
    rendezvous_round: Round,
    timeout: datetime.timedelta,
    *,
    backend: str = "gloo",
    name: str = "main",
    ranks: list[int] | None = None,
) -> dist.ProcessGroup:
    """A fresh process group of the round (Gloo on CPU, NCCL on GPU), built directly on
    the round's store without ``init_process_group``, as torchft does.

    ``ranks``: the round's ranks that form the group (default all), in their order;
    every one of them calls this with the same ``name`` and ``ranks``. This is how the
    members of a round shrink without a new round when some of them leave.
    """
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    members = list(range(rendezvous_round.world_size)) if ranks is None else list(ranks)
    if rendezvous_round.rank not in members:
        raise ValueError(f"ranks {members} do not include this worker's {rendezvous_round.rank}")
    rank, size = members.index(rendezvous_round.rank), len(members)
    store = dist.PrefixStore(f"vflow/{name}", rendezvous_round.store)
    return _group_on(store, rank, size, timeout, backend, f"round {rendezvous_round.number}/{name}")


def single_group(timeout: datetime.timedelta) -> dist.ProcessGroup:
    """A Gloo group of this process alone, on a store of its own: what an elastic
    worker builds its executor on before it joins (vflow.elastic)."""
    return _group_on(dist.HashStore(), 0, 1, timeout, "gloo", "this worker alone")


def _group_on(
    store: dist.Store,
    rank: int,
    size: int,
    timeout: datetime.timedelta,
    backend: str,
    name: str,
) -> dist.ProcessGroup:
    group = dist.ProcessGroup(store, rank, size)
    if backend == "gloo":
        impl = dist.ProcessGroupGloo(store, rank, size, timeout)
        kind, device = dist.ProcessGroup.BackendType.GLOO, torch.device("cpu")
    else:
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        impl = dist.ProcessGroupNCCL(store, rank, size, options)
        kind, device = dist.ProcessGroup.BackendType.NCCL, torch.device("cuda")
    group._set_default_backend(kind)
    group._register_backend(device, kind, impl)
    # Errors then name the round and the group instead of "default".
    group._set_group_name(name)
    return group


class Rendezvous:
    """A worker's handle on the membership of job ``job_id`` at ``endpoint``
    (``"HOST:PORT"`` of ``python -m vflow rendezvous``). See Note [Rounds without
    restarts]. Connecting fails with a RuntimeError naming the endpoint when the store
    cannot be reached within ``store_timeout_s``."""

    def __init__(
        self,
        endpoint: str,
        job_id: str,
        *,
        min_workers: int,
        max_workers: int,
        join_timeout_s: float,
        last_call_s: float,
        keep_alive_s: float,
        keep_alive_attempts: int,
        store_timeout_s: float,
    ) -> None:
        host, port = parse_endpoint(endpoint)
        try:
            # Two connections (Note [Two connections to the store]).
            self._store, self._round_connection = (
                dist.TCPStore(
                    host,
                    port,
                    is_master=False,
                    timeout=datetime.timedelta(seconds=store_timeout_s),
                    use_libuv=True,
                )
                for _ in range(2)
            )
        except (RuntimeError, OSError) as e:
            raise RuntimeError(
                f"cannot reach the rendezvous store at {endpoint} within {store_timeout_s:g} s "
                f"(is `python -m vflow rendezvous` running there?): {e}"
            ) from e
        # Note [Rounds without restarts]: no worker hosts a store for the others.
        os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        self.endpoint = endpoint
        self.job_id = job_id
        self._handler = DynamicRendezvousHandler.from_backend(
            run_id=job_id,
            store=self._store,
            backend=C10dRendezvousBackend(self._store, job_id),
            min_nodes=min_workers,
            max_nodes=max_workers,
            local_addr=socket.gethostname(),
            timeout=RendezvousTimeout(
                join=datetime.timedelta(seconds=join_timeout_s),
                last_call=datetime.timedelta(seconds=last_call_s),
                close=datetime.timedelta(seconds=max(store_timeout_s, 5.0)),
                heartbeat=datetime.timedelta(seconds=max(keep_alive_s, 1.0)),
            ),
            keep_alive_interval=keep_alive_s,  # type: ignore[arg-type]  # a float works
            keep_alive_max_attempt=keep_alive_attempts,
        )
        self._lock = threading.Lock()  # the poller and next_round never overlap
        # Job-wide keys of vflow's own (Note [Joining a running job], vflow/elastic/job.py),
        # read by the poller: on the connection no long wait ever holds.
        self._job = dist.PrefixStore(f"vflow/{job_id}", self._store)
        self._adopted = False
        self._waiting = 0
        self._knock_beats: dict[int, tuple[int, float]] = {}  # ticket: beat, when it moved
        self._evicted = False
        self._in_round = False
        self._round: Round | None = None
        self._closed = threading.Event()
        self._poller = threading.Thread(target=self._poll, name="vflow-rendezvous", daemon=True)
        self._poller.start()

    def next_round(self) -> Round:
        """Leaves the current round (if any) and joins the next; returns once it is
        complete. Raises RendezvousTimeoutError after the join timeout and
        RendezvousClosedError (or, for a worker that was waiting to join,
        RendezvousGracefulExitError) when the job is finished."""
        with self._lock:
            self._in_round = False
            info = self._handler.next_rendezvous()
            number = self._handler._state_holder.state.round
            # The handler's join loop sends a heartbeat only once per 1 s poll and its timer
            # ticks first keep_alive_s after the round: without this one, a member's
            # heartbeat can age past the expiry and a peer drops it from the round.
            self._handler._keep_alive()
            self._waiting = 0
            self._evicted = False
            self._adopted = False
            self._round = Round(number, info.rank, info.world_size, self._round_store(number))
            self._in_round = True
        return self._round

    def knock(self, timeout_s: float) -> dict[str, Any] | None:
        """Asks the running job's worker set to take this worker in, without a round
        (Note [Joining a running job], vflow/elastic/job.py); returns the members'
        answer, or None when the job finished first. Raises RendezvousTimeoutError
        after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            ticket = int(self._job.add(_KNOCKS, 1))
            answer_key = f"admit/{ticket}"
            next_look = next_beat = 0.0
            while not self._job.check([answer_key]):
                now = time.monotonic()
                if now >= next_beat:  # Note [Knockers beat too]
                    self._job.add(_knock_beat_key(ticket), 1)
                    next_beat = now + _POLL_S
                if now >= next_look:
                    with self._lock:
                        if self._handler.is_closed():
                            return None
                    next_look = now + _CLOSED_POLL_S
                if now > deadline:
                    raise RendezvousTimeoutError(
                        f"no answer to this worker's request to join within {timeout_s:g} s"
                    )
                time.sleep(_KNOCK_POLL_S)
            answer = json.loads(self._job.get(answer_key))
            if not answer.get("again"):
                return dict(answer, ticket=ticket)

    def pending(self, room: int) -> list[int]:
        """The tickets of workers that knocked, were not answered yet and still beat
        (Note [Knockers beat too]), oldest first, at most ``room``."""
        answered, knocks = self._tickets()
        with self._lock:
            live = [t for t in range(answered + 1, knocks + 1) if not self._knocker_gone(t)]
        return live[: max(room, 0)]

    def _knocker_gone(self, ticket: int) -> bool:
        seen = self._knock_beats.get(ticket)
        return seen is not None and time.monotonic() - seen[1] >= GONE_AFTER_S

    def _watch_knockers(self, answered: int, knocks: int) -> int:
        """Reads the beats of the unanswered tickets' knockers (the poller, under the
        lock); returns how many of them still beat."""
        now = time.monotonic()
        watched = range(answered + 1, min(knocks, answered + _TICKETS_WATCHED) + 1)
        beats = {t: int(self._job.add(_knock_beat_key(t), 0)) for t in watched}
        self._knock_beats = {
            t: seen if (seen := self._knock_beats.get(t)) and seen[0] == beat else (beat, now)
            for t, beat in beats.items()
        }
        return knocks - answered - sum(self._knocker_gone(t) for t in watched)

    def _tickets(self) -> tuple[int, int]:
        """The highest ticket answered and the highest taken."""
        return int(self._job.add(_ANSWERED, 0)), int(self._job.add(_KNOCKS, 0))

    def wait_list(self) -> int:
        """Workers on the rendezvous' wait list now (a store round trip)."""
        with self._lock:
            return int(self._handler.num_nodes_waiting())

    def answer(self, tickets: list[int], answers: list[dict[str, Any]]) -> None:
        """Writes the members' answer to each ticket (every member writes the same)."""
        self._waiting = 0  # they are answered: not waiting any more
        for ticket, answer in zip(tickets, answers, strict=True):
            self._job.set(f"admit/{ticket}", json.dumps(answer))
        top = max(tickets)
        for ticket in range(int(self._job.add(_ANSWERED, 0)) + 1, top):
            if ticket not in tickets:  # judged gone: should it still live, it knocks again
                self._job.set(f"admit/{ticket}", json.dumps({"again": True}))
        # Raised to ``top`` with compare-and-set: the members write at the same time.
        answered = int(self._job.add(_ANSWERED, 0))
        while answered < top:
            answered = int(self._job.compare_set(_ANSWERED, str(answered), str(top)))

    def adopt(self, number: int, rank: int) -> Round:
        """The round a worker let in by the members now belongs to (it is not a
        participant of the rendezvous' round: the heartbeats' view of it is not its)."""
        with self._lock:
            self._waiting = 0
            self._evicted = False
            self._adopted = True
            self._round = Round(number, rank, 0, self._round_store(number))
            self._in_round = True
        return self._round

    def _round_store(self, number: int) -> dist.Store:
        return dist.PrefixStore(f"vflow/{self.job_id}/round{number}", self._round_connection)

    @property
    def job_store(self) -> dist.Store:
        """The job's own keys (under ``vflow/<job>``), on the connection the poller uses:
        quick requests only, never a long wait."""
        return self._job

    def waiting(self) -> int:
        """Workers waiting to join, as last seen by the poller (0 outside a round)."""
        return self._waiting

    def beats(self, ranks: list[int]) -> dict[int, int]:
        """How many times each of the current round's ``ranks`` has beaten (Note [Beats]):
        a count that stops moving is a worker gone (killed, stopped, or out of the round)."""
        rnd = self._round
        if rnd is None:
            raise RuntimeError("beats() outside a round")
        return {r: int(self._job.add(_beat_key(rnd, r), 0)) for r in ranks}

    def evicted(self) -> bool:
        """Whether the rendezvous dropped this worker from its round (its heartbeats
        lapsed): it must join the next round, or two worker sets could train apart."""
        return self._evicted

    def leave(self) -> None:
        """Leaves the current round without ending the job; the others go on."""
        self._stop()
        with self._lock:
            self._handler._stop_heartbeats()
            deadline = time.monotonic() + self._handler.settings.timeout.close.total_seconds()
            try:
                self._handler._op_executor.run(_RendezvousExitOp(), deadline)
            except Exception:  # best effort: the heartbeat expiry removes us anyway
                pass

    def finish(self) -> None:
        """Ends the job's rendezvous: waiting and later workers get RendezvousClosedError."""
        self._stop()
        with self._lock:
            self._handler.shutdown()

    def close(self) -> None:
        """Stops the poller and the heartbeats (a worker that raises)."""
        self._stop()
        with self._lock:
            self._handler._stop_heartbeats()

    def _stop(self) -> None:
        self._closed.set()
        if self._poller.is_alive() and self._poller is not threading.current_thread():
            self._poller.join()

    def _poll(self) -> None:
        while not self._closed.wait(_POLL_S):
            with self._lock:
                if not self._in_round or self._round is None:
                    continue
                try:
                    self._job.add(_beat_key(self._round, self._round.rank), 1)
                    knocking = self._watch_knockers(*self._tickets())
                    # num_nodes_waiting syncs the handler's state.
                    self._waiting = self._handler.num_nodes_waiting() + knocking
                    state = self._handler._state_holder.state
                    self._evicted = (
                        not self._adopted and self._handler._this_node not in state.participants
                    )
                except Exception:
                    # A store that went away shows in the next round; the step's own
                    # collectives are not affected by it.
                    self._waiting = 0


def _beat_key(rnd: Round, rank: int) -> str:
    return f"round{rnd.number}/beat/{rank}"


def _knock_beat_key(ticket: int) -> str:
    return f"knock/{ticket}/beat"
