"""Fewer collectives per step (issue 34): the step's statistics ride with bucket 0
(Note [Statistics ride with bucket 0], csrc/reduction/reduction.h), the ordered
reduction exchanges small buckets with one all-gather (Note [Gathered buckets],
csrc/reduction/ordered.cpp), and so does the default one on the CPU (Note [Small
buckets by all-gather], csrc/reduction/all_reduce.cpp).

On 2 and 3 Gloo ranks, a Reducer whose bucket 0 is small and whose bucket 1 is large
(sharded exchange in ordered mode, an all-reduce in the default kind) reduces VN
gradients with weights that make float sums order-sensitive; every bucket must hold
the bits of the tree sum (ordered), or of the workers' partial sums added in rank
order (the default kind's gathered bucket 0), or the same sum on every worker (its
all-reduced bucket 1), and the statistics must come back bit for bit, -0.0 and a NaN
payload included, whichever way they travelled.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.reducers import make_reducer
from vflow.mapping.plan import Plan
from vflow.runtime import tree
from vflow.world.launch import run_ranks

V = 6
SMALL, LARGE = 40, 70_000  # bucket 0 gathered, bucket 1 (280 KB) sharded in ordered mode
ODD_BITS = 0x7FF4_0000_DEAD_BEEF  # a NaN with a payload


def _leaves(v: int) -> list[list[torch.Tensor]]:
    generator = torch.Generator().manual_seed(11)
    out = []
    for _ in range(v):
        exponents = torch.randint(-20, 20, (SMALL + LARGE,), generator=generator).float()
        values = torch.randn(SMALL + LARGE, generator=generator) * torch.exp2(exponents)
        out.append([values[:SMALL].clone(), values[SMALL:].clone()])
    return out


def _stats(rank: int, world_size: int) -> torch.Tensor:
    """Each value nonzero on one rank only, as vflow.runtime.step_stats lays them out."""
    stats = torch.zeros(3 * world_size, dtype=torch.float64)
    stats[3 * rank] = -0.0 if rank == 0 else 1.0 / (rank + 3)
    stats.view(torch.int64)[3 * rank + 1] = ODD_BITS
    stats[3 * rank + 2] = -(2.0**-1070) * (rank + 1)  # subnormal
    return stats


def _reduce(rank: int, world_size: int, kind: str, counts: list[int]) -> dict:
    import torch.distributed as dist

    out = _run(rank, world_size, kind, counts, dist.group.WORLD)
    if kind == "all-reduce":
        # This worker's partial sums: the same folds with no one to reduce with.
        out["partial"] = _run(rank, world_size, kind, counts, None)["grads"]
    return out


def _run(rank: int, world_size: int, kind: str, counts: list[int], group: object) -> dict:
    # Slot 0, the small parameter, fills bucket 0 (first_bucket_bytes); slot 1 bucket 1.
    small, large = torch.nn.Parameter(torch.zeros(SMALL)), torch.nn.Parameter(torch.zeros(LARGE))
    reducer = make_reducer([[small, large]], [torch.float32], SMALL * 4, 1 << 22, group, kind=kind)
    assert reducer.num_buckets == 2
    plan = Plan(counts=counts)
    vns = list(plan.vns(rank))
    if kind == "ordered":
        ranges = [(plan.vns(w).start, plan.vns(w).stop) for w in range(world_size)]
        schedule = tree.schedule(ranges, rank, V)
        reducer.reduction.set_tree(list(schedule.cover_counts), list(schedule.combine_merges))
        placements = [(s.level, s.merges) for s in schedule.vn_steps]
    else:
        placements = [(0, 0)] * len(vns)
    leaves = _leaves(V)
    weights = [0.1 * (k + 1) for k in range(V)]
    out = {}
    for step in range(2):  # the second step reuses the private tensors
        reducer.begin_step(step)
        for position, vn in enumerate(vns):
            last = position == len(vns) - 1
            level, merges = placements[position]
            reducer.begin_vn(weights[vn], last, level, merges)
            if last and group is not None:
                reducer.start_stats(_stats(rank, world_size), with_buckets=True)
            for slot, grad in enumerate(leaves[vn]):
                reducer.add_grad(reducer.bucket_of(0, slot), slot, grad)
            reducer.end_vn()
        if group is not None:
            out[f"carried {step}"] = reducer.stats_with_buckets
            out[f"stats {step}"] = reducer.wait_stats()
        reducer.finalize(1.0, [])
    out["grads"] = [v.clone() for v in reducer.buffers[0].views()]
    return out


def _tree_sum(leaves: list[torch.Tensor], lo: int, hi: int) -> torch.Tensor:
    if hi - lo == 1:
        return leaves[lo].clone()
    mid = tree.split(lo, hi)
    return _tree_sum(leaves, lo, mid) + _tree_sum(leaves, mid, hi)


@pytest.mark.parametrize(
    ("kind", "counts"),
    [
        ("ordered", [3, 3]),
        ("ordered", [1, 2, 3]),
        ("all-reduce", [3, 3]),
        ("all-reduce", [2, 2, 2]),
    ],
)
def test_statistics_ride_with_bucket_0_and_sums_keep_their_bits(
    kind: str, counts: list[int]
) -> None:
    world_size = len(counts)
    results = run_ranks(world_size, _reduce, kind, counts, timeout=120)
    # Each value comes from the one rank that wrote it, bits unchanged.
    want_stats = torch.zeros(3 * world_size, dtype=torch.float64)
    for rank in range(world_size):
        own = slice(3 * rank, 3 * rank + 3)
        want_stats[own] = _stats(rank, world_size)[own]
    weights = [0.1 * (k + 1) for k in range(V)]
    leaves = _leaves(V)
    for r in results:
        for step in range(2):
            assert r.value[f"carried {step}"]
            got = r.value[f"stats {step}"]
            assert got.view(torch.int64).tolist() == want_stats.view(torch.int64).tolist()
        if kind == "ordered":
            for slot in range(2):
                want = _tree_sum(
                    [
                        torch.tensor(weights[k], dtype=torch.float32) * leaves[k][slot]
                        for k in range(V)
                    ],
                    0,
                    V,
                )
                assert torch.equal(r.value["grads"][slot], want), (r.rank, slot)
    if kind == "all-reduce":
        first = results[0].value["grads"]
        for r in results[1:]:
            assert all(torch.equal(a, b) for a, b in zip(r.value["grads"], first, strict=True))
        # Bucket 0 went by all-gather: the partial sums added in rank order, bit for bit.
        partials = [r.value["partial"][0] for r in sorted(results, key=lambda r: r.rank)]
        want = partials[0] + partials[1]
        for partial in partials[2:]:
            want = want + partial
        assert torch.equal(first[0], want)
        # Bucket 1 (280 KB a worker, over the gather limit) went by all-reduce: the sum
        # within float32 rounding of W - 1 additions in whatever order the ring took.
        large = [r.value["partial"][1].double() for r in results]
        error = (first[1].double() - sum(large)).abs()
        assert bool((error <= 2.0**-22 * sum(p.abs() for p in large)).all())
