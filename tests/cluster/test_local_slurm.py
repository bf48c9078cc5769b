"""The real Slurm the Slurm backend is tested on (tests/support/slurm.py, issue 36):
nodes as slurmd daemons with fake GPUs, a GPU as the unit of allocation, a worker's
device from Slurm's CUDA_VISIBLE_DEVICES, and SIGTERM through ``scancel --full`` reaching
the batch script, which is how a worker is asked to leave after its step."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.support import slurm

pytestmark = [
    pytest.mark.alone,  # five daemons and their jobs beside the tests would starve them
    pytest.mark.skipif(bool(slurm.missing()), reason=f"Slurm tests: {slurm.missing()}"),
]

# A worker stand-in: says where it runs, then waits; on SIGTERM it says so and ends.
_WORKER = """#!/bin/bash
out="$1/$SLURM_JOB_ID"
trap 'echo "left after TERM" >> "$out"; exit 0' TERM
echo "$SLURMD_NODENAME ${CUDA_VISIBLE_DEVICES:-none}" > "$out"
for i in $(seq 1 1200); do sleep 0.1; done
"""


def _until(what: str, ready: Callable[[], bool], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def test_a_gpu_is_the_slot_and_scancel_full_reaches_the_worker(tmp_path: Path) -> None:
    script = tmp_path / "worker.sh"
    script.write_text(_WORKER)
    script.chmod(0o755)
    out = tmp_path / "out"
    out.mkdir()
    conf_before = os.environ.get("SLURM_CONF")  # a user's own cluster, if any
    with slurm.LocalSlurm(nodes=4, gpus=2) as cluster:
        assert cluster.node_states() == {f"n{i}": "idle" for i in range(1, 5)}
        jobs = [
            cluster.sbatch(["--gres=gpu:1", "-o", str(tmp_path / "%j.log"), str(script), str(out)])
            for _ in range(9)
        ]
        # 4 nodes x 2 GPUs: 8 run, each on a GPU of its own; the ninth waits for one.
        _until("8 workers reporting", lambda: len(list(out.iterdir())) == 8)
        queue = cluster.squeue()
        running = [j for j in jobs if queue[j][0] == "RUNNING"]
        assert len(running) == 8 and queue[jobs[8]] == ("PENDING", "")
        slots = sorted(tuple((out / j).read_text().split()) for j in running)
        assert slots == [(f"n{i}", gpu) for i in range(1, 5) for gpu in ("0", "1")]
        assert all((out / j).read_text().split()[0] == queue[j][1] for j in running)
        # scancel --full signals the batch script itself (without --full only its steps):
        # the worker leaves, and its GPU goes to the job that waited.
        leaving = running[0]
        cluster.run(["scancel", "--full", "--signal=TERM", leaving])
        _until("the worker's TERM", lambda: "left after TERM" in (out / leaving).read_text())
        _until("the waiting job to start", lambda: (out / jobs[8]).exists())
        node, device = (out / jobs[8]).read_text().split()
        assert (node, device) == tuple((out / leaving).read_text().split()[:2])
        _until("the job's end in sacct --completion", lambda: leaving in cluster.completed())
        ended = cluster.completed()[leaving]
        assert ended["State"] == "COMPLETED" and ended["ExitCode"] == "0:0"
        cluster.run(["scancel", *jobs])
        _until("an empty queue", lambda: not cluster.squeue())
        pids = cluster.pids
    # Stopped by their pids: no daemon is left, and the folder is gone.
    for pid in pids:
        assert not Path(f"/proc/{pid}").exists() or _zombie(pid)
    assert not cluster.root.exists()
    assert os.environ.get("SLURM_CONF") == conf_before  # the tests' environment is untouched


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    except OSError:
        return True


def test_bad_sizes_are_refused_before_anything_starts() -> None:
    with pytest.raises(ValueError, match="need nodes >= 1"):
        slurm.LocalSlurm(nodes=0)
