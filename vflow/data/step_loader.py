"""``StepLoader``: a ``torch.utils.data.DataLoader`` with worker processes feeding a job
whose workers, plan and step count change while it runs (vflow.elastic).

Usage, in an elastic job's ``train_step``::

    sampler = vflow.VNBatchSampler(len(dataset), B, seed=0)
    loader = vflow.data.StepLoader(dataset, sampler, num_workers=2, pin_memory=True)

    def train_step(ex, step):
        batch, size = loader.batch(ex, step)
        return ex.step(batch, global_batch_size=size)

Note [Loading ahead of an elastic job]
The data position is the step count (``VNBatchSampler.step_indices``): step s reads
global batch s of the job's order, split under the plan step s runs with, as this
worker's rank. A DataLoader's workers load ahead: the loader draws the indices of the
next steps before the job asks for them, under the plan and rank of that moment, and
every draw is reported to the executor (Note [Plan changes wait for the data]). What it
drew is right as long as the job goes on as drawn: the next step asked for is the one
after the last, from the same executor, under the plan and rank it was drawn with. A
grow, shrink or crash breaks that (a step redone after a crash, a step count that
jumped when this worker caught up, another plan or rank, a newcomer's new executor):
the loader then drops what it loaded ahead and starts again at the step asked for.
The loader's worker processes stay (``persistent_workers``): starting again only sends
them the new indices, so a change costs the batches loaded ahead, not new processes.

Every batch comes back with the step, plan and rank its indices were drawn for, checked
before it is handed out: a batch is never used for another step or split. Loading
happens in the worker processes, so the dataset's ``__getitem__`` (decoding, say) runs
there; random augmentation belongs in the executor's ``vn_transform``, whose generator
is seeded per VN and step (the loader's workers' random state depends on how often the
loader started again).

Note [A leave is the worker's, not its loader's]
SIGTERM asks an elastic worker to leave after its current step, SIGUSR1 its job to
suspend. Cluster managers often send a signal to every process of a job, not only the
worker: Slurm's ``scancel --full --signal=TERM`` and the SIGTERM of a job's time limit,
``kill -TERM -PGID``. A DataLoader's worker process dies of either, and the DataLoader
then fails the step ("worker killed by signal"), so the worker crashes where it was
asked to leave: the others redo the step and the leaver's slot is lost for a timeout.
The loader's worker processes therefore ignore both (before ``worker_init_fn`` runs,
which may decide otherwise). A signal sent while a worker process starts, before it has
set that, would still kill it: the loader starts them with both signals blocked (the
mask is inherited, through fork and exec), and each unblocks them once it ignores them,
which drops what arrived meanwhile. The loader's own thread blocks them only while it
starts its workers; the process still gets them (a signal blocked by one thread goes
to another, or waits until it is unblocked).
They still end with the worker: a DataLoader's workers exit when their parent does,
and ``close`` stops them.
"""

from __future__ import annotations

import collections
import signal
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from torch.utils.data import DataLoader, Dataset

from vflow.data.sampler import PlanFollower, VNBatchSampler, _check_follower
from vflow.mapping._checks import require_int
from vflow.mapping.plan import Plan

# Blocked while the loader starts its worker processes (Note [A leave is the worker's,
# not its loader's]); none where the platform cannot block signals.
_LEAVE_SIGNALS = (
    {signal.SIGTERM, signal.SIGUSR1}
    if hasattr(signal, "pthread_sigmask") and hasattr(signal, "SIGUSR1")
    else set()
)


@dataclass(frozen=True)
class _IgnoreSigterm:
    """A loader worker process's start (Note [A leave is the worker's, not its
    loader's]); a class, so that spawned workers can unpickle it."""

    then: Callable[[int], None] | None

    def __call__(self, worker_id: int) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)
        if _LEAVE_SIGNALS:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, _LEAVE_SIGNALS)
        if self.then is not None:
            self.then(worker_id)


@dataclass(frozen=True)
class _Draw:
    """What the indices of one loaded batch were drawn for."""

    step: int
    plan: Plan
    rank: int
    size: int  # the global batch's size B over all workers
    indices: list[int]


class _Steps:
    """The loader's batch sampler: this worker's indices of steps ``first``, ``first + 1``,
    ... of the job, recording each draw for ``StepLoader`` to check."""

    def __init__(self, sampler: VNBatchSampler, drawn: collections.deque[_Draw]) -> None:
        self._sampler = sampler
        self._drawn = drawn
        self.first = 0

    def __iter__(self) -> Iterator[list[int]]:
        step = self.first
        executor = self._sampler.executor
        assert executor is not None
        while True:
            plan, rank = executor.plan_for_step(step), executor.rank
            indices, size = self._sampler.step_indices(step)
            self._drawn.append(_Draw(step, plan, rank, size, indices))
            yield indices
            step += 1


