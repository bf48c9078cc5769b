"""vflow.elastic.groups: the bounds on creating a worker set's group (Note [Bounds that
grow with the set]). Making and moving onto groups needs process groups and executors:
tests/elastic/test_job.py runs them."""

from __future__ import annotations

from vflow.elastic.groups import GROUP_REQUESTS_PER_S, Groups, group_bound_s


def test_the_group_bound_is_the_collective_timeout_until_the_mesh_outgrows_it() -> None:
    assert group_bound_s(32, 10.0) == 10.0
    assert group_bound_s(316, 10.0) == 10.0
    assert group_bound_s(1024, 10.0) == 1024 * 1024 / GROUP_REQUESTS_PER_S  # 104.9 s
    assert group_bound_s(1024, 300.0) == 300.0


def test_set_bounds_take_precedence_and_the_join_deadline_bounds_only_joins() -> None:
    default = Groups("gloo", 10.0, None)
    assert default.bound_s(1024) == default.bound_s(1024, joining=True) == group_bound_s(1024, 10)
    assert "the group bound of 1024 workers" in default.deadline_words(1024)
    fixed = Groups("gloo", 10.0, None, group_timeout_s=30.0, join_deadline_s=5.0)
    assert fixed.bound_s(1024) == 30.0 and fixed.bound_s(1024, joining=True) == 5.0
    assert fixed.deadline_words(8) == "join_deadline_s=5 s"
    only_groups = Groups("gloo", 10.0, None, group_timeout_s=30.0)
    assert only_groups.bound_s(8, joining=True) == 30.0
