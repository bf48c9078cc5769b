"""vflow.ops' stateless kernels against pure-PyTorch float64 references."""

import math

import pytest
import torch

from tests.support.cuda_marks import requires_cuda
from vflow import ops

SIZES = [0, 1, 97, 1025, 1_000_003]
GRAD_DTYPES = [torch.float32, torch.bfloat16, torch.float16]

# Every case exists on every machine; the ones this machine cannot run are skipped.
DEVICE_PARAMS = [
    pytest.param(
        ("cpu", "avx2"),
        id="cpu-avx2",
        marks=pytest.mark.skipif(
            "avx2" not in ops.cpu_vector_paths(),
            reason="this CPU (or build) has no AVX2/FMA/F16C path",
        ),
    ),
    pytest.param(("cpu", "portable"), id="cpu-portable"),
    pytest.param(("cuda", None), id="cuda", marks=requires_cuda),
]


@pytest.fixture(params=DEVICE_PARAMS)
def device(request, restore_cpu_vector_path):
    dev, path = request.param
    if path is not None:
        ops.set_cpu_vector_path(path)
    return dev


def _reference(acc: torch.Tensor, grad: torch.Tensor, weight: float) -> torch.Tensor:
    return (acc.double() + weight * grad.double()).to(acc.dtype)


def _tolerance(acc_dtype: torch.dtype) -> float:
    # One rounding of the product-sum in the accumulator dtype; grads are exact in it.
    return 4 * torch.finfo(acc_dtype).eps


@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES)
@pytest.mark.parametrize("size", SIZES)
def test_accumulate_matches_reference(device, grad_dtype, size):
    acc = torch.randn(size, device=device)
    grad = torch.randn(size, device=device).to(grad_dtype)
    expected = _reference(acc, grad, 0.37)
    ops.multi_accumulate_([acc], [grad], 0.37)
    torch.testing.assert_close(acc, expected, rtol=_tolerance(torch.float32), atol=1e-6)


def test_accumulate_many_tensors_mixed_dtypes(device):
    sizes = [1, 3, 97, 1025, 4096, 65537, 7, 200_000] * 20  # 160 tensors, crosses launch limits
    accs = [torch.randn(n, device=device) for n in sizes]
    grads = [torch.randn(n, device=device).to(GRAD_DTYPES[i % 3]) for i, n in enumerate(sizes)]
    expected = [_reference(a, g, -1.5) for a, g in zip(accs, grads)]
    ops.multi_accumulate_(accs, grads, -1.5)
    for got, want in zip(accs, expected):
        torch.testing.assert_close(got, want, rtol=_tolerance(torch.float32), atol=1e-5)


@pytest.mark.parametrize("grad_dtype", [*GRAD_DTYPES, torch.float64])
def test_accumulate_into_float64(device, grad_dtype):
    accs = [torch.randn(n, device=device, dtype=torch.float64) for n in (1, 97, 1025, 100_003)]
    grads = [torch.randn(a.shape, device=device).to(grad_dtype) for a in accs]
    expected = [a + 0.1 * g.double() for a, g in zip(accs, grads)]
    ops.multi_accumulate_(accs, grads, 0.1)
    for got, want in zip(accs, expected):
        torch.testing.assert_close(got, want, rtol=1e-14, atol=1e-14)


def test_accumulate_float64(device):
    accs = [torch.randn(n, device=device, dtype=torch.float64) for n in (1, 97, 1025, 100_003)]
    grads = [torch.randn_like(a) for a in accs]
    expected = [a + 3.25 * g for a, g in zip(accs, grads)]
    ops.multi_accumulate_(accs, grads, 3.25)
    for got, want in zip(accs, expected):
        torch.testing.assert_close(got, want, rtol=1e-14, atol=1e-14)


def test_accumulate_weight_one_is_exact_addition(device):
    acc = torch.randn(1025, device=device)
    grad = torch.randn(1025, device=device)
    expected = acc + grad
    ops.multi_accumulate_([acc], [grad], 1.0)
    assert torch.equal(acc, expected)


def test_accumulate_multidim_and_offsets_into_buffer(device):
    # Views at unaligned offsets of one storage exercise the scalar head/tail paths.
    flat = torch.zeros(5000, device=device)
    accs = [flat[1:98].view(97), flat[100:1125].view(25, 41), flat[1200:1201]]
    grads = [torch.randn(a.shape, device=device).to(torch.bfloat16) for a in accs]
    ops.multi_accumulate_(accs, grads, 2.0)
    for a, g in zip(accs, grads):
        torch.testing.assert_close(a, 2.0 * g.float(), rtol=0, atol=0)
    assert flat[:1].eq(0).all() and flat[98:100].eq(0).all() and flat[1201:].eq(0).all()


