"""Membership rounds of an elastic job, from torch.distributed.elastic's rendezvous.

vflow does not run a membership protocol of its own. It uses the engine torchrun uses,
``DynamicRendezvousHandler`` over the c10d store backend (join, keep-alive heartbeats,
last call, min/max nodes, the wait list), but inside long-lived worker processes: a new
round re-forms the worker set without restarting anybody (Note [Rounds without
restarts]). The store lives in a process of its own, ``python -m vflow rendezvous``
(vflow/elastic/server.py), so that no worker's death takes it down; the job's record in
it says which worker set owns the job (vflow/elastic/record.py).

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
  running worker set within its round (Note [Recovering within the round],
  vflow/elastic/agreement.py; Note [Joining a running job], vflow/elastic/admission.py).
* A process that wants in while a round is complete sits on the wait list.
  ``num_nodes_waiting()`` reads it, but costs a store round trip, so a poller thread
  reads it in the background and ``waiting()`` returns the last count at no cost; the
  members agree on when to act by exchanging it in a step's statistics (vflow.elastic).
  The poller and ``next_round`` never use the handler at the same time.
* Each round's store (``Round.store``) is the backend store under the prefix
  ``vflow/<job>/<boot>/round<N>`` (``<boot>``: the store process's boot id, so that
  rounds numbered again after a restart of the store never meet the old ones); process
  groups of the round live under further prefixes of it (``round_group``), so keys of
  an old round never meet a new round.

Note [Two connections to the store]
A TCPStore client sends one request at a time. Creating a process group waits on the
store for every peer's address, up to the collective timeout when a peer died; on the
connection that also carries the handler's heartbeats and the beats, that wait would
starve them, and the rendezvous would drop this live worker. And a request to a store
that went silent holds its connection until it fails (``store_timeout_s``, Note [A
store that goes silent] in vflow/world/store.py): a recovery whose request queued
behind the poller's would wait for both. So each connection has one owner: the poller
thread (and the handler it drives) uses its own, and the worker's main thread (the
rounds' stores: groups, agreements, recovery keys, knocks, the job's record) the
other; neither ever waits for the other's request. Only ``next_round`` and leaving use
the handler from the main thread, under the poller's lock.
* torchrun's agent makes the round's rank 0 host a TCP store for the workers
  (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE`` unset). vflow's store is the rendezvous
  store itself, so that sharing is switched off: a worker never hosts anything others
  depend on. The handler still publishes a bootstrap address under each round's
  prefix (rank 0 writes, the others read); that is why every member must call
  ``next_round`` promptly, and why a probe that let only the newcomer call it timed out.
* Leaving without ending the job uses the handler's exit operation (the first half
  of ``next_rendezvous``) and stops the heartbeats; ``shutdown()`` would close the
  rendezvous for everybody, so it is called only when the job is finished.

Note [Restarts of the store]
A store process that restarts (killed, started again at the same address) breaks every
connection, and the new process knows nothing of the old one's keys. The poller finds
its connection broken and connects again (one attempt of ``_RECONNECT_S`` per poll,
for as long as it takes); the store's boot id tells a restart from a connection that
merely broke. After a restart the worker keeps everything it had: its round (keys
under the old boot id's prefix, now in the new store), its set and its handler, rewired
to the new connection; it counts as let in by knocking (the new rendezvous has no
round), so the heartbeats' view no longer speaks for it, and the beats and knocks start
afresh. Its set re-registers the job (Note [Fencing a job], vflow/elastic/record.py),
republishes its members and probes, and from then on grows, shrinks and recoveries
work as before. Training never waited for any of it. A worker whose lineage lost the
job meanwhile is fenced.

Note [Resumed generations]
A job that was suspended (Note [Suspending a job], vflow/elastic/job.py) shut its
rendezvous down on the way out, as a finished job does: that is how the workers waiting
on its wait list learn that it stopped, and torch's handler cannot reopen a closed
rendezvous (``next_rendezvous`` raises RendezvousClosedError for good). So each
generation of a job, its first run and each resumption, has a rendezvous of its own:
the handler's run id is the job id for a job never resumed and ``<job>/resume<R>``
after R resumptions, and the rounds' keys live under ``vflow/<job>/<boot>/resume<R>/``
(R > 0), so that the new generation's round 0 never meets the keys of the old one's.
Only the internals change: the job id users pass and see, the record
(``vflow/<job>/record``, which counts R in ``resumes``), the tickets of knocking
workers and the published members stay the job's. A worker learns R from the record
before it takes part in a round or knocks (``use_resumes``): a suspended record with
``resumes`` R means the next generation, R + 1, whose first round claims the record
back. A handler that has taken part in a round keeps its generation: a worker that
waited to join one generation of a job and finds it suspended stops, told so; it does
not carry on into the next.

The c10d store has no authentication: anybody who can reach its port can read and
write the job's keys. ``python -m vflow rendezvous`` listens on loopback only unless
told otherwise (Note [Stores listen only where asked] in vflow/world/store.py).
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import socket
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timezone
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
    _BackendRendezvousStateHolder,
    _DistributedRendezvousOpExecutor,
    _RendezvousExitOp,
)

from vflow.elastic import record as records
from vflow.elastic.record import Record
from vflow.world.network import ProbeListener, loopback_interface, reachable
from vflow.world.store import CountingStore, RequestCounts, connect_store

__all__ = [
    "BROKEN",
    "GONE_AFTER_S",
    "SUSPECT_S",
    "Rendezvous",
    "RendezvousClosedError",
    "RendezvousConnectionError",
    "RendezvousGracefulExitError",
    "RendezvousStateError",
    "RendezvousTimeoutError",
    "Round",
    "parse_endpoint",
    "round_group",
    "single_group",
]

# Note [Beats]
# The handler's keep-alive heartbeats tell the rendezvous that a worker is gone only
# after keep_alive_s x keep_alive_attempts (2 s at least: it polls once a second). Crash
# recovery within a round (vflow.elastic) needs to know sooner which of its peers are
# gone, so the poller also adds 1 to a counter of this worker's in the round's store
# every _POLL_S. A peer is judged gone on one of two grounds:
# * its probe refuses connections (Note [Probing a peer], vflow/world/network.py): its
#   process is dead. Asked of a peer that has not answered the survivors when they
#   tell it that its set broke (at once: Note [A survivor blocked on survivors],
#   vflow/elastic/agreement.py), and again of one whose counter has not moved for
#   SUSPECT_S (two beats), so that a worker that dies later is known gone a fifth of a
#   second after its death;
# * its counter has not moved for ``gone_after_s`` (ElasticJob's option, default
#   GONE_AFTER_S): stopped, hung, or on a host that went silent (no refusal comes
#   back from there).
# The verdict is the observer's own monotonic clock against a count, never a time
# another machine wrote, so clocks that disagree cannot make it. A live worker's poller
# needs the GIL for a moment every _POLL_S, which a step's compute releases, and its
# beats cross the store's queue, which at a thousand workers carries ten thousand of
# them a second; so a live worker's counter can stand still for a few hundred
# milliseconds on a loaded host or store, and the silence verdict waits GONE_AFTER_S,
# many beats: a live worker judged gone is left out and comes back as a grow, a whole
# event, while the dead are found by the refusal long before.
_POLL_S = 0.1
SUSPECT_S = 2 * _POLL_S
BROKEN = "broken"  # the message that a worker set's group broke
GONE_AFTER_S = 2.0

# Note [Knockers acknowledge]
# Members never follow a knocker's liveness: the members' answer to a ticket is first an
# offer, which the knocker acknowledges by appending its ticket to the offer's ``acks``
# key; the member that wrote the offer waits up to ACK_S from its write for every
# offered ticket's acknowledgement (one read of that key per poll, whatever the number
# of tickets) and then decides, by compare-and-set, who comes in: the knockers that
# acknowledged. The others' tickets are answered "again" (one alive after all, stopped
# or starved, takes a new ticket). So a knocker that died while it waited, however many
# knocked, is never let in, and costs the members at most ACK_S once; nothing is
# watched per ticket, so there is no limit on how many knock at once. A knocker that
# dies after its acknowledgement, in the milliseconds before it connects, still costs
# the group's creation timeout.
# The other members give the writer ACK_S more, counted from when they saw the offer
# written, before they propose what they saw: on a loaded host a member can reach the
# wait long before the writer wrote the offer, and a window counted from its own start
# would close first and have its empty view decide (every knocker answered "again"
# before it could see its offer). An offer not written within OFFER_S (its writer
# died) is taken as acknowledged by nobody.
_KNOCKS, _ANSWERED = "knocks", "answered"  # counters of tickets
_KNOCK_POLL_S = 0.02  # a knocking worker looks for its answer this often
ACK_S = 1.0  # how long the members wait for an offered ticket's acknowledgement
OFFER_S = 10.0  # how long the members wait for the offer to be written
_DOOR_POLL_S = 0.25  # the watching member reads the knocks counter this often
_NEIGHBOUR_POLL_S = 1.0  # a member reads the next member's beats this often
_RECORD_POLL_S = 1.0  # a knocker looks whether the job finished, a member whether it is fenced
_MEMBERS = "members"  # job key: the current worker set's round prefix and ranks
# One attempt to connect again to a store that broke the connection: long enough for a
# store that is back, short enough that a poller retrying a dead one stays responsive.
_RECONNECT_S = 1.0

_log = logging.getLogger("vflow")


def parse_endpoint(endpoint: object, name: str = "rendezvous") -> tuple[str, int]:
    """``"HOST:PORT"`` as (host, port), or a ValueError naming ``name``."""
    if not isinstance(endpoint, str):
        raise TypeError(f"{name} must be a 'HOST:PORT' string, got {type(endpoint).__name__}")
    host, sep, port_text = endpoint.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ValueError(f"{name} must be 'HOST:PORT' with a port in 1..65535, got {endpoint!r}")
    return host, int(port_text)


@dataclass(frozen=True)
class Round:
    """One completed round as this worker belongs to it: its number, this worker's rank
    in it, the worker count (0 for a worker let in by knocking), the prefix of its keys
    (``vflow/<job>/<boot>/round<N>``: a round number of one start of the store
    process, so that keys of rounds before and after a restart never meet) and the
    connection its keys are read and written on, which changes when the store restarts
    (Note [Restarts of the store])."""

    number: int
    rank: int
    world_size: int
    prefix: str
    connection: Callable[[], dist.Store]
    # The client itself, when ``connection`` counts requests (Note [Counting requests to
    # the store], vflow/world/store.py): process groups are built on it.
    raw_connection: Callable[[], dist.Store] | None = None

    @property
    def store(self) -> dist.Store:
        """The round's keys, on this worker's current connection to the store."""
        return dist.PrefixStore(self.prefix, self.connection())

    @property
    def group_store(self) -> dist.Store:
        """The round's keys for its process groups."""
        raw = self.raw_connection or self.connection
        return dist.PrefixStore(self.prefix, raw())


