"""Run a function on N local processes joined in one Gloo process group.

The demo, the test suite and the distributed benchmark all need the same thing: start
``world_size`` processes on this machine, put them in one ``torch.distributed`` group,
call a function in each and get back what every rank returned or raised, without ever
hanging. ``run_ranks`` does that; ``current_store`` gives a rank the rendezvous store,
e.g. to build further groups on it or to report progress to the parent (the parent
reads the same store through ``poll``).

Design choices:

* The parent hosts the rendezvous ``TCPStore`` on 127.0.0.1 with port 0, so the OS
  picks a free port: parallel runs never collide, and no rank's exit takes the store
  down with it. The store has no authentication: anything on this machine that can
  open a loopback connection can read and write it while the run lasts. It never
  listens on another interface (Note [Stores listen only where asked], store.py).
* Every wait is bounded. ``collective_timeout`` bounds the rendezvous and every
  collective inside a rank; ``timeout`` bounds the whole run in the parent, which then
  stops the ranks still alive and raises ``TimeoutError`` naming them, with the Python
  stacks faulthandler dumps from each when it is stopped.
* Children are started with "spawn", not "fork": forking a process that has already
  started torch's thread pools can deadlock the child.
* Results come back through one file per rank, written then renamed, rather than
  through a queue: a file is either there or not, even when a rank is killed or calls
  ``os._exit``, whereas a queue's feeder thread can lose or half-write a message, and
  joining a child whose large result sits unread in a queue's pipe deadlocks.
"""

from __future__ import annotations

import faulthandler
import multiprocessing as mp
import multiprocessing.connection
import os
import pickle
import signal
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from vflow.world.group import use_loopback_for_gloo
from vflow.world.store import host_store

__all__ = ["HOST", "STORE_ENV", "RankError", "RankResult", "current_store", "run_ranks"]

HOST = "127.0.0.1"
# Set in every rank to "host:port" of the launcher's store, for code that connects to it
# itself (a client of its own, another process it starts).
STORE_ENV = "VFLOW_LAUNCH_STORE"
# How long a terminated rank gets to exit before it is killed outright.
_GRACE_S = 5.0
# How often the parent looks at the ranks when it has a poll function or fails fast.
_POLL_S = 0.1

# The rank's client of the launcher's store (None outside a rank).
_store: dist.TCPStore | None = None


@dataclass(frozen=True)
class RankResult:
    """What one rank produced: ``fn``'s return value, or the error that ended it (a
    traceback, or why the rank gave no result)."""

    rank: int
    value: Any
    error: str | None


class RankError(AssertionError):
    """One or more ranks failed; the message holds every failed rank's error.

    An AssertionError, so that a test using ``run_ranks`` reports it as a failed check.
    """


def current_store() -> dist.TCPStore:
    """Inside a rank started by ``run_ranks``: a client of the launcher's store (the one
    the default group was built on). Keys under ``vflow/`` and ``default_pg/`` are
    taken. Its address is also in the environment variable ``VFLOW_LAUNCH_STORE``."""
    if _store is None:
        raise RuntimeError(
            "current_store() is only available inside a rank started by "
            "vflow.world.launch.run_ranks"
        )
    return _store


