"""The worker sets of an elastic job and their process groups.

A worker set (``WorkerSet``) is the round ranks that train together; each set gets a
fresh process group on the round's store (``Groups.make``), the executor moves onto it
(``Groups.move``), and the group it leaves, or one given up after a failure, is shut
down or aborted where the backend needs it (Note [NCCL rounds]). The set's lowest
member publishes who is in it, for knockers to probe (``publish``). The interface the
collectives use is chosen here too (``choose_interface``).

The protocols that change a worker set (vflow/elastic/admission.py,
vflow/elastic/agreement.py) and the state machine (vflow/elastic/job.py) use this
module; it uses none of them.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from vflow.elastic.rendezvous import Rendezvous, Round, round_group
from vflow.pipeline.executor import PipelineExecutor
from vflow.pipeline.grid import ProcessGrid
from vflow.runtime.executor import Executor
from vflow.world import network
from vflow.world.group import (
    CollectiveError,
    end_default_group,
    failure_words,
    start_default_group,
)

# What an elastic job trains: one worker per process of a plain executor, or one stage
# of a pipeline replica per process (Note [Replicas as members], vflow/elastic/replicas.py).
AnyExecutor = Executor | PipelineExecutor
# A worker set's group: a process group, or a pipeline's grid (Note [A grid per set]).
SetGroup = Any

__all__ = [
    "GROUP_REQUESTS_PER_S",
    "Groups",
    "WorkerSet",
    "choose_interface",
    "group_bound_s",
    "next_member",
    "prepare_nccl",
    "publish",
]

_log = logging.getLogger("vflow")


@dataclasses.dataclass(frozen=True)
class WorkerSet:
    """This worker's worker set within a round: the round ranks in it, and how many sets
    the round has had before (every member counts the same: the sets change at the same
    steps on all of them), which names the set's group and its recovery keys."""

    round: Round
    ranks: list[int]
    generation: int = 0

    @property
    def name(self) -> str:
        return f"set{self.generation}"

    @property
    def key(self) -> str:
        """The set's name unique in the job (its round's prefix names the store's boot
        and the round)."""
        return f"{self.round.prefix}/{self.name}"

    def without(self, ranks: list[int]) -> WorkerSet:
        return self.successor([r for r in self.ranks if r not in ranks])

    def successor(self, ranks: list[int]) -> WorkerSet:
        return WorkerSet(self.round, list(ranks), self.generation + 1)


# Note [Bounds that grow with the set]
# Creating a Gloo group is a full mesh: every worker writes its address to the round's
# store and waits for, then reads, every other's, two requests per pair of workers,
# 2 N^2 for a set of N at one store, and a connection per pair. At the store's capacity
# measured here (benchmarks/store_load.py: 40,000-80,000 requests a second), 1,024
# workers' group takes 25-50 s of the store alone, where 32 workers' takes 50 ms. So
# the bound on creating a group (``group_timeout_s``) cannot be the collective timeout
# (``timeout_s``: how long a hung peer may stall a step, which does not grow with N):
# by default it is max(timeout_s, N^2 / GROUP_REQUESTS_PER_S), at least twice the
# store's time, 10 s up to 316 workers, 105 s at 1,024. The collectives of a group pass
# their own timeout (``timeout_s``), so the longer bound never slows hang detection.
# The join deadline (``join_deadline_s``: how long members wait for newcomers to
# connect) bounds the creation of a grown set's group, and defaults to the same bound.
GROUP_REQUESTS_PER_S = 10_000


def group_bound_s(workers: int, timeout_s: float) -> float:
    """The default bound on creating the group of ``workers`` (Note [Bounds that grow
    with the set])."""
    return max(timeout_s, workers * workers / GROUP_REQUESTS_PER_S)


