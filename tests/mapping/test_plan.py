"""vflow.Plan: which VNs each worker runs, and how a batch's samples map to them."""

import pytest

from vflow.mapping.plan import Plan, VNSlice


def test_even_spreads_vns_as_evenly_as_possible():
    assert Plan.even(8, 2).counts == (4, 4)
    assert Plan.even(8, 3).counts == (3, 3, 2)
    assert Plan.even(5, 5).counts == (1, 1, 1, 1, 1)
    assert Plan.even(3, 1).counts == (3,)


def test_counts_plan_uses_the_global_split_whatever_the_mapping():
    b = 37
    whole = Plan(counts=[8]).slices(b)
    for plan in (Plan(counts=[5, 3]), Plan(counts=[1, 1, 6]), Plan.even(8, 4)):
        assert plan.virtual_nodes == 8 and plan.batch_size is None
        assert plan.slices(b) == whole
        joined = [s for w in range(plan.num_workers) for s in plan.worker_slices(w, b)]
        assert joined == whole
    plan = Plan(counts=[5, 3])
    assert list(plan.vns(1)) == [5, 6, 7]
    assert plan.first_vn(1) == 5
    assert plan.worker_range(0, b) == (0, whole[5].start)
    assert plan.worker_range(1, b) == (whole[5].start, b)


def test_sizes_plan_fixes_b_and_vn_sizes():
    plan = Plan(sizes=[[12, 12], [4, 4, 4]])
    assert plan.counts == (2, 3)
    assert plan.virtual_nodes == 5
    assert plan.batch_size == 36
    assert plan.vn_sizes(36) == [12, 12, 4, 4, 4]
    assert plan.worker_slices(1, 36) == [VNSlice(2, 24, 4), VNSlice(3, 28, 4), VNSlice(4, 32, 4)]
    assert plan.worker_range(0, 36) == (0, 24)
    with pytest.raises(ValueError, match="VN sizes sum to 36"):
        plan.slices(35)


def test_value_semantics():
    assert Plan(counts=[5, 3]) == Plan(counts=(5, 3))
    assert Plan(counts=[5, 3]) != Plan(counts=[3, 5])
    assert Plan(counts=[2, 1]) != Plan(sizes=[[4, 4], [4]])
    assert hash(Plan.even(8, 2)) == hash(Plan(counts=[4, 4]))
    assert repr(Plan(counts=[5, 3])) == "Plan(counts=[5, 3])"
    assert repr(Plan(sizes=[[2], [1, 1]])) == "Plan(sizes=[[2], [1, 1]])"


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({}, ValueError, "exactly one of counts"),
        ({"counts": [1], "sizes": [[1]]}, ValueError, "exactly one of counts"),
        ({"counts": []}, ValueError, "at least one worker"),
        ({"counts": [2, 0]}, ValueError, r"counts\[1\] must be >= 1, got 0"),
        ({"counts": [2, 1.5]}, TypeError, r"counts\[1\] must be an int, got float"),
        ({"counts": [True]}, TypeError, r"counts\[0\] must be an int, got bool"),
        ({"counts": "53"}, TypeError, "counts must be a sequence of ints"),
        ({"sizes": []}, ValueError, "sizes must be a non-empty sequence"),
        ({"sizes": [[3], []]}, ValueError, r"sizes\[1\] must name at least one worker"),
        ({"sizes": [[3], [-1]]}, ValueError, r"sizes\[1\]\[0\] must be >= 1, got -1"),
    ],
)
def test_bad_plans_are_rejected(kwargs, error, match):
    with pytest.raises(error, match=match):
        Plan(**kwargs)


def test_bad_even_and_worker_arguments():
    with pytest.raises(ValueError, match="workers=3 exceeds virtual_nodes=2"):
        Plan.even(2, 3)
    with pytest.raises(ValueError, match="virtual_nodes must be an int >= 1"):
        Plan.even(0, 1)
    plan = Plan(counts=[1, 1])
    with pytest.raises(ValueError, match=r"worker must be in \[0, 2\), got 2"):
        plan.vns(2)
    with pytest.raises(TypeError, match="worker must be an int"):
        plan.worker_range("0", 4)
    with pytest.raises(ValueError, match="B >= V"):
        plan.slices(1)
