"""The Executor's side of torch.distributed: the worker set it runs on (``World``:
which group, which rank, and the few collectives that are not gradient buckets —
those live in the C++ Reducer, csrc/reducer.h).

Every collective here is issued by every rank at the same point of a step, so the
issue order on the process group — which is how collectives are matched — is the
same on all ranks (Note [Launch order] in csrc/reducer.h). Each wait is bounded by
the Executor's timeout and a failure raises ``CollectiveError`` naming the step, the
collective and the group.
"""

from __future__ import annotations

import datetime
import hashlib
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from vflow._extension import _C
from vflow.mapping.plan import Plan
from vflow.world.network import loopback_interface

CollectiveError = _C.CollectiveError


def use_loopback_for_gloo() -> None:
    """For processes that only talk to each other on this host: keeps Gloo on the
    loopback interface (unless GLOO_SOCKET_IFNAME is set). By default Gloo binds to the
    address the hostname resolves to, which may be an external interface that a
    sandbox blocks."""
    if "GLOO_SOCKET_IFNAME" not in os.environ:
        loopback = loopback_interface()
        if loopback is not None:
            os.environ["GLOO_SOCKET_IFNAME"] = loopback


def resolve_group(process_group: object) -> dist.ProcessGroup | None:
    """The group an Executor runs on: the one given, else the default group when
    torch.distributed is initialised, else None (one process)."""
    if process_group is None:
        if dist.is_available() and dist.is_initialized():
            return dist.distributed_c10d._get_default_group()
        return None
    if not dist.is_available() or not isinstance(process_group, dist.ProcessGroup):
        raise TypeError(
            "process_group must be a torch.distributed.ProcessGroup (e.g. dist.group.WORLD "
            f"or dist.new_group(...)) or None, got {type(process_group).__name__}"
        )
    return process_group


def new_group(ranks: Sequence[int], timeout: datetime.timedelta | None) -> dist.ProcessGroup:
    """A group of the default group's ``ranks``, with its own ``timeout`` (which bounds
    every wait on it, a pipeline's sends and receives included). A collective of the
    whole default group: every process calls it with the same arguments, in the same
    order as every other ``new_group``, members or not."""
    return dist.new_group(list(ranks), timeout=timeout)


def start_default_group(
    store: dist.Store, rank: int, size: int, backend: str, timeout: datetime.timedelta
) -> None:
    """Makes ``size`` processes on ``store`` the default group of torch.distributed, this
    one rank ``rank``, replacing the default group this process had (destroyed with
    every group made on it). A pipeline's grid needs one: torch.distributed.pipelining
    addresses its peers through the default group's ranks (Note [The grid],
    vflow/pipeline/grid.py), so an elastic pipeline makes one per worker set
    (vflow.elastic). Connecting to the others is bounded by ``timeout``, which also
    becomes the default group's own."""
    end_default_group()
    dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=timeout)


def end_default_group() -> None:
    """Destroys the default group, if any, and every group made on it."""
    if dist.is_initialized():
        dist.destroy_process_group()


def backend_name(group: dist.ProcessGroup) -> str:
    """``group``'s backend ("gloo", "nccl", ...), also for a group built directly on a
    store rather than through ``init_process_group``/``new_group``."""
    try:
        return str(dist.get_backend(group))
    except (ValueError, RuntimeError):
        return str(group.name())


def describe(group: dist.ProcessGroup) -> str:
    name = getattr(group, "group_name", "") or "default"
    return (
        f"process group {name!r} (backend {backend_name(group)}, rank {group.rank()} "
        f"of {group.size()})"
    )


