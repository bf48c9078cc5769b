"""vflow.data: each worker's share of every global batch."""

import itertools

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from vflow.data import VNBatchSampler
from vflow.mapping.plan import Plan


def samplers(n, b, plan, **kw):
    return [VNBatchSampler(n, b, plan, rank, **kw) for rank in range(plan.num_workers)]


def global_batches(n, b, plan, **kw):
    """The global batches, rebuilt by concatenating every worker's part in rank order."""
    parts = [list(s) for s in samplers(n, b, plan, **kw)]
    assert len({len(p) for p in parts}) == 1, "every rank must yield the same number of batches"
    return [list(itertools.chain(*batch_parts)) for batch_parts in zip(*parts)]


@pytest.mark.parametrize(
    ("plan", "b"),
    [
        (Plan(counts=[5, 3]), 8),
        (Plan(counts=[5, 3]), 11),
        (Plan(counts=[1, 1, 6]), 13),
        (Plan.even(4, 4), 9),
        (Plan(sizes=[[3, 3], [2]]), 8),
    ],
)
def test_workers_together_yield_the_global_batch_in_order(plan, b):
    n = 5 * b + 3
    single = list(VNBatchSampler(n, b, Plan(counts=[1]), 0, seed=7))
    assert global_batches(n, b, plan, seed=7) == single
    assert len(single) == 5 and all(len(batch) == b for batch in single)
    # Each worker gets exactly its VNs' slices, with no overlap between workers.
    for rank, s in enumerate(samplers(n, b, plan, seed=7)):
        lo, hi = plan.worker_range(rank, b)
        assert [batch[lo:hi] for batch in single] == list(s)


def test_sizes_plan_follows_its_vn_sizes():
    plan = Plan(sizes=[[3, 3], [2]])
    s0, s1 = (list(s) for s in samplers(16, 8, plan, shuffle=False))
    assert s0 == [[0, 1, 2, 3, 4, 5], [8, 9, 10, 11, 12, 13]]
    assert s1 == [[6, 7], [14, 15]]


def test_vn_contents_do_not_depend_on_the_plan():
    n, b = 100, 12
    plans = [Plan(counts=[8]), Plan(counts=[5, 3]), Plan(counts=[1, 1, 6]), Plan.even(8, 4)]
    per_plan = []
    for plan in plans:
        vn_samples = []
        for batch in global_batches(n, b, plan, seed=3):
            sizes = plan.vn_sizes(len(batch))
            starts = [sum(sizes[:i]) for i in range(len(sizes))]
            vn_samples.append([batch[s : s + k] for s, k in zip(starts, sizes)])
        per_plan.append(vn_samples)
    assert all(p == per_plan[0] for p in per_plan)


def test_epochs_reshuffle_deterministically():
    def epoch_order(epoch, seed=0):
        s = VNBatchSampler(50, 5, Plan.even(5, 2), 1, seed=seed)
        s.set_epoch(epoch)
        assert s.epoch == epoch
        return list(s)

    assert epoch_order(0) == epoch_order(0)
    assert epoch_order(1) == epoch_order(1)
    assert epoch_order(0) != epoch_order(1)
    assert epoch_order(0, seed=1) != epoch_order(0)
    # Independent of the process-wide generator.
    first = epoch_order(2)
    torch.manual_seed(99)
    torch.rand(10)
    assert epoch_order(2) == first
    # Each epoch is a permutation of the whole dataset.
    full = VNBatchSampler(50, 50, Plan(counts=[1]), 0)
    full.set_epoch(4)
    (order,) = list(full)
    assert sorted(order) == list(range(50)) and order != list(range(50))


def test_iterating_twice_gives_the_same_epoch():
    s = VNBatchSampler(40, 8, Plan(counts=[2, 2]), 0, seed=5)
    assert list(s) == list(s)


def test_no_shuffle_is_index_order():
    plan = Plan(counts=[2, 1])
    assert global_batches(10, 3, plan, shuffle=False) == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    assert list(VNBatchSampler(10, 3, plan, 1, shuffle=False)) == [[2], [5], [8]]


