"""The ``local`` backend: each worker a process on this machine, its slot an emulated
device (Note [Emulated device time] in vflow/demo/cluster_worker.py). No daemons: the
runner is the cluster.

A worker runs in a process group of its own, so that the runner alone decides when it
stops (a Ctrl-C in the terminal reaches the runner, which kills it), and a command
template that wraps the worker in a shell stops with it.
"""

from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
from pathlib import Path
from typing import IO

from vflow.cluster.launchers.base import Ended, Launcher, LaunchError, WorkerHandle

__all__ = ["LocalLauncher"]

_KILL_WAIT_S = 10.0  # a SIGKILLed process is gone within this


class _Process(WorkerHandle):
    def __init__(self, process: subprocess.Popen[bytes], output: IO[bytes]) -> None:
        self._process = process
        self._output = output
        self._ended: Ended | None = None

    @property
    def ended(self) -> Ended | None:
        return self._ended

    @property
    def where(self) -> str:
        return socket.gethostname()

    @property
    def ident(self) -> str:
        return str(self._process.pid)

    def leave(self) -> None:
        self._signal(signal.SIGTERM)

    def suspend(self) -> None:
        self._signal(signal.SIGUSR1)

    def kill(self) -> None:
        self._signal(signal.SIGKILL)

    def _signal(self, signum: int) -> None:
        if self._process.poll() is None:
            try:
                os.killpg(self._process.pid, signum)
            except ProcessLookupError:
                pass

    def refresh(self) -> None:
        if self._ended is not None:
            return
        code = self._process.poll()
        if code is None:
            return
        self._output.close()
        cause = "exited" if code == 0 else "signal" if code < 0 else "failed"
        self._ended = Ended(code, cause)

    def wait(self) -> None:
        try:
            self._process.wait(timeout=_KILL_WAIT_S)
        except subprocess.TimeoutExpired:
            pass
        self._output.close()


class LocalLauncher(Launcher):
    """Workers as local processes (module docstring); as many slots as the trace says."""

    name = "local"

    def __init__(self) -> None:
        self._workers: list[_Process] = []

    def check(self, slots: int) -> None:
        pass  # emulated slots: any number

    def capacity(self) -> None:
        return None

    def launch(self, argv: list[str], output: Path, name: str) -> WorkerHandle:
        out = open(output, "wb")
        try:
            process = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        except OSError as e:
            out.close()
            raise LaunchError(f"{name}: cannot start {shlex.join(argv)}: {e}") from e
        worker = _Process(process, out)
        self._workers.append(worker)
        return worker

    def refresh(self) -> None:
        for worker in self._workers:
            worker.refresh()

    def close(self) -> None:
        alive = [w for w in self._workers if w.ended is None]
        for worker in alive:
            worker.kill()
        for worker in alive:
            worker.wait()
        self.refresh()
