"""vflow.ops: the six kernels as registered PyTorch operators (one surface).

``torch.library.opcheck`` checks each schema against its implementation (mutation and
alias annotations), the fake implementation and the operator under AOT dispatch.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from tests.support.cuda_marks import devices
from vflow import _C, ops

Args = tuple[object, ...]


def _pairs(
    device: str, shapes: list[tuple[int, ...]], dtypes: list[torch.dtype]
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    accs = [torch.randn(s, device=device) for s in shapes]
    grads = [torch.randn(s, device=device).to(d) for s, d in zip(shapes, dtypes, strict=True)]
    return accs, grads


def _exact_state(device: str, n: int) -> tuple[torch.Tensor, ...]:
    """Top bins and three limbs after one contribution, as the Reducer holds them."""
    top = torch.zeros(n, dtype=torch.int8, device=device)
    limbs = torch.zeros(3, n, dtype=torch.int32, device=device)
    ops.exact_accumulate_(top, *limbs, torch.randn(n, device=device), 0.5, True)
    return top, *limbs


def _exact_pack_args(device: str, n: int) -> Args:
    top, *limbs = _exact_state(device, n)
    return top, top.clone(), *limbs, torch.empty(n, dtype=torch.int64, device=device)


def _exact_unpack_args(device: str, n: int) -> Args:
    top, _, *limbs, wire = _exact_pack_args(device, n)
    ops.exact_pack_(top, top, *limbs, wire)
    return top, wire, torch.empty(n, device=device), 0.5


def _channels_last_args(device: str) -> Args:
    grad = torch.randn(4, 3, 5, 5, device=device).to(memory_format=torch.channels_last)
    return [torch.zeros(4, 3, 5, 5, device=device)], [grad], 2.0, False


# (operator, case) -> arguments on a device, built afresh per test: opcheck mutates them.
CASES: dict[tuple[str, str], Callable[[str], Args]] = {
    ("multi_accumulate_", "bf16_into_fp32_odd_sizes"): lambda d: (
        *_pairs(d, [(97,), (1025,), (97, 1025)], [torch.bfloat16] * 3),
        0.37,
        False,
    ),
    ("multi_accumulate_", "mixed_dtypes_overwrite"): lambda d: (
        *_pairs(d, [(3, 4), (1,), (5, 7)], [torch.float32, torch.float16, torch.bfloat16]),
        -1.5,
        True,
    ),
    ("multi_accumulate_", "channels_last_grad"): _channels_last_args,
    ("scale_", "fp32_97"): lambda d: (torch.randn(97, device=d), 0.125),
    ("scale_", "fp64_1025"): lambda d: (torch.randn(1025, dtype=torch.float64, device=d), 0.125),
    ("scale_check_", "scale_1025"): lambda d: (
        torch.randn(1025, device=d),
        0.5,
        torch.zeros((), device=d),
    ),
    ("scale_check_", "check_only_97"): lambda d: (
        torch.randn(97, device=d),
        1.0,
        torch.zeros((), device=d),
    ),
    ("exact_accumulate_", "fp32_1025"): lambda d: (
        *_exact_state(d, 1025),
        torch.randn(1025, device=d),
        0.1,
    ),
    ("exact_accumulate_", "bf16_97_fresh"): lambda d: (
        *_exact_state(d, 97),
        torch.randn(97, device=d).bfloat16(),
        0.1,
        True,
    ),
    ("exact_pack_", "1025"): lambda d: _exact_pack_args(d, 1025),
    ("exact_unpack_", "97"): lambda d: _exact_unpack_args(d, 97),
}


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize(("op", "case"), list(CASES), ids=[f"{o}-{c}" for o, c in CASES])
def test_opcheck(op: str, case: str, device: str) -> None:
    overload = getattr(torch.ops.vflow, op).default
    torch.library.opcheck(overload, CASES[(op, case)](device))


def test_every_operator_has_opcheck_cases() -> None:
    assert {op for op, _ in CASES} == set(ops.OP_NAMES)


def test_every_operator_has_cpu_and_cuda_kernels() -> None:
    for name in ops.OP_NAMES:
        qualified = f"vflow::{name}"
        assert torch._C._dispatch_has_kernel_for_dispatch_key(qualified, "CPU"), qualified
        # A CPU-only build registers a CUDA kernel too: the one that says so.
        assert torch._C._dispatch_has_kernel_for_dispatch_key(qualified, "CUDA"), qualified


def test_schemas_annotate_every_tensor_the_operator_writes() -> None:
    written = {
        "multi_accumulate_": {"accs"},
        "scale_": {"buf"},
        "scale_check_": {"buf", "found_nonfinite"},
        "exact_accumulate_": {"top", "l0", "l1", "l2"},
        "exact_pack_": {"wire"},
        "exact_unpack_": {"out"},
    }
    assert set(written) == set(ops.OP_NAMES)
    for name, expected in written.items():
        schema = getattr(torch.ops.vflow, name).default._schema
        mutable = {a.name for a in schema.arguments if a.alias_info and a.alias_info.is_write}
        assert mutable == expected, name
        assert not schema.returns, name


def test_kernels_are_gone_from_the_pybind_module() -> None:
    for name in ops.OP_NAMES:
        assert not hasattr(_C, name), f"vflow._C.{name} still exists beside torch.ops.vflow"


def test_profiler_records_the_operators_for_python_and_cpp_callers() -> None:
    acc, grad = torch.zeros(97), torch.randn(97)
    buffer = _C.GradBuffer([acc], torch.float32)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        ops.multi_accumulate_([acc], [grad], 0.5)
        buffer.accumulate_([0], [grad], 0.5)  # C++ GradBuffer -> vflow::multi_accumulate_
        buffer.scale_(2.0)
    names = [event.name for event in prof.events()]
    assert names.count("vflow::multi_accumulate_") == 2, names
    assert "vflow::scale_" in names, names


def test_empty_call_does_nothing() -> None:
    ops.multi_accumulate_([], [], 1.0)
    buffer = _C.GradBuffer([torch.zeros(3)], torch.float32)
    buffer.accumulate_([], [], 1.0)
    assert torch.equal(buffer.data, torch.zeros_like(buffer.data))


@pytest.mark.skipif(ops.built_with_cuda(), reason="a CUDA build has the real CUDA kernels")
@pytest.mark.parametrize(
    ("op", "case"), [next(k for k in CASES if k[0] == n) for n in ops.OP_NAMES]
)
def test_cpu_only_build_names_the_missing_gpu_kernels(op: str, case: str) -> None:
    # No CUDA tensor exists without a GPU: call the kernel registered for the CUDA key
    # directly, as the dispatcher would for CUDA tensors.
    overload = getattr(torch.ops.vflow, op).default
    cuda_only = torch._C.DispatchKeySet(torch._C.DispatchKey.CUDA)
    message = f"vflow::{op}: this build of vflow has no CUDA kernels"
    with pytest.raises(RuntimeError, match=message):
        overload.redispatch(cuda_only, *CASES[(op, case)]("cpu"))
