"""Prepares a step's VN batches one ahead of the VN being computed.

Note [Prefetch]
Preparing a VN's batch — slicing it out of the step's batch, copying it to fresh memory
in deterministic mode, the user's ``vn_transform``, and moving it to the model's GPU —
is work that does not depend on the VN before it. While VN i computes, one background
thread prepares VN i+1, so that preparation costs nothing when it is shorter than a
VN's compute (the first VN of a step is prepared while nothing else runs: the next
step's batch is not known before ``step`` is called).

Why a thread and not a process: the work is torch ops, which release the GIL, and a
user transform, which must see the same objects the caller passed; a process would
pickle every batch. Why exactly one thread and one VN ahead: VN batches are consumed
in order, and a deeper queue would only hold more VN batches in memory at once.

CUDA (a model on a GPU, batch tensors on the CPU): the thread copies the VN's tensors
into pinned host memory (unless already pinned), then issues the host-to-device copies
``non_blocking`` on a side stream and records an event. The consumer makes its current
stream wait for that event — a GPU-side wait, the host does not block — and calls
``record_stream`` on every copied tensor, because the caching allocator would
otherwise consider their memory free as soon as the side stream's work is done, while
the compute stream is still reading it. torch's stream API does all of this, so no
C++ is needed: the expensive parts (the copies) run on the DMA engines either way.

Errors: an exception in the thread is re-raised in the caller by
``Future.result()``, which keeps the original traceback. Lifetime: the thread is
started on first use and shut down by ``close()`` (the Executor's ``close`` and
finaliser call it), so no thread outlives its executor.

Randomness: the transform gets a CPU ``torch.Generator`` seeded from (seed, step, VN),
never the global generator, which the VN being computed uses at the same time (and
whose draws would otherwise depend on thread timing and on the plan).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from vflow.mapping.batching import Batch, _leaves, map_batch

# (vn batch, CPU generator for the VN) -> transformed vn batch
VNTransform = Callable[[Batch, torch.Generator], Batch]


@dataclass
class _Staged:
    batch: Batch
    ready: torch.cuda.Event | None = None  # the side stream's copies are done


class Prefetcher:
    """Yields prepared VN batches in order, preparing the next one in a background
    thread while the caller works on the current one (Note [Prefetch])."""

    def __init__(self, device: torch.device, enabled: bool = True) -> None:
        self.device = device
        self.enabled = enabled
        self._cuda = device.type == "cuda"
        self._pool: ThreadPoolExecutor | None = None
        self._finalizer: weakref.finalize | None = None
        self._side_stream: torch.cuda.Stream | None = None
        self._lock = threading.Lock()

    def _thread_pool(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vflow-prefetch")
                # Shuts the thread down even if close() is never called.
                self._finalizer = weakref.finalize(self, self._pool.shutdown, wait=True)
            return self._pool

    def needs_transfer(self, batch: Batch) -> bool:
        """Whether some tensor of ``batch`` must be copied to the model's GPU."""
        if not self._cuda:
            return False
        return any(t.device.type == "cpu" for _, t in _leaves(batch, "batch"))

    def batches(
        self, jobs: Sequence[Callable[[], Batch]], background: bool = True
    ) -> Iterator[Batch]:
        """Runs ``jobs`` (each returns one VN's batch) in order and yields their results,
        with CPU tensors moved to the model's GPU (whether or not prefetching is on).
        With prefetch enabled and ``background``, job i+1 runs in the background while
        the caller holds batch i. Closing the iterator early (an error in the caller)
        waits for the job in flight, so nothing of this step runs after it."""
        if not jobs:
            return
        if not (self.enabled and background):
            for job in jobs:
                yield job() if not self._cuda else self._consume(self._stage(job))
            return
        pool = self._thread_pool()
        pending: Future[_Staged] | None = pool.submit(self._stage, jobs[0])
        try:
            for index in range(len(jobs)):
                assert pending is not None
                staged = pending.result()
                pending = (
                    pool.submit(self._stage, jobs[index + 1]) if index + 1 < len(jobs) else None
                )
                yield self._consume(staged)
        finally:
            if pending is not None:
                # The caller stopped early; its error is the one that matters.
                pending.exception()

    def _stage(self, job: Callable[[], Batch]) -> _Staged:
        batch = job()
        # Decided on the job's output: a transform may change what the batch holds.
        if not self.needs_transfer(batch):
            return _Staged(batch)
        if self._side_stream is None:
            self._side_stream = torch.cuda.Stream(self.device)
        stream = self._side_stream
        with torch.cuda.device(self.device), torch.cuda.stream(stream):
            batch = map_batch(batch, self._to_device)
            ready = torch.cuda.Event()
            ready.record(stream)
        return _Staged(batch, ready)

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        if t.device.type != "cpu":
            return t
        if not t.is_pinned():
            t = t.pin_memory()
        return t.to(self.device, non_blocking=True)

    def _consume(self, staged: _Staged) -> Batch:
        if staged.ready is None:
            return staged.batch
        current = torch.cuda.current_stream(self.device)
        current.wait_event(staged.ready)

        def adopt(t: torch.Tensor) -> torch.Tensor:
            if t.device.type == "cuda":
                t.record_stream(current)
            return t

        return map_batch(staged.batch, adopt)

    def close(self) -> None:
        """Stops the background thread (waiting for a job in flight)."""
        with self._lock:
            pool, self._pool = self._pool, None
            finalizer, self._finalizer = self._finalizer, None
        if finalizer is not None:
            finalizer.detach()
        if pool is not None:
            pool.shutdown(wait=True)
