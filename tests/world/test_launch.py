"""vflow.world.launch.run_ranks, which every multi-rank test uses: results, errors, dead
ranks and hung ranks are all reported; threads, fail_fast, poll and the store."""

import os
import time

import pytest
import torch
import torch.distributed as dist

from tests.support.sockets import listening, needs_proc_net
from vflow.world.launch import RankError, current_store, run_ranks


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


# Long enough for both ranks to start and form their group on a loaded 2-core machine
# (a CI run beside a build took over 8 s), so that only the hung rank is still running.
HUNG_TIMEOUT_S = 20


def test_hung_rank_raises_timeout_error_naming_it():
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"ranks \[1\] of 2") as info:
        run_ranks(2, _sleep_on_rank_1, timeout=HUNG_TIMEOUT_S, collective_timeout=5)
    assert time.monotonic() - start < HUNG_TIMEOUT_S + 10
    # With the Python stack faulthandler dumped from the hung rank before the deadline.
    assert "--- rank 1, where it hung ---" in str(info.value)
    assert "_sleep_on_rank_1" in str(info.value)


def _threads_and_store(rank: int, world_size: int) -> tuple[int, str, int]:
    store = current_store()
    # Every rank adds to one counter of the launcher's store, then reads the total.
    store.add("test/count", rank + 1)
    dist.barrier()
    return torch.get_num_threads(), os.environ["VFLOW_LAUNCH_STORE"], store.add("test/count", 0)


def _report_then_sleep(rank: int, world_size: int) -> None:
    current_store().set(f"test/rank{rank}", "started")
    dist.barrier()


def _fail_at_once_on_rank_1(rank: int, world_size: int) -> None:
    if rank == 1:
        raise RuntimeError("rank 1 gives up")
    # Blocks on something rank 1's end does not break, until the store's timeout.
    current_store().wait(["test/never-set"])


def test_threads_store_and_its_address_reach_the_ranks():
    results = run_ranks(2, _threads_and_store, threads=2)
    for r in results:
        threads, address, count = r.value
        assert threads == 2
        host, port = address.rsplit(":", 1)
        assert host == "127.0.0.1" and int(port) > 0
        assert count == 1 + 2
    assert results[0].value[1] == results[1].value[1]


def test_poll_reads_what_ranks_write_to_the_store():
    seen: set[str] = set()

    def poll(store: dist.TCPStore) -> None:
        for rank in range(2):
            if store.check([f"test/rank{rank}"]):
                seen.add(store.get(f"test/rank{rank}").decode())
                seen.add(f"rank{rank}")

    run_ranks(2, _report_then_sleep, poll=poll)
    # The last call comes after the ranks ended, so it sees everything they wrote.
    assert seen == {"started", "rank0", "rank1"}


def test_fail_fast_stops_the_others_at_once():
    start = time.monotonic()
    results = run_ranks(
        2, _fail_at_once_on_rank_1, collective_timeout=60, fail_fast=True, expect_failure=True
    )
    assert time.monotonic() - start < 30
    assert "RuntimeError: rank 1 gives up" in results[1].error
    assert results[0].error == "rank 0 was stopped after rank 1 failed (fail_fast)"


def test_failed_ranks_raise_rank_error():
    with pytest.raises(RankError, match="1 of 2 ranks failed"):
        run_ranks(2, _raise_on_rank_1)


def test_current_store_outside_a_rank_says_so():
    with pytest.raises(RuntimeError, match="only available inside a rank"):
        current_store()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"world_size": 0}, "world_size must be an int >= 1, got 0"),
        ({"timeout": 0}, "timeout must be > 0 seconds, got 0"),
        ({"collective_timeout": -1}, "collective_timeout must be > 0 seconds, got -1"),
        ({"threads": 0}, "threads must be None or an int >= 1, got 0"),
    ],
)
def test_bad_arguments_are_named(kwargs, message):
    world_size = kwargs.pop("world_size", 1)
    with pytest.raises(ValueError, match=message):
        run_ranks(world_size, _raise_on_rank_1, **kwargs)


def test_unpicklable_fn_is_a_type_error():
    with pytest.raises(TypeError, match="module-level fn and picklable args"):
        run_ranks(1, lambda rank, world_size: rank)


def _barrier(rank: int, world_size: int) -> None:
    dist.barrier()


@needs_proc_net
def test_the_store_listens_only_on_loopback():
    seen: list[tuple[int, set[tuple[str, int]]]] = []

    def poll(store: dist.TCPStore) -> None:
        # This process hosts the store: what the kernel says it listens on, on that port.
        seen.append((store.port, {s for s in listening(os.getpid()) if s[1] == store.port}))

    run_ranks(2, _barrier, timeout=60, collective_timeout=30, poll=poll)
    assert seen
    for port, sockets in seen:
        assert sockets == {("127.0.0.1", port)}
