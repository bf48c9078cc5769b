"""What the runner needs from a cluster: start a worker on a slot, ask it to leave after
its step (or its job to suspend), stop it at once, notice its end and its cause, say
where it ran.

The runner's policy code and event loop are the same whatever starts the workers; a
``Launcher`` is the part that differs (``local``: processes on this machine; ``slurm``:
one Slurm job per worker). Its workers are ``WorkerHandle`` objects; ``refresh`` brings
every handle's state up to date at once, so that a launcher that asks a daemon (squeue)
asks once per poll of the runner, not once per worker.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Ended", "LaunchError", "Launcher", "WorkerHandle"]


class LaunchError(RuntimeError):
    """The cluster refused or could not do what was asked (a submit failed, the cluster
    is not there, it has fewer slots than the trace asks)."""


@dataclass(frozen=True)
class Ended:
    """How a worker ended. ``returncode``: its exit status, negative for the signal
    that killed it, None where the cluster does not say. ``cause``: ``exited`` (status
    0), ``failed`` (another status), ``signal`` (killed by one), or the cluster's own
    word for an end the worker did not choose (``node_fail``, ``cancelled``,
    ``out_of_memory``, ``timeout``, ``preempted``, ``lost``: it left the cluster's
    records without an end being seen)."""

    returncode: int | None
    cause: str

    @property
    def ok(self) -> bool:
        return self.cause == "exited"


class WorkerHandle(abc.ABC):
    """One worker started by a launcher. Its state is as of the launcher's last
    ``refresh``."""

    @property
    @abc.abstractmethod
    def ended(self) -> Ended | None:
        """How it ended, or None while it is pending or running."""

    @property
    @abc.abstractmethod
    def where(self) -> str | None:
        """Where it runs or ran (a host, or a node), or None while it waits for a slot."""

    @property
    @abc.abstractmethod
    def ident(self) -> str:
        """The cluster's name for it (a pid, a Slurm job id)."""

    @abc.abstractmethod
    def leave(self) -> None:
        """Asks it to leave after its current step (SIGTERM to the worker)."""

    @abc.abstractmethod
    def suspend(self) -> None:
        """Asks it to suspend its whole job after the current step (SIGUSR1: the job's
        state saved to its checkpoint, every worker gone; Note [Suspending a job] in
        vflow/elastic/job.py). A worker not started yet is cancelled instead."""

    @abc.abstractmethod
    def kill(self) -> None:
        """Stops it now (SIGKILL); ``Launcher.close`` waits for it to be gone."""


class Launcher(abc.ABC):
    """Starts workers on a cluster's slots (module docstring)."""

    name: str

    @abc.abstractmethod
    def check(self, slots: int) -> None:
        """LaunchError naming the problem if this cluster cannot give ``slots`` workers
        at once (too few slots, the cluster not running); nothing is started."""

    @abc.abstractmethod
    def capacity(self) -> int | None:
        """The slots usable now (nodes lost take theirs away), or None when the cluster
        does not change under the run (as of the last ``refresh``)."""

    @abc.abstractmethod
    def launch(self, argv: list[str], output: Path, name: str) -> WorkerHandle:
        """Starts ``argv`` as one worker on one slot, its output to ``output``; ``name``
        labels it on the cluster (``<job>.<n>``). LaunchError when it cannot."""

    @abc.abstractmethod
    def refresh(self) -> None:
        """Brings every handle's ``ended`` and ``where`` up to date, and ``capacity``."""

    @abc.abstractmethod
    def close(self) -> None:
        """Stops every worker still alive and waits until they are gone."""

    def describe(self) -> dict[str, object]:
        """The launcher's settings, for the run's result."""
        return {"backend": self.name}
