"""vflow/cluster/launchers/local.py: workers as local processes, their ends and causes,
a leave as SIGTERM to the worker's process group, and nothing left after close."""

from __future__ import annotations

import os
import socket
import sys
import time
from pathlib import Path

import pytest

from vflow.cluster.launchers import LaunchError, LocalLauncher, WorkerHandle

# Prints its pid, then its shell child's; on SIGTERM says so and leaves (status 0).
LEAVER = """
import os, signal, subprocess, sys, time
child = subprocess.Popen(["sleep", "60"])
print(os.getpid(), child.pid, flush=True)
signal.signal(signal.SIGTERM, lambda *_: (print("left", flush=True), sys.exit(0)))
time.sleep(60)
"""


def _python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def _until_ended(launcher: LocalLauncher, *workers: WorkerHandle) -> None:
    deadline = time.monotonic() + 30
    while not all(w.ended for w in workers):
        assert time.monotonic() < deadline, "a worker did not end"
        time.sleep(0.05)
        launcher.refresh()


def _pids(output: Path) -> list[int]:
    deadline = time.monotonic() + 30
    while not output.read_text().strip():
        assert time.monotonic() < deadline, "the worker did not start"
        time.sleep(0.05)
    return [int(word) for word in output.read_text().split()[:2]]


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # A zombie child of this process counts as gone.
    return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"


def test_workers_end_with_their_causes(tmp_path: Path) -> None:
    launcher = LocalLauncher()
    launcher.check(10_000)  # emulated slots: any number
    assert launcher.capacity() is None
    done = launcher.launch(_python("pass"), tmp_path / "done.out", "a.0")
    failed = launcher.launch(_python("import sys; sys.exit(3)"), tmp_path / "failed.out", "a.1")
    killed = launcher.launch(_python(LEAVER), tmp_path / "killed.out", "a.2")
    leaver = launcher.launch(_python(LEAVER), tmp_path / "leaver.out", "a.3")
    _until_ended(launcher, done, failed)
    assert (done.ended.cause, done.ended.returncode, done.ended.ok) == ("exited", 0, True)
    assert (failed.ended.cause, failed.ended.returncode, failed.ended.ok) == ("failed", 3, False)
    assert killed.ended is None and killed.where == socket.gethostname()
    killed_pid, killed_child = _pids(tmp_path / "killed.out")
    assert killed.ident == str(killed_pid)
    _pids(tmp_path / "leaver.out")
    killed.kill()
    leaver.leave()
    _until_ended(launcher, killed, leaver)
    assert (killed.ended.cause, killed.ended.returncode) == ("signal", -9)
    assert (leaver.ended.cause, leaver.ended.returncode) == ("exited", 0)
    assert (tmp_path / "leaver.out").read_text().split()[-1] == "left"
    # The signal went to the process group: the worker's own child died with it.
    deadline = time.monotonic() + 10
    while not _gone(killed_child):
        assert time.monotonic() < deadline, "the killed worker's child outlived it"
        time.sleep(0.05)
    launcher.close()


def test_close_stops_every_worker_and_a_bad_command_is_a_launch_error(tmp_path: Path) -> None:
    launcher = LocalLauncher()
    workers = [launcher.launch(_python(LEAVER), tmp_path / f"{i}.out", f"a.{i}") for i in range(3)]
    pids = [pid for i in range(3) for pid in _pids(tmp_path / f"{i}.out")[:1]]
    launcher.close()
    assert all(w.ended is not None for w in workers) and all(_gone(pid) for pid in pids)
    with pytest.raises(LaunchError, match=r"b\.0: cannot start"):
        launcher.launch([str(tmp_path / "missing")], tmp_path / "b.out", "b.0")
