"""The ``slurm`` backend: one Slurm job per worker, so that a vflow job grows by
submitting and shrinks by cancelling, which Slurm does for any job (Note [One Slurm job
per worker]).

* start: ``sbatch --gres=gpu:1 --no-requeue --wrap "exec WORKER"`` (the GRES, or a CPU
  count, configurable): the slot is the GRES unit, and Slurm sets the worker's
  ``CUDA_VISIBLE_DEVICES``. ``exec``: the batch script's process is the worker itself,
  so a signal to the script reaches it (Note [Leaving after the step]).
* leave: ``scancel --batch --signal=TERM`` (a pending worker is cancelled instead);
  suspend the job: ``--signal=USR1`` alike.
* kill: ``scancel --full --signal=KILL`` (a pending one: ``scancel``).
* ends and causes: ``squeue --states=all`` for the jobs' states and nodes, and
  ``scontrol show job`` for an ended job's exit code, as long as the controller keeps
  ended jobs (``MinJobAge``, 300 s by default; accounting, sacct, is not needed). A job
  gone from both has ended, cause ``lost``.
* capacity: the partition's GRES (or CPUs) on nodes that are up (``sinfo``); a node
  lost takes its slots away until it returns.

Commands run with this process's environment (``SLURM_CONF`` picks the cluster), and
sbatch passes it on to the workers (``--export=ALL``): the same Python, the same
PYTHONPATH. They are asked at most every ``refresh_s`` seconds.

Note [One Slurm job per worker]
Slurm 22.05 cannot resize a running job in a way a training job survives: expansion is
off by default and undocumented, shrinking works per node and kills the steps on the
nodes released, and heterogeneous jobs are fixed at submission. A vflow job is elastic
by itself (workers join at the next step and leave after one), so each worker is a
Slurm job of its own, and the vflow job is the set of Slurm jobs named ``<job>.<n>``.

Note [Leaving after the step]
``scancel --signal=TERM`` reaches a job's steps only, not its batch script. ``--full``
reaches the script and every process under it; ``--batch`` the script's process alone.
The worker's own children must not get it: a DataLoader's worker processes die of
SIGTERM (vflow's StepLoader makes them ignore it, a user's own DataLoader does not),
and so do torch.compile's compile workers, and the worker then crashes where it was
asked to leave. So a leave is ``--batch``, and the script must be the worker
(``exec``): a shell that died of the signal would end the job, and Slurm would kill the
worker before its step is done. The cluster's ``KillWait`` (SIGTERM to SIGKILL on a
cancel) must outlast a step; a worker asked to leave here is signalled, not cancelled,
so it ends when it has left.

Note [No requeue]
Slurm requeues a batch job whose node fails, by default. A requeued worker would start
again later, as a newcomer the scheduler never asked for, holding a slot the scheduler
counts as free. So workers are submitted with ``--no-requeue``: a lost node ends its
workers (NODE_FAIL), and the scheduler decides what to start instead.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from vflow.cluster.launchers.base import Ended, Launcher, LaunchError, WorkerHandle

__all__ = ["SlurmLauncher"]

_COMMAND_TIMEOUT_S = 30.0
_CLOSE_TIMEOUT_S = 60.0
# Node states whose slots can run a worker (sinfo's short names; a "*" suffix, not
# responding, is not up).
_UP = {"idle", "mix", "alloc", "comp", "resv", "plnd"}
_CAUSES = {
    "CANCELLED": "cancelled",
    "NODE_FAIL": "node_fail",
    "OUT_OF_MEMORY": "out_of_memory",
    "TIMEOUT": "timeout",
    "PREEMPTED": "preempted",
    "BOOT_FAIL": "boot_fail",
    "DEADLINE": "deadline",
}
_ENDED = {"COMPLETED", "FAILED", *_CAUSES}


class _SlurmJob(WorkerHandle):
    def __init__(self, launcher: SlurmLauncher, job_id: str) -> None:
        self._launcher = launcher
        self.job_id = job_id
        self.state = "PENDING"
        self.node: str | None = None
        self._ended: Ended | None = None

    @property
    def ended(self) -> Ended | None:
        return self._ended

    @property
    def where(self) -> str | None:
        return self.node

    @property
    def ident(self) -> str:
        return self.job_id

    def leave(self) -> None:
        self._ask("TERM")

    def suspend(self) -> None:
        self._ask("USR1")

    def _ask(self, signal_name: str) -> None:
        """``signal_name`` to the worker alone (Note [Leaving after the step]); a worker
        not started yet is cancelled: it leaves by never starting."""
        if self._ended is not None:
            return
        # Asked afresh: a signal to a pending job waits until it starts (scancel blocks).
        now = self._launcher.command(["squeue", "-h", "-j", self.job_id, "-o", "%T"], check=False)
        if now.stdout.strip() == "PENDING":
            # Should it start meanwhile, the cancel sends it SIGTERM, and it leaves after
            # its step (KillWait outlasts one).
            self._launcher.command(["scancel", self.job_id], check=False)
        elif now.returncode == 0 and now.stdout.strip():
            self._launcher.command(
                ["scancel", "--batch", f"--signal={signal_name}", self.job_id], check=False
            )

    def kill(self) -> None:
        if self._ended is not None:
            return
        if self.state == "PENDING":
            self._launcher.command(["scancel", self.job_id], check=False)
        else:
            # SIGKILL now: a plain scancel would send SIGTERM and wait KillWait.
            self._launcher.command(["scancel", "--full", "--signal=KILL", self.job_id], check=False)

    def update(self, state: str, node: str) -> None:
        self.state = state
        self.node = node or self.node
        if state in _ENDED and self._ended is None:
            self._ended = self._launcher.end_of(self.job_id, state)

    def lost(self) -> None:
        self._ended = Ended(None, "lost")


class SlurmLauncher(Launcher):
    """Workers as Slurm jobs (module docstring). ``partition``: where to submit (None:
    the cluster's default). ``gres``: the GRES each worker takes, ``NAME:COUNT`` (the
    slot); None for CPU-only workers, whose slot is ``cpus_per_worker`` CPUs.
    ``sbatch_args``: more sbatch options for every worker (an account, a QOS, a time
    limit)."""

    name = "slurm"

    def __init__(
        self,
        partition: str | None = None,
        gres: str | None = "gpu:1",
        cpus_per_worker: int = 1,
        sbatch_args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        refresh_s: float = 0.5,
    ) -> None:
        if partition is not None and not re.fullmatch(r"[\w.-]+", partition):
            raise ValueError(f"partition must be a Slurm partition name, got {partition!r}")
        if gres is not None and not re.fullmatch(r"\w+(:\w+)?:[1-9]\d*", gres):
            raise ValueError(f"gres must be NAME:COUNT (e.g. gpu:1), got {gres!r}")
        if isinstance(cpus_per_worker, bool) or not (
            isinstance(cpus_per_worker, int) and cpus_per_worker >= 1
        ):
            raise ValueError(f"cpus_per_worker must be an int >= 1, got {cpus_per_worker!r}")
        if not refresh_s > 0:
            raise ValueError(f"refresh_s must be seconds > 0, got {refresh_s!r}")
        self.partition = partition
        self.gres = gres
        self.cpus_per_worker = cpus_per_worker
        self.sbatch_args = list(sbatch_args)
        self._env = None if env is None else dict(env)
        self._refresh_s = refresh_s
        self._jobs: list[_SlurmJob] = []
        self._last_refresh = -float("inf")
        self._capacity: int | None = None

    # ---- the cluster ---------------------------------------------------------------

    def check(self, slots: int) -> None:
        try:
            ping = self.command(["scontrol", "ping"], check=False)
        except LaunchError as e:
            raise LaunchError(f"Slurm is not running here: {e}") from None
        if ping.returncode != 0 or "UP" not in ping.stdout:
            said = (ping.stdout + ping.stderr).strip().splitlines()
            raise LaunchError(
                "Slurm is not running here: scontrol ping says "
                + (said[-1] if said else f"nothing (exit {ping.returncode})")
            )
        partitions = self._partitions()
        if self.partition is None:
            default = [name for name, is_default in partitions.items() if is_default]
            if not default:
                raise LaunchError("the cluster has no default partition: name one (--partition)")
            self.partition = default[0]
        elif self.partition not in partitions:
            raise LaunchError(
                f"--partition: no partition {self.partition!r} on this cluster "
                f"(it has: {', '.join(sorted(partitions)) or 'none'})"
            )
        total = self._slots(up_only=False)
        if slots > total:
            raise LaunchError(
                f"the trace's slots ({slots}) exceed partition {self.partition!r}'s "
                f"{total} ({self._unit()} each)"
            )
        self._capacity = self._slots(up_only=True)

    def _partitions(self) -> dict[str, bool]:
        out = self.command(["sinfo", "-h", "-o", "%P"]).stdout
        names = {}
        for line in out.split():
            names[line.rstrip("*")] = line.endswith("*")
        return names

    def _unit(self) -> str:
        if self.gres is not None:
            return f"gres {self.gres}"
        return f"{self.cpus_per_worker} CPU{'s' if self.cpus_per_worker > 1 else ''}"

    def _slots(self, up_only: bool) -> int:
        """Workers the partition's nodes hold at once (those up, or all)."""
        assert self.partition is not None
        out = self.command(["sinfo", "-h", "-N", "-p", self.partition, "-o", "%N|%t|%c|%G"])
        total = 0
        seen = set()
        for line in out.stdout.splitlines():
            node, state, cpus, gres = [*line.split("|"), "", "", ""][:4]
            if not node or node in seen or (up_only and state not in _UP):
                continue
            seen.add(node)
            if self.gres is None:
                total += int(cpus) // self.cpus_per_worker
            else:
                total += _gres_count(gres, self.gres)
        return total

    def capacity(self) -> int | None:
        return self._capacity

    # ---- workers ---------------------------------------------------------------------

    def launch(self, argv: list[str], output: Path, name: str) -> WorkerHandle:
        args = ["sbatch", "--parsable", "--no-requeue", "--export=ALL"]
        args += [f"--job-name={name}", f"--output={output}"]
        if self.partition is not None:
            args.append(f"--partition={self.partition}")
        if self.gres is not None:
            args.append(f"--gres={self.gres}")
        args += [f"--cpus-per-task={self.cpus_per_worker}", *self.sbatch_args]
        args += ["--wrap", "exec " + shlex.join(argv)]
        done = self.command(args, check=False)
        if done.returncode != 0:
            raise LaunchError(f"{name}: sbatch refused it: {done.stderr.strip()}")
        job = _SlurmJob(self, done.stdout.strip().split(";")[0])
        self._jobs.append(job)
        return job

    def refresh(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last_refresh < self._refresh_s:
            return
        self._last_refresh = now
        live = {job.job_id: job for job in self._jobs if job.ended is None}
        if live:
            done = self.command(
                ["squeue", "-h", "--states=all", "-j", ",".join(live), "-o", "%i|%T|%N"],
                check=False,
            )
            if done.returncode == 0 or "Invalid job id" in done.stderr:
                rows = {}
                for line in done.stdout.splitlines():
                    job_id, state, node = [*line.split("|"), "", ""][:3]
                    rows[job_id] = (state, node)
                for job_id, job in live.items():
                    if job_id in rows:
                        job.update(*rows[job_id])
                    else:
                        job.lost()
        if self.partition is not None:
            self._capacity = self._slots(up_only=True)

    def end_of(self, job_id: str, state: str) -> Ended:
        """How job ``job_id``, in end state ``state``, ended (its exit code, if the
        controller still has it)."""
        done = self.command(["scontrol", "show", "job", "-o", job_id], check=False)
        found = re.search(r"\bExitCode=(\d+):(\d+)", done.stdout)
        code: int | None = None
        if found:
            status, signum = int(found[1]), int(found[2])
            code = -signum if signum else status
        if state in _CAUSES:
            # Ended by the cluster: an exit code 0:0 is Slurm's "none", not the worker's.
            return Ended(code or None, _CAUSES[state])
        if code is None:
            return Ended(None, "exited" if state == "COMPLETED" else "failed")
        return Ended(code, "exited" if code == 0 else "signal" if code < 0 else "failed")

    def close(self) -> None:
        self.refresh(force=True)
        deadline = time.monotonic() + _CLOSE_TIMEOUT_S
        while time.monotonic() < deadline:
            alive = [job for job in self._jobs if job.ended is None]
            if not alive:
                return
            # Again every round: a job pending at the last refresh may have started.
            for job in alive:
                job.kill()
            for _ in range(10):
                time.sleep(0.2)
                self.refresh(force=True)
                if all(job.ended is not None for job in alive):
                    break

    def describe(self) -> dict[str, object]:
        return {
            "backend": self.name,
            "partition": self.partition,
            "gres": self.gres,
            "cpus_per_worker": self.cpus_per_worker,
            "sbatch_args": self.sbatch_args,
        }

    def command(self, argv: list[str], check: bool = True) -> subprocess.CompletedProcess[str]:
        """Runs one of Slurm's client commands in this launcher's environment, bounded
        in time; LaunchError if it is missing, does not answer, or (``check``) fails."""
        try:
            done = subprocess.run(
                argv, env=self._env, capture_output=True, text=True, timeout=_COMMAND_TIMEOUT_S
            )
        except FileNotFoundError:
            raise LaunchError(f"{argv[0]} is not installed (Slurm's client commands)") from None
        except subprocess.TimeoutExpired:
            raise LaunchError(
                f"{shlex.join(argv)} did not answer within {_COMMAND_TIMEOUT_S:g} s"
            ) from None
        if check and done.returncode != 0:
            raise LaunchError(f"{shlex.join(argv)} exited {done.returncode}: {done.stderr.strip()}")
        return done


def _gres_count(listing: str, want: str) -> int:
    """How many workers asking ``want`` (``gpu:1``, ``gpu:a100:1``) fit in a node's GRES
    as sinfo lists them (``gpu:2``, ``gpu:a100:4(S:0-1)``, comma-separated)."""
    *want_name, per_worker = want.split(":")
    total = 0
    for item in listing.split(","):
        parts = re.sub(r"\(.*?\)", "", item).split(":")
        if len(parts) < 2 or not parts[-1].isdigit():
            continue
        *name, count = parts
        if name[: len(want_name)] == want_name:
            total += int(count)
    return total // int(per_worker)