def comm_device(group: dist.ProcessGroup) -> torch.device:
    """Where small control tensors must live for ``group``'s backend."""
    if backend_name(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def to_timedelta(timeout: object) -> datetime.timedelta:
    if isinstance(timeout, datetime.timedelta):
        seconds = timeout.total_seconds()
    elif isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        seconds = float(timeout)
    else:
        raise TypeError(
            f"timeout must be a number of seconds or a datetime.timedelta, got "
            f"{type(timeout).__name__}"
        )
    if not seconds > 0:
        raise ValueError(f"timeout must be > 0 seconds, got {seconds}")
    return datetime.timedelta(seconds=seconds)


def check_plan(plan: object, virtual_nodes: int, world_size: int) -> Plan:
    """Validates ``plan`` against the Executor's V and its group's size (no collective)."""
    if not isinstance(plan, Plan):
        raise TypeError(f"plan must be a vflow.Plan or None, got {type(plan).__name__}")
    if plan.virtual_nodes != virtual_nodes:
        raise ValueError(
            f"plan {plan} has {plan.virtual_nodes} virtual nodes but virtual_nodes="
            f"{virtual_nodes}; the plan must map exactly the Executor's V VNs"
        )
    if plan.num_workers != world_size:
        raise ValueError(
            f"plan {plan} is for {plan.num_workers} workers but the process group has "
            f"{world_size}; give one entry per rank"
        )
    return plan


def default_plan(virtual_nodes: int, world_size: int) -> Plan:
    if world_size > virtual_nodes:
        raise ValueError(
            f"virtual_nodes={virtual_nodes} is smaller than the process group's {world_size} "
            "workers; every worker needs at least one virtual node"
        )
    return Plan.even(virtual_nodes, world_size)


# How often a retired group is asked whether what it was left running has ended.
_RETIRED_POLL_S = 0.5


def retire(group: dist.ProcessGroup) -> bool:
    """After an interrupted wait (``World.interrupt``): when a collective of ``group``
    it left behind still runs, keeps the group referenced by a thread of its own until
    that collective ends, and returns True. Gloo's destructor waits for a running
    collective, up to its timeout: dropped by the caller, the group would block it
    (Note [Interrupting a wait], csrc/interrupt.cpp)."""
    if not _C.group_busy(group):
        return False
    threading.Thread(
        target=_hold_while_busy, args=(group,), name="vflow-retired-group", daemon=True
    ).start()
    return True


def _hold_while_busy(group: dist.ProcessGroup) -> None:
    while _C.group_busy(group):
        time.sleep(_RETIRED_POLL_S)


def failure_words(cause: str, waited_s: float, timeout_s: float) -> str:
    """How a failed wait ended, for an error message: "timed out (timeout T s)" when
    it reached the timeout or the backend says it timed out, else "failed after W s": a
    peer that died closes its connections long before the timeout, and a crash must
    not read as a hang (Note [Saying what failed] in csrc/comm.cpp)."""
    lower = cause.lower()
    if waited_s >= timeout_s or "timed out" in lower or "timeout" in lower:
        return f"timed out (timeout {timeout_s:g} s)"
    return f"failed after {waited_s:.1f} s"


class World:
    """One worker set as the Executor sees it: a process group (or this process alone),
    this worker's rank in it, the bound on every wait, and the collectives of the
    Executor that are not gradient buckets. Replaced as a whole when the worker set
    changes (``Executor.reconfigure``)."""

    def __init__(self, group: dist.ProcessGroup | None, timeout: datetime.timedelta) -> None:
        self.group = group
        self.timeout = timeout
        if group is None:
            self.rank, self.size = 0, 1
            self.device = torch.device("cpu")
            self.description = "this process"
        else:
            self.rank, self.size = group.rank(), group.size()
            self.device = comm_device(group)
            self.description = describe(group)
        self._timeout_s = timeout.total_seconds()
        self._abort_lock = threading.Lock()
        self._aborted = False

    def interrupt(self) -> None:
        """From any thread: every wait on this world's group, running or later, ends at
        once in CollectiveError (Note [Interrupting a wait], csrc/interrupt.cpp). The
        elastic job's way out of a collective blocked on live peers once the others
        agree without this worker (Note [A survivor blocked on survivors],
        vflow/elastic/agreement.py). On NCCL the group's communicators are aborted as
        well, which is what ends a hung kernel (Note [Interrupting an NCCL wait]). No
        effect alone."""
        if self.group is not None:
            _C.interrupt_group(self.group)  # first: a wait the abort ends sees it
            if backend_name(self.group) == "nccl":
                self.abort()

    def abort(self) -> None:
        """Aborts the group's NCCL communicators, once (from any thread): unlike Gloo's
        sockets they outlive the group's last reference, and a hung collective ends
        only so. Nothing for other backends or alone."""
        group = self.group
        if group is None or backend_name(group) != "nccl":
            return
        with self._abort_lock:
            if self._aborted:
                return
            self._aborted = True
        group.abort()

    def check_interrupted(self, what: str, step: int | None) -> None:
        """Raises CollectiveError when ``interrupt`` was called: a worker told that its
        set broke stops where it is (``what``: what it was about to do) rather than
        compute the rest of its step for a collective that would fail at once (Note
        [Told while computing], vflow/runtime/step_run.py)."""
        if self.group is not None and _C.group_interrupted(self.group):
            where = "vflow" if step is None else f"vflow step {step}"
            raise CollectiveError(
                f"{where}: interrupted before {what} on {self.description}: the worker set "
                "broke elsewhere (another worker said so)"
            )

    @property
    def distributed(self) -> bool:
        """Whether there are other workers to talk to."""
        return self.group is not None and self.size > 1

    def _run(self, collective: Callable[[], None], what: str, step: int | None) -> None:
        """Runs ``collective``, one of the ``_C`` collectives (which copy their tensors:
        Note [Collectives on tensors Python cannot see] in csrc/collectives.h) or
        ``broadcast_own``'s; a failure becomes a CollectiveError saying ``what``."""
        where = "vflow" if step is None else f"vflow step {step}"
        start = time.monotonic()
        try:
            collective()
        except RuntimeError as e:
            outcome = failure_words(str(e), time.monotonic() - start, self._timeout_s)
            raise CollectiveError(f"{where}: {what} on {self.description} {outcome}: {e}") from e
        if self._aborted:
            # Note [Interrupting an NCCL wait], csrc/interrupt.cpp: a collective that the
            # abort ended returns, and its output is garbage.
            raise CollectiveError(
                f"{where}: {what} on {self.description} was cut short: the worker set broke "
                "elsewhere and this worker's communicators were aborted"
            )

    def gather_ints(self, values: Sequence[int], what: str, step: int | None) -> list[list[int]]:
        """Every rank's ``values`` (the same count on every rank), in rank order."""
        mine = torch.tensor(list(values), dtype=torch.int64)
        if not self.distributed:
            return [mine.tolist()]
        mine = mine.to(self.device)
        gathered = [torch.empty_like(mine) for _ in range(self.size)]
        self._run(
            lambda: _C.all_gather_into(self.group, mine, gathered, self._timeout_s), what, step
        )
        return [t.cpu().tolist() for t in gathered]

    def broadcast_from(
        self, root: int, tensors: Sequence[torch.Tensor], what: str, step: int | None
    ) -> None:
        """Copies rank ``root``'s values into ``tensors`` on every rank."""
        if not self.distributed:
            return
        self._coalesced(
            tensors,
            lambda members: _C.broadcast_(self.group, members, self.device, root, self._timeout_s),
            what,
            step,
        )

    def broadcast_own(self, root: int, tensor: torch.Tensor, what: str) -> None:
        """Copies rank ``root``'s ``tensor`` into ``tensor`` on every rank, in place:
        for a contiguous tensor on ``device`` that nothing else reads or writes until
        this returns or raises, which then needs none of ``broadcast_from``'s copies
        (a timed-out collective may still write into it: the caller drops it)."""
        if not self.distributed:
            return
        self._check_own(tensor)
        options = dist.BroadcastOptions()
        options.rootRank = root
        options.rootTensor = 0
        options.timeout = self.timeout

        group = self.group
        assert group is not None  # distributed

        def collective() -> None:
            group.broadcast([tensor], options).wait(self.timeout)

        self._run(collective, what, None)

    def send_own(self, peers: Sequence[int], tensor: torch.Tensor, tag: int, what: str) -> None:
        """Sends ``tensor`` to each of ``peers`` (their ``recv_own`` with the same
        ``tag``), all at once, and waits until every send is done; each wait is bounded
        by the timeout. The same conditions on ``tensor`` as ``broadcast_own``."""
        self._check_own(tensor)
        group = self.group
        assert group is not None  # _check_own: distributed

        def collective() -> None:
            works = [group.send([tensor], peer, tag) for peer in peers]
            for work in works:
                work.wait(self.timeout)

        self._run(collective, what, None)

    def recv_own(self, peer: int, tensor: torch.Tensor, tag: int, what: str) -> None:
        """Receives into ``tensor``, in place, what ``peer`` sends with ``send_own`` and
        ``tag``; the wait is bounded by the timeout."""
        self._check_own(tensor)
        group = self.group
        assert group is not None  # _check_own: distributed

        def collective() -> None:
            group.recv([tensor], peer, tag).wait(self.timeout)

        self._run(collective, what, None)

    def _check_own(self, tensor: torch.Tensor) -> None:
        if not self.distributed:
            raise ValueError(f"{self.description} has no other worker to exchange with")
        if not tensor.is_contiguous() or tensor.device != self.device:
            raise ValueError(
                f"tensor must be contiguous and on {self.device}, got one on {tensor.device}"
            )

    def sum(self, tensors: Sequence[torch.Tensor], what: str, step: int | None) -> None:
        """In place: each tensor becomes its sum over the ranks."""
        if not self.distributed:
            return
        self._coalesced(
            tensors,
            lambda members: _C.all_reduce_sum_(self.group, members, self.device, self._timeout_s),
            what,
            step,
        )

    def start_sum(self, tensor: torch.Tensor, what: str, step: int | None) -> PendingSum:
        """Starts summing ``tensor`` over the ranks, in place, and returns at once;
        ``wait()`` on the result ends it. For a contiguous tensor on ``device`` that
        nothing reads or writes until then (as ``broadcast_own``'s). Alone: done."""
        if not self.distributed:
            return PendingSum(None, self, what, step)
        self._check_own(tensor)
        assert self.group is not None  # distributed
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.SUM
        options.timeout = self.timeout
        work = None

        def collective() -> None:
            nonlocal work
            work = self.group.allreduce([tensor], options)  # type: ignore[union-attr]

        self._run(collective, what, step)
        return PendingSum(work, self, what, step)

    def _coalesced(
        self,
        tensors: Sequence[torch.Tensor],
        collective: Callable[[list[torch.Tensor]], None],
        what: str,
        step: int | None,
    ) -> None:
        """Runs ``collective`` once per dtype and device of ``tensors``; the ``_C``
        collectives reduce each such group as one flat copy."""
        for members in _by_kind(tensors).values():
            self._run(lambda members=members: collective(members), what, step)

    def gather_rows(self, local: torch.Tensor, counts: Sequence[int], step: int) -> torch.Tensor:
        """Concatenates every rank's ``local`` rows in rank order; rank r has
        ``counts[r]`` rows (all_gather needs equal shapes, so rows are padded)."""
        if not self.distributed:
            return local
        rows = max(counts)
        padded = local.new_zeros((rows, *local.shape[1:]), device=self.device)
        padded[: local.shape[0]] = local.to(self.device)
        gathered = [torch.empty_like(padded) for _ in range(self.size)]
        self._run(
            lambda: _C.all_gather_into(self.group, padded, gathered, self._timeout_s),
            "all-gather of inference outputs",
            step,
        )
        parts = [part[:n] for part, n in zip(gathered, counts, strict=True)]
        return torch.cat(parts).to(local.device)


class PendingSum:
    """A sum ``World.start_sum`` started: ``wait()`` ends it within the world's timeout,
    or raises CollectiveError saying what it was."""

    def __init__(self, work: Any, world: World, what: str, step: int | None) -> None:
        self._work, self._world, self._what, self._step = work, world, what, step

    def wait(self) -> None:
        work, self._work = self._work, None
        if work is not None:
            self._world._run(lambda: work.wait(self._world.timeout), self._what, self._step)


def fingerprint(text: str) -> int:
    """A 63-bit hash of ``text`` (stable across processes, unlike ``hash``)."""
    digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1  # fits an int64


def _by_kind(tensors: Sequence[torch.Tensor]) -> dict[tuple, list[torch.Tensor]]:
    kinds: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        kinds.setdefault((t.dtype, t.device), []).append(t)
    return kinds
