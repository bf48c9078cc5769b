"""examples/slurm/elastic.sbatch as examples/slurm/README.md uses it, on a real Slurm
(tests/support/slurm.py, issue 36): the first job starts the store and the job; two
more jobs join it, each a worker on a GPU of its own; ``scancel --batch --signal=TERM``
makes one of them leave after its step, and ``scancel --full --signal=TERM`` (which
reaches the DataLoader's worker processes too) the first job's worker, while its store
serves on until no job of the name is left. Every Slurm job ends COMPLETED 0:0,
the last worker runs the job to its last step, and the ``--out`` file is bitwise the
one a single worker of examples/train_elastic.py writes with the same flags, without
Slurm. Every wait is bounded; the daemons, the jobs and the store are stopped by pid on
the way out."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.support import REPO_ROOT, slurm
from tests.support.rendezvous import store_process
from tests.support.several_hosts import assert_bitwise_equal

pytest.importorskip("sklearn", reason="the example trains on scikit-learn's digits")
if not (dist.is_available() and dist.is_gloo_available()):
    pytest.skip("needs torch.distributed with Gloo", allow_module_level=True)

pytestmark = [
    pytest.mark.alone,  # five daemons and three workers on two cores: nothing beside them
    pytest.mark.skipif(bool(slurm.missing()), reason=f"Slurm tests: {slurm.missing()}"),
]

SBATCH = REPO_ROOT / "examples" / "slurm" / "elastic.sbatch"
SCRIPT = REPO_ROOT / "examples" / "train_elastic.py"
# Paced by --sleep until each worker has seen 2 changes of the worker set: the last to
# join sees the two leaves, and the job runs at full speed after them. 400 paced steps
# leave 80 s for the joins and the leaves, which take about 20 s. The loader in the
# worker's process, as elastic.sbatch's own flags say (README.md, "Removing a worker").
FLAGS = [
    "--steps", "400", "--virtual-nodes", "4", "--seed", "0", "--deterministic",
    "--sleep", "0.2", "--sleep-until-changes", "2", "--loader-workers", "1",
]  # fmt: skip
WAIT_S = 60.0
EVENT = re.compile(r"vflow elastic: step (\d+), round \d+, (\d+) worker\(s\), (\w+), [\d.]+ s$")
SLOT = re.compile(r"^vflow: (?:store|worker) job \d+ of \S+ on (\S+), GPU (\S+)$", re.MULTILINE)
STORE = re.compile(r"^vflow: rendezvous store at (\S+) \(pid (\d+)\)", re.MULTILINE)


def _env() -> dict[str, str]:
    # As the jobs run: one thread, no GPU (the example trains on the CPU with Gloo).
    return dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", PYTHONUNBUFFERED="1")


def _until(what: str, ready: Callable[[], bool], show: Callable[[], str]) -> None:
    deadline = time.monotonic() + WAIT_S
    while not ready():
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} within {WAIT_S:g} s\n{show()}")
        time.sleep(0.2)


class Jobs:
    """The example's Slurm jobs on ``cluster``, their output files in ``tmp``."""

    def __init__(self, cluster: slurm.LocalSlurm, tmp: Path, out: Path) -> None:
        self.cluster, self.tmp = cluster, tmp
        # As README.md says, but on this one-host cluster the store listens on loopback,
        # and squeue is asked every second instead of every 30.
        settings = {
            "VFLOW_RDZV_FILE": tmp / "digits.rdzv",
            "VFLOW_STORE_HOST": "127.0.0.1",
            "VFLOW_PYTHON": sys.executable,
            "VFLOW_POLL_S": 1,
        }
        self.options = [
            "--job-name=digits",
            f"--chdir={REPO_ROOT}",
            f"--output={tmp}/%j.out",
            "--export=ALL," + ",".join(f"{k}={v}" for k, v in settings.items()),
        ]
        self.flags = [*FLAGS, "--out", str(out)]

    def submit(self, *more: str, store: bool = False) -> str:
        """A job of the script: with ``store``, the first one. ``more``: sbatch's options."""
        role = ["store"] if store else []
        return self.cluster.sbatch([*self.options, *more, str(SBATCH), *role, *self.flags])

    def output(self, job: str) -> str:
        path = self.tmp / f"{job}.out"
        return path.read_text(errors="replace") if path.exists() else ""

    def events(self, job: str) -> list[tuple[int, int, str]]:
        """(step, workers, reason) of each change of the worker set the job's worker saw."""
        lines = self.output(job).splitlines()
        return [(int(m[1]), int(m[2]), m[3]) for line in lines if (m := EVENT.search(line))]

    def reasons(self, job: str) -> list[str]:
        return [reason for _, _, reason in self.events(job)]

    def changes(self, job: str) -> list[tuple[int, str]]:
        return [(workers, reason) for _, workers, reason in self.events(job)]

    def ended(self, job: str) -> tuple[str, str]:
        """The job's state and exit code in Slurm's completion log."""
        fields = self.cluster.completed()[job]
        return fields["State"], fields["ExitCode"]

    def show(self, *jobs: str) -> Callable[[], str]:
        return lambda: "\n".join(f"--- job {j}:\n{self.output(j)[-3000:]}" for j in jobs)