def round_group(
    rendezvous_round: Round,
    timeout: datetime.timedelta,
    *,
    backend: str = "gloo",
    name: str = "main",
    ranks: list[int] | None = None,
    interface: str | None = None,
) -> dist.ProcessGroup:
    """A fresh process group of the round (Gloo on CPU, NCCL on GPU), built directly on
    the round's store without ``init_process_group``, as torchft does.

    ``ranks``: the round's ranks that form the group (default all), in their order;
    every one of them calls this with the same ``name`` and ``ranks``. This is how the
    members of a round shrink without a new round when some of them leave.
    ``interface``: the network interface Gloo binds (Note [The interface that reaches the
    store], vflow/world/network.py); None: Gloo's own choice.
    """
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    members = list(range(rendezvous_round.world_size)) if ranks is None else list(ranks)
    if rendezvous_round.rank not in members:
        raise ValueError(f"ranks {members} do not include this worker's {rendezvous_round.rank}")
    rank, size = members.index(rendezvous_round.rank), len(members)
    store = dist.PrefixStore(f"vflow/{name}", rendezvous_round.group_store)
    return _group_on(
        store, rank, size, timeout, backend, f"round {rendezvous_round.number}/{name}", interface
    )


def single_group(timeout: datetime.timedelta) -> dist.ProcessGroup:
    """A Gloo group of this process alone, on a store of its own: what an elastic
    worker builds its executor on before it joins (vflow.elastic). It talks to nobody,
    so it binds loopback."""
    return _group_on(
        dist.HashStore(), 0, 1, timeout, "gloo", "this worker alone", loopback_interface()
    )


