"""Run a function on N ranks of a Gloo process group on localhost, for tests.

Multi-rank behaviour (collectives, a rank failing mid-step) can only be tested
with real processes, so `run_ranks` starts `world_size` child processes that
join one ``torch.distributed`` Gloo group on 127.0.0.1 and returns what each
rank's function returned or raised.

Design choices:

* The parent hosts the rendezvous ``TCPStore`` on port 0, so the OS picks a
  free port: parallel test runs never collide, and no rank's early exit takes
  the store down with it.
* Every wait is bounded. ``collective_timeout`` bounds each collective and the
  rendezvous inside a rank; ``timeout`` bounds the whole run in the parent,
  which then kills the ranks still alive and raises ``TimeoutError``. A broken
  rank therefore fails a test instead of hanging the suite.
* Children are started with "spawn", not "fork": forking a process that has
  already started torch's thread pools can deadlock the child.
"""

from __future__ import annotations

import faulthandler
import multiprocessing as mp
import pickle
import signal
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from vflow.distributed import use_loopback_for_gloo

_HOST = "127.0.0.1"
# How long a terminated rank gets to exit before it is killed outright.
_GRACE_S = 5.0


@dataclass(frozen=True)
class RankResult:
    """What one rank produced: ``fn``'s return value, or the error that ended it."""

    rank: int
    value: Any
    error: str | None


def run_ranks(
    world_size: int,
    fn: Callable[..., Any],
    *args: Any,
    timeout: float = 120.0,
    collective_timeout: float = 60.0,
    expect_failure: bool = False,
) -> list[RankResult]:
    """Call ``fn(rank, world_size, *args)`` on every rank and return results by rank.

    ``fn`` must be a module-level function and ``args`` and its return value must
    pickle (return CPU tensors or plain values). Raises ``TimeoutError`` naming the
    ranks still running after ``timeout`` seconds. Unless ``expect_failure``,
    raises ``AssertionError`` carrying every rank's error if any rank failed.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    # Fail here with a clear message instead of inside spawn's pickling.
    try:
        pickle.dumps((fn, args))
    except Exception as exc:
        raise TypeError(f"run_ranks needs a module-level fn and picklable args: {exc!r}") from exc

    ctx = mp.get_context("spawn")
    # world_size=None with wait_for_workers=False: the parent is not a rank and
    # must not block; the ranks' own rendezvous in init_process_group does the waiting.
    store = dist.TCPStore(
        _HOST,
        0,
        None,
        is_master=True,
        wait_for_workers=False,
        timeout=timedelta(seconds=timeout),
    )
    # Results go through per-rank files rather than an mp.Queue: a file is either
    # there or not, even when a rank is killed or calls os._exit, whereas a Queue's
    # feeder thread can lose or half-write the message, and joining a child whose
    # large result sits unread in a Queue pipe deadlocks.
    with tempfile.TemporaryDirectory(prefix="vflow-ranks-") as tmp:
        out_dir = Path(tmp)
        procs = [
            ctx.Process(
                target=_rank_main,
                args=(
                    rank,
                    world_size,
                    store.port,
                    collective_timeout,
                    max(1.0, timeout - _GRACE_S),
                    str(out_dir),
                    fn,
                    args,
                ),
                name=f"vflow-rank-{rank}",
                # Daemonic, so ranks die with the parent if it is interrupted.
                daemon=True,
            )
            for rank in range(world_size)
        ]
        try:
            for p in procs:
                p.start()
            deadline = time.monotonic() + timeout
            for p in procs:
                p.join(max(0.0, deadline - time.monotonic()))
            hung = [rank for rank, p in enumerate(procs) if p.is_alive()]
        finally:
            _stop(procs)
        results = [_collect(rank, p, out_dir) for rank, p in enumerate(procs)]
        stacks = {rank: _stacks(out_dir, rank) for rank in hung}
    del store  # Only now: ranks may still use the store until they end.

    if hung:
        raise TimeoutError(
            f"ranks {hung} of {world_size} still running after {timeout:g} s and were killed"
            + _describe_errors(results, skip=hung)
            + "".join(
                f"\n--- rank {rank}, where it hung ---\n{text}" for rank, text in stacks.items()
            )
        )
    if not expect_failure and any(r.error is not None for r in results):
        raise AssertionError(
            f"{sum(r.error is not None for r in results)} of {world_size} ranks failed"
            + _describe_errors(results)
        )
    return results


def _rank_main(
    rank: int,
    world_size: int,
    port: int,
    collective_timeout: float,
    dump_stacks_after: float,
    out_dir: str,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
) -> None:
    # Up to four ranks share two cores in CI; more threads only oversubscribe them.
    torch.set_num_threads(1)
    # A rank that hangs past the parent's deadline leaves its Python stacks behind, so
    # the TimeoutError shows where it was stuck.
    stacks = (Path(out_dir) / f"rank{rank}.stacks").open("w")
    faulthandler.dump_traceback_later(dump_stacks_after, file=stacks)
    use_loopback_for_gloo()
    value: Any = None
    error: str | None = None
    try:
        store = dist.TCPStore(
            _HOST, port, is_master=False, timeout=timedelta(seconds=collective_timeout)
        )
        dist.init_process_group(
            "gloo",
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=collective_timeout),
        )
        try:
            value = fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
    except BaseException:
        error = traceback.format_exc()
    try:
        payload = pickle.dumps(RankResult(rank, value, error))
    except Exception:
        payload = pickle.dumps(
            RankResult(rank, None, "result could not be pickled:\n" + traceback.format_exc())
        )
    # Write then rename, so the parent never reads a half-written result.
    part = Path(out_dir) / f"rank{rank}.part"
    part.write_bytes(payload)
    part.replace(_result_path(out_dir, rank))


def _stacks(out_dir: str | Path, rank: int) -> str:
    path = Path(out_dir) / f"rank{rank}.stacks"
    return path.read_text() if path.exists() else ""


def _result_path(out_dir: str | Path, rank: int) -> Path:
    return Path(out_dir) / f"rank{rank}.pkl"


def _stop(procs: list[Any]) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + _GRACE_S
    # pid is None for a process whose start() failed; it cannot be joined.
    started = [p for p in procs if p.pid is not None]
    for p in started:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in started:
        if p.is_alive():
            p.kill()
            p.join()


def _collect(rank: int, proc: Any, out_dir: Path) -> RankResult:
    path = _result_path(out_dir, rank)
    if path.exists():
        result = pickle.loads(path.read_bytes())
        assert isinstance(result, RankResult)
        return result
    return RankResult(
        rank,
        None,
        f"rank {rank} {_describe_exit(proc.exitcode)} without a result (its stderr may say why)",
    )


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "never exited"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by {name} (exit code {code})"
    return f"exited with exit code {code}"


def _describe_errors(results: list[RankResult], skip: list[int] | tuple[int, ...] = ()) -> str:
    parts = [
        f"\n--- rank {r.rank} ---\n{r.error.rstrip()}"
        for r in results
        if r.error is not None and r.rank not in skip
    ]
    return "".join(parts)
