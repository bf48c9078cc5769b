"""vflow/cluster/launchers/slurm.py against a real Slurm (tests/support/slurm.py): what it
refuses before submitting anything, how its workers end and why, and the slots a lost
node takes away until it returns."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.support import slurm
from vflow.cluster.launchers import LaunchError, SlurmLauncher, WorkerHandle

pytestmark = [
    pytest.mark.alone,  # five daemons and their jobs beside the tests would starve them
    pytest.mark.skipif(bool(slurm.missing()), reason=f"Slurm tests: {slurm.missing()}"),
]

# A worker stand-in: says where it runs, leaves on SIGTERM (status 0), else sleeps. Its
# child (as a DataLoader's worker process would be) says if a SIGTERM reached it.
LEAVER = """
import os, signal, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import signal, sys, time; "
    "signal.signal(signal.SIGTERM, lambda *_: (print('child got TERM', flush=True), sys.exit(1))); "
    "time.sleep(120)"])
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
print(os.environ["SLURMD_NODENAME"], os.environ.get("CUDA_VISIBLE_DEVICES"), flush=True)
time.sleep(120)
"""


def _python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def _until(what: str, ready: Callable[[], bool], launcher: SlurmLauncher) -> None:
    deadline = time.monotonic() + 60
    while not ready():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)
        launcher.refresh(force=True)


def test_refuses_what_the_cluster_cannot_give_before_submitting(tmp_path: Path) -> None:
    with slurm.LocalSlurm(nodes=2, gpus=2) as cluster:
        conf = cluster.conf.read_text()
        launcher = SlurmLauncher(env=cluster.env)
        launcher.check(4)
        assert (launcher.partition, launcher.capacity()) == ("main", 4)
        too_many = r"the trace's slots \(5\) exceed partition 'main''s 4 \(gres gpu:1 each\)"
        with pytest.raises(LaunchError, match=too_many):
            SlurmLauncher(env=cluster.env).check(5)
        with pytest.raises(LaunchError, match=r"slots \(3\) exceed .* 2 \(gres gpu:2 each\)"):
            SlurmLauncher(gres="gpu:2", env=cluster.env).check(3)
        SlurmLauncher(gres=None, env=cluster.env).check(4)  # 2 CPUs a node, 1 a worker
        with pytest.raises(LaunchError, match=r"slots \(3\) exceed .* 2 \(2 CPUs each\)"):
            SlurmLauncher(gres=None, cpus_per_worker=2, env=cluster.env).check(3)
        unknown = r"--partition: no partition 'gpu' on this cluster \(it has: main\)"
        with pytest.raises(LaunchError, match=unknown):
            SlurmLauncher("gpu", env=cluster.env).check(1)
        assert cluster.squeue() == {} and cluster.completed() == {}
        down = tmp_path / "slurm.conf"  # the same cluster, once its controller is gone
        down.write_text(conf)
        env = {**cluster.env, "SLURM_CONF": str(down)}
    began = time.monotonic()
    with pytest.raises(LaunchError, match="Slurm is not running here"):
        SlurmLauncher(env=env).check(1)
    assert time.monotonic() - began < 40
    for bad in ({"partition": "a b"}, {"gres": "gpu"}, {"cpus_per_worker": 0}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            SlurmLauncher(**bad)  # type: ignore[arg-type]


def test_workers_end_with_their_causes_and_say_where_they_ran(tmp_path: Path) -> None:
    with slurm.LocalSlurm(nodes=2, gpus=2) as cluster:
        launcher = SlurmLauncher(env=cluster.env, refresh_s=0.2)
        launcher.check(4)

        def launch(name: str, code: str) -> WorkerHandle:
            return launcher.launch(_python(code), tmp_path / f"{name}.out", name)

        done = launch("done", "pass")
        failed = launch("failed", "import sys; sys.exit(3)")
        leaver = launch("leaver", LEAVER)
        killed = launch("killed", LEAVER)
        _until("two running", lambda: done.ended and failed.ended, launcher)
        _until("the others printing", lambda: all(
            (tmp_path / f"{n}.out").exists() and (tmp_path / f"{n}.out").read_text()
            for n in ("leaver", "killed")
        ), launcher)  # fmt: skip
        waiting = [launch(f"waiting{i}", LEAVER) for i in range(3)]  # 2 GPUs free, 3 asked
        _until("a queue", lambda: sum(w.where is not None for w in waiting) == 2, launcher)
        pending = next(w for w in waiting if w.where is None)
        pending.leave()  # before a GPU is free: it leaves by never starting
        leaver.leave()
        killed.kill()
        _until("those ended", lambda: leaver.ended and killed.ended and pending.ended, launcher)
        assert (done.ended.cause, done.ended.returncode) == ("exited", 0)
        assert (failed.ended.cause, failed.ended.returncode) == ("failed", 3)
        assert (leaver.ended.cause, leaver.ended.returncode) == ("exited", 0)
        assert killed.ended.cause == "cancelled"  # Slurm's word for a job sent SIGKILL
        assert pending.ended.cause == "cancelled" and pending.where is None
        said = (tmp_path / "leaver.out").read_text()
        node, gpu = said.splitlines()[0].split()
        assert "child got TERM" not in said  # the leave was the worker's alone
        assert leaver.where == node and gpu in ("0", "1")
        ended = cluster.completed()
        assert ended[leaver.ident]["State"] == "COMPLETED"
        running = [w for w in waiting if w is not pending]
        launcher.close()  # kills the rest, and waits for their ends
        assert all(w.ended is not None for w in running)
        assert cluster.squeue() == {}


def test_a_lost_node_ends_its_workers_and_takes_its_slots_until_it_returns(
    tmp_path: Path,
) -> None:
    with slurm.LocalSlurm(nodes=2, gpus=2) as cluster:
        launcher = SlurmLauncher(env=cluster.env, refresh_s=0.2)
        launcher.check(4)
        workers = [
            launcher.launch(_python(LEAVER), tmp_path / f"{i}.out", f"w{i}") for i in range(4)
        ]
        _until("4 running", lambda: all(w.where for w in workers), launcher)
        on_n2 = [w for w in workers if w.where == "n2"]
        assert len(on_n2) == 2
        cluster.lose_node("n2")
        _until("n2's workers ended", lambda: all(w.ended for w in on_n2), launcher)
        assert {w.ended.cause for w in on_n2} == {"node_fail"}
        assert all(w.ended is None for w in workers if w not in on_n2)
        assert launcher.capacity() == 2
        cluster.restore_node("n2")
        _until("n2 back", lambda: launcher.capacity() == 4, launcher)
        launcher.close()
