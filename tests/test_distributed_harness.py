"""tests.distributed.run_ranks: results, errors, dead ranks and hung ranks are all reported."""

import os
import time

import pytest
import torch
import torch.distributed as dist

from tests.distributed import run_ranks


def _all_reduce_rank(rank: int, world_size: int, scale: float) -> torch.Tensor:
    t = torch.full((3,), float(rank + 1) * scale)
    dist.all_reduce(t)
    return t


def _raise_on_rank_1(rank: int, world_size: int) -> int:
    if rank == 1:
        raise ValueError("boom from rank 1")
    return rank


def _exit_on_rank_1(rank: int, world_size: int) -> None:
    if rank == 1:
        os._exit(3)
    dist.all_reduce(torch.ones(1))


def _sleep_on_rank_1(rank: int, world_size: int) -> int:
    if rank == 1:
        while True:
            time.sleep(1)
    return rank


def test_all_reduce_sums_on_every_rank():
    results = run_ranks(3, _all_reduce_rank, 2.0)
    assert [r.rank for r in results] == [0, 1, 2]
    for r in results:
        assert r.error is None
        torch.testing.assert_close(r.value, torch.full((3,), 12.0))


def test_exception_in_one_rank_is_raised_with_its_message():
    with pytest.raises(AssertionError, match="boom from rank 1") as info:
        run_ranks(2, _raise_on_rank_1)
    assert "ValueError" in str(info.value)


def test_exception_in_one_rank_is_returned_when_expected():
    results = run_ranks(2, _raise_on_rank_1, expect_failure=True)
    assert results[0].error is None and results[0].value == 0
    assert results[1].error is not None
    assert "ValueError: boom from rank 1" in results[1].error


def test_dead_rank_reports_exit_code_and_survivor_fails_fast():
    start = time.monotonic()
    results = run_ranks(2, _exit_on_rank_1, timeout=30, collective_timeout=10, expect_failure=True)
    assert time.monotonic() - start < 30
    assert results[1].error is not None and "exit code 3" in results[1].error
    # The survivor's collective must fail, not hang until the harness kills it.
    assert results[0].error is not None
    assert "killed" not in results[0].error


def test_hung_rank_raises_timeout_error_naming_it():
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"ranks \[1\] of 2"):
        run_ranks(2, _sleep_on_rank_1, timeout=15, collective_timeout=10)
    assert time.monotonic() - start < 15 + 10
