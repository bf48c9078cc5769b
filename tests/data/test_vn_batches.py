"""vflow.data.vn_batches: when preparing VNs is worth the prefetch thread (Note [A copy
inline or on the prefetch thread])."""

from __future__ import annotations

import torch

from vflow.data.vn_batches import COPY_WORTH_A_THREAD_BYTES, VNBatchSource


def _slices(sizes: list[int]) -> list[tuple[int, int, int]]:
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return [(vn, start, size) for vn, (start, size) in enumerate(zip(starts, sizes, strict=True))]


def test_a_small_copy_is_made_inline_and_a_large_one_on_the_thread() -> None:
    row_bytes = 1024 * 4  # 1024 float32 per sample
    per_vn = COPY_WORTH_A_THREAD_BYTES // row_bytes  # samples in a VN of exactly the limit
    batch = (torch.zeros(4 * per_vn, 1024), torch.zeros(4 * per_vn, dtype=torch.int8))
    copy = VNBatchSource(copy=True, transform=None)
    assert copy.needs_work(batch, _slices([per_vn] * 4))
    assert not copy.needs_work(batch, _slices([per_vn - 2] * 4 + [8]))
    # The largest VN decides: one VN at the limit sends the step to the thread.
    assert copy.needs_work(batch, _slices([per_vn // 2, per_vn // 2, per_vn, 2 * per_vn]))
    small = (torch.zeros(64, 64), torch.zeros(64, dtype=torch.long))
    assert not copy.needs_work(small, _slices([8] * 8))
    assert not VNBatchSource(copy=False, transform=None).needs_work(batch, _slices([per_vn] * 4))
    # A transform is the user's code, of unknown cost: always on the thread.
    transform = VNBatchSource(copy=False, transform=lambda b, g: b)
    assert transform.needs_work(small, _slices([8] * 8))
