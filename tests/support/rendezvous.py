"""The rendezvous store of elastic jobs as a process, for the tests that need one, and
workers' handles on a store."""

from __future__ import annotations

import select
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch.distributed as dist

from vflow.elastic.rendezvous import Rendezvous
from vflow.elastic.server import serve
from vflow.world.store import RequestCounts


@contextmanager
def store_process(
    command: Sequence[str] = (sys.executable, "-m", "vflow", "rendezvous", "--port", "0"),
    **popen: Any,
) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """The store's ``command`` (``python -m vflow rendezvous`` on a port the OS picks):
    the process and the first line it printed (its address, or nothing if it ended).
    A process still running on the way out is stopped (SIGTERM, then SIGKILL)."""
    proc = subprocess.Popen(list(command), stdout=subprocess.PIPE, text=True, **popen)
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 60)
        assert ready, "python -m vflow rendezvous printed no address within 60 s"
        assert proc.stdout is not None
        yield proc, proc.stdout.readline().strip()
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=30)
        if proc.stdout is not None:
            proc.stdout.close()


def worker_rendezvous(endpoint: str, job: str, counts: RequestCounts | None = None) -> Rendezvous:
    """A worker's handle on job ``job`` at the store at ``endpoint`` (``"HOST:PORT"``),
    with timeouts short enough for tests, its requests counted in ``counts`` if given;
    ``close()`` it at the end."""
    return Rendezvous(
        endpoint,
        job,
        min_workers=1,
        max_workers=4,
        join_timeout_s=10.0,
        last_call_s=0.1,
        keep_alive_s=0.5,
        keep_alive_attempts=4,
        store_timeout_s=5.0,
        counts=counts,
    )


def until(what: str, done: Callable[[], bool], timeout: float = 20.0) -> None:
    """Waits until ``done()``; fails naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, f"no {what} within {timeout:g} s"
        time.sleep(0.05)


@contextmanager
def local_store(
    job: str,
) -> Iterator[tuple[dist.TCPStore, Callable[..., Rendezvous]]]:
    """A rendezvous store in this process (``serve``), whose keys the caller reads, and
    a maker of workers' handles on job ``job`` there (``worker(counts=None)``); the
    handles are closed on the way out."""
    store = serve("127.0.0.1", 0)
    made: list[Rendezvous] = []

    def worker(counts: RequestCounts | None = None) -> Rendezvous:
        made.append(worker_rendezvous(f"127.0.0.1:{store.port}", job, counts))
        return made[-1]

    try:
        yield store, worker
    finally:
        for rdzv in made:
            rdzv.close()