def test_accumulate_noncontiguous_grad_falls_back(device):
    acc = torch.zeros(8, 3, 5, 5, device=device)
    grad = torch.randn(8, 3, 5, 5, device=device).to(memory_format=torch.channels_last)
    ops.multi_accumulate_([acc], [grad], 0.5)
    torch.testing.assert_close(acc, 0.5 * grad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("size", SIZES)
def test_scale(device, dtype, size):
    buf = torch.randn(size, device=device, dtype=dtype)
    expected = (buf.double() * 0.125).to(dtype)
    ops.scale_(buf, 0.125)
    assert torch.equal(buf, expected)


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
@pytest.mark.parametrize("position", [0, 5, 1024, 1_000_002])
def test_scale_check_finds_nonfinite_anywhere(device, bad, position):
    buf = torch.randn(1_000_003, device=device)
    buf[position] = bad
    flag = torch.zeros((), device=device)
    ops.scale_check_(buf, 0.5, flag)
    assert flag.item() == 1.0


def test_scale_check_detects_overflow_of_the_product(device):
    buf = torch.full((97,), 3e38, device=device)
    flag = torch.zeros((), device=device)
    ops.scale_check_(buf, 4.0, flag)
    assert flag.item() == 1.0 and torch.isinf(buf).all()


def test_scale_check_clean_buffer_leaves_flag_and_factor_one_leaves_data(device):
    buf = torch.randn(1025, device=device)
    before = buf.clone()
    flag = torch.zeros((), device=device)
    ops.scale_check_(buf, 1.0, flag)
    assert flag.item() == 0.0 and torch.equal(buf, before)
    ops.scale_check_(buf, 2.0, flag)
    assert flag.item() == 0.0 and torch.equal(buf, before * 2)


def test_scale_check_never_clears_a_set_flag(device):
    flag = torch.ones((), device=device)
    ops.scale_check_(torch.randn(100, device=device), 1.0, flag)
    assert flag.item() == 1.0


_shared = torch.zeros(8)


@pytest.mark.parametrize(
    ("accs", "grads", "message"),
    [
        ([torch.zeros(3)], [], "same length"),
        ([torch.zeros(3)], [torch.zeros(4)], "grads\\[0\\] has shape"),
        ([torch.zeros(3)], [torch.zeros(3, dtype=torch.float64)], "cannot be accumulated"),
        (
            [torch.zeros(3, dtype=torch.float64)],
            [torch.zeros(3, dtype=torch.int64)],
            "cannot be accumulated",
        ),
        ([torch.zeros(3, dtype=torch.float16)], [torch.zeros(3)], "accs\\[0\\] must be float32"),
        ([torch.zeros(6)[::2]], [torch.zeros(3)], "accs\\[0\\] must be contiguous"),
        ([torch.zeros(3, dtype=torch.int32)], [torch.zeros(3)], "accs\\[0\\] must be float32"),
        ([_shared[:4], _shared[2:6]], [torch.ones(4), torch.ones(4)], "accs must not overlap"),
    ],
)
def test_accumulate_rejects_bad_arguments(accs, grads, message):
    before = [a.clone() for a in accs]
    with pytest.raises(RuntimeError, match=message):
        ops.multi_accumulate_(accs, grads, 1.0)
    assert all(torch.equal(a, b) for a, b in zip(accs, before))


def test_scale_rejects_bad_buffers():
    with pytest.raises(RuntimeError, match="buf must be float32 or float64"):
        ops.scale_(torch.zeros(3, dtype=torch.bfloat16), 2.0)
    with pytest.raises(RuntimeError, match="found_nonfinite must be a 0-dim float32"):
        ops.scale_check_(torch.zeros(3), 2.0, torch.zeros(1))


def test_vector_path_selection_is_validated():
    with pytest.raises(RuntimeError, match="name must be 'avx2' or 'portable'"):
        ops.set_cpu_vector_path("sse9")


def test_kernels_are_registered_as_torch_operators(device):
    accs = [torch.zeros(97, device=device), torch.zeros(5, 5, device=device)]
    grads = [torch.randn(97, device=device).half(), torch.randn(5, 5, device=device)]
    torch.ops.vflow.multi_accumulate_(accs, grads, 0.25)
    for a, g in zip(accs, grads):
        torch.testing.assert_close(a, 0.25 * g.float())
    flag = torch.zeros((), device=device)
    accs[0][3] = float("nan")
    torch.ops.vflow.scale_check_(accs[0], 2.0, flag)
    assert flag.item() == 1.0
    torch.ops.vflow.scale_(accs[1], 4.0)
    torch.testing.assert_close(accs[1], grads[1].float())


@pytest.mark.parametrize("grad_dtype", [*GRAD_DTYPES, torch.float64])
@pytest.mark.parametrize("size", SIZES)
def test_overwrite_equals_accumulating_into_zero(device, grad_dtype, size):
    acc_dtype = torch.float64 if grad_dtype == torch.float64 else torch.float32
    grad = torch.randn(size, device=device).to(grad_dtype)
    stale = torch.randn(size, device=device, dtype=acc_dtype)  # must not leak through
    zeroed = torch.zeros(size, device=device, dtype=acc_dtype)
    ops.multi_accumulate_([stale], [grad], -0.3, overwrite=True)
    ops.multi_accumulate_([zeroed], [grad], -0.3)
    assert torch.equal(stale, zeroed)
    torch.testing.assert_close(stale, (-0.3 * grad.double()).to(acc_dtype))


def test_overwrite_noncontiguous_grad(device):
    acc = torch.randn(4, 3, 5, 5, device=device)
    grad = torch.randn(4, 3, 5, 5, device=device).bfloat16().to(memory_format=torch.channels_last)
    ops.multi_accumulate_([acc], [grad], 0.1, overwrite=True)
    torch.testing.assert_close(acc, 0.1 * grad.float(), rtol=1e-6, atol=0)
