"""Markers for tests that need CUDA: their cases are always generated and skipped, with
one reason, where CUDA cannot run."""

from __future__ import annotations

import pytest
import torch

from vflow import ops


def _cuda_missing() -> str | None:
    """Why CUDA tests cannot run here, or None when they can."""
    if not torch.cuda.is_available():
        return "needs a CUDA device"
    if not ops.built_with_cuda():
        return "built without CUDA kernels"
    return None


CUDA_MISSING = _cuda_missing()
CUDA = CUDA_MISSING is None

requires_cuda = pytest.mark.skipif(not CUDA, reason=CUDA_MISSING or "")


def devices() -> list[object]:
    """Devices a device-parametrised test runs on: the CPU and CUDA, whose cases are
    always generated (ids "cpu", "cuda") and skipped where CUDA cannot run."""
    return ["cpu", pytest.param("cuda", marks=requires_cuda)]