def _group_on(
    store: dist.Store,
    rank: int,
    size: int,
    timeout: datetime.timedelta,
    backend: str,
    name: str,
    interface: str | None,
) -> dist.ProcessGroup:
    group = dist.ProcessGroup(store, rank, size)
    if backend == "gloo":
        if interface is None:
            impl = dist.ProcessGroupGloo(store, rank, size, timeout)
        else:
            options = dist.ProcessGroupGloo._Options()
            options._devices = [dist.ProcessGroupGloo.create_device(interface=interface)]
            options._timeout = timeout
            options._threads = 2  # what the constructor without options uses per device
            impl = dist.ProcessGroupGloo(store, rank, size, options)
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


# Note [Heartbeats across clocks]
# torch's handler drops a participant whose last heartbeat is older than keep_alive_s
# x keep_alive_attempts, comparing the time that participant wrote (its wall clock)
# with the reader's wall clock. Across machines whose clocks disagree by more than
# that window, the worker whose clock is ahead finds every other heartbeat expired and
# removes the others from the round while they live: measured here with one host 30 s
# ahead (faketime). vflow's handler judges a heartbeat by whether it *changes* instead:
# the reader notes, on its own monotonic clock, when it last saw each participant's
# heartbeat value change, and drops a participant whose value stood still for the
# window. No time of another machine is compared with this machine's. A participant
# first seen now gets the whole window. (The last call's deadline is still a wall-clock
# time written by one participant: across skewed clocks the first round's last call is
# longer or shorter, which changes who is in it, not whether it forms.)
class _ClockFreeStateHolder(_BackendRendezvousStateHolder):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._changed: dict[Any, tuple[Any, float]] = {}  # node: (heartbeat, when it changed)

    def _sanitize(self) -> None:
        state = self._state
        now = time.monotonic()
        changed = {}
        for node, beat in state.last_heartbeats.items():
            seen = self._changed.get(node)
            changed[node] = seen if seen is not None and seen[0] == beat else (beat, now)
        self._changed = changed
        original = dict(state.last_heartbeats)
        # torch's verdict, on heartbeats restated in this machine's clock: the time each
        # value was last seen to change here.
        wall = datetime.datetime.now(timezone.utc)
        for node, (_, since) in changed.items():
            state.last_heartbeats[node] = wall - datetime.timedelta(seconds=now - since)
        super()._sanitize()
        for node in state.last_heartbeats:
            state.last_heartbeats[node] = original[node]


