"""Reduction strategies: how the workers' gradients are summed (Note [Reduction
strategies], csrc/reduction/reduction.h).

Each strategy wraps its C++ object (``native``, handed to the Reducer) and owns the
Python side of its kind: the checks of what it supports, and its world-dependent state.
That state is rebuilt in two halves around a change of worker set:
``prepare_world(plan, rank)`` computes it without side effects (it may raise, leaving
everything as it was), and ``apply_world`` installs it once the change is certain.
"""

from __future__ import annotations

import logging
from typing import NamedTuple

import torch

from vflow._extension import _C
from vflow.mapping.plan import Plan
from vflow.runtime import tree
from vflow.runtime.config import Deterministic

_log = logging.getLogger("vflow")


class VNPlacement(NamedTuple):
    """Where a VN's gradients go on the ordered strategy's stack (0, 0 elsewhere)."""

    level: int
    merges: int


_FLAT = VNPlacement(0, 0)


class Reduction:
    """A strategy; this base is the default one: one all-reduce (SUM) per bucket, or for
    a small CPU bucket one all-gather added up in rank order (Note [Small buckets by
    all-gather], csrc/reduction/all_reduce.cpp)."""

    kind = "all-reduce"

    def __init__(self) -> None:
        self.native: _C.Reduction = self._make_native()

    def _make_native(self) -> _C.Reduction:
        return _C.AllReduceSum()

    def check_support(
        self,
        params: list[torch.nn.Parameter],
        accumulate_dtype: torch.dtype,
        virtual_nodes: int,
    ) -> None:
        """Raises ValueError for a model or setting this kind cannot reduce."""

    def prepare_world(self, plan: Plan, rank: int) -> object:
        """World-dependent state for ``plan`` with this worker at ``rank``."""
        return None

    def apply_world(self, prepared: object) -> None:
        """Installs what ``prepare_world`` computed (after the Reducer's new group)."""

    def placement(self, position: int) -> VNPlacement:
        """Where this worker's ``position``-th VN of a step goes."""
        return _FLAT


class _Deterministic(Reduction):
    """A kind whose sum does not depend on the mapping of VNs onto workers."""

    def check_support(
        self,
        params: list[torch.nn.Parameter],
        accumulate_dtype: torch.dtype,
        virtual_nodes: int,
    ) -> None:
        if any(p.is_cuda for p in params) and not torch.are_deterministic_algorithms_enabled():
            _log.warning(
                "vflow: deterministic=True on CUDA also needs deterministic kernels in the "
                "model: call torch.use_deterministic_algorithms(True) (see "
                "docs/reproducibility.md)"
            )


class OrderedTreeSum(_Deterministic):
    """deterministic="ordered": float sums in one fixed tree over the VN indices
    (Note [Ordered sum], csrc/reduction/ordered.cpp; the tree in vflow.runtime.tree)."""

    kind = "ordered"

    def __init__(self) -> None:
        super().__init__()
        self._schedule: tree.TreeSchedule | None = None

    def _make_native(self) -> _C.Reduction:
        return _C.OrderedSum()

    def prepare_world(self, plan: Plan, rank: int) -> tree.TreeSchedule:
        ranges = [(plan.vns(w).start, plan.vns(w).stop) for w in range(plan.num_workers)]
        return tree.schedule(ranges, rank, plan.virtual_nodes)

    def apply_world(self, prepared: object) -> None:
        assert isinstance(prepared, tree.TreeSchedule)
        self.native.set_tree(list(prepared.cover_counts), list(prepared.combine_merges))
        self._schedule = prepared

    def placement(self, position: int) -> VNPlacement:
        assert self._schedule is not None
        step = self._schedule.vn_steps[position]
        return VNPlacement(step.level, step.merges)


class ExactSum(_Deterministic):
    """deterministic="exact": exact integer sums (Note [Exact buckets],
    csrc/reduction/exact_sum.cpp)."""

    kind = "exact"

    def _make_native(self) -> _C.Reduction:
        return _C.ExactSum()

    def check_support(
        self,
        params: list[torch.nn.Parameter],
        accumulate_dtype: torch.dtype,
        virtual_nodes: int,
    ) -> None:
        super().check_support(params, accumulate_dtype, virtual_nodes)
        if accumulate_dtype != torch.float32:
            raise ValueError(
                f'deterministic="exact" sums gradients exactly and converts them to float32 once; '
                f"accumulate_dtype must be torch.float32, got {accumulate_dtype}"
            )
        wide = [tuple(p.shape) for p in params if p.dtype == torch.float64]
        if wide:
            raise ValueError(
                f'deterministic="exact" supports float32, bfloat16 and float16 parameters; '
                f"{len(wide)} trainable parameter(s) are float64 (first shape {wide[0]})"
            )
        if virtual_nodes > _C.EXACT_MAX_TERMS:
            raise ValueError(
                f'deterministic="exact" supports at most {_C.EXACT_MAX_TERMS} virtual nodes (the '
                f"exact sums would overflow beyond), got virtual_nodes={virtual_nodes}"
            )


def for_kind(deterministic: Deterministic) -> Reduction:
    """The strategy of an Executor's ``deterministic`` setting."""
    if deterministic == "ordered":
        return OrderedTreeSum()
    if deterministic == "exact":
        return ExactSum()
    return Reduction()