def run_ranks(
    world_size: int,
    fn: Callable[..., Any],
    *args: Any,
    timeout: float = 120.0,
    collective_timeout: float = 60.0,
    expect_failure: bool = False,
    threads: int | None = 1,
    fail_fast: bool = False,
    poll: Callable[[dist.TCPStore], None] | None = None,
) -> list[RankResult]:
    """Call ``fn(rank, world_size, *args)`` on every rank and return results by rank.

    Each rank runs in a fresh process, joined to a Gloo group of ``world_size`` (the
    default group, on the loopback interface) before ``fn`` is called and left after.
    ``fn`` must be a module-level function, and ``args`` and its return value must
    pickle (return CPU tensors or plain values).

    Args:
        timeout: seconds for the whole run; ranks still running then are killed and
            ``TimeoutError`` is raised naming them, with their Python stacks.
        collective_timeout: seconds for the rendezvous and for each collective in a rank.
        expect_failure: return failed ranks' errors in their ``RankResult`` instead of
            raising ``RankError`` (an AssertionError) carrying every rank's error.
        threads: torch intra-op threads per rank (``torch.set_num_threads``); None
            keeps torch's default. Several ranks share the cores: the default is 1.
        fail_fast: when a rank fails, stop the others at once instead of letting them
            run into ``collective_timeout`` (their result then says so).
        poll: called in the parent about every 0.1 s while the ranks run, and once
            after, with the parent's client of the store: reads what ranks write to
            ``current_store()`` (progress, for instance). An exception from it stops
            the ranks and is raised.
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    for name, value in (("timeout", timeout), ("collective_timeout", collective_timeout)):
        if not value > 0:
            raise ValueError(f"{name} must be > 0 seconds, got {value!r}")
    if threads is not None and (not isinstance(threads, int) or threads < 1):
        raise ValueError(f"threads must be None or an int >= 1, got {threads!r}")
    # Fail here with a clear message instead of inside spawn's pickling.
    try:
        pickle.dumps((fn, args))
    except Exception as exc:
        raise TypeError(f"run_ranks needs a module-level fn and picklable args: {exc!r}") from exc

    ctx = mp.get_context("spawn")
    # The parent is not a rank and must not block (host_store waits for no client); the
    # ranks' own rendezvous in init_process_group does the waiting.
    store = host_store(HOST, 0, timeout=timedelta(seconds=timeout))
    with tempfile.TemporaryDirectory(prefix="vflow-ranks-") as tmp:
        out_dir = Path(tmp)
        settings = _RankSettings(world_size, store.port, collective_timeout, threads, str(out_dir))
        procs = [
            ctx.Process(
                target=_rank_main,
                args=(rank, settings, fn, args),
                name=f"vflow-rank-{rank}",
                # Daemonic, so ranks die with the parent if it is interrupted.
                daemon=True,
            )
            for rank in range(world_size)
        ]
        stopped_after: int | None = None
        try:
            for p in procs:
                p.start()
            stopped_after = _wait(procs, timeout, fail_fast, store, poll)
            hung = (
                []
                if stopped_after is not None
                else [r for r, p in enumerate(procs) if p.is_alive()]
            )
        finally:
            _stop(procs)
        if poll is not None:
            poll(store)
        results = [_collect(rank, p, out_dir, stopped_after) for rank, p in enumerate(procs)]
        stacks = {rank: _read(out_dir / f"rank{rank}.stacks") for rank in hung}
    del store  # Only now: ranks may use the store until they end.

    if hung:
        raise TimeoutError(
            f"ranks {hung} of {world_size} still running after {timeout:g} s and were killed"
            + _describe_errors(results, skip=hung)
            + "".join(
                f"\n--- rank {rank}, where it hung ---\n{text}" for rank, text in stacks.items()
            )
        )
    if not expect_failure and any(r.error is not None for r in results):
        raise RankError(
            f"{sum(r.error is not None for r in results)} of {world_size} ranks failed"
            + _describe_errors(results)
        )
    return results


@dataclass(frozen=True)
class _RankSettings:
    world_size: int
    port: int
    collective_timeout: float
    threads: int | None
    out_dir: str


def _wait(
    procs: Sequence[Any],
    timeout: float,
    fail_fast: bool,
    store: dist.TCPStore,
    poll: Callable[[dist.TCPStore], None] | None,
) -> int | None:
    """Waits until every rank has ended or ``timeout`` passed; with ``fail_fast``, only
    until a rank fails, returning its rank (None otherwise)."""
    deadline = time.monotonic() + timeout
    step = _POLL_S if poll is not None or fail_fast else None
    while True:
        if poll is not None:
            poll(store)
        alive = [p for p in procs if p.is_alive()]
        if fail_fast:
            # A rank that raised exits with status 1 after writing its result.
            failed = next((r for r, p in enumerate(procs) if p.exitcode not in (None, 0)), None)
            if failed is not None:
                return failed if alive else None
        left = deadline - time.monotonic()
        if not alive or left <= 0:
            return None
        multiprocessing.connection.wait(
            [p.sentinel for p in alive], left if step is None else min(step, left)
        )


def _rank_main(
    rank: int, settings: _RankSettings, fn: Callable[..., Any], args: tuple[Any, ...]
) -> None:
    global _store
    if settings.threads is not None:
        torch.set_num_threads(settings.threads)
    out_dir = Path(settings.out_dir)
    # The parent stops a rank with SIGTERM (then SIGKILL): a rank stopped at the deadline
    # leaves the Python stacks of all its threads behind, at that moment, before the
    # default action ends it, so the TimeoutError shows where it was stuck.
    stacks = (out_dir / f"rank{rank}.stacks").open("w")
    faulthandler.register(signal.SIGTERM, file=stacks, all_threads=True, chain=True)
    use_loopback_for_gloo()
    os.environ[STORE_ENV] = f"{HOST}:{settings.port}"
    timeout = timedelta(seconds=settings.collective_timeout)
    value: Any = None
    error: str | None = None
    try:
        _store = dist.TCPStore(HOST, settings.port, is_master=False, timeout=timeout)
        dist.init_process_group(
            "gloo", store=_store, rank=rank, world_size=settings.world_size, timeout=timeout
        )
        try:
            value = fn(rank, settings.world_size, *args)
        finally:
            dist.destroy_process_group()
    except BaseException:
        error = traceback.format_exc()
    try:
        payload = pickle.dumps(RankResult(rank, value, error))
    except Exception:
        error = "result could not be pickled:\n" + traceback.format_exc()
        payload = pickle.dumps(RankResult(rank, None, error))
    # Write then rename, so the parent never reads a half-written result.
    part = out_dir / f"rank{rank}.part"
    part.write_bytes(payload)
    part.replace(_result_path(out_dir, rank))
    if error is not None:
        # The exit status tells the parent at once (fail_fast) without reading files.
        raise SystemExit(1)


def _read(path: Path) -> str:
    return path.read_text() if path.exists() else ""


def _result_path(out_dir: Path, rank: int) -> Path:
    return out_dir / f"rank{rank}.pkl"


def _stop(procs: Sequence[Any]) -> None:
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


def _collect(rank: int, proc: Any, out_dir: Path, stopped_after: int | None) -> RankResult:
    path = _result_path(out_dir, rank)
    if path.exists():
        result = pickle.loads(path.read_bytes())
        assert isinstance(result, RankResult)
        return result
    if stopped_after is not None and rank != stopped_after:
        why = f"was stopped after rank {stopped_after} failed (fail_fast)"
    else:
        why = f"{_describe_exit(proc.exitcode)} without a result (its stderr may say why)"
    return RankResult(rank, None, f"rank {rank} {why}")


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


def _describe_errors(results: Sequence[RankResult], skip: Sequence[int] = ()) -> str:
    return "".join(
        f"\n--- rank {r.rank} ---\n{r.error.rstrip()}"
        for r in results
        if r.error is not None and r.rank not in skip
    )
