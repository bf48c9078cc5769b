"""Where a cluster run's workers start: the ``Launcher`` interface (base) and its
backends, ``local`` (processes on this machine, emulated slots) and ``slurm`` (one Slurm
job per worker). The runner (vflow/cluster/runner.py) drives either with the same
policy code."""

from vflow.cluster.launchers.base import Ended, Launcher, LaunchError, WorkerHandle
from vflow.cluster.launchers.local import LocalLauncher
from vflow.cluster.launchers.slurm import SlurmLauncher

BACKENDS = ("local", "slurm")

__all__ = [
    "BACKENDS",
    "Ended",
    "LaunchError",
    "Launcher",
    "LocalLauncher",
    "SlurmLauncher",
    "WorkerHandle",
]