class StepLoader:
    """This worker's part of the global batch of any step, loaded ahead by a DataLoader
    with worker processes (Note [Loading ahead of an elastic job]).

    Args:
        dataset: a map-style dataset (``dataset[i]``); ``len`` need not be defined when
            ``sampler`` knows the dataset's size.
        sampler: a ``vflow.VNBatchSampler`` over the dataset (B, seed, shuffle and
            drop_last are its); the loader binds it to the executor of each step.
        num_workers: the DataLoader's worker processes (>= 0; 0 loads in this
            process, as the DataLoader does).
        pin_memory: the DataLoader's; batches in page-locked memory for a fast copy to
            a GPU (it needs one).
        collate_fn: the DataLoader's (default: torch's default collation).
        prefetch_factor: batches each worker loads ahead (with num_workers > 0; the
            DataLoader's default, 2, when None).
        multiprocessing_context: the DataLoader's, e.g. ``"spawn"`` or ``"forkserver"``
            where forking this process is unsafe.
        worker_init_fn: the DataLoader's; it runs after the worker process was set
            to ignore SIGTERM and SIGUSR1 (Note [A leave is the worker's, not its
            loader's]).
    """

    def __init__(
        self,
        dataset: Dataset[Any],
        sampler: VNBatchSampler,
        *,
        num_workers: int = 2,
        pin_memory: bool = False,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        prefetch_factor: int | None = None,
        multiprocessing_context: Any = None,
        worker_init_fn: Callable[[int], None] | None = None,
    ) -> None:
        if not isinstance(sampler, VNBatchSampler):
            raise TypeError(f"sampler must be a vflow.VNBatchSampler, got {type(sampler).__name__}")
        num_workers = require_int("num_workers", num_workers, minimum=0)
        if not isinstance(pin_memory, bool):
            raise TypeError(f"pin_memory must be a bool, got {type(pin_memory).__name__}")
        if prefetch_factor is not None:
            prefetch_factor = require_int("prefetch_factor", prefetch_factor, minimum=1)
            if num_workers == 0:
                raise ValueError("prefetch_factor needs num_workers > 0 (it counts per worker)")
        self._sampler = sampler
        self._drawn: collections.deque[_Draw] = collections.deque()
        self._steps = _Steps(sampler, self._drawn)
        options: dict[str, Any] = {}
        if num_workers > 0:
            options["persistent_workers"] = True
            if prefetch_factor is not None:
                options["prefetch_factor"] = prefetch_factor
        self._loader: DataLoader[Any] | None = DataLoader(
            dataset,
            batch_sampler=self._steps,
            num_workers=num_workers,
            pin_memory=pin_memory,
            collate_fn=collate_fn,
            multiprocessing_context=multiprocessing_context,
            worker_init_fn=_IgnoreSigterm(worker_init_fn),
            **options,
        )
        self._iterator: Iterator[Any] | None = None
        self._executor: PlanFollower | None = None
        self._next_step: int | None = None
        self._last: _Draw | None = None
        self.restarts = 0

    @property
    def last_indices(self) -> list[int]:
        """The dataset indices of the batch ``batch`` returned last (this worker's part
        of that step's global batch, in VN order); empty before the first."""
        return [] if self._last is None else list(self._last.indices)

    def batch(self, executor: PlanFollower, step: int) -> tuple[Any, int]:
        """This worker's part of step ``step``'s global batch under the plan and rank
        ``executor`` runs it with, as the DataLoader collated it, and the global batch's
        size B (for ``Executor.step(batch, global_batch_size=B)``). ``step`` is the step
        ``executor`` runs next (its ``step_count``)."""
        if self._loader is None:
            raise RuntimeError("this StepLoader is closed")
        follower = _check_follower(executor)
        step = require_int("step", step, minimum=0)
        if step != follower.step_count:
            raise ValueError(
                f"step must be the executor's next step (step_count={follower.step_count}), "
                f"got {step}"
            )
        plan, rank = follower.plan_for_step(step), follower.rank
        if not self._continues(follower, step, plan, rank):
            self._start(follower, step)
        assert self._iterator is not None
        batch = next(self._iterator)
        draw = self._drawn.popleft()
        if (draw.step, draw.plan, draw.rank) != (step, plan, rank):
            raise RuntimeError(
                f"the DataLoader returned the batch of step {draw.step} (rank {draw.rank}) "
                f"for step {step} (rank {rank}); a DataLoader that returns batches out of "
                "order (in_order=False) cannot feed a StepLoader"
            )
        self._next_step = step + 1
        self._last = draw
        return batch, draw.size

    def _continues(self, executor: PlanFollower, step: int, plan: Plan, rank: int) -> bool:
        """Whether what was loaded ahead is what step ``step`` needs."""
        if self._iterator is None or executor is not self._executor or step != self._next_step:
            return False
        head = self._drawn[0] if self._drawn else None
        # Nothing drawn yet for ``step``: the sampler will draw it under the plan of now.
        return head is None or (head.step, head.plan, head.rank) == (step, plan, rank)

    def _start(self, executor: PlanFollower, step: int) -> None:
        """Drops what was loaded ahead and loads from ``step`` on (Note [Loading ahead of
        an elastic job]); the worker processes stay."""
        assert self._loader is not None
        if executor is not self._executor:
            self._sampler.bind(executor)
            self._executor = executor
        # The draws of the dropped batches will not run: plan changes need not wait for
        # them (Note [Plan changes wait for the data]).
        executor.forget_draws()
        self._drawn.clear()
        self._steps.first = step
        if self._iterator is not None:
            self.restarts += 1
        if not _LEAVE_SIGNALS:
            self._iterator = iter(self._loader)
            return
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, _LEAVE_SIGNALS)
        try:
            self._iterator = iter(self._loader)  # starts the worker processes
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)

    def close(self) -> None:
        """Stops the loader's worker processes (also when the loader is garbage)."""
        self._iterator = None
        self._loader = None
        self._drawn.clear()

    def __enter__(self) -> StepLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
