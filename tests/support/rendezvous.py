"""The rendezvous store of elastic jobs as a process, for the tests that need one."""

from __future__ import annotations

import select
import subprocess
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any


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
