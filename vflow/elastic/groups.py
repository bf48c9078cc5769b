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

import torch.distributed as dist

from vflow.elastic.rendezvous import Rendezvous, Round, round_group
from vflow.runtime.executor import Executor
from vflow.world import network
from vflow.world.group import CollectiveError, failure_words

__all__ = ["Groups", "WorkerSet", "choose_interface", "prepare_nccl", "publish"]

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

    def without(self, ranks: list[int]) -> WorkerSet:
        return self.successor([r for r in self.ranks if r not in ranks])

    def successor(self, ranks: list[int]) -> WorkerSet:
        return WorkerSet(self.round, list(ranks), self.generation + 1)


class Groups:
    """One worker's process groups for its worker sets: ``backend`` ("gloo" or "nccl"),
    the bound ``timeout_s`` on every collective, and ``gloo_interface``, the interface
    Gloo binds (None: Gloo reads ``GLOO_SOCKET_IFNAME`` itself). On NCCL it keeps the
    group the executor is on, to shut it down once the executor has moved on."""

    def __init__(self, backend: str, timeout_s: float, gloo_interface: str | None) -> None:
        self.backend = backend
        self.timeout_s = timeout_s
        self._gloo_interface = gloo_interface
        self._nccl_group: dist.ProcessGroup | None = None

    def make(self, rnd: Round, name: str, ranks: list[int] | None) -> dist.ProcessGroup:
        """The group of ``ranks`` (None: the round's all) named ``name`` in ``rnd``; a
        peer that never connects (dead or hung) is a CollectiveError, like a failed
        collective."""
        start = time.monotonic()
        try:
            return round_group(
                rnd,
                timedelta(seconds=self.timeout_s),
                backend=self.backend,
                name=name,
                ranks=ranks,
                interface=self._gloo_interface,
            )
        except RuntimeError as e:  # a peer that never connected: dead or hung
            outcome = failure_words(str(e), time.monotonic() - start, self.timeout_s)
            raise CollectiveError(
                f"creating the process group of round {rnd.number} ({name}) {outcome}: {e}"
            ) from e

    def move(self, ex: Executor, group: dist.ProcessGroup, newcomer: bool = False) -> None:
        """``ex`` onto ``group`` (Note [Joining a worker set]); on NCCL, the group it
        leaves is shut down (Note [NCCL rounds])."""
        ex.reconfigure(group, timeout=self.timeout_s, catch_up=True, newcomer=newcomer)
        if self.backend == "nccl":
            previous, self._nccl_group = self._nccl_group, group
            if previous is not None:
                previous.shutdown()

    def discard(self, group: dist.ProcessGroup) -> None:
        """A group that will not be used: NCCL's communicators need an abort (Note [NCCL
        rounds]); Gloo's sockets close with the last reference."""
        if self.backend == "nccl":
            group.abort()

    def abort(self, ex: Executor) -> None:
        """Drops ``ex``'s group at once after a failure (``Executor.abort_group``): a peer
        still blocked on it fails now, not at its timeout (Note [Recovering within the
        round], vflow/elastic/agreement.py)."""
        self._nccl_group = None
        ex.abort_group()


def publish(rdzv: Rendezvous, ex: Executor, workers: WorkerSet) -> None:
    """The set's lowest member says who is in it, for knockers to probe (Note [Probing
    a peer], vflow/world/network.py), and watches for them (Note [One member watches
    the door], vflow/elastic/rendezvous.py); training goes on without the store."""
    rdzv.watch(ex.rank == 0)
    if ex.rank == 0:
        try:
            rdzv.publish_members(workers.ranks)
        except dist.DistError:
            pass


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
