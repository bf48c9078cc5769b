"""Builds a bare vflow._C.Reducer for tests that drive it by hand, the way
vflow.runtime.grad_store builds one for an Executor (buffers, the bucket cut, a strategy)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from vflow import _C
from vflow.runtime.grad_store import assign_buckets

STRATEGIES = {"all-reduce": _C.AllReduceSum, "ordered": _C.OrderedSum, "exact": _C.ExactSum}


def make_reducer(
    groups: Sequence[Sequence[torch.Tensor]],
    dtypes: Sequence[torch.dtype],
    first_bucket_bytes: int,
    bucket_cap_bytes: int,
    process_group: object = None,
    *,
    kind: str = "all-reduce",
    timeout_seconds: float = 600.0,
) -> _C.Reducer:
    """One GradBuffer per group (shapes taken from the tensors), cut into buckets by
    ``vflow.runtime.grad_store.assign_buckets``, reduced with the ``kind`` strategy."""
    buffers = [_C.GradBuffer(list(g), d) for g, d in zip(groups, dtypes, strict=True)]
    return _C.Reducer(
        buffers,
        assign_buckets(buffers, first_bucket_bytes, bucket_cap_bytes),
        STRATEGIES[kind](),
        process_group,
        timeout_seconds,
    )
