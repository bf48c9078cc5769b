"""The step's statistics: one small float64 tensor per worker, summed over the workers
with the gradient buckets (csrc/reducer.h, ``start_stats``). This module is the one
owner of its layout: the Executor hands it values and gets totals back.

Layout, for V virtual nodes and W workers::

    [0, V)          weighted loss of each VN (n_i / B * loss_i, or loss_sum_i)
    [V, 2V)         num_items of each VN (summed losses)
    [2V, 2V+W)      each worker's 1 if its losses are summed
    [2V+W, 2V+2W)   each worker's VNs with an invalid num_items
    [2V+2W, 6V+2W)  the previous step's profile, per VN: owner rank + 1, size,
                    forward seconds, backward seconds (Note [Profiles], vflow.planning.profile)
    [6V+2W, 6V+8W)  the previous step's profile, per worker: present, step, compute,
                    exposed communication, optimizer and step seconds
    [6V+8W, 6V+9W)  each worker's signal word (``Executor.signal``)
    [6V+9W, 6V+10W) each worker's data lead: the steps beyond this one whose
                    batches its bound sampler has drawn (Note [Plan changes wait for
                    the data], vflow/runtime/executor.py)

Every value sits in a slot of its own — a VN's, or a worker's — and is zero on every
other worker, so the sum over workers only ever adds zeros to a value: exact in any
order. That is also what lets the tensor ride inside the first gradient bucket's
collective (Note [Statistics ride with bucket 0], csrc/reduction/reduction.h), as
pieces of its bits that the sum leaves alone. Totals are then added in VN order (the
workers' counts in rank order), which keeps the reported loss independent of the plan
(and bitwise so in deterministic mode).
"""

from __future__ import annotations

import array
import functools
import math
from dataclasses import dataclass, field

import torch

from vflow.planning.profile import StepProfile, VNProfile, WorkerProfile
from vflow.runtime.losses import LossKind

_VN_ROWS = 4  # owner + 1, size, forward, backward
_WORKER_FIELDS = 6  # present, step, compute, exposed comm, optimizer, step


@dataclass(frozen=True)
class GlobalStats:
    loss_total: float  # weighted VN losses added in VN order
    items_total: float  # num_items added in VN order
    sum_workers: float  # workers whose losses are summed
    bad_items: float  # VNs with an invalid num_items, all workers
    signals: tuple[int, ...]  # every worker's signal word, by rank
    leads: tuple[int, ...]  # every worker's data lead, by rank
    _layout: StatsLayout = field(repr=False, compare=False)
    _values: list[float] = field(repr=False, compare=False)

    @functools.cached_property
    def profile(self) -> StepProfile | None:
        """Every worker's previous step (None while a worker new to the set has none).
        Built when first read: most steps never read it (``plan="auto"`` and
        ``Executor.last_profile`` do), and it is a few dozen objects."""
        return self._layout.profile(self._values)


