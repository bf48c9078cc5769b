"""``vflow.Plan``: which virtual nodes each worker runs.

A plan maps the V VNs of every global batch onto W workers. Worker w runs a
contiguous run of VNs — VNs ``first_vn(w) .. first_vn(w) + counts[w] - 1`` — so its
samples are one contiguous range of the global batch and a data loader can hand it
exactly those. Two kinds of plan exist:

* **counts** (``Plan(counts=[5, 3])``, ``Plan.even(8, 2)``): the VN sizes are those of
  ``split_sizes(B, V)`` — a function of (B, V) alone — so the VN → sample mapping, and
  with it the result, is the same for every mapping of the same V.
* **sizes** (``Plan(sizes=[[48, 48], [32]])``): VirtualFlow's heterogeneous split, where
  a faster worker's VNs hold more samples. The plan fixes B (the sum of all sizes) and
  the VN sizes; gradients are weighted by items, so a step's gradient is still the
  gradient of the loss over the whole global batch.

Plans are immutable values; an Executor takes a new one between steps with
``set_plan``.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import NamedTuple

from vflow.mapping import batching
from vflow.mapping._checks import require_int
from vflow.mapping.batching import Batch, split_sizes


class VNSlice(NamedTuple):
    """One VN of a global batch: its index, first sample and number of samples."""

    vn: int
    start: int
    size: int


def _positive_ints(name: str, values: object) -> tuple[int, ...]:
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise TypeError(f"{name} must be a sequence of ints, got {type(values).__name__}")
    out = []
    for k, value in enumerate(values):
        out.append(require_int(f"{name}[{k}]", value, 1))
    if not out:
        raise ValueError(f"{name} must name at least one worker")
    return tuple(out)


class Plan:
    """Which VNs each of W workers runs.

    Args:
        counts: VNs per worker (worker w runs ``counts[w]`` consecutive VNs); V is their
            sum. Every worker needs at least one VN.
        sizes: per worker, the sample count of each of its VNs (VirtualFlow's
            heterogeneous split). V is the number of entries and B their sum.

    Give exactly one of the two.
    """

    __slots__ = ("_counts", "_sizes", "_slices", "_worker_slices")

    def __init__(
        self,
        counts: Sequence[int] | None = None,
        *,
        sizes: Sequence[Sequence[int]] | None = None,
    ) -> None:
        if (counts is None) == (sizes is None):
            raise ValueError("Plan needs exactly one of counts=[...] or sizes=[[...], ...]")
        self._sizes: tuple[tuple[int, ...], ...] | None
        # batch size -> its VN slices: a step asks for the same ones every time.
        self._slices: dict[int, tuple[VNSlice, ...]] = {}
        self._worker_slices: dict[tuple[int, int], tuple[VNSlice, ...]] = {}
        if sizes is not None:
            if isinstance(sizes, (str, bytes)) or not isinstance(sizes, Sequence) or not sizes:
                raise ValueError(
                    "sizes must be a non-empty sequence with one sequence of VN sizes per worker"
                )
            self._sizes = tuple(_positive_ints(f"sizes[{w}]", s) for w, s in enumerate(sizes))
            self._counts = tuple(len(s) for s in self._sizes)
        else:
            self._counts = _positive_ints("counts", counts)
            self._sizes = None

    @classmethod
    def even(cls, virtual_nodes: int, workers: int) -> Plan:
        """V VNs over W workers as evenly as possible (the first V % W get one more)."""
        for name, value in (("virtual_nodes", virtual_nodes), ("workers", workers)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if workers > virtual_nodes:
            raise ValueError(
                f"workers={workers} exceeds virtual_nodes={virtual_nodes}: every worker needs "
                "at least one virtual node"
            )
        return cls(counts=split_sizes(virtual_nodes, workers))

    # ---- shape -------------------------------------------------------------------

    @property
    def num_workers(self) -> int:
        return len(self._counts)

    @property
    def virtual_nodes(self) -> int:
        return sum(self._counts)

    @property
    def counts(self) -> tuple[int, ...]:
        """Number of VNs of each worker."""
        return self._counts

    @property
    def sizes(self) -> tuple[tuple[int, ...], ...] | None:
        """Per-worker VN sizes of a sizes plan; None for a counts plan."""
        return self._sizes

    @property
    def batch_size(self) -> int | None:
        """B fixed by a sizes plan; None when any B >= V works (counts plan)."""
        return None if self._sizes is None else sum(map(sum, self._sizes))

    def first_vn(self, worker: int) -> int:
        self._check_worker(worker)
        return sum(self._counts[:worker])

    def vns(self, worker: int) -> range:
        """Global indices of the VNs ``worker`` runs, in run order."""
        first = self.first_vn(worker)
        return range(first, first + self._counts[worker])

    # ---- samples -----------------------------------------------------------------

    def vn_sizes(self, batch_size: int) -> list[int]:
        """Sample count of every VN (all workers, VN order) for a global batch of B."""
        if self._sizes is None:
            return split_sizes(batch_size, self.virtual_nodes)
        if batch_size != self.batch_size:
            raise ValueError(
                f"global batch has {batch_size} samples but the plan's VN sizes sum to "
                f"{self.batch_size}; a sizes plan fixes the global batch size"
            )
        return [size for worker in self._sizes for size in worker]

    def slices(self, batch_size: int) -> list[VNSlice]:
        """Every VN of a global batch of ``batch_size`` samples, in VN order."""
        return list(self._cached_slices(batch_size))

    def _cached_slices(self, batch_size: int) -> tuple[VNSlice, ...]:
        cached = self._slices.get(batch_size)
        if cached is None:
            sizes = self.vn_sizes(batch_size)
            starts = itertools.accumulate(sizes[:-1], initial=0)
            cached = tuple(
                VNSlice(i, start, size) for i, (start, size) in enumerate(zip(starts, sizes))
            )
            if len(self._slices) >= 8:  # a few sizes recur (e.g. a short last batch)
                self._slices.clear()
            self._slices[batch_size] = cached
        return cached

    def worker_slices(self, worker: int, batch_size: int) -> list[VNSlice]:
        """The VNs ``worker`` runs, with their positions in the global batch."""
        # Only an int is looked up: True or 1.0 would find worker 1's and skip the check.
        cached = self._worker_slices.get((worker, batch_size)) if type(worker) is int else None
        if cached is None:
            vns = self.vns(worker)
            cached = self._cached_slices(batch_size)[vns.start : vns.stop]
            if len(self._worker_slices) >= 64:  # every step asks for the same few
                self._worker_slices.clear()
            self._worker_slices[(worker, batch_size)] = cached
        return list(cached)

    def worker_range(self, worker: int, batch_size: int) -> tuple[int, int]:
        """[start, stop) of ``worker``'s samples in a global batch of ``batch_size``."""
        mine = self.worker_slices(worker, batch_size)
        return mine[0].start, mine[-1].start + mine[-1].size

    def local_slices(
        self, worker: int, batch: Batch, global_batch_size: int | None
    ) -> tuple[list[VNSlice], int]:
        """``worker``'s VNs as slices of ``batch``, and the global batch size B.

        ``batch`` is the global batch, or with ``global_batch_size`` only ``worker``'s
        samples of it (its VNs' slices, concatenated in VN order).
        """
        total = batching.batch_size(batch)
        if global_batch_size is None:
            return self.worker_slices(worker, total), total
        require_int("global_batch_size", global_batch_size, 1)
        start, stop = self.worker_range(worker, global_batch_size)
        if total != stop - start:
            raise ValueError(
                f"batch has {total} samples but worker {worker}'s share of a global batch of "
                f"global_batch_size={global_batch_size} under {self} is {stop - start} "
                f"(samples [{start}, {stop})); pass this worker's samples only, or the whole "
                "global batch without global_batch_size"
            )
        slices = self.worker_slices(worker, global_batch_size)
        return [VNSlice(vn, begin - start, size) for vn, begin, size in slices], global_batch_size

    def _check_worker(self, worker: int) -> None:
        require_int("worker", worker)
        if not 0 <= worker < self.num_workers:
            raise ValueError(f"worker must be in [0, {self.num_workers}), got {worker}")

    # ---- value semantics -----------------------------------------------------------

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Plan):
            return NotImplemented
        return self._counts == other._counts and self._sizes == other._sizes

    def __hash__(self) -> int:
        return hash((self._counts, self._sizes))

    def __repr__(self) -> str:
        if self._sizes is not None:
            return f"Plan(sizes={[list(s) for s in self._sizes]})"
        return f"Plan(counts={list(self._counts)})"
