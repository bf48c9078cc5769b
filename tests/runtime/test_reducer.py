"""vflow._C.Reducer on one process: bucket layout, folding, and its call protocol.
Its collectives are tested with real process groups in tests/runtime/test_distributed.py."""

import pytest
import torch

from tests.support.reducers import make_reducer
from vflow import _C
from vflow.runtime.grad_store import assign_buckets

MB = 1024 * 1024


def _params(numels):
    return [torch.zeros(n) for n in numels]


def test_buckets_are_contiguous_slot_ranges_with_a_small_first_bucket():
    # Slots of 1 MB each (float32), first bucket capped at 1 MB, later ones at 3 MB.
    numels = [MB // 4] * 7 + [10]
    reducer = make_reducer([_params(numels)], [torch.float32], MB, 3 * MB)
    ranges = [(r.first_slot, r.last_slot) for r in reducer.bucket_ranges()]
    assert ranges == [(0, 0), (1, 3), (4, 6), (7, 7)]
    buffer = reducer.buffers[0]
    for r in reducer.bucket_ranges():
        assert r.offset == buffer.offsets[r.first_slot]
        assert r.offset + r.numel == buffer.offsets[r.last_slot] + buffer.numels[r.last_slot]
    assert [reducer.bucket_of(0, s) for s in range(8)] == [0, 1, 1, 1, 2, 2, 2, 3]
    assert reducer.num_buckets == 4 and reducer.world_size == 1


def test_a_slot_larger_than_the_cap_gets_a_bucket_of_its_own():
    reducer = make_reducer([_params([10, MB, 10])], [torch.float32], 100, 200)
    assert [(r.first_slot, r.last_slot) for r in reducer.bucket_ranges()] == [
        (0, 0),
        (1, 1),
        (2, 2),
    ]


def test_buckets_are_numbered_buffer_by_buffer():
    groups = [_params([4, 4]), [torch.zeros(3, dtype=torch.float64)]]
    reducer = make_reducer(groups, [torch.float32, torch.float64], 1, 1)
    assert [(r.buffer, r.first_slot) for r in reducer.bucket_ranges()] == [(0, 0), (0, 1), (1, 0)]
    assert reducer.buffers[1].data.dtype == torch.float64


def test_folds_weighted_gradients_and_treats_missing_ones_as_zero():
    reducer = make_reducer([_params([3, 5, 2])], [torch.float32], 16, 16)
    g = [torch.randn(3), torch.randn(5), torch.randn(2)]
    reducer.begin_step(0)
    reducer.begin_vn(0.5, False)
    for slot in (1, 0, 2):
        reducer.add_grad(reducer.bucket_of(0, slot), slot, g[slot])
    reducer.end_vn()
    reducer.begin_vn(0.25, True)
    reducer.add_grad(reducer.bucket_of(0, 1), 1, g[1])  # slots 0 and 2 unused in this VN
    reducer.end_vn()
    reducer.finalize(2.0, [])
    assert reducer.early_launches == 0  # the last VN left slots 0 and 2 empty: one bucket
    views = reducer.buffers[0].views()
    torch.testing.assert_close(views[0], g[0])
    torch.testing.assert_close(views[1], 2.0 * (0.5 + 0.25) * g[1])
    torch.testing.assert_close(views[2], g[2])


def test_a_bucket_without_any_gradient_in_the_step_is_zero():
    reducer = make_reducer([_params([3, 5])], [torch.float32], 1, 1)
    reducer.buffers[0].data.fill_(7.0)  # stale values from an earlier step
    reducer.begin_step(0)
    reducer.begin_vn(1.0, True)
    reducer.add_grad(reducer.bucket_of(0, 1), 1, torch.ones(5))
    reducer.end_vn()
    # Slot 1's bucket completed during "backward" but may only start after bucket 0,
    # which became final when backward returned (Note [Launch order]).
    assert reducer.early_launches == 0
    flag = torch.zeros(())
    reducer.finalize(1.0, [flag])
    assert torch.equal(reducer.buffers[0].views()[0], torch.zeros(3))
    assert flag.item() == 0.0


def test_call_protocol_and_argument_errors():
    reducer = make_reducer([_params([3])], [torch.float32], 8, 8)
    with pytest.raises(RuntimeError, match="add_grad called outside a step"):
        reducer.add_grad(0, 0, torch.ones(3))
    reducer.begin_step(0)
    with pytest.raises(RuntimeError, match="previous step was neither finalized nor discarded"):
        reducer.begin_step(1)
    reducer.begin_vn(1.0, False)
    with pytest.raises(RuntimeError, match=r"bucket must be in \[0, 1\), got 4"):
        reducer.add_grad(4, 0, torch.ones(3))
    with pytest.raises(RuntimeError, match="slot 2 is not in bucket 0"):
        reducer.add_grad(0, 2, torch.ones(3))
    with pytest.raises(RuntimeError, match="must follow the end of the step's last VN"):
        reducer.finalize(1.0, [])
    reducer.discard()
    reducer.begin_step(1)  # discard ended the step
    with pytest.raises(RuntimeError, match="dtypes has 2 entries but groups has 1"):
        _C.GradStore([[torch.zeros(3, requires_grad=True)]], [torch.float32, torch.float32])
    with pytest.raises(ValueError, match="bucket_cap_bytes must be > 0"):
        assign_buckets(reducer.buffers, 8, 0)
    with pytest.raises(RuntimeError, match="timeout_seconds must be > 0"):
        make_reducer([_params([3])], [torch.float32], 8, 8, timeout_seconds=0)
