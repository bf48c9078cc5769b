"""vflow._C.GradBuffer: layout, views and the fused operations on a whole buffer."""

import pytest
import torch

from tests.support.cuda_marks import devices
from vflow import _C


@pytest.fixture(params=devices())
def device(request):
    return request.param


def _params(device, dtype=torch.float32):
    shapes = [(3, 4), (5,), (1,), (97, 11), (2, 3, 5, 5)]
    return [torch.randn(s, device=device, dtype=dtype) for s in shapes]


def test_layout_is_aligned_and_views_match_parameters(device):
    params = _params(device)
    buf = _C.GradBuffer(params, torch.float32)
    assert buf.num_slots == len(params) == len(buf)
    assert buf.data.dim() == 1 and buf.data.dtype == torch.float32
    assert buf.data.eq(0).all()
    base = buf.data.data_ptr()
    for view, p, offset, numel in zip(buf.views(), params, buf.offsets, buf.numels):
        assert view.shape == p.shape and view.is_contiguous()
        assert view.data_ptr() == base + 4 * offset
        assert offset % 16 == 0 and numel == p.numel()
    view = buf.views()[1]
    view.fill_(2.0)
    assert buf.data[buf.offsets[1] : buf.offsets[1] + 5].eq(2).all()


def test_accumulate_by_index_and_whole_buffer_ops(device):
    params = _params(device)
    buf = _C.GradBuffer(params, torch.float32)
    grads = [torch.randn_like(p) for p in params]
    buf.accumulate_([3, 0], [grads[3], grads[0]], 0.5)
    buf.accumulate_([0], [grads[0]], 0.5)
    views = buf.views()
    torch.testing.assert_close(views[0], grads[0])
    torch.testing.assert_close(views[3], 0.5 * grads[3])
    assert views[1].eq(0).all()
    buf.scale_(4.0)
    torch.testing.assert_close(views[3], 2.0 * grads[3])
    flag = torch.zeros((), device=device)
    buf.scale_check_(1.0, flag)
    assert flag.item() == 0
    views[4][0, 0, 0, 0] = float("nan")
    buf.scale_check_(1.0, flag)
    assert flag.item() == 1
    buf.zero_()
    assert buf.data.eq(0).all()


def test_low_precision_grads_accumulate_in_float32(device):
    params = _params(device, torch.bfloat16)
    buf = _C.GradBuffer(params, torch.float32)
    grads = [torch.randn_like(p) for p in params]
    for _ in range(3):
        buf.accumulate_(list(range(len(params))), grads, 1.0 / 3.0)
    for view, g in zip(buf.views(), grads):
        assert view.dtype == torch.float32
        torch.testing.assert_close(view, g.float(), rtol=1e-6, atol=1e-6)


def test_views_of_maps_layout_onto_another_flat_tensor(device):
    params = _params(device)
    buf = _C.GradBuffer(params, torch.float32)
    for view in buf.views():
        view.normal_()
    mirror = buf.data.to(torch.bfloat16)
    for v, m in zip(buf.views(), buf.views_of(mirror)):
        assert m.dtype == torch.bfloat16 and m.shape == v.shape
        assert torch.equal(m, v.to(torch.bfloat16))
    with pytest.raises(RuntimeError, match="flat has 3 elements"):
        buf.views_of(torch.zeros(3, device=device))


def test_float64_buffer(device):
    params = _params(device, torch.float64)
    buf = _C.GradBuffer(params, torch.float64)
    buf.accumulate_([2], [torch.full((1,), 0.1, dtype=torch.float64, device=device)], 3.0)
    assert buf.views()[2].item() == pytest.approx(0.3, abs=1e-16)


def test_rejects_bad_construction_and_indices():
    with pytest.raises(RuntimeError, match="dtype must be torch.float32 or torch.float64"):
        _C.GradBuffer([torch.zeros(3)], torch.bfloat16)
    with pytest.raises(RuntimeError, match="params must hold at least one tensor"):
        _C.GradBuffer([], torch.float32)
    with pytest.raises(RuntimeError, match=r"params\[1\] must be floating point"):
        _C.GradBuffer([torch.zeros(3), torch.zeros(3, dtype=torch.int64)], torch.float32)
    buf = _C.GradBuffer([torch.zeros(3), torch.zeros(4)], torch.float32)
    with pytest.raises(RuntimeError, match=r"indices\[0\]=2 is out of range"):
        buf.accumulate_([2], [torch.zeros(3)], 1.0)
    with pytest.raises(RuntimeError, match=r"indices\[1\]=0 appears more than once"):
        buf.accumulate_([0, 0], [torch.ones(3), torch.ones(3)], 1.0)
    with pytest.raises(RuntimeError, match=r"grads\[0\] has shape"):
        buf.accumulate_([1], [torch.zeros(3)], 1.0)
    assert buf.data.eq(0).all()


def test_zero_slots_clears_exactly_a_range(device):
    params = _params(device)
    buf = _C.GradBuffer(params, torch.float32)
    buf.data.fill_(1.0)
    buf.zero_slots_(1, 3)
    views = buf.views()
    assert views[0].eq(1).all() and views[4].eq(1).all()
    assert all(views[k].eq(0).all() for k in (1, 2, 3))
    with pytest.raises(RuntimeError, match=r"slots \[3, 1\] are not a valid range"):
        buf.zero_slots_(3, 1)
    with pytest.raises(RuntimeError, match=r"slots \[0, 5\] are not a valid range"):
        buf.zero_slots_(0, 5)
