"""VN batches of a step: each VN's slice of the batch, made ready for ``loss_fn``.

A ``VNBatchSource`` knows nothing of the executor: it is given the step's batch and
this worker's VN slices and returns one job per VN, which the Prefetcher runs one VN
ahead on its thread (Note [Prefetch], vflow/data/prefetch.py).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from vflow.data.prefetch import VNTransform
from vflow.mapping import rng
from vflow.mapping.batching import Batch, batch_size, map_batch, slice_batch, tensor_bytes
from vflow.mapping.plan import VNSlice

# Note [A copy inline or on the prefetch thread]
# Handing a VN's preparation to the prefetch thread and taking the result back costs
# about 0.1 ms a VN on CPU (waking the thread, passing the GIL back and forth): 1.5 ms
# of a 13 ms step of 12 VNs of 5 digits each in deterministic mode, measured. A copy of
# a VN smaller than this many bytes costs less than that hand-off, so deterministic
# mode's copy alone is made inline below it; a transform always goes to the thread.
COPY_WORTH_A_THREAD_BYTES = 1 << 20


class VNBatchSource:
    """Prepares VN batches: slicing, the deterministic-mode copy and ``vn_transform``.

    ``copy``: give every VN a fresh, equally aligned copy of its slice. A VN's slice
    starts at a different offset (and alignment) under different plans, and some CPU
    kernels' summation order depends on the alignment of their input, so deterministic
    mode needs it.
    """

    def __init__(self, copy: bool, transform: VNTransform | None) -> None:
        self.copy = copy
        self.transform = transform

    def needs_work(self, batch: Batch, slices: list[VNSlice]) -> bool:
        """Whether preparing these VNs is worth a thread hand-off: more than slicing
        and, for a copy alone, a VN of COPY_WORTH_A_THREAD_BYTES or more (Note [A copy
        inline or on the prefetch thread])."""
        if self.transform is not None:
            return True
        if not self.copy or not slices:
            return False
        largest = max(size for _, _, size in slices)
        return tensor_bytes(batch) * largest >= COPY_WORTH_A_THREAD_BYTES * batch_size(batch)

    def jobs(
        self, batch: Batch, slices: list[VNSlice], seed: int, step: int
    ) -> list[Callable[[], Batch]]:
        """One job per VN; its transform draws from (seed, step, VN)'s generator."""
        return [
            functools.partial(self.prepare, batch, start, size, vn, seed, step)
            for vn, start, size in slices
        ]

    def prepare(self, batch: Batch, start: int, size: int, vn: int, seed: int, step: int) -> Batch:
        """VN ``vn``'s batch, ready for loss_fn except for the move to the GPU."""
        vn_batch = slice_batch(batch, start, start + size)
        if self.copy:
            vn_batch = map_batch(vn_batch, lambda t: t.clone(memory_format=torch.contiguous_format))
        if self.transform is not None:
            generator = torch.Generator().manual_seed(rng.vn_seed(seed, step, vn, rng.DATA_STREAM))
            vn_batch = self.transform(vn_batch, generator)
            got = batch_size(vn_batch)
            if got != size:
                # The VN's loss weight and the step's item count come from its size.
                raise ValueError(
                    f"vn_transform returned a batch of {got} samples for virtual node {vn}, "
                    f"which has {size}; it must keep the number of samples"
                )
        return vn_batch