class StatsLayout:
    """The statistics tensor of a step with V virtual nodes on W workers."""

    def __init__(self, virtual_nodes: int, world_size: int) -> None:
        self.virtual_nodes = virtual_nodes
        self.world_size = world_size
        self._summed = 2 * virtual_nodes
        self._bad = self._summed + world_size
        self._profile_vns = self._bad + world_size
        self._profile_workers = self._profile_vns + _VN_ROWS * virtual_nodes
        self._signals = self._profile_workers + _WORKER_FIELDS * world_size
        self._leads = self._signals + world_size
        self.numel = self._leads + world_size

    def encode(
        self,
        vns: list[int],
        losses: list[torch.Tensor],
        weights: list[float],
        kind: LossKind,
        items: list[torch.Tensor | float],
        previous: WorkerProfile | None,
        rank: int,
        signal: int,
        lead: int,
        device: torch.device,
    ) -> torch.Tensor:
        """This worker's statistics on ``device``. Losses and items on an accelerator
        stay there until the one copy at the end: no host synchronisation before the
        last backward. On the CPU, where reading a value costs no synchronisation, they
        are read and the tensor is built on the host in one piece (a fifth of the
        tensor operations' time, which every step pays); the products are the same
        float64 ones either way (``local_totals``)."""
        v = self.virtual_nodes
        loss_device = losses[0].device
        host = [0.0] * self.numel
        host[self._summed + rank] = 1.0 if kind == "sum" else 0.0
        if previous is not None:
            self._put_profile(host, previous)
        host[self._signals + rank] = float(signal)
        host[self._leads + rank] = float(lead)
        if loss_device.type == "cpu" and (
            kind != "sum"  # mean losses send no item counts
            or not any(isinstance(n, torch.Tensor) and n.device.type != "cpu" for n in items)
        ):
            for vn, loss, weight in zip(vns, losses, weights, strict=True):
                host[vn] = loss.item() * weight
            if kind == "sum":
                bad = 0.0
                for vn, n in zip(vns, items, strict=True):
                    number = float(n)
                    host[v + vn] = number
                    if not number >= 0 or number == math.inf:
                        bad += 1.0
                host[self._bad + rank] = bad
            # No copy: start_stats copies what it sends.
            stats = torch.frombuffer(array.array("d", host), dtype=torch.float64)
            return stats if device.type == "cpu" else stats.to(device)
        stats = torch.tensor(host, dtype=torch.float64, device=loss_device)
        index = torch.tensor(vns, device=loss_device)
        stats[index] = _stack_double(losses) * torch.tensor(
            weights, dtype=torch.float64, device=loss_device
        )
        if kind == "sum":
            counts = torch.stack(
                [torch.as_tensor(n, dtype=torch.float64).to(loss_device) for n in items]
            )
            stats[v + index] = counts
            # Counted on the device, so that bad counts are seen by every worker
            # without a host synchronisation before the last backward.
            stats[self._bad + rank] = ((counts < 0) | ~torch.isfinite(counts)).sum().double()
        return stats.to(device)

    def _put_profile(self, host: list[float], profile: WorkerProfile) -> None:
        v = self.virtual_nodes
        base = self._profile_vns
        for entry in profile.vns:
            host[base + entry.vn] = profile.rank + 1.0
            host[base + v + entry.vn] = float(entry.size)
            host[base + 2 * v + entry.vn] = entry.forward_s
            host[base + 3 * v + entry.vn] = entry.backward_s
        at = self._profile_workers + _WORKER_FIELDS * profile.rank
        host[at : at + _WORKER_FIELDS] = [
            1.0,
            float(profile.step),
            profile.compute_s,
            profile.exposed_comm_s,
            profile.optimizer_s,
            profile.step_s,
        ]

    def decode(self, sums: torch.Tensor) -> GlobalStats:
        """Totals from the statistics summed over the workers."""
        values = sums.tolist()
        v = self.virtual_nodes
        loss_total = 0.0
        items_total = 0.0
        for vn in range(v):
            loss_total += values[vn]
            items_total += values[v + vn]
        w = self.world_size
        signals = tuple(int(x) for x in values[self._signals : self._signals + w])
        leads = tuple(int(x) for x in values[self._leads : self._leads + w])
        return GlobalStats(
            loss_total,
            items_total,
            sum(values[self._summed : self._summed + w]),
            sum(values[self._bad : self._bad + w]),
            signals,
            leads,
            self,
            values,
        )

    def profile(self, values: list[float]) -> StepProfile | None:
        """The previous step's profile of every worker, from the summed ``values``."""
        v, w = self.virtual_nodes, self.world_size
        first = self._profile_workers
        rows = [
            values[first + _WORKER_FIELDS * r : first + _WORKER_FIELDS * (r + 1)] for r in range(w)
        ]
        if any(row[0] != 1.0 for row in rows):
            return None  # a worker new to the set has no previous step
        base = self._profile_vns
        owners = values[base : base + v]
        sizes = values[base + v : base + 2 * v]
        forward = values[base + 2 * v : base + 3 * v]
        backward = values[base + 3 * v : base + 4 * v]
        # One pass over the VNs, each to its owner, in VN order.
        vns: list[list[VNProfile]] = [[] for _ in range(w)]
        for vn in range(v):
            owner = int(owners[vn]) - 1
            if 0 <= owner < w:
                vns[owner].append(VNProfile(vn, int(sizes[vn]), forward[vn], backward[vn]))
        workers = tuple(
            WorkerProfile(rank, int(row[1]), tuple(vns[rank]), row[2], row[3], row[4], row[5])
            for rank, row in enumerate(rows)
        )
        return StepProfile(max(worker.step for worker in workers), workers)


def local_totals(
    losses: list[torch.Tensor], weights: list[float], items: list[torch.Tensor | float] | None
) -> tuple[float, float, float]:
    """(loss total, item total, invalid item counts) of a single worker's VNs, added in
    VN order as ``decode`` adds them. The products are float64 (Python floats) of the
    same operands as ``encode``'s, so the bits are those of the statistics path.
    ``items``: the VNs' num_items of summed losses, None for mean losses."""
    if len(losses) <= 4 or any(t.dtype != losses[0].dtype for t in losses):
        values = [t.item() for t in losses]  # fewer calls than a stack for a few VNs
    else:
        values = torch.stack([t.detach() for t in losses]).tolist()
    loss_total = 0.0
    for value, weight in zip(values, weights, strict=True):
        loss_total += value * weight
    items_total = 0.0
    bad = 0.0
    for value in items or ():
        number = float(value)
        items_total += number
        if not number >= 0 or number == math.inf:
            bad += 1.0
    return loss_total, items_total, bad


def _stack_double(values: list[torch.Tensor]) -> torch.Tensor:
    detached = [t.detach() for t in values]
    if all(t.dtype == detached[0].dtype for t in detached):
        return torch.stack(detached).double()
    return torch.stack([t.double() for t in detached])
