"""``VNBatchSampler``: each worker loads only the samples of its own virtual nodes.

A plan (``vflow.Plan``) gives every worker a contiguous run of VNs, hence one
contiguous range of each global batch. This sampler yields, for every global batch,
exactly that range of sample indices, so no worker reads, decodes or transfers samples
another worker will process, and the ranges of all workers put together are the global
batch, in order.

The global order of an epoch depends only on ``(seed, epoch)`` — a permutation drawn
from a generator seeded with ``vflow.mapping.rng.vn_seed`` — never on the number of workers or
on the rank. Because a counts plan splits a batch by ``split_sizes(B, V)`` alone, the
same sample lands in the same VN under every counts plan with the same V: resizing a
job (``set_plan``) changes which worker computes a VN, not what the VN contains.

Usage, one process per worker::

    sampler = VNBatchSampler(len(dataset), B, executor=ex, seed=0)
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for local_batch in loader:  # this worker's VNs' samples, in VN order
            ex.step(local_batch, global_batch_size=B)

Note [Data follows the plan]
A sampler bound to an executor (``executor=ex`` or ``bind(ex)``) splits every global
batch under the plan the executor will run that batch's step with, as that executor's
rank, so no plan change — ``plan="auto"``, ``set_plan``, an elastic round — needs a
call here. Step numbering: an iteration starts at the executor's ``step_count`` when
``iter()`` is called and counts one step per global batch it yields. A ``DataLoader``
with ``num_workers > 0`` draws indices ahead of the batches it returns, so the sampler
reports every draw to the executor (``PlanFollower.record_draw``): the executor makes a
plan change take effect only at a step whose indices no rank has drawn yet (Note
[Plan changes wait for the data], vflow/runtime/executor.py). A new iteration
resynchronises with the step count; the draws of an abandoned one are forgotten.
Unbound (``plan`` and ``rank``), the sampler keeps its plan until ``set_plan``.

``Executor.step`` accepts either the whole global batch or, as here, the worker's part
with ``global_batch_size=B``. With ``drop_last=False`` the last global batch may be
shorter than B; pass ``global_batch_size=sampler.global_batch_size(i)`` for batch ``i``
of the epoch instead.

Short last batch: with ``drop_last=True`` an incomplete final global batch is dropped.
With ``drop_last=False`` it is kept if it has at least V samples (one per VN) under a
counts plan; a sizes plan fixes B and every VN's size, so under a sizes plan a short
last batch is always dropped. An epoch that would yield no global batch at all is a
configuration error and raises ``ValueError``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

import torch
from torch.utils.data import Sampler

from vflow.mapping._checks import require_int
from vflow.mapping.plan import Plan
from vflow.mapping.rng import vn_seed

# The stream argument of vn_seed: keeps the data order independent of the dropout
# streams (0, 1) even when the Executor and the sampler share a seed. ASCII "data".
_DATA_STREAM = 0x64617461


class PlanFollower(Protocol):
    """What a bound ``VNBatchSampler`` needs of its executor (``vflow.Executor``
    implements it; vflow.data may not import vflow.runtime, hence a protocol)."""

    @property
    def step_count(self) -> int:
        """The next step to run."""
        ...

    @property
    def rank(self) -> int:
        """This worker's rank in the executor's worker set."""
        ...

    def plan_for_step(self, step: int) -> Plan:
        """The plan step ``step`` (>= step_count) runs under."""
        ...

    def record_draw(self, step: int, plan: Plan, rank: int) -> None:
        """The sampler drew this worker's indices of step ``step`` under ``plan`` as
        ``rank``."""
        ...

    def forget_draws(self) -> None:
        """A new iteration starts at step_count: the draws of steps >= step_count that
        an abandoned iteration made will not be used."""
        ...


def _check_follower(executor: object) -> PlanFollower:
    missing = [
        name
        for name in ("step_count", "rank", "plan_for_step", "record_draw", "forget_draws")
        if not hasattr(executor, name)
    ]
    if missing:
        raise TypeError(
            f"executor must be a vflow.Executor (or implement "
            f"vflow.data.sampler.PlanFollower), got {type(executor).__name__} without "
            f"{', '.join(missing)}"
        )
    return executor  # type: ignore[return-value]


def _check_bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return value


def _check_plan(plan: object, rank: object, batch_size: int) -> tuple[Plan, int]:
    if not isinstance(plan, Plan):
        raise TypeError(f"plan must be a vflow.Plan, got {type(plan).__name__}")
    rank = require_int("rank", rank)
    if not 0 <= rank < plan.num_workers:
        raise ValueError(
            f"rank must be in [0, {plan.num_workers}) for {plan!r} "
            f"({plan.num_workers} workers), got {rank}"
        )
    if plan.batch_size is not None and plan.batch_size != batch_size:
        raise ValueError(
            f"batch_size={batch_size} but {plan!r} has VN sizes summing to "
            f"{plan.batch_size}; a sizes plan fixes the global batch size"
        )
    if batch_size < plan.virtual_nodes:
        raise ValueError(
            f"batch_size={batch_size} is smaller than the plan's virtual_nodes="
            f"{plan.virtual_nodes}: every virtual node needs at least one sample"
        )
    return plan, rank


def _keeps_short(plan: Plan, size: int, drop_last: bool) -> bool:
    """Whether a final global batch of ``size`` < B samples is yielded."""
    return size > 0 and not drop_last and plan.batch_size is None and size >= plan.virtual_nodes


def _check_nonempty(dataset_size: int, batch_size: int, plan: Plan, drop_last: bool) -> None:
    if dataset_size >= batch_size or _keeps_short(plan, dataset_size, drop_last):
        return
    if drop_last:
        why = "with drop_last=True an incomplete global batch is dropped"
    elif plan.batch_size is not None:
        why = (
            "a sizes plan fixes the global batch size, so an incomplete global batch is "
            "dropped even with drop_last=False"
        )
    else:
        why = (
            "with drop_last=False an incomplete global batch is kept only if it has at "
            f"least virtual_nodes={plan.virtual_nodes} samples (one per virtual node)"
        )
    raise ValueError(
        f"dataset_size={dataset_size} is smaller than batch_size={batch_size} and {why}, "
        "so an epoch would yield no batch"
    )


class VNBatchSampler(Sampler[list[int]]):
    """Yields one worker's sample indices of every global batch of an epoch.

    Args:
        dataset_size: number of samples in the dataset (indices ``0 .. dataset_size-1``).
        batch_size: B, the samples of one global batch (over all workers). Must equal
            ``plan.batch_size`` for a sizes plan and be >= ``plan.virtual_nodes``.
        plan: which VNs each worker runs (unbound; with ``rank``).
        rank: this worker, in ``[0, plan.num_workers)``.
        executor: instead of ``plan`` and ``rank``: follow this executor's plan and
            rank, step by step (Note [Data follows the plan]). Pass exactly one of
            ``plan`` and ``executor``, or neither and ``bind`` an executor before
            iterating.
        seed: with ``epoch`` (see ``set_epoch``), fixes the global order.
        shuffle: permute the dataset every epoch; otherwise use index order.
        drop_last: drop an incomplete final global batch. If False it is kept when it
            has at least V samples, under a counts plan only (see the module docstring).

    Global batch b of an epoch is ``order[b*B:(b+1)*B]``; this worker gets
    ``global_batch[start:stop]`` with
    ``(start, stop) = plan.worker_range(rank, len(global_batch))``, i.e. its VNs'
    slices in VN order.
    """

    def __init__(
        self,
        dataset_size: int,
        batch_size: int,
        plan: Plan | None = None,
        rank: int | None = None,
        *,
        executor: PlanFollower | None = None,
        seed: int = 0,
        shuffle: bool = True,
        drop_last: bool = True,
    ) -> None:
        dataset_size = require_int("dataset_size", dataset_size, minimum=0)
        batch_size = require_int("batch_size", batch_size, minimum=1)
        seed = require_int("seed", seed)
        shuffle = _check_bool("shuffle", shuffle)
        drop_last = _check_bool("drop_last", drop_last)
        if plan is not None and executor is not None:
            raise ValueError(
                "pass either plan (with rank) or executor, not both: a sampler bound to an "
                "executor takes the plan and the rank from it"
            )
        follower: PlanFollower | None = None
        if executor is not None:
            if rank is not None:
                raise ValueError(
                    f"rank={rank!r} was given with executor: a bound sampler uses the "
                    "executor's rank"
                )
            follower = _check_follower(executor)
            plan = follower.plan_for_step(follower.step_count)
            rank = follower.rank
        if plan is not None:
            plan, rank = _check_plan(plan, rank, batch_size)
            _check_nonempty(dataset_size, batch_size, plan, drop_last)
        elif rank is not None:
            raise ValueError(f"rank={rank!r} was given without a plan; pass plan as well")
        self._dataset_size = dataset_size
        self._batch_size = batch_size
        self._seed = seed
        self._shuffle = shuffle
        self._drop_last = drop_last
        # Bound, plan and rank come from the executor at every use (as after ``bind``).
        self._plan: Plan | None = None if follower is not None else plan
        self._rank: int | None = None if follower is not None else rank
        self._executor: PlanFollower | None = follower
        self._epoch = 0

    # ---- state -------------------------------------------------------------------

    @property
    def executor(self) -> PlanFollower | None:
        """The executor this sampler follows (None when unbound)."""
        return self._executor

    @property
    def plan(self) -> Plan:
        """Bound: the executor's plan for its next step; unbound: the sampler's plan."""
        return self._plan_and_rank(None)[0]

    @property
    def rank(self) -> int:
        return self._plan_and_rank(None)[1]

    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def batch_size(self) -> int:
        """B, the size of a (complete) global batch over all workers."""
        return self._batch_size

    def set_epoch(self, epoch: int) -> None:
        """Selects the epoch's global order. Applies to the next ``iter()``; an iteration
        already running keeps the order it started with."""
        self._epoch = require_int("epoch", epoch, minimum=0)

    def set_plan(self, plan: Plan, rank: int | None = None) -> None:
        """Replaces the plan (and, if given, the rank; otherwise the rank is kept) of an
        unbound sampler.

        The plan is read at the start of every global batch, so a running iteration
        switches from its next global batch on; the global order is unchanged. A
        ``DataLoader`` draws indices ahead of the batches it returns (always with
        ``num_workers > 0``): batches it has already drawn keep the old plan. A sampler
        bound to an executor follows the executor's plan instead: it refuses this.
        """
        if self._executor is not None:
            raise RuntimeError(
                "set_plan on a sampler bound to an executor: it follows the executor's plan "
                "(change that with Executor.set_plan); pass plan and rank to an unbound "
                "sampler instead"
            )
        if rank is None:
            if self._rank is None:
                raise ValueError("rank is needed: this sampler has no plan and rank yet")
            rank = self._rank
        plan, new_rank = _check_plan(plan, rank, self._batch_size)
        _check_nonempty(self._dataset_size, self._batch_size, plan, self._drop_last)
        self._plan, self._rank = plan, new_rank

    def bind(self, executor: PlanFollower) -> None:
        """Follows ``executor``'s plan and rank from now on (e.g. an elastic newcomer's
        new executor); replaces any plan or executor this sampler had. Applies to the
        next ``iter()`` and ``step_indices``; an iteration already running keeps its
        executor. Raises, changing nothing, when the executor's plan does not fit
        this sampler's batch size and dataset."""
        follower = _check_follower(executor)
        plan, _ = _check_plan(
            follower.plan_for_step(follower.step_count), follower.rank, self._batch_size
        )
        _check_nonempty(self._dataset_size, self._batch_size, plan, self._drop_last)
        self._executor = follower
        self._plan = self._rank = None

    def _plan_and_rank(self, step: int | None) -> tuple[Plan, int]:
        """Bound: the plan of ``step`` (None: the executor's next step), checked against
        this sampler; unbound: the sampler's own."""
        executor = self._executor
        if executor is not None:
            plan = executor.plan_for_step(executor.step_count if step is None else step)
            return _check_plan(plan, executor.rank, self._batch_size)
        if self._plan is None or self._rank is None:
            raise RuntimeError(
                "this VNBatchSampler has neither a plan nor an executor: pass executor=ex "
                "(or plan and rank) when constructing it, or call bind(ex) before iterating"
            )
        return self._plan, self._rank

    # ---- iteration -----------------------------------------------------------------

    def _order(self) -> torch.Tensor:
        return self._order_of(self._epoch)

    def _order_of(self, epoch: int) -> torch.Tensor:
        if not self._shuffle:
            return torch.arange(self._dataset_size)
        gen = torch.Generator()
        gen.manual_seed(vn_seed(self._seed, epoch, 0, stream=_DATA_STREAM))
        return torch.randperm(self._dataset_size, generator=gen)

    def __iter__(self) -> Iterator[list[int]]:
        # Read now, not at the first next(): the iteration's plan source, its epoch and,
        # when bound, its first step are those of the moment iter() is called.
        self._plan_and_rank(None)  # fails here when there is nothing to follow
        executor = self._executor
        if executor is not None:
            executor.forget_draws()
        return self._batches(self._order(), executor)

    def _batches(self, order: torch.Tensor, executor: PlanFollower | None) -> Iterator[list[int]]:
        size_b = self._batch_size
        first_step = 0 if executor is None else executor.step_count
        for index, start in enumerate(range(0, self._dataset_size, size_b)):
            step = first_step + index
            if executor is None:
                # Read once per global batch: a set_plan between two batches takes effect
                # at the next one, and plan and rank always come from the same set_plan.
                plan, rank = self._plan, self._rank
                assert plan is not None and rank is not None
            else:
                # The plan this batch's step will run under, decided before it is drawn:
                # the executor delays any later change past the steps drawn so far.
                plan, rank = _check_plan(executor.plan_for_step(step), executor.rank, size_b)
            size = min(size_b, self._dataset_size - start)
            if size < size_b and not _keeps_short(plan, size, self._drop_last):
                return
            lo, hi = plan.worker_range(rank, size)
            indices = order[start + lo : start + hi].tolist()
            if executor is not None:
                executor.record_draw(step, plan, rank)
            yield indices

    def __len__(self) -> int:
        """Global batches per epoch under the current plan (the same for every rank)."""
        plan, _ = self._plan_and_rank(None)
        return self._batches_per_epoch(plan)

    def _batches_per_epoch(self, plan: Plan) -> int:
        full, rest = divmod(self._dataset_size, self._batch_size)
        return full + (rest > 0 and _keeps_short(plan, rest, self._drop_last))

    def step_indices(self, step: int) -> tuple[list[int], int]:
        """This worker's sample indices of the global batch that training step ``step``
        (0, 1, ... over all epochs) uses, and that batch's size B over all workers.
        Unbound: under the sampler's plan and rank; bound: under the plan the executor
        runs step ``step`` with (``step`` must not be before its ``step_count``), as the
        executor's rank, and the draw is reported to the executor.

        Step ``step`` reads global batch ``step % len(self)`` of epoch
        ``step // len(self)``: the data position follows the step count alone, so a
        job that changes its workers or plan between steps (``set_plan``; vflow.elastic)
        uses every sample of every epoch exactly once, whoever computes it. Does not
        change ``epoch``."""
        step = require_int("step", step, minimum=0)
        plan, rank = self._plan_and_rank(step)
        per_epoch = self._batches_per_epoch(plan)
        epoch, index = divmod(step, per_epoch)
        order = self._order_of(epoch)
        size = self._size_of(index, per_epoch)
        start = index * self._batch_size
        lo, hi = plan.worker_range(rank, size)
        indices = order[start + lo : start + hi].tolist()
        if self._executor is not None:
            self._executor.record_draw(step, plan, rank)
        return indices, size

    def global_batch_size(self, index: int) -> int:
        """Samples in global batch ``index`` of an epoch, over all workers: B, except for
        a kept incomplete last batch (``drop_last=False``)."""
        index = require_int("index", index, minimum=0)
        return self._size_of(index, len(self))

    def _size_of(self, index: int, per_epoch: int) -> int:
        if index >= per_epoch:
            raise ValueError(f"index must be < {per_epoch} (batches per epoch), got {index}")
        return min(self._batch_size, self._dataset_size - index * self._batch_size)