class Groups:
    """One worker's process groups for its worker sets: ``backend`` ("gloo" or "nccl"),
    the bound ``timeout_s`` on every collective, and ``gloo_interface``, the interface
    Gloo binds (None: Gloo reads ``GLOO_SOCKET_IFNAME`` itself). A group's creation is
    bounded by ``group_timeout_s``, or ``join_deadline_s`` when newcomers join it (None:
    Note [Bounds that grow with the set]). On NCCL it keeps the group the executor is
    on, to shut it down once the executor has moved on. With ``stages`` > 1 a set's
    group is a pipeline's grid (Note [A grid per set])."""

    def __init__(
        self,
        backend: str,
        timeout_s: float,
        gloo_interface: str | None,
        group_timeout_s: float | None = None,
        join_deadline_s: float | None = None,
        stages: int = 1,
    ) -> None:
        self.backend = backend
        self.stages = stages
        self.timeout_s = timeout_s
        self.group_timeout_s = group_timeout_s
        self.join_deadline_s = join_deadline_s
        self._gloo_interface = gloo_interface
        self._nccl_group: dist.ProcessGroup | None = None

    def bound_s(self, workers: int, joining: bool = False) -> float:
        """How long creating the group of ``workers`` may take; ``joining``: newcomers
        join it (the join deadline)."""
        if joining and self.join_deadline_s is not None:
            return self.join_deadline_s
        if self.group_timeout_s is not None:
            return self.group_timeout_s
        return group_bound_s(workers, self.timeout_s)

    def deadline_words(self, workers: int) -> str:
        """The join deadline of a set of ``workers``, for messages."""
        bound = self.bound_s(workers, joining=True)
        if self.join_deadline_s is not None:
            return f"join_deadline_s={bound:g} s"
        return f"{bound:g} s, the group bound of {workers} workers"

    def make(
        self, rnd: Round, name: str, ranks: list[int] | None, joining: bool = False
    ) -> SetGroup:
        """The group of ``ranks`` (None: the round's all) named ``name`` in ``rnd``,
        ``joining``: with newcomers; a peer that never connects within ``bound_s`` (dead
        or hung) is a CollectiveError, like a failed collective. With ``stages`` > 1,
        the grid of ``ranks`` in grid order (Note [A grid per set])."""
        start = time.monotonic()
        bound = self.bound_s(rnd.world_size if ranks is None else len(ranks), joining)
        try:
            if self.stages > 1:
                assert ranks is not None  # a pipelined set is always shaped
                return self._grid(rnd, name, ranks, bound)
            return round_group(
                rnd,
                timedelta(seconds=bound),
                backend=self.backend,
                name=name,
                ranks=ranks,
                interface=self._gloo_interface,
            )
        except RuntimeError as e:  # a peer that never connected: dead or hung
            outcome = failure_words(str(e), time.monotonic() - start, bound)
            raise CollectiveError(
                f"creating the process group of round {rnd.number} ({name}) {outcome}: {e}"
            ) from e

    def _grid(self, rnd: Round, name: str, ranks: list[int], bound: float) -> ProcessGrid:
        if self.backend == "gloo" and self._gloo_interface is not None:
            # The default group and new_group read Gloo's interface from there.
            os.environ.setdefault("GLOO_SOCKET_IFNAME", self._gloo_interface)
        start_default_group(
            dist.PrefixStore(f"vflow/{name}/grid", rnd.group_store),
            ranks.index(rnd.rank),
            len(ranks),
            self.backend,
            timedelta(seconds=bound),
        )
        return ProcessGrid.of(self.stages, timeout=self.timeout_s)

    @staticmethod
    def world_group(group: SetGroup) -> dist.ProcessGroup | None:
        """The process group of all of a set's workers."""
        return group.group if isinstance(group, ProcessGrid) else group

    def move(self, ex: AnyExecutor, group: SetGroup, newcomer: bool = False) -> None:
        """``ex`` onto ``group`` (Note [Joining a worker set]); on NCCL, the group it
        leaves is shut down (Note [NCCL rounds])."""
        if isinstance(ex, PipelineExecutor):
            ex.reconfigure(group, catch_up=True, newcomer=newcomer)
            return
        ex.reconfigure(group, timeout=self.timeout_s, catch_up=True, newcomer=newcomer)
        if self.backend == "nccl":
            previous, self._nccl_group = self._nccl_group, group
            if previous is not None:
                previous.shutdown()

    def discard(self, group: SetGroup) -> None:
        """A group that will not be used: NCCL's communicators need an abort (Note [NCCL
        rounds]); Gloo's sockets close with the last reference; a grid's default group
        is destroyed with every group made on it."""
        if isinstance(group, ProcessGrid):
            end_default_group()
        elif self.backend == "nccl":
            group.abort()

    def abort(self, ex: AnyExecutor) -> None:
        """Drops ``ex``'s group at once after a failure (``Executor.abort_group``): a peer
        still blocked on it fails now, not at its timeout (Note [Recovering within the
        round], vflow/elastic/agreement.py); a grid's default group goes with it."""
        self._nccl_group = None
        ex.abort_group()
        if self.stages > 1:
            end_default_group()