@pytest.mark.parametrize(
    ("n", "b", "plan", "drop_last", "expected_sizes"),
    [
        (97, 7, Plan(counts=[2, 1]), True, [7] * 13),
        (97, 7, Plan(counts=[2, 1]), False, [7] * 13 + [6]),
        (97, 9, Plan(counts=[4, 3]), False, [9] * 10 + [7]),  # 7 >= V=7: kept
        (97, 9, Plan(counts=[5, 3]), False, [9] * 10),  # 7 < V=8: dropped
        (99, 9, Plan(counts=[5, 4]), False, [9] * 11),  # no remainder
        (1, 1, Plan(counts=[1]), True, [1]),
        (1, 7, Plan(counts=[1]), False, [1]),
        (3, 7, Plan(counts=[2, 1]), False, [3]),
        (97, 8, Plan(sizes=[[3, 3], [2]]), False, [8] * 12),  # sizes plan: always dropped
    ],
)
def test_drop_last_and_len(n, b, plan, drop_last, expected_sizes):
    sampler = VNBatchSampler(n, b, plan, 0, drop_last=drop_last)
    assert len(sampler) == len(expected_sizes)
    batches = global_batches(n, b, plan, drop_last=drop_last)
    assert [len(batch) for batch in batches] == expected_sizes
    assert [sampler.global_batch_size(i) for i in range(len(sampler))] == expected_sizes
    flat = list(itertools.chain(*batches))
    assert len(set(flat)) == len(flat) and set(flat) <= set(range(n))


def test_short_last_batch_is_split_by_its_own_size():
    plan = Plan(counts=[2, 1])
    # 10 samples, B=7: the last global batch has 3 samples, one per VN.
    parts = [list(s) for s in samplers(10, 7, plan, shuffle=False, drop_last=False)]
    assert parts == [[[0, 1, 2, 3, 4], [7, 8]], [[5, 6], [9]]]


def test_set_plan_mid_iteration_applies_to_the_next_batch():
    s = VNBatchSampler(48, 8, Plan.even(4, 2), 0, shuffle=False)
    it = iter(s)
    assert next(it) == [0, 1, 2, 3]
    s.set_plan(Plan.even(4, 4), rank=2)
    assert (s.plan, s.rank) == (Plan.even(4, 4), 2)
    assert next(it) == [12, 13]
    s.set_plan(Plan(counts=[1, 3]), rank=1)
    assert next(it) == [18, 19, 20, 21, 22, 23]
    s.set_plan(Plan(counts=[4]), rank=0)
    assert next(it) == [24, 25, 26, 27, 28, 29, 30, 31]
    assert [len(batch) for batch in it] == [8, 8]


def test_set_plan_keeps_rank_and_switches_at_batch_boundaries():
    s = VNBatchSampler(24, 8, Plan(counts=[2, 2]), 1, shuffle=False)
    it = iter(s)
    assert next(it) == [4, 5, 6, 7]
    s.set_plan(Plan(counts=[1, 3]))
    assert s.rank == 1
    assert next(it) == [10, 11, 12, 13, 14, 15]
    s.set_plan(Plan(sizes=[[2, 2], [2, 2]]), rank=0)
    assert next(it) == [16, 17, 18, 19]
    assert next(it, None) is None


def test_set_plan_changes_len_with_virtual_nodes():
    s = VNBatchSampler(20, 8, Plan(counts=[2]), 0, drop_last=False)
    assert len(s) == 3  # remainder 4 >= V=2
    s.set_plan(Plan(counts=[3, 3]))
    assert len(s) == 2  # remainder 4 < V=6


def test_data_loader_yields_the_workers_rows():
    n, b = 30, 8
    data = torch.arange(n * 2).reshape(n, 2)
    labels = torch.arange(n) * 10
    dataset = TensorDataset(data, labels)
    plan = Plan(counts=[3, 1])
    rows = []
    for rank in range(plan.num_workers):
        sampler = VNBatchSampler(n, b, plan, rank, seed=11)
        sampler.set_epoch(3)
        loader = DataLoader(dataset, batch_sampler=sampler)
        assert len(loader) == 3
        got = list(loader)
        for (x, y), idx in zip(got, sampler):
            assert torch.equal(x, data[idx]) and torch.equal(y, labels[idx])
        rows.append(got)
    # Stacking both workers' parts gives each global batch, rows in the global order.
    full = VNBatchSampler(n, b, Plan(counts=[4]), 0, seed=11)
    full.set_epoch(3)
    for (x0, _), (x1, _), idx in zip(*rows, full):
        assert torch.equal(torch.cat([x0, x1]), data[idx])
        assert len(idx) == b and x0.shape[0] == 6 and x1.shape[0] == 2


def test_data_loader_sees_set_plan_between_batches():
    data = torch.arange(24)
    s = VNBatchSampler(24, 8, Plan(counts=[2, 2]), 0, shuffle=False)
    got = []
    for (x,) in DataLoader(TensorDataset(data), batch_sampler=s):
        got.append(x.tolist())
        s.set_plan(Plan(counts=[1, 3]))
    assert got == [[0, 1, 2, 3], [8, 9], [16, 17]]


