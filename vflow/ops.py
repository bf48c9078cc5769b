"""vflow's stateless kernels as PyTorch operators (``torch.ops.vflow.*``).

The six kernels behind the accumulation buffers are registered with ``TORCH_LIBRARY``
(``csrc/torch_ops.cpp``): the dispatcher picks the CPU or CUDA implementation from the
tensors' device, ``torch.profiler`` records each call under its own name, and
``torch.library.opcheck`` can check the schemas. The functions below are typed
wrappers around those operators; vflow's C++ code (GradBuffer, Reducer) calls the same
operators. Every operator mutates some of its arguments in place and returns nothing.

The non-tensor helpers of the extension are re-exported here too, so that tests and
benchmarks need only this module: ``built_with_cuda``, ``cpu_vector_paths``,
``cpu_vector_path``, ``set_cpu_vector_path`` and ``EXACT_MAX_TERMS``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from vflow._extension import _C

__all__ = [
    "EXACT_MAX_TERMS",
    "OP_NAMES",
    "built_with_cuda",
    "cpu_vector_path",
    "cpu_vector_paths",
    "exact_accumulate_",
    "exact_pack_",
    "exact_unpack_",
    "multi_accumulate_",
    "scale_",
    "scale_check_",
    "set_cpu_vector_path",
]

EXACT_MAX_TERMS: int = _C.EXACT_MAX_TERMS
"""The most contributions an exact sum takes without overflow (32767)."""

OP_NAMES = (
    "multi_accumulate_",
    "scale_",
    "scale_check_",
    "exact_accumulate_",
    "exact_pack_",
    "exact_unpack_",
)
"""The operators' names in the ``vflow`` namespace of ``torch.ops``."""


def built_with_cuda() -> bool:
    """Whether this build of the extension contains the CUDA kernels."""
    return _C.built_with_cuda()


def cpu_vector_paths() -> list[str]:
    """The CPU kernels' vector paths this CPU and build offer, best first:
    ``["avx2", "portable"]`` or ``["portable"]``."""
    return _C.cpu_vector_paths()


def cpu_vector_path() -> str:
    """The CPU kernels' current vector path, ``"avx2"`` or ``"portable"``."""
    return _C.cpu_vector_path()


def set_cpu_vector_path(name: str) -> None:
    """Selects the CPU kernels' vector path for the whole process (tests, benchmarks):
    ``"avx2"`` (AVX2+FMA+F16C, the default where the CPU has them) or ``"portable"``.
    Raises ``RuntimeError`` for another name or for ``"avx2"`` without CPU support."""
    _C.set_cpu_vector_path(name)


def multi_accumulate_(
    accs: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    weight: float,
    overwrite: bool = False,
) -> None:
    """``accs[i] += weight * grads[i]`` for every i, in one fused call.

    With ``overwrite``, ``accs[i] = weight * grads[i]`` instead, without reading
    ``accs``. Accumulators: contiguous float32 or float64, not overlapping each other.
    Gradients: the accumulator's shape and device; float32, bfloat16 or float16 into
    float32, any of those or float64 into float64. The product is rounded in the
    accumulator's dtype. Non-contiguous gradients are accepted (a strided pass); an
    empty call does nothing.
    """
    if not accs and not grads:
        # The dispatcher needs a tensor to pick a backend; there is no work anyway.
        return
    torch.ops.vflow.multi_accumulate_(list(accs), list(grads), weight, overwrite)


def scale_(buf: torch.Tensor, factor: float) -> None:
    """``buf *= factor`` in one pass (contiguous float32 or float64)."""
    torch.ops.vflow.scale_(buf, factor)


def scale_check_(buf: torch.Tensor, factor: float, found_nonfinite: torch.Tensor) -> None:
    """``buf *= factor`` (no write when ``factor`` is 1) and, in the same pass, sets the
    0-dim float32 ``found_nonfinite`` (on ``buf``'s device) to 1 if any result is inf
    or NaN. The flag is never cleared, so one flag can collect several buffers."""
    torch.ops.vflow.scale_check_(buf, factor, found_nonfinite)


def exact_accumulate_(
    top: torch.Tensor,
    l0: torch.Tensor,
    l1: torch.Tensor,
    l2: torch.Tensor,
    grad: torch.Tensor,
    weight: float,
    fresh: bool = False,
) -> None:
    """Adds ``weight * grad`` to exact accumulators: int8 top bins ``top`` and int32
    limbs ``l0``, ``l1``, ``l2``, all contiguous with ``grad``'s number of elements
    and device; ``grad`` float32, bfloat16 or float16. With ``fresh`` the accumulators'
    old contents are ignored (the first contribution of a step). See Note [Exact
    accumulation] in ``csrc/exact.h``."""
    torch.ops.vflow.exact_accumulate_(top, l0, l1, l2, grad, weight, fresh)


def exact_pack_(
    local_top: torch.Tensor,
    global_top: torch.Tensor,
    l0: torch.Tensor,
    l1: torch.Tensor,
    l2: torch.Tensor,
    wire: torch.Tensor,
) -> None:
    """Packs exact accumulators (``local_top`` and limbs) against the global top bins
    ``global_top`` (each at least the local one, int8) into the int64 ``wire``, whose
    elementwise sum over workers is exact."""
    torch.ops.vflow.exact_pack_(local_top, global_top, l0, l1, l2, wire)


def exact_unpack_(
    global_top: torch.Tensor, wire: torch.Tensor, out: torch.Tensor, factor: float = 1.0
) -> None:
    """``out = factor * value`` of the packed sums ``wire`` with top bins
    ``global_top``, rounded once to float32 (NaN for non-finite elements)."""
    torch.ops.vflow.exact_unpack_(global_top, wire, out, factor)


def _returns_nothing(*args: object, **kwargs: object) -> None:
    # Fake (meta) implementation of every vflow operator: they only mutate their
    # arguments in place, so under fake tensors there is nothing to compute or return.
    # Argument checks run in the real kernels.
    return None


for _name in OP_NAMES:
    torch.library.register_fake(f"vflow::{_name}", _returns_nothing)
