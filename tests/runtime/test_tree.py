"""vflow.runtime.tree: the fixed summation tree of deterministic mode, and the ordered Reducer
that follows it (Note [Ordered sum] in csrc/reduction/ordered.cpp) on one process.

The reference is the tree sum written recursively in float32: node [lo, hi) is
sum(left) + sum(right). Whatever the tiling of [0, V) into workers, every worker's
stack plus the owner's combine must give exactly those bits. The multi-process path
(shards over Gloo) is tested end to end in tests/runtime/test_deterministic.py.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from tests.support.cuda_marks import devices
from tests.support.reducers import make_reducer
from vflow import _C
from vflow.runtime import tree


def tree_sum(leaves: list[torch.Tensor], lo: int, hi: int) -> torch.Tensor:
    if hi - lo == 1:
        return leaves[lo].clone()
    mid = tree.split(lo, hi)
    return tree_sum(leaves, lo, mid) + tree_sum(leaves, mid, hi)


def tilings(v: int, max_workers: int = 4):
    for workers in range(1, min(v, max_workers) + 1):
        for cuts in itertools.combinations(range(1, v), workers - 1):
            bounds = [0, *cuts, v]
            yield list(itertools.pairwise(bounds))


def test_split_is_the_largest_power_of_two_below_the_size() -> None:
    assert [tree.split(0, n) for n in range(2, 10)] == [1, 2, 2, 4, 4, 4, 4, 8]
    assert tree.split(8, 12) == 10 and tree.split(5, 8) == 7


def test_nodes_and_covers() -> None:
    assert tree.is_node(0, 12, 12) and tree.is_node(8, 12, 12) and tree.is_node(10, 11, 12)
    assert not tree.is_node(4, 12, 12) and not tree.is_node(2, 6, 12)
    assert tree.cover(0, 12, 12) == [(0, 12)]
    assert tree.cover(0, 6, 12) == [(0, 4), (4, 6)]
    assert tree.cover(6, 9, 12) == [(6, 8), (8, 9)]
    assert tree.cover(9, 12, 12) == [(9, 10), (10, 12)]


@pytest.mark.parametrize("v", [1, 2, 3, 5, 8, 12])
def test_every_tiling_gives_the_bits_of_the_tree_sum(v: int) -> None:
    """Simulates every worker's stack (write, then merges) and the owner's combine
    with float32 tensors whose sums are sensitive to the order of additions."""
    generator = torch.Generator().manual_seed(v)
    exponents = torch.randint(-30, 30, (v, 64), generator=generator).float()
    leaves = list(torch.randn(v, 64, generator=generator) * torch.exp2(exponents))
    want = tree_sum(leaves, 0, v)
    for ranges in tilings(v):
        partials = []
        for worker, (first, stop) in enumerate(ranges):
            schedule = tree.schedule(ranges, worker, v)
            stack: list[torch.Tensor] = []
            for vn, step in zip(range(first, stop), schedule.vn_steps, strict=True):
                assert step.level == len(stack)
                stack.append(leaves[vn].clone())
                for _ in range(step.merges):
                    right = stack.pop()
                    stack[-1] += right
            assert len(stack) == schedule.cover_counts[worker]
            partials += stack
        combine = tree.schedule(ranges, 0, v).combine_merges
        stack = []
        for partial, merges in zip(partials, combine, strict=True):
            stack.append(partial)
            for _ in range(merges):
                right = stack.pop()
                stack[-1] = stack[-1] + right
        assert len(stack) == 1
        assert torch.equal(stack[0], want), ranges


def test_schedule_rejects_ranges_that_do_not_tile() -> None:
    with pytest.raises(ValueError, match="must tile"):
        tree.schedule([(0, 2), (3, 4)], 0, 4)
    with pytest.raises(ValueError, match="must tile"):
        tree.schedule([(0, 2)], 0, 4)
    with pytest.raises(ValueError, match="worker must be in"):
        tree.schedule([(0, 4)], 1, 4)


def _ordered_reducer(device: str) -> _C.Reducer:
    params = [torch.zeros(5, 3, device=device), torch.zeros(7, device=device)]
    # Tiny caps: two buckets, so the per-bucket merges run more than once.
    return make_reducer([params], [torch.float32], 1, 1, kind="ordered")


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("v", [1, 3, 6])
def test_ordered_reducer_gives_the_tree_sum(device: str, v: int) -> None:
    reducer = _ordered_reducer(device)
    assert reducer.reduction.kind == "ordered" and reducer.num_buckets == 2
    generator = torch.Generator().manual_seed(v)
    grads = [
        [torch.randn(5, 3, generator=generator), torch.randn(7, generator=generator)]
        for _ in range(v)
    ]
    weights = [0.1 * (k + 1) for k in range(v)]
    schedule = tree.schedule([(0, v)], 0, v)
    reducer.reduction.set_tree(list(schedule.cover_counts), list(schedule.combine_merges))
    for step in range(2):  # the second step reuses the levels: nothing may leak over
        reducer.begin_step(step)
        for k, vn_step in enumerate(schedule.vn_steps):
            reducer.begin_vn(weights[k], k == v - 1, vn_step.level, vn_step.merges)
            for slot, grad in enumerate(grads[k]):
                if not (k == 1 and slot == 1):  # VN 1 gives parameter 1 no gradient
                    reducer.add_grad(reducer.bucket_of(0, slot), slot, grad.to(device))
            reducer.end_vn()
        reducer.finalize(1.0, [])
    got = [view.cpu() for view in reducer.buffers[0].views()]
    for slot in range(2):
        leaves = [
            torch.zeros_like(grads[k][slot])
            if (k == 1 and slot == 1)
            else torch.tensor(weights[k], dtype=torch.float32) * grads[k][slot]
            for k in range(v)
        ]
        assert torch.equal(got[slot], tree_sum(leaves, 0, v)), slot


def test_ordered_reducer_checks_its_schedule() -> None:
    reducer = _ordered_reducer("cpu")
    with pytest.raises(RuntimeError, match="already used by another Reducer"):
        _C.Reducer(reducer.buffers, [(0, 0, 1)], reducer.reduction)
    with pytest.raises(RuntimeError, match="needs set_tree before the first step"):
        reducer.begin_step(0)
    with pytest.raises(RuntimeError, match="one per worker"):
        reducer.reduction.set_tree([1, 1], [0, 1])
    with pytest.raises(RuntimeError, match="2 partial sums in all"):
        reducer.reduction.set_tree([2], [0])
    with pytest.raises(RuntimeError, match="not one root"):
        reducer.reduction.set_tree([2], [0, 0])
    reducer.reduction.set_tree([1], [0])
    reducer.begin_step(0)
    with pytest.raises(RuntimeError, match="level must be the stack depth"):
        reducer.begin_vn(1.0, False, 1, 0)
    with pytest.raises(RuntimeError, match="merges must be in"):
        reducer.begin_vn(1.0, False, 0, 1)
    reducer.begin_vn(1.0, False, 0, 0)
    reducer.end_vn()
    reducer.begin_vn(1.0, True, 1, 0)  # leaves two partial sums where the tree says one
    with pytest.raises(RuntimeError, match="holds 2 partial sums but set_tree says 1"):
        reducer.end_vn()
    # Only the ordered strategy has a tree to set.
    assert not hasattr(
        make_reducer([[torch.zeros(3)]], [torch.float32], 1, 1).reduction, "set_tree"
    )
