"""An elastic job's README lines run as a user runs them: the store's line on a free port,
and worker processes of a worker line, each logging to a file whose events (the
changes of the worker set ElasticJob logs) the tests wait for and read. Every process
is killed on the way out."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from tests.support import REPO_ROOT
from tests.support.rendezvous import store_process

ALTERED = REPO_ROOT / "tests" / "support" / "altered_example.py"
README_PORT = "29400"
WAIT_S = 90.0
# One line per change of the worker set (ElasticJob's log, Note [Elastic state machine]).
EVENT = re.compile(r"vflow elastic: step (\d+), round \d+, (\d+) worker\(s\), (\w+), [\d.]+ s$")


def worker_env() -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    # Bitwise equality needs the same thread count in every worker and in the
    # one-worker run; no GPU: the example trains on the CPU with Gloo.
    env.update(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", PYTHONUNBUFFERED="1")
    return env


def as_here(words: list[str], port: int, **replace: str) -> list[str]:
    """``words`` with the README's port replaced by ``port`` and the value of each flag
    in ``replace`` (``out="..."`` for ``--out``) by the given one; the README's
    interpreter (.venv/bin/python) unless this checkout has none."""
    words = [w.replace(README_PORT, str(port)) for w in words]
    assert any(str(port) in w for w in words), f"the README's port {README_PORT} not in {words}"
    for flag, value in replace.items():
        index = words.index(f"--{flag}")  # a README line without it is out of date
        words[index + 1] = value
    if not (REPO_ROOT / words[0]).exists():
        words[0] = sys.executable
    return words


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def readme_store(words: list[str], state: Path) -> Iterator[int]:
    """The README's store line, on a free port (another one if that was taken)."""
    for _ in range(3):
        port = free_port()
        command = as_here(words, port)
        # The README's line names a port, so the store keeps a journal: in ``state``,
        # not in the home folder.
        env = dict(worker_env(), XDG_STATE_HOME=str(state))
        with store_process(command, cwd=REPO_ROOT, env=env) as (proc, endpoint):
            if endpoint == f"127.0.0.1:{port}":
                yield port
                return
            assert proc.wait(timeout=30) != 0, endpoint  # the port was taken meanwhile
    raise AssertionError("python -m vflow rendezvous found no free port in 3 tries")


class Workers:
    """Processes of the README's worker line, each with a stderr file (the example logs
    there)."""

    def __init__(self, words: list[str], port: int, tmp: Path, extra: Sequence[str] = ()) -> None:
        self.words, self.port, self.tmp, self.extra = words, port, tmp, list(extra)
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(
        self, name: str, change: str | None = None, more: Sequence[str] = (), **replace: str
    ) -> None:
        """Starts the line (with ``replace``'s values, the extra flags and this worker's
        ``more``); ``change``: through tests/support/altered_example.py with that
        change."""
        words = as_here(self.words, self.port, **replace) + self.extra + list(more)
        if change is not None:
            script = next(i for i, w in enumerate(words) if w.endswith(".py"))
            words = [words[0], str(ALTERED), change, "--", *words[script + 1 :]]
        with (self.tmp / f"{name}.err").open("wb") as err:
            self.procs[name] = subprocess.Popen(
                words,
                cwd=REPO_ROOT,
                env=worker_env(),
                stdout=subprocess.DEVNULL,
                stderr=err,
            )

    def stderr(self, name: str) -> str:
        return (self.tmp / f"{name}.err").read_text(encoding="utf-8", errors="replace")

    def events(self, name: str) -> list[tuple[int, int, str]]:
        """(step, workers, reason) of each change of the worker set the worker logged."""
        return [
            (int(m[1]), int(m[2]), m[3])
            for line in self.stderr(name).splitlines()
            if (m := EVENT.search(line))
        ]

    def wait_for(self, name: str, what: str, done: Callable[[list[Any]], bool]) -> None:
        """Polls ``done(events of name)`` until true, for at most WAIT_S."""
        deadline = time.monotonic() + WAIT_S
        while not done(self.events(name)):
            if self.procs[name].poll() is not None:
                raise AssertionError(f"{name} ended before {what}:\n{self.stderr(name)[-4000:]}")
            if time.monotonic() > deadline:
                raise AssertionError(f"no {what} within {WAIT_S:g} s:\n{self.stderr(name)[-4000:]}")
            time.sleep(0.05)

    def wait(self, names: list[str], timeout: float) -> dict[str, int]:
        deadline = time.monotonic() + timeout
        return {
            name: self.procs[name].wait(timeout=max(1.0, deadline - time.monotonic()))
            for name in names
        }

    def kill_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)


def reasons(events: list[tuple[int, int, str]]) -> list[str]:
    return [reason for _, _, reason in events]