def test_properties():
    plan = Plan.even(4, 2)
    s = VNBatchSampler(100, 10, plan, 1, seed=2)
    assert (s.plan, s.rank, s.epoch, s.batch_size) == (plan, 1, 0, 10)


@pytest.mark.parametrize(
    ("args", "kwargs", "error", "match"),
    [
        (("10", 4, Plan(counts=[2]), 0), {}, TypeError, "dataset_size must be an int, got str"),
        ((True, 4, Plan(counts=[2]), 0), {}, TypeError, "dataset_size must be an int, got bool"),
        ((-1, 4, Plan(counts=[2]), 0), {}, ValueError, "dataset_size must be >= 0, got -1"),
        ((10, 4.0, Plan(counts=[2]), 0), {}, TypeError, "batch_size must be an int, got float"),
        ((10, 0, Plan(counts=[2]), 0), {}, ValueError, "batch_size must be >= 1, got 0"),
        (
            (10, 3, Plan(counts=[2, 2]), 0),
            {},
            ValueError,
            "batch_size=3 is smaller than the plan's virtual_nodes=4",
        ),
        ((10, 4, [2, 2], 0), {}, TypeError, "plan must be a vflow.Plan, got list"),
        ((10, 4, Plan(counts=[2]), 0.0), {}, TypeError, "rank must be an int, got float"),
        (
            (10, 4, Plan(counts=[1, 1]), 2),
            {},
            ValueError,
            r"rank must be in \[0, 2\) for Plan\(counts=\[1, 1\]\) \(2 workers\), got 2",
        ),
        ((10, 4, Plan(counts=[1, 1]), -1), {}, ValueError, r"rank must be in \[0, 2\)"),
        (
            (20, 9, Plan(sizes=[[3, 3], [2]]), 0),
            {},
            ValueError,
            r"batch_size=9 but Plan\(sizes=\[\[3, 3\], \[2\]\]\) has VN sizes summing to 8",
        ),
        ((10, 4, Plan(counts=[2]), 0), {"seed": 1.5}, TypeError, "seed must be an int"),
        ((10, 4, Plan(counts=[2]), 0), {"shuffle": 1}, TypeError, "shuffle must be a bool"),
        ((10, 4, Plan(counts=[2]), 0), {"drop_last": None}, TypeError, "drop_last must be a bool"),
        (
            (3, 4, Plan(counts=[2]), 0),
            {},
            ValueError,
            "dataset_size=3 is smaller than batch_size=4 and with drop_last=True an "
            "incomplete global batch is dropped, so an epoch would yield no batch",
        ),
        (
            (0, 4, Plan(counts=[2]), 0),
            {"drop_last": False},
            ValueError,
            "dataset_size=0 is smaller than batch_size=4 and with drop_last=False",
        ),
        (
            (1, 4, Plan(counts=[1, 1]), 0),
            {"drop_last": False},
            ValueError,
            r"kept only if it has at least virtual_nodes=2 samples \(one per virtual node\)",
        ),
        (
            (7, 8, Plan(sizes=[[3, 3], [2]]), 0),
            {"drop_last": False},
            ValueError,
            "a sizes plan fixes the global batch size, so an incomplete global batch is "
            "dropped even with drop_last=False",
        ),
    ],
)
def test_constructor_errors(args, kwargs, error, match):
    with pytest.raises(error, match=match):
        VNBatchSampler(*args, **kwargs)


def test_set_plan_errors_leave_the_sampler_unchanged():
    plan = Plan(counts=[2, 2])
    s = VNBatchSampler(20, 8, plan, 1, drop_last=False)
    before = list(s)
    bad = [
        ((Plan(counts=[1]),), ValueError, r"rank must be in \[0, 1\) .* got 1"),
        ((Plan(counts=[1, 1]), 2), ValueError, r"rank must be in \[0, 2\)"),
        ((Plan(counts=[1, 1]), "0"), TypeError, "rank must be an int, got str"),
        ((Plan(counts=[5, 4]),), ValueError, "batch_size=8 is smaller than the plan's"),
        ((Plan(sizes=[[4], [3]]),), ValueError, "a sizes plan fixes the global batch size"),
        (("counts=[2, 2]",), TypeError, "plan must be a vflow.Plan, got str"),
    ]
    for args, error, match in bad:
        with pytest.raises(error, match=match):
            s.set_plan(*args)
        assert (s.plan, s.rank) == (plan, 1)
    assert list(s) == before
    small = VNBatchSampler(5, 8, Plan(counts=[2]), 0, drop_last=False)
    with pytest.raises(ValueError, match="virtual_nodes=6 samples"):
        small.set_plan(Plan(counts=[3, 3]))
    assert small.plan == Plan(counts=[2]) and len(small) == 1


