"""benchmarks/store_load.py: how many processes its light members live in, and its
arguments; CI's benchmark smoke run (``make bench``) runs it end to end at N = 8 and 64."""

from __future__ import annotations

import pytest

from tests.support.benchmark_scripts import load_script

store_load = load_script("store_load")


def test_members_are_spread_at_most_32_to_a_process_over_at_least_4() -> None:
    assert [store_load.hosts_for(n, None) for n in (8, 64, 128, 129, 512, 1024)] == [
        4,
        4,
        4,
        5,
        16,
        32,
    ]
    assert store_load.hosts_for(1024, 4) == 4  # --hosts, as given


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["--hosts", "0"], "--hosts must be >= 1, got 0"),
        (["--workers", "8,x"], "--workers must be comma-separated ints"),
        (["--workers", "1"], "--workers: every N must be >= 2"),
        (["--workers", "8", "--kill", "8"], "--kill must be in 1..7"),
        (["--last-call", "-1"], "--last-call must be >= 0, got -1.0"),
    ],
)
def test_bad_arguments_are_named(
    argv: list[str], said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        store_load.main(argv)
    assert exit_.value.code == 2 and said in capsys.readouterr().err
