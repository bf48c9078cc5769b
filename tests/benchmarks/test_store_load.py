"""benchmarks/store_load.py: how many processes its light members live in, and its
arguments; CI's benchmark smoke run (``make bench``) runs it end to end at N = 8 and 64."""

from __future__ import annotations

import pytest

from tests.support.benchmark_scripts import load_script

store_load = load_script("store_load")


def test_members_are_spread_at_most_16_to_a_process_over_at_least_4() -> None:
    sizes = (8, 64, 65, 128, 512, 1024)
    assert [store_load.hosts_for(n, None) for n in sizes] == [4, 4, 5, 8, 32, 64]
    assert store_load.hosts_for(1024, 4) == 4  # --hosts, as given


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["--hosts", "0"], "--hosts must be >= 1, got 0"),
        (["--workers", "8,x"], "--workers must be comma-separated ints"),
        (["--workers", "1"], "--workers: every N must be >= 2"),
        (["--workers", "8", "--kill", "8"], "--kill must be in 1..7"),
        (["--last-call", "-1"], "--last-call must be >= 0, got -1.0"),
        (["--arrival", "-1"], "--arrival must be >= 0, got -1.0"),
    ],
)
def test_bad_arguments_are_named(
    argv: list[str], said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        store_load.main(argv)
    assert exit_.value.code == 2 and said in capsys.readouterr().err


def test_the_members_that_fail_at_once_are_the_victims_neighbours_on_the_ring() -> None:
    order = list(range(8))
    victims = {5, 6, 7}
    assert [r for r in range(5) if store_load._next_to(order, r, victims)] == [0, 4]
    assert [r for r in range(5) if store_load._next_to(order, r, {2})] == [1, 3]
    assert store_load._next_to([3, 1, 2], 3, {2})  # the set's order, around the ring


def test_a_rank_reaches_the_collective_within_the_spread_and_at_the_same_time_each_run() -> None:
    times = [store_load._arrival(r, 0.5) for r in range(64)]
    assert all(0.0 <= t <= 0.5 for t in times) and len(set(times)) == 64
    assert times == [store_load._arrival(r, 0.5) for r in range(64)]
    assert store_load._arrival(3, 0.0) == 0.0