def next_member(workers: WorkerSet) -> int | None:
    """The round rank after this worker's in its set's order, around the ring (Note
    [The next worker's beats], vflow/elastic/rendezvous.py); None alone."""
    ranks = workers.ranks
    if len(ranks) < 2:
        return None
    return ranks[(ranks.index(workers.round.rank) + 1) % len(ranks)]


def publish(rdzv: Rendezvous, ex: AnyExecutor, workers: WorkerSet) -> None:
    """The set's lowest member says who is in it, for knockers to probe (Note [Probing
    a peer], vflow/world/network.py), and watches for them (Note [One member watches
    the door], vflow/elastic/rendezvous.py) and reads the beats of the member after it
    (Note [The next worker's beats]); a "broken" message for the set interrupts the
    executor's waits on its group (Note [A survivor blocked on survivors],
    vflow/elastic/agreement.py); training goes on without the store."""
    # Held weakly: a pipeline's whole grid is the executor's (its ``world`` is made
    # on each read), a plain executor's group its World's.
    interrupt = ex.interrupt if isinstance(ex, PipelineExecutor) else ex.world.interrupt
    rdzv.interrupt_on_broken(workers.key, interrupt)
    rdzv.watch(ex.rank == 0, next_member(workers))
    if ex.rank == 0:
        try:
            rdzv.publish_members(workers.ranks)
        except dist.DistError:
            pass


# Note [A grid per set]
# torch.distributed.pipelining addresses a stage's peers by their ranks in the default
# group (Note [The grid], vflow/pipeline/grid.py), which a group built on the round's
# store alone (round_group) is not part of. So each worker set of a pipelined job is a
# default group of its own: the set's workers, in grid order (Note [Replicas as
# members], vflow/elastic/replicas.py), on the set's keys of the round's store, and the
# grid's groups made on it (ProcessGrid.of). Making the next set's destroys the previous
# one with every group made on it, which is what a crash needs too: the connections of
# the broken grid close, and peers blocked on this worker fail at once (``abort``).
# Only the members of the set take part: a worker left out never connects to it.

# Note [NCCL rounds]
# Every worker set of a job gets its own group, hence its own NCCL communicators, which
# (unlike Gloo's sockets) outlive the group's last Python reference: ElasticJob shuts a
# set's group down once the executor has moved on, and aborts it after a failure
# (Executor.abort_group). NCCL's watchdog by default (TORCH_NCCL_ASYNC_ERROR_HANDLING=3)
# kills the process when a collective fails or times out, before vflow could recover:
# an elastic job asks it to clean up only (2), unless the user chose otherwise. None of
# this has run here: it needs one GPU per worker (docs/design.md, Limits).
_NCCL_ERROR_HANDLING = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
_nccl_said = False


def prepare_nccl() -> None:
    """Note [NCCL rounds]: keeps NCCL's watchdog from killing a worker whose collective
    failed, and says once per process that this is untested."""
    global _nccl_said
    chosen = os.environ.setdefault(_NCCL_ERROR_HANDLING, "2")
    if _nccl_said:
        return
    _nccl_said = True
    _log.warning(
        "vflow elastic on NCCL: untested on several GPUs (vflow's tests run Gloo); "
        "%s=%s%s; see docs/design.md, Limits",
        _NCCL_ERROR_HANDLING,
        chosen,
        ""
        if chosen in ("0", "2")
        else " makes NCCL's watchdog kill a worker whose collective fails, before vflow "
        "can recover: set it to 2",
    )


def choose_interface(host: str, port: int, interface: str | None) -> tuple[str, str | None]:
    """Note [The interface that reaches the store] (vflow/world/network.py): the
    interface the job's collectives use, and the one to give Gloo (None when
    ``GLOO_SOCKET_IFNAME`` chooses: Gloo reads it itself, lists of names included)."""
    if interface is not None:
        return network.check_interface(interface, "interface"), interface
    chosen = os.environ.get("GLOO_SOCKET_IFNAME", "")
    if chosen:
        names = [network.check_interface(n, "GLOO_SOCKET_IFNAME") for n in chosen.split(",")]
        return names[0], None
    try:
        name = network.route_interface(host, port)[0]
    except RuntimeError as e:
        raise ValueError(f"rendezvous: {e}") from None
    return name, name