def test_set_epoch_and_global_batch_size_errors():
    s = VNBatchSampler(20, 8, Plan(counts=[2]), 0)
    with pytest.raises(TypeError, match="epoch must be an int, got float"):
        s.set_epoch(1.0)
    with pytest.raises(ValueError, match="epoch must be >= 0, got -1"):
        s.set_epoch(-1)
    assert s.epoch == 0
    with pytest.raises(ValueError, match=r"index must be < 2 \(batches per epoch\), got 2"):
        s.global_batch_size(2)
    with pytest.raises(TypeError, match="index must be an int"):
        s.global_batch_size("0")


@pytest.mark.parametrize("drop_last", [True, False])
def test_step_indices_follow_the_step_count_across_epochs_and_plans(drop_last):
    n, b, v = 54, 12, 4  # 4 full batches and a short one of 6, kept without drop_last
    one = VNBatchSampler(n, b, Plan.even(v, 1), 0, seed=3, drop_last=drop_last)
    expected = []
    for epoch in range(3):
        one.set_epoch(epoch)
        expected += list(one)
    for step, batch in enumerate(expected):
        assert one.step_indices(step) == (batch, len(batch))
    assert one.epoch == 2  # step_indices reads the epoch from the step; set_epoch is untouched
    for plan in (Plan.even(v, 2), Plan(counts=[3, 1])):
        workers = [VNBatchSampler(n, b, plan, r, seed=3, drop_last=drop_last) for r in range(2)]
        for step, batch in enumerate(expected):
            parts = [w.step_indices(step) for w in workers]
            assert parts[0][0] + parts[1][0] == batch
            assert parts[0][1] == parts[1][1] == len(batch)
    with pytest.raises(ValueError, match="step must be"):
        one.step_indices(-1)


# ---- bound to an executor (Note [Data follows the plan]) -------------------------------


class FakeExecutor:
    """The PlanFollower protocol: a step count, a rank and plan changes by first step;
    records what the sampler reports."""

    def __init__(self, plan, rank=0, changes=()):
        self.step_count = 0
        self.rank = rank
        self.plans = [(0, plan), *changes]  # (first step, plan), by first step
        self.draws = {}
        self.forgotten = 0

    def plan_for_step(self, step):
        if step < self.step_count:
            raise ValueError(f"step must be >= step_count={self.step_count}, got {step}")
        return [plan for first, plan in self.plans if first <= step][-1]

    def record_draw(self, step, plan, rank):
        self.draws[step] = (plan, rank)

    def forget_draws(self):
        self.forgotten += 1
        self.draws.clear()

    def lead(self):
        return max(self.draws, default=self.step_count) - self.step_count


def test_a_bound_sampler_switches_plan_at_the_executors_step():
    even, uneven = Plan(counts=[2, 2]), Plan(counts=[3, 1])
    single = list(VNBatchSampler(40, 8, Plan(counts=[4]), 0, seed=3))
    for rank in (0, 1):
        ex = FakeExecutor(even, rank, changes=[(2, uneven)])
        got = list(VNBatchSampler(40, 8, executor=ex, seed=3))
        want = [
            batch[slice(*(even if step < 2 else uneven).worker_range(rank, 8))]
            for step, batch in enumerate(single)
        ]
        assert got == want  # the same global batches, split under each step's plan
        assert ex.draws == {step: (even if step < 2 else uneven, rank) for step in range(5)}


def test_a_bound_sampler_reports_its_lead_and_resynchronises_on_a_new_iteration():
    ex = FakeExecutor(Plan(counts=[2, 2]))
    s = VNBatchSampler(40, 8, executor=ex, seed=3)
    single = list(VNBatchSampler(40, 8, Plan(counts=[4]), 0, seed=3))
    it = iter(s)
    assert ex.forgotten == 1 and ex.draws == {}
    drawn = [next(it) for _ in range(3)]  # a DataLoader drawing ahead
    assert ex.lead() == 2
    ex.step_count = 1  # step 0 ran; the rest of this iteration is abandoned
    again = list(s)  # starts at step 1: the epoch's batches 0.. for steps 1..
    assert ex.forgotten == 2 and sorted(ex.draws) == [1, 2, 3, 4, 5]
    assert again[0] == drawn[0] == single[0][:4]
    s.set_epoch(1)
    ex.step_count = 6
    whole = VNBatchSampler(40, 8, Plan(counts=[4]), 0, seed=3)
    whole.set_epoch(1)
    assert list(s) == [batch[:4] for batch in whole]  # epoch 1's order, from step 6 on
    assert sorted(ex.draws) == [6, 7, 8, 9, 10]