@contextlib.contextmanager
def _one_worker(tmp: Path, out: Path) -> Iterator[subprocess.Popen[bytes]]:
    """The same flags on one worker, without Slurm, on a store of its own. --sleep only
    paces the steps, so the reference runs without it."""
    flags = [*FLAGS, "--out", str(out)]
    flags[flags.index("--sleep") + 1] = "0"
    with store_process(cwd=REPO_ROOT, env=_env()) as (_, endpoint):
        with (tmp / "alone.err").open("wb") as err:
            proc = subprocess.Popen(
                [sys.executable, str(SCRIPT), "--rdzv", endpoint, "--job", "alone", *flags],
                cwd=REPO_ROOT,
                env=_env(),
                stdout=subprocess.DEVNULL,
                stderr=err,
            )
        try:
            yield proc
            assert proc.wait(timeout=WAIT_S) == 0, (tmp / "alone.err").read_text()[-3000:]
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def _alive(pid: int) -> bool:
    """Whether ``pid`` is still the store of the first job (not a pid used again)."""
    try:
        return b"vflow.elastic.server" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def test_workers_join_and_leave_as_slurm_jobs_and_the_model_is_bitwise_one_workers(
    tmp_path: Path,
) -> None:
    out, alone = tmp_path / "final.pt", tmp_path / "alone.pt"
    store_pid = 0
    try:
        # The reference trains while the cluster starts.
        with _one_worker(tmp_path, alone), slurm.LocalSlurm(nodes=4, gpus=2) as cluster:
            jobs = Jobs(cluster, tmp_path, out)
            first = jobs.submit("--no-requeue", store=True)
            _until("a start", lambda: "start" in jobs.reasons(first), jobs.show(first))
            found = STORE.search(jobs.output(first))
            assert found is not None, jobs.output(first)
            store_pid = int(found[2])
            assert (tmp_path / "digits.rdzv").read_text().strip() == found[1]

            # Two more workers, as the README adds them.
            grown = [jobs.submit(f"--dependency=after:{first}") for _ in range(2)]
            everyone = [first, *grown]
            _until(
                "3 workers training",
                lambda: any(w == 3 for _, w, _ in jobs.events(first)),
                jobs.show(*everyone),
            )
            assert "grow" in jobs.reasons(first), jobs.output(first)
            # They joined the running job: their first step is not the job's first.
            assert all(jobs.events(job)[0][0] > 0 for job in grown), jobs.show(*grown)()
            slots = {job: SLOT.findall(jobs.output(job)) for job in everyone}
            assert all(len(s) == 1 and s[0][1] != "none" for s in slots.values()), slots
            assert len({s[0] for s in slots.values()}) == 3, f"two workers on one GPU: {slots}"

            # A later job leaves after its step; its Slurm job ends COMPLETED 0:0.
            leaving, last = grown
            cluster.run(["scancel", "--batch", "--signal=TERM", leaving])
            _until("its end", lambda: leaving in cluster.completed(), jobs.show(leaving))
            assert jobs.ended(leaving) == ("COMPLETED", "0:0"), jobs.output(leaving)
            assert "left job 'digits'" in jobs.output(leaving), jobs.output(leaving)
            _until("2 workers", lambda: (2, "leave") in jobs.changes(last), jobs.show(last))

            # The first job's worker leaves too, but its store serves on: the last worker
            # still agrees on a change of the worker set through it, and finishes. --full
            # signals the loader's worker process as well, which ignores it (Note [A
            # leave is the worker's, not its loader's] in vflow/data/step_loader.py).
            cluster.run(["scancel", "--full", "--signal=TERM", first])
            # (Seen once there, as the job may finish within the next poll.)
            _until("1 worker", lambda: (1, "leave") in jobs.changes(last), jobs.show(last))
            assert "left job 'digits'" in jobs.output(first), jobs.output(first)
            assert first not in cluster.completed() and _alive(store_pid), jobs.output(first)
            _until("the job's end", lambda: "finish" in jobs.reasons(last), jobs.show(last))
            # The first job stops the store once no job of this name is left.
            _until(
                "every Slurm job's end",
                lambda: all(job in cluster.completed() for job in everyone),
                jobs.show(*everyone),
            )
            for job in everyone:
                assert jobs.ended(job) == ("COMPLETED", "0:0"), jobs.output(job)
            assert not _alive(store_pid), "the store outlived its job"
            assert not (tmp_path / "digits.rdzv").exists(), "the store's address outlived it"
    finally:
        if _alive(store_pid):
            os.kill(store_pid, signal.SIGKILL)
    assert_bitwise_equal(torch.load(out), torch.load(alone))
