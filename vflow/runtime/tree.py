"""The fixed summation tree of deterministic mode (Note [Ordered sum] in
csrc/reduction/ordered.cpp).

The gradients of the V virtual nodes are added in one binary tree that depends on V
alone: node [lo, hi) is the float32 sum of its two children [lo, mid) and [mid, hi),
where mid - lo is the largest power of two below hi - lo. Float addition of two
values is exact-rounded and commutative, so as long as every node is computed as
"left + right" from the same two children, the root has the same bits on any number
of workers, under any plan, with any communication backend.

A worker that runs the contiguous VN range [a, b) can compute, on its own, exactly the
tree nodes that lie inside [a, b); the largest of them (its *cover*) are its partial
sums. They are computed with a stack: each VN's gradient is pushed, then the two
entries on top are merged while they are the two children of one node. Whoever holds
every worker's cover (the owner of a shard of the gradient) pushes those nodes in VN
order through the same stack and ends with the root.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

Node = tuple[int, int]


def split(lo: int, hi: int) -> int:
    """First VN of the right child of node [lo, hi) (needs hi - lo >= 2)."""
    return lo + (1 << ((hi - lo - 1).bit_length() - 1))


def is_node(lo: int, hi: int, virtual_nodes: int) -> bool:
    """Whether [lo, hi) is a node of the tree over [0, virtual_nodes)."""
    node_lo, node_hi = 0, virtual_nodes
    while (node_lo, node_hi) != (lo, hi):
        if node_hi - node_lo < 2 or not (node_lo <= lo and hi <= node_hi):
            return False
        mid = split(node_lo, node_hi)
        if hi <= mid:
            node_hi = mid
        elif lo >= mid:
            node_lo = mid
        else:
            return False
    return True


def _siblings(left: Node, right: Node, virtual_nodes: int) -> bool:
    return (
        left[1] == right[0]
        and is_node(left[0], right[1], virtual_nodes)
        and split(left[0], right[1]) == left[1]
    )


def merges_after_push(nodes: Sequence[Node], virtual_nodes: int) -> tuple[list[int], list[Node]]:
    """Runs the stack over ``nodes`` (consecutive ranges in VN order): for each node
    the number of merges right after pushing it, and the stack at the end."""
    stack: list[Node] = []
    merges: list[int] = []
    for node in nodes:
        if stack and stack[-1][1] != node[0]:
            raise ValueError(f"node {node} does not follow {stack[-1]}")
        stack.append(node)
        count = 0
        while len(stack) >= 2 and _siblings(stack[-2], stack[-1], virtual_nodes):
            right = stack.pop()
            stack[-1] = (stack[-1][0], right[1])
            count += 1
        merges.append(count)
    return merges, stack


def cover(first: int, stop: int, virtual_nodes: int) -> list[Node]:
    """The largest tree nodes inside [first, stop), in VN order: the partial sums a
    worker running those VNs contributes."""
    _, stack = merges_after_push([(i, i + 1) for i in range(first, stop)], virtual_nodes)
    return stack


@dataclass(frozen=True)
class VNStep:
    """Where one VN's gradient goes on its worker's stack: it is written to stack
    level ``level``, then ``merges`` merges follow (level - 1 += level, and so on)."""

    level: int
    merges: int


@dataclass(frozen=True)
class TreeSchedule:
    """Everything one worker needs for one step under one plan."""

    vn_steps: tuple[VNStep, ...]  # this worker's VNs, in order
    cover_counts: tuple[int, ...]  # partial sums of each worker
    combine_merges: tuple[int, ...]  # merges after pushing each worker's partials, in order


def schedule(ranges: Sequence[tuple[int, int]], worker: int, virtual_nodes: int) -> TreeSchedule:
    """The schedule of ``worker`` when worker w runs VNs [ranges[w][0], ranges[w][1])
    and the ranges tile [0, virtual_nodes) in order."""
    if not 0 <= worker < len(ranges):
        raise ValueError(f"worker must be in [0, {len(ranges)}), got {worker}")
    expected = 0
    for first, stop in ranges:
        if first != expected or stop <= first:
            raise ValueError(f"ranges must tile [0, {virtual_nodes}) in order, got {ranges}")
        expected = stop
    if expected != virtual_nodes:
        raise ValueError(f"ranges must tile [0, {virtual_nodes}) in order, got {ranges}")
    first, stop = ranges[worker]
    leaf_merges, _ = merges_after_push([(i, i + 1) for i in range(first, stop)], virtual_nodes)
    vn_steps = []
    depth = 0
    for count in leaf_merges:
        vn_steps.append(VNStep(level=depth, merges=count))
        depth += 1 - count
    covers = [cover(a, b, virtual_nodes) for a, b in ranges]
    combine, root = merges_after_push([n for c in covers for n in c], virtual_nodes)
    if root != [(0, virtual_nodes)]:
        raise AssertionError(f"the partial sums of {ranges} do not combine to the root")
    return TreeSchedule(tuple(vn_steps), tuple(len(c) for c in covers), tuple(combine))