def test_bound_step_indices_use_the_plan_of_that_step():
    even, uneven = Plan(counts=[2, 2]), Plan(counts=[3, 1])
    ex = FakeExecutor(even, 1, changes=[(7, uneven)])
    s = VNBatchSampler(40, 8, executor=ex, seed=3)
    unbound = VNBatchSampler(40, 8, Plan(counts=[4]), 0, seed=3)
    for step in (0, 6, 7, 12):
        batch = unbound.step_indices(step)[0]
        plan = even if step < 7 else uneven
        assert s.step_indices(step) == (batch[slice(*plan.worker_range(1, 8))], 8)
        assert ex.draws[step] == (plan, 1)
    ex.step_count = 8
    with pytest.raises(ValueError, match="step must be >= step_count=8"):
        s.step_indices(7)


def test_bind_follows_another_executor_and_an_unbound_sampler_says_what_is_missing():
    s = VNBatchSampler(40, 8, seed=3)
    for call in (lambda: iter(s), lambda: s.step_indices(0), lambda: len(s), lambda: s.plan):
        with pytest.raises(RuntimeError, match=r"neither a plan nor an executor.*bind\(ex\)"):
            call()
    first, second = FakeExecutor(Plan(counts=[2, 2]), 0), FakeExecutor(Plan(counts=[1, 3]), 1)
    s.bind(first)
    assert (s.plan, s.rank, s.executor, len(s)) == (Plan(counts=[2, 2]), 0, first, 5)
    s.bind(second)
    assert (s.plan, s.rank, s.executor) == (Plan(counts=[1, 3]), 1, second)
    assert (
        s.step_indices(0)[0]
        == VNBatchSampler(40, 8, Plan(counts=[1, 3]), 1, seed=3).step_indices(0)[0]
    )
    assert second.draws and not first.draws
    # An unbound sampler bound later follows the executor, not its own plan.
    unbound = VNBatchSampler(40, 8, Plan(counts=[4]), 0, seed=3)
    unbound.bind(first)
    assert unbound.plan == Plan(counts=[2, 2]) and len(next(iter(unbound))) == 4


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (
            {"plan": Plan(counts=[2, 2]), "rank": 0, "executor": "ex"},
            ValueError,
            "either plan .with rank. or executor, not both",
        ),
        ({"rank": 0, "executor": "ex"}, ValueError, "rank=0 was given with executor"),
        ({"rank": 1}, ValueError, "rank=1 was given without a plan"),
        (
            {"executor": object()},
            TypeError,
            "executor must be a vflow.Executor .* without step_count",
        ),
        ({"plan": Plan(counts=[2, 2])}, TypeError, "rank must be an int, got NoneType"),
    ],
)
def test_bound_constructor_errors(kwargs, error, match):
    with pytest.raises(error, match=match):
        VNBatchSampler(40, 8, **kwargs)


def test_bind_errors_leave_the_sampler_unchanged():
    s = VNBatchSampler(40, 8, Plan(counts=[2, 2]), 1, seed=3)
    before = list(s)
    with pytest.raises(TypeError, match="executor must be a vflow.Executor"):
        s.bind(object())
    with pytest.raises(ValueError, match="batch_size=8 is smaller than the plan's"):
        s.bind(FakeExecutor(Plan(counts=[5, 4])))
    with pytest.raises(ValueError, match=r"rank must be in \[0, 2\)"):
        s.bind(FakeExecutor(Plan(counts=[2, 2]), rank=2))
    assert s.executor is None and (s.plan, s.rank) == (Plan(counts=[2, 2]), 1)
    assert list(s) == before
    bound = VNBatchSampler(40, 8, executor=FakeExecutor(Plan(counts=[2, 2])))
    with pytest.raises(RuntimeError, match="bound to an executor: it follows the executor's plan"):
        bound.set_plan(Plan(counts=[3, 1]), 0)


def test_a_bound_sampler_in_a_dataloader_follows_plan_changes():
    even, uneven = Plan(counts=[2, 2]), Plan(counts=[3, 1])
    ex = FakeExecutor(even, 0)
    data = TensorDataset(torch.arange(40))
    seen = []
    for (batch,) in DataLoader(data, batch_sampler=VNBatchSampler(40, 8, executor=ex, seed=3)):
        seen.append(len(batch))
        assert ex.lead() == 0  # lazy: each batch drawn just before its step
        ex.step_count += 1
        if ex.step_count == 2:
            ex.plans.append((2, uneven))  # the executor re-planned after step 1
    assert seen == [4, 4, 6, 6, 6]