class Rendezvous:
    """A worker's handle on the membership of job ``job_id`` at ``endpoint``
    (``"HOST:PORT"`` of ``python -m vflow rendezvous``). See Note [Rounds without
    restarts]. Connecting fails with a RuntimeError naming the endpoint when the store
    cannot be reached within ``store_timeout_s``. ``probe_address``: the address of the
    interface this worker's collectives use, where it answers its peers' probes (Note
    [Probing a peer], vflow/world/network.py). ``counts``: where this worker's requests
    to the store are counted (Note [Counting requests to the store],
    vflow/world/store.py); None: not counted."""

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
        probe_address: str = "127.0.0.1",
        counts: RequestCounts | None = None,
    ) -> None:
        self._host, self._port = parse_endpoint(endpoint)
        self.counts = counts
        self.endpoint = endpoint
        self.job_id = job_id
        self.store_timeout_s = store_timeout_s
        self._handler_options = {
            "min_nodes": min_workers,
            "max_nodes": max_workers,
            "timeout": RendezvousTimeout(
                join=datetime.timedelta(seconds=join_timeout_s),
                last_call=datetime.timedelta(seconds=last_call_s),
                close=datetime.timedelta(seconds=max(store_timeout_s, 5.0)),
                heartbeat=datetime.timedelta(seconds=max(keep_alive_s, 1.0)),
            ),
            "keep_alive_interval": keep_alive_s,
            "keep_alive_max_attempt": keep_alive_attempts,
        }
        try:
            # Two connections (Note [Two connections to the store]).
            poll, main = (self._client(store_timeout_s) for _ in range(2))
            boot = records.boot_id(main)
            journal = (
                main.get(records.JOURNAL_KEY).decode() if main.check([records.JOURNAL_KEY]) else ""
            )
        except (RuntimeError, OSError) as e:
            raise RuntimeError(
                f"cannot reach the rendezvous store at {endpoint} within {store_timeout_s:g} s "
                f"(is `python -m vflow rendezvous` running there?): {e}"
            ) from e
        # Note [Rounds without restarts]: no worker hosts a store for the others.
        os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        self.journal = journal  # the store's journal ("": none)
        self._lock = threading.Lock()  # the poller and the handler's users never overlap
        self._reconnecting = threading.Lock()
        self._waiting = 0
        self._wait_list = 0
        self._answered_seen = 0  # the poller's: Note [Reading the tickets]
        self._watching = False  # Note [One member watches the door]
        # Note [The next worker's beats]: whose beats the poller reads, and (that rank,
        # the count it last read, when it first read that count: time.monotonic()); the
        # rank too, as ``watch`` may change the neighbour during the poller's read.
        self._neighbour: int | None = None
        self._neighbour_seen: tuple[int, int, float] | None = None
        self._next_neighbour_look = 0.0
        self._knocks_seen = 0  # the highest ticket the poller has seen taken
        self._knock_since = 0.0  # when it first saw it (time.monotonic())
        self._unanswered_since = 0.0  # when it first saw a ticket unanswered
        self._evicted = False
        self._adopted = False
        self._in_round = False
        self._round: Round | None = None
        self._lineage: Record | None = None  # the job's record as this worker set holds it
        self._fenced: Record | None = None
        self._members: str | None = None  # what this worker last published as _MEMBERS
        self._lost_since: float | None = None
        self._next_record_look = 0.0
        self._next_door_look = 0.0
        self._handler: DynamicRendezvousHandler | None = None
        # Note [Resumed generations]: the generation this worker's handler belongs to,
        # and whether the handler has taken part in a round (then it keeps it).
        self._resumes = 0
        self._handler_used = False
        # The record a claim replaced, which ``release`` restores; None: not known here.
        self._claimed_over: str | None = ""
        self._install(poll, main, boot)
        # Note [A survivor blocked on survivors], vflow/elastic/agreement.py: the set
        # whose group a "broken" message interrupts, and how.
        self._broken_target: tuple[str, Callable[[], Callable[[], None] | None]] | None = None
        self._probe = ProbeListener(probe_address, on_message=self._told)
        self._closed = threading.Event()
        self._poller = threading.Thread(target=self._poll, name="vflow-rendezvous", daemon=True)
        self._poller.start()

    # ---- connections (Note [Restarts of the store]) -----------------------------------

    def _client(self, connect_s: float) -> dist.TCPStore:
        # A silent store fails a request within store_timeout_s (Note [A store that
        # goes silent], vflow/world/store.py).
        return connect_store(
            self._host,
            self._port,
            connect_s=connect_s,
            timeout_s=self.store_timeout_s,
            silence_s=self.store_timeout_s,
        )

    def _install(self, poll: dist.Store, main: dist.Store, boot: str) -> None:
        """Puts this worker on new connections: the first ones, or after the old ones
        broke. The handler stays the same (its node keeps its name in the rendezvous)
        and is rewired to the new connection."""
        self._main_raw = main
        if self.counts is not None:
            poll = CountingStore(poll, self.counts, "poller")
            main = CountingStore(main, self.counts, "main")
        if self._handler is None:
            self._handler = self._new_handler(poll)
        else:
            self._handler._store = poll
            self._handler._state_holder._backend = C10dRendezvousBackend(poll, self._run_id)
        self._poll_store, self._main_store, self._boot = poll, main, boot
        # The job's own keys on the poller's connection (the poller's alone).
        self._poll_job = dist.PrefixStore(f"vflow/{self.job_id}", poll)
        # A restarted store counts tickets from 0 again (Note [Reading the tickets]).
        self._answered_seen = self._knocks_seen = 0

    @property
    def _run_id(self) -> str:
        """The run id of this worker's handler (Note [Resumed generations])."""
        return self.job_id if not self._resumes else f"{self.job_id}/resume{self._resumes}"

    def _new_handler(self, poll: dist.Store) -> DynamicRendezvousHandler:
        backend = C10dRendezvousBackend(poll, self._run_id)
        handler = DynamicRendezvousHandler.from_backend(
            run_id=self._run_id,
            store=poll,
            backend=backend,
            local_addr=socket.gethostname(),
            **self._handler_options,  # type: ignore[arg-type]  # a float interval works
        )
        # Note [Heartbeats across clocks].
        holder = _ClockFreeStateHolder(backend, handler._settings)
        handler._state_holder = holder
        handler._op_executor = _DistributedRendezvousOpExecutor(
            handler._this_node, holder, handler._settings
        )
        return handler

    @property
    def resumes(self) -> int:
        """The generation of the job this worker's rendezvous belongs to (Note [Resumed
        generations])."""
        return self._resumes

    def use_resumes(self, resumes: int) -> bool:
        """Puts this worker in generation ``resumes`` of the job (Note [Resumed
        generations]), before it takes part in a round or knocks; returns False, changing
        nothing, when its handler has already taken part in a round of another
        generation."""
        if resumes == self._resumes:
            return True
        with self._lock:
            if self._handler_used:
                return False
            self._resumes = resumes
            self._handler = self._new_handler(self._poll_store)
        return True

    def _main(self) -> dist.Store:
        return self._main_store

    def _group_connection(self) -> dist.Store:
        return self._main_raw

    @property
    def job_store(self) -> dist.Store:
        """The job's own keys (under ``vflow/<job>``), on the connection of the calling
        (main) thread, which the poller never uses."""
        return dist.PrefixStore(f"vflow/{self.job_id}", self._main_store)

    def reconnect(self) -> bool:
        """Note [Restarts of the store]: one attempt to connect again after the store
        broke the connections; returns whether this worker is connected now. After a
        restart (a new boot id), this worker's set re-registers the job."""
        with self._reconnecting:
            if self._lost_since is None:
                return True
            try:
                poll, main = self._client(_RECONNECT_S), self._client(_RECONNECT_S)
                boot = records.boot_id(main)
            except Exception:
                return False
            restarted = boot != self._boot
            with self._lock:
                self._install(poll, main, boot)
                if restarted:
                    # The new store's rendezvous has no round: this worker stays in its
                    # own (its keys travel with it), like a worker let in by knocking.
                    self._adopted = True
            try:
                if restarted:
                    self._reregister()
                self._republish()
            except Exception:
                return False
            self._lost_since = None
            _log.log(
                logging.WARNING if restarted else logging.INFO,
                "vflow elastic: the rendezvous store at %s %s",
                self.endpoint,
                "restarted; this worker set re-registered the job"
                if restarted and self._lineage is not None
                else "is reachable again",
            )
            return True

    def _lost(self, error: Exception) -> None:
        if self._lost_since is None:
            self._lost_since = time.monotonic()
            _log.debug("vflow elastic: the rendezvous store at %s: %s", self.endpoint, error)

    # ---- the job's record (Note [Fencing a job], vflow/elastic/record.py) ------------

    def record(self) -> Record | None:
        """The job's record in the store now, or None."""
        return records.read(self._main_store, self.job_id)[1]

    def claim(self, lineage: str) -> Record:
        """Claims the job for the worker set of ``lineage`` (its start, or its resumption
        in this worker's generation: Note [Resumed generations]): returns the record that
        stands, this lineage's or the one that claimed the job first. A job is claimed
        from no record, or from the suspended record of the generation before this
        worker's; any other record stands. On a journaled store it returns once the
        journal holds the claim."""
        store = self._main_store
        want = records.encode(records.running(lineage, 1, self._resumes))
        raw, current = records.read(store, self.job_id)
        if current is not None and not (
            current["state"] == "suspended" and records.resumes(current) + 1 == self._resumes
        ):
            if raw == want:
                # Another member of this round claimed it first: the record is this set's
                # as much as the claimer's (its poller fences on it, its suspend marks it).
                # What the claim replaced is known here only for a start (no record); a
                # resumption's suspended record is the claimer's to put back.
                self._adopt_claim(current, "" if self._resumes == 0 else None)
            return current
        got = records.parse(store.compare_set(records.record_key(self.job_id), raw, want))
        assert got is not None
        if got["lineage"] == lineage:
            store.append(records.JOBS_KEY, self.job_id + "\n")
            self._adopt_claim(got, raw)
        return got

    def _adopt_claim(self, record: Record | None, over: str | None) -> None:
        """This worker's set holds the job (``record``, its claim), which replaced the
        record ``over`` (None: not known to this worker). The claimer alone lists the
        job under JOBS_KEY."""
        assert record is not None
        self._lineage = record
        self._claimed_over = over
        if self.journal:
            self._await_journal(records.encode(record))

    def _await_journal(self, encoded: str) -> None:
        key = records.journaled_key(self.job_id)
        deadline = time.monotonic() + self.store_timeout_s
        store = self._main_store
        while not (store.check([key]) and store.get(key).decode() == encoded):
            if time.monotonic() > deadline:
                raise RendezvousConnectionError(
                    f"the store at {self.endpoint} did not write job {self.job_id!r} to its "
                    f"journal ({self.journal}) within {self.store_timeout_s:g} s"
                )
            time.sleep(_KNOCK_POLL_S)

    def joined(self, record: Record) -> None:
        """This worker belongs to the worker set of ``record`` (a newcomer learns it from
        the members' answer or from the store)."""
        self._lineage = dict(record)

    @property
    def lineage(self) -> Record | None:
        return self._lineage

    def fenced(self) -> Record | None:
        """The record that fenced this worker set (another lineage, or the job finished
        without it), as the poller last read it; None while the job is this set's."""
        return self._fenced

    def _reregister(self) -> None:
        """After the store restarted: puts this worker set's record back (Note [Fencing
        a job]), or notes that another lineage holds the job."""
        mine = self._lineage
        if mine is None:
            return
        store, key = self._main_store, records.record_key(self.job_id)
        for _ in range(8):
            raw, current = records.read(store, self.job_id)
            if current is None or (
                current["lineage"] == mine["lineage"] and current.get("restored")
            ):
                epoch = max(mine["epoch"], current["epoch"] if current else 0) + 1
                want = records.encode(
                    records.running(mine["lineage"], epoch, records.resumes(mine))
                )
                if store.compare_set(key, raw, want).decode() == want:
                    store.append(records.JOBS_KEY, self.job_id + "\n")
                    self._lineage = records.parse(want)
                    return
                continue  # another member wrote first: read what it wrote
            if current["lineage"] == mine["lineage"] and current["state"] == "running":
                self._lineage = current
                return
            self._fenced = current
            return

    def _look_at_record(self) -> None:
        mine = self._lineage
        if mine is None:
            return
        current = records.read(self._poll_store, self.job_id)[1]
        if current is None or current.get("restored"):
            return  # a restart not seen yet on this connection: the reconnection decides
        if current["lineage"] != mine["lineage"] or current["state"] != "running":
            self._fenced = current

    def release(self, lineage: str) -> None:
        """Gives up the claim of ``lineage`` on the job, which nobody trained (its first
        worker set failed to form): the record it replaced (none, or the suspended one)
        is put back, and the next round claims it again."""
        mine = self._lineage
        if mine is not None and mine["lineage"] == lineage:
            if self._claimed_over is not None:
                self._main_store.compare_set(
                    records.record_key(self.job_id), records.encode(mine), self._claimed_over
                )
            self._lineage = None

    def finish_record(self) -> None:
        """Marks the job finished, if the record is this worker set's (every member
        writes the same bytes; the epoch is whatever the set re-registered last)."""
        mine = self._lineage
        if mine is None:
            return
        raw, current = records.read(self._main_store, self.job_id)
        if current is None or current["lineage"] != mine["lineage"]:
            return
        done = {k: v for k, v in current.items() if k != "restored"}
        self._main_store.compare_set(
            records.record_key(self.job_id), raw, records.encode(dict(done, state="finished"))
        )

    def suspend(self, step: int) -> Record | None:
        """Marks the job suspended at ``step`` (Note [Suspending a job],
        vflow/elastic/job.py), if the record is this worker set's running one (every
        member writes the same bytes), and ends this worker's part in the rendezvous: the
        poller and heartbeats stop, and the generation's rendezvous is shut down, which
        tells workers waiting on its wait list. Returns the record that stands: this
        set's suspended one, or the one that fenced it (another lineage, the job
        finished), or None without a record. On a journaled store it returns once the
        journal holds the suspended record. Raises DistError (or
        RendezvousConnectionError) when the store cannot be reached."""
        self._stop()
        mine = self._lineage
        store, key = self._main_store, records.record_key(self.job_id)
        raw, current = records.read(store, self.job_id)
        if mine is None or current is None or current["lineage"] != mine["lineage"]:
            return current
        if current["state"] == "running":
            want = records.encode(records.suspended(current, step))
            current = records.parse(store.compare_set(key, raw, want))
            assert current is not None
        if current["lineage"] != mine["lineage"] or current["state"] != "suspended":
            return current
        self._lineage = current
        store.append(records.JOBS_KEY, self.job_id + "\n")
        if self.journal:
            self._await_journal(records.encode(current))
        # Knockers learn it from the record; their tickets are answered, so that the next
        # generation's members never offer places to workers gone meanwhile (Note
        # [Knockers acknowledge]); the members' list goes, so that the next generation's
        # knockers never probe this one's.
        job = self.job_store
        knocks = int(job.add(_KNOCKS, 0))
        answered = int(job.add(_ANSWERED, 0))
        while answered < knocks:
            answered = int(job.compare_set(_ANSWERED, str(answered), str(knocks)))
        job.delete_key(_MEMBERS)
        with self._lock:
            self._handler.shutdown()
        return current

    # ---- rounds ----------------------------------------------------------------------

    def next_round(self) -> Round:
        """Leaves the current round (if any) and joins the next; returns once it is
        complete. Raises RendezvousTimeoutError after the join timeout and
        RendezvousClosedError (or, for a worker that was waiting to join,
        RendezvousGracefulExitError) when the job is finished."""
        with self._lock:
            self._in_round = False
            self._handler_used = True
            info = self._handler.next_rendezvous()
            number = self._handler._state_holder.state.round
            # The handler's join loop sends a heartbeat only once per 1 s poll and its timer
            # ticks first keep_alive_s after the round: without this one, a member's
            # heartbeat can age past the expiry and a peer drops it from the round.
            self._handler._keep_alive()
            self._waiting = 0
            self._evicted = False
            self._adopted = False
            generation = f"resume{self._resumes}/" if self._resumes else ""
            prefix = f"vflow/{self.job_id}/{self._boot}/{generation}round{number}"
            self._round = Round(
                number, info.rank, info.world_size, prefix, self._main, self._group_connection
            )
            self._say_probe()
            self._in_round = True
        return self._round

    def adopt(self, prefix: str, number: int, rank: int) -> Round:
        """The round a worker let in by the members now belongs to (it is not a
        participant of the rendezvous' round: the heartbeats' view of it is not its)."""
        with self._lock:
            self._waiting = 0
            self._evicted = False
            self._adopted = True
            self._round = Round(number, rank, 0, prefix, self._main, self._group_connection)
            self._say_probe()
            self._in_round = True
        return self._round

    def _say_probe(self) -> None:
        rnd = self._round
        assert rnd is not None
        self._main_store.set(_probe_key(rnd, rnd.rank), self._probe.endpoint)

    @property
    def probe_endpoint(self) -> str:
        """Where this worker answers probes (Note [Probing a peer])."""
        return self._probe.endpoint

    def publish_members(self, ranks: list[int]) -> None:
        """Says which of the round's ranks form the worker set now (its lowest member
        calls this), so that a knocker can probe them first."""
        rnd = self._round
        assert rnd is not None
        self._members = json.dumps({"prefix": rnd.prefix, "ranks": ranks})
        self.job_store.set(_MEMBERS, self._members)

    def _republish(self) -> None:
        """After reconnecting: this worker's probe, and the members if it published them."""
        if self._in_round and self._round is not None:
            self._say_probe()
            if self._members is not None:
                self.job_store.set(_MEMBERS, self._members)

    def member_probes(self) -> list[str]:
        """The probe endpoints of the running worker set's members, as far as published."""
        job = self.job_store
        if not job.check([_MEMBERS]):
            return []
        members = json.loads(job.get(_MEMBERS))
        keys = [f"{members['prefix']}/probe/{r}" for r in members["ranks"]]
        return [value for value in _present(self._main_store, keys) if value is not None]

    # ---- knocking (Note [Joining a running job], vflow/elastic/admission.py) ---------

    def knock(self, timeout_s: float, stage: int | None = None) -> dict[str, Any] | None:
        """Asks the running job's worker set to take this worker in, without a round
        (Note [Joining a running job], vflow/elastic/admission.py); returns the members'
        answer, or None when the job finished first. Raises RendezvousTimeoutError
        after ``timeout_s``, also when this worker cannot reach a member (Note [Probing
        a peer]). ``stage``: the pipeline stage this worker holds, said beside its
        ticket (Note [Replicas as members], vflow/elastic/replicas.py)."""
        # Out of any round it was in: its poller no longer beats there, so that peers
        # recovering without it do not wait for it (Note [Beats]).
        with self._lock:
            self._in_round = False
            self._round = None
        deadline = time.monotonic() + timeout_s
        self._said_restored = False
        while True:
            if not self._await_reachable_members(deadline):
                return None
            job = self.job_store
            ticket = int(job.add(_KNOCKS, 1))
            if stage is not None:
                job.set(f"stage/{ticket}", str(stage))
            offer = self._await_answer(job, f"admit/{ticket}", deadline, timeout_s)
            if offer is None:
                return None
            if "acks" in offer:  # Note [Knockers acknowledge]
                job.append(str(offer["acks"]), f"{ticket},")
                answer = self._await_answer(job, f"admit/{ticket}/in", deadline, timeout_s)
                if answer is None:
                    return None
            else:
                answer = offer
            if not answer.get("again"):
                return dict(answer, ticket=ticket)

    def _await_answer(
        self, job: dist.Store, key: str, deadline: float, timeout_s: float
    ) -> dict[str, Any] | None:
        """The members' answer at ``key``, or None when the job finished first; raises
        RendezvousTimeoutError at ``deadline``."""
        next_look = 0.0
        while not job.check([key]):
            now = time.monotonic()
            if now >= next_look:
                current = self.record()
                if current is not None and current["state"] != "running":
                    return None
                if current is not None and current.get("restored") and not self._said_restored:
                    self._said_restored = True
                    _log.warning(
                        "vflow elastic: job %r ran on the store at %s before the store "
                        "restarted, and its workers have not re-registered yet; waiting "
                        "for them (up to join_timeout_s=%g s). If they are gone, start the "
                        "job under a new id (from its checkpoint)",
                        self.job_id,
                        self.endpoint,
                        timeout_s,
                    )
                next_look = now + _RECORD_POLL_S
            if now > deadline:
                raise RendezvousTimeoutError(
                    f"no answer to this worker's request to join within {timeout_s:g} s"
                )
            time.sleep(_KNOCK_POLL_S)
        return dict(json.loads(job.get(key)))

    def _await_reachable_members(self, deadline: float) -> bool:
        """Waits until this worker reaches every member of the running set (Note
        [Probing a peer]): a worker that cannot would only make the members' next group
        fail. Returns False when the job finished meanwhile; raises
        RendezvousTimeoutError naming the members it cannot reach at ``deadline``."""
        said = False
        while True:
            current = self.record()
            if current is not None and current["state"] != "running":
                return False
            endpoints = self.member_probes()
            cut = [e for e, ok in zip(endpoints, reachable(endpoints), strict=True) if not ok]
            if not cut:
                return True
            if time.monotonic() > deadline:
                raise RendezvousTimeoutError(
                    f"this worker cannot reach the job's workers at {', '.join(cut)} (a "
                    "partition, or a link down?); it did not ask to join"
                )
            if not said:
                said = True
                _log.warning(
                    "vflow elastic: this worker cannot reach the job's workers at %s; it asks "
                    "to join once it can",
                    ", ".join(cut),
                )
            time.sleep(1.0)

    def pending(self, room: int) -> list[int]:
        """The tickets of workers that knocked and were not answered yet, oldest first,
        at most ``room`` (read now)."""
        answered, knocks = _tickets(self.job_store)
        return list(range(answered + 1, knocks + 1))[: max(room, 0)]

    def wait_list(self) -> int:
        """Workers on the rendezvous' wait list: as the poller last saw them on the
        member that watches (Note [One member watches the door]), read now on the
        others."""
        if self._watching:
            return self._wait_list
        with self._lock:
            return self._handler.num_nodes_waiting()

    def offer(self, tickets: list[int], acks: str, *, write: bool) -> None:
        """Note [Knockers acknowledge]: offers each of ``tickets`` a place, to be
        acknowledged under ``acks``, and counts them answered (``write``: the member
        whose view the set adopted; on the others this only forgets them)."""
        self._waiting = 0  # they are answered: not waiting any more
        if not write:
            return
        job = self.job_store
        job.append(acks, "")  # exists from now on: read without waiting for it
        job.multi_set([f"admit/{t}" for t in tickets], [json.dumps({"acks": acks})] * len(tickets))
        # Raised to the highest with compare-and-set: the members write at the same time.
        top = max(tickets)
        answered = int(job.add(_ANSWERED, 0))
        while answered < top:
            answered = int(job.compare_set(_ANSWERED, str(answered), str(top)))

    def acknowledged(
        self,
        acks: str,
        tickets: list[int],
        poll_s: float,
        *,
        window_s: float = ACK_S,
        offer_s: float = OFFER_S,
    ) -> list[int]:
        """The ``tickets`` acknowledged under ``acks`` once all of them are, or
        ``window_s`` after this member first saw the offer written (Note [Knockers
        acknowledge]), in the order of ``tickets``; it looks every ``poll_s``. An offer
        not written within ``offer_s`` (its writer died) has nothing acknowledged."""
        job = self.job_store
        start = time.monotonic()
        seen: float | None = None  # when this member first saw the offer written
        while True:
            said = set()
            if job.check([acks]):
                seen = time.monotonic() if seen is None else seen
                said = {int(t) for t in job.get(acks).decode().split(",") if t}
            now = time.monotonic()
            late = now > start + offer_s if seen is None else now > seen + window_s
            if said.issuperset(tickets) or late:
                return [t for t in tickets if t in said]
            time.sleep(poll_s)

    def answer(self, tickets: list[int], answers: list[dict[str, Any]]) -> None:
        """Writes the members' final answer to each offered ticket (every member writes
        the same)."""
        self.job_store.multi_set(
            [f"admit/{t}/in" for t in tickets], [json.dumps(a) for a in answers]
        )

    # ---- what the poller saw ---------------------------------------------------------

    def waiting(self) -> int:
        """Workers waiting to join, as last seen by the poller (0 outside a round)."""
        return self._waiting

    def beats(self, ranks: list[int]) -> dict[int, int]:
        """How many times each of the current round's ``ranks`` has beaten (Note [Beats]):
        a count that stops moving is a worker gone (killed, stopped, or out of the round)."""
        rnd = self._round
        if rnd is None:
            raise RuntimeError("beats() outside a round")
        store = self._main_store
        keys = [_beat_key(rnd, r) for r in ranks]
        # One request for all (Note [An agreement's requests], vflow/elastic/agreement.py);
        # a key missing (a store that restarted and a worker that never beat on it)
        # would make multi_get wait, so then each is read with add, which makes it.
        if keys and store.check(keys):
            return {r: int(v) for r, v in zip(ranks, store.multi_get(keys), strict=True)}
        return {r: int(store.add(key, 0)) for r, key in zip(ranks, keys, strict=True)}

    def probes(self, ranks: list[int]) -> dict[int, str]:
        """Where each of the current round's ``ranks`` answers probes (Note [Probing a
        peer], vflow/world/network.py), for those that said so."""
        rnd = self._round
        if rnd is None:
            raise RuntimeError("probes() outside a round")
        values = _present(self._main_store, [_probe_key(rnd, r) for r in ranks])
        return {r: v for r, v in zip(ranks, values, strict=True) if v is not None}

    def evicted(self) -> bool:
        """Whether the rendezvous dropped this worker from its round (its heartbeats
        lapsed): it must join the next round, or two worker sets could train apart."""
        return self._evicted

    # ---- ending ----------------------------------------------------------------------

    def leave(self) -> None:
        """Leaves the current round without ending the job; the others go on."""
        if not self._stop():
            return
        with self._lock:
            self._handler._stop_heartbeats()
            deadline = time.monotonic() + self._handler.settings.timeout.close.total_seconds()
            try:
                self._handler._op_executor.run(_RendezvousExitOp(), deadline)
            except Exception:  # best effort: the heartbeat expiry removes us anyway
                pass

    def finish(self) -> None:
        """Ends the job: its record says finished, and waiting and later workers learn
        that the job is over."""
        if not self._stop():
            return
        try:
            self.finish_record()
        except dist.DistError:
            pass  # the store lost at the very end: knockers learn it from their own errors
        with self._lock:
            self._handler.shutdown()

    def close(self) -> None:
        """Stops the poller and the heartbeats (a worker that raises)."""
        if self._stop():
            with self._lock:
                self._handler._stop_heartbeats()

    def _stop(self) -> bool:
        """Stops the poller, the probe and, when the store is unreachable, the handler's
        heartbeats; returns whether the store is reachable. Every wait here is bounded:
        a request to a silent store fails within ``store_timeout_s`` (Note [A store that
        goes silent], vflow/world/store.py), and no thread is left inside one when the
        process exits."""
        self._closed.set()
        self._probe.close()
        if self._poller.is_alive() and self._poller is not threading.current_thread():
            self._poller.join(timeout=4 * _POLL_S)
            if self._poller.is_alive():  # inside a request to a store that does not answer
                self._lost(TimeoutError("the rendezvous store does not answer"))
                self._poller.join(timeout=self.store_timeout_s + 1.0)
        if self._lost_since is not None:
            self._handler._stop_heartbeats()
            return False
        return True

    def _poll(self) -> None:
        while not self._closed.wait(_POLL_S):
            if self._lost_since is not None:
                self.reconnect()
                continue
            with self._lock:
                if not self._in_round or self._round is None:
                    continue
                try:
                    self._poll_once(self._round)
                except Exception as e:
                    # Training needs no store (Note [The store during a round],
                    # vflow/elastic/reporting.py): the poller reconnects on its next turn.
                    self._waiting = 0
                    self._lost(e)

    def watch(self, door: bool, neighbour: int | None = None) -> None:
        """Whether this worker's poller watches for workers that wait to join (Note [One
        member watches the door]): the lowest member of its worker set does; and whose
        beats it reads, ``neighbour``: the round rank after this worker's in its set
        (Note [The next worker's beats]), None alone."""
        self._watching = door
        if not door:
            self._waiting = self._wait_list = 0
        if neighbour != self._neighbour:
            self._neighbour, self._neighbour_seen = neighbour, None
            self._next_neighbour_look = 0.0

    def interrupt_on_broken(self, key: str, interrupt: Callable[[], None]) -> None:
        """From now on, the message "broken ``key``" on this worker's probe calls
        ``interrupt`` (Note [A survivor blocked on survivors],
        vflow/elastic/agreement.py); a message naming another key is ignored, so a late
        one never breaks the set that followed. ``interrupt`` is a bound method, held
        weakly: its object (the executor's World) must not outlive the executor's use
        of it, for a group dropped after a failure closes its connections only with its
        last reference (Note [Recovering within the round])."""
        self._broken_target = (key, weakref.WeakMethod(interrupt))

    def _told(self, message: str) -> None:
        target = self._broken_target  # read once: the main thread may replace it
        if target is not None and message == f"{BROKEN} {target[0]}":
            interrupt = target[1]()
            if interrupt is not None:
                _log.info(
                    "vflow elastic: told that worker set %s broke; leaving its collective",
                    target[0],
                )
                interrupt()

    def beat_seen(self, rank: int) -> tuple[int, float] | None:
        """The beat count of ``rank`` as this worker's poller last read it, and since
        when (time.monotonic()) it has read that count (Note [The next worker's beats]);
        None unless ``rank`` is the neighbour it watches and it has read it."""
        seen = self._neighbour_seen
        return (seen[1], seen[2]) if seen is not None and seen[0] == rank else None

    def _poll_once(self, rnd: Round) -> None:
        self._poll_store.add(_beat_key(rnd, rnd.rank), 1)
        now = time.monotonic()
        if self._watching and now >= self._next_door_look:
            self._next_door_look = now + _DOOR_POLL_S
            knocking = self._knocking(*self._poll_tickets())
            # num_nodes_waiting syncs the handler's state (at most once a second).
            self._wait_list = self._handler.num_nodes_waiting()
            self._waiting = self._wait_list + knocking
        neighbour = self._neighbour
        if neighbour is not None and now >= self._next_neighbour_look:
            self._next_neighbour_look = now + _NEIGHBOUR_POLL_S
            count = int(self._poll_store.add(_beat_key(rnd, neighbour), 0))
            seen = self._neighbour_seen
            if seen is None or seen[:2] != (neighbour, count):
                self._neighbour_seen = (neighbour, count, now)
        state = self._handler._state_holder.state
        self._evicted = not self._adopted and self._handler._this_node not in state.participants
        if now >= self._next_record_look:
            self._next_record_look = now + _RECORD_POLL_S
            self._look_at_record()

    # Note [The next worker's beats]
    # A silent peer (a host whose link went down, a stopped process) is found gone once
    # its beats stood still for gone_after_s (Note [Beats]). The survivors only start to
    # look after a collective failed, which for a silent peer is timeout_s after it fell
    # silent: a verdict clocked from then would cost timeout_s + gone_after_s, although
    # the beats had stopped long before. So each member's poller also reads the beat
    # count of the member after it in the set's order (``watch``), every
    # _NEIGHBOUR_POLL_S, and keeps when it first read the count it last read: the count
    # has stood still at least since then. In an agreement, the survivor watching that
    # peer (the one before it: Note [Each silent worker watched once],
    # vflow/elastic/agreement.py) starts the peer's clock there when the count has not
    # moved since (``beat_seen``), so a peer silent since before the failure is judged
    # at once. One request a second per member.
    #
    # Note [One member watches the door]
    # A member learns of workers waiting to join only to set WAITING in its step's signal
    # word, and the words travel in the step's statistics to every member: one member
    # seeing them is enough. So only the set's lowest member (``watch``, called at every
    # change of the set) reads the ticket counters and the rendezvous' wait list; the
    # others' pollers only beat. Should it die, the set that recovers has another lowest
    # member. A member's steady requests to the store are then its beat every _POLL_S,
    # its look at the job's record every _RECORD_POLL_S and, for a participant of the
    # rendezvous' round, the handler's keep-alive every keep_alive_s (two
    # compare-and-sets: torch's c10d backend reads the state with one) and its read of
    # the next member's beats every _NEIGHBOUR_POLL_S: 10 + 1 + 4 + 1 a second with the
    # defaults, whatever N; the watching member adds a read of the knocks counter every
    # _DOOR_POLL_S (4 a second; the wait list's read shares the keep-alive's), 20 in all
    # (benchmarks/store_load.py counts them).
    #
    # Note [A window for joiners]
    # Joiners started together knock over a few seconds (each builds its executor
    # first: Note [Joining ahead], vflow/elastic/job.py). Each grow costs the members a
    # stall, so the watching member reports them only once no new ticket was taken for
    # the last call (``last_call_s``, the rendezvous' window for the same purpose), or
    # once the oldest has waited 5 x that: joiners arriving within one window come in
    # by one grow.
    def _knocking(self, answered: int, knocks: int) -> int:
        """How many tickets wait for an answer, once they are due (Note [A window for
        joiners]); 0 before."""
        now = time.monotonic()
        if knocks <= answered:
            self._unanswered_since = 0.0
            return 0
        if knocks != self._knocks_seen:
            self._knocks_seen, self._knock_since = knocks, now
        if not self._unanswered_since:
            self._unanswered_since = now
        window = self._handler_options["timeout"].last_call.total_seconds()
        quiet = now - self._knock_since >= window
        if quiet or now - self._unanswered_since >= 5 * window:
            return knocks - answered
        return 0

    # Note [Reading the tickets]
    # Every poll of every member reads the ticket counters, so their reads are most of a
    # member's requests to the store (issue 35 measured ~40 a second per worker in
    # steady state, 4 a poll). The answered counter only grows and never passes the
    # knocks counter, so the poller keeps the highest answered it has read: while the
    # knocks counter is at most that, nothing is unanswered and the answered counter
    # need not be read (one request a poll instead of two, in steady state). A new
    # connection starts again from 0: a restarted store counts tickets from 0 too.
    def _poll_tickets(self) -> tuple[int, int]:
        """The highest ticket answered and the highest taken, as the poller reads them."""
        knocks = int(self._poll_job.add(_KNOCKS, 0))
        if knocks > self._answered_seen:
            self._answered_seen = int(self._poll_job.add(_ANSWERED, 0))
        return min(self._answered_seen, knocks), knocks


def _tickets(job: dist.Store) -> tuple[int, int]:
    """The highest ticket answered and the highest taken."""
    return int(job.add(_ANSWERED, 0)), int(job.add(_KNOCKS, 0))


def _beat_key(rnd: Round, rank: int) -> str:
    return f"{rnd.prefix}/beat/{rank}"


def _present(store: dist.Store, keys: list[str]) -> list[str | None]:
    """The values of ``keys``, None for those missing: one request for all when all are
    there (multi_get would wait for a missing one), else two for each."""
    if keys and store.check(keys):
        return [value.decode() for value in store.multi_get(keys)]
    return [store.get(key).decode() if store.check([key]) else None for key in keys]


def _probe_key(rnd: Round, rank: int) -> str:
    return f"{rnd.prefix}/probe/{rank}"
