"""A real Slurm cluster on one machine, for the Slurm tests (issue 36): Debian's
slurm-wlm (22.05) as one controller and several nodes, each node a slurmd of its own
(Debian builds Slurm with multiple-slurmd), each with fake GPUs.

    with LocalSlurm(nodes=4, gpus=2) as slurm:   # nodes n1..n4, 2 GPUs each
        job = slurm.sbatch(["--gres=gpu:1", "-o", out, script])
        slurm.squeue()                            # {job id: (state, node)}
        slurm.run(["scancel", "--full", "--signal=TERM", job])

Everything lives in a folder of its own: the configuration, the state, the logs, a
munged of its own (its own key and socket, so a system munged is neither needed nor
touched) and the fake GPUs, character devices named ``nvidiaN`` (Slurm sets
``CUDA_VISIBLE_DEVICES`` only for GRES files that are character devices so named).
Commands find the cluster through ``SLURM_CONF`` (``env``), never /etc/slurm. Every
daemon runs in the foreground as a child of the test, and is stopped by its pid on the
way out, also when a test fails; the jobs' processes die with their slurmd's steps.

The controller and the nodes listen on loopback only, on ports free when the cluster is
made (``controller_port``, ``node_ports``), so that clusters made side by side do not
meet. ``missing()`` says why the cluster cannot be made here, or None.

For trying the Slurm backend by hand, or the Slurm validation
(``benchmarks/cluster.py --real --real-backend slurm``), it also runs on its own: it
starts the cluster, prints the line that points Slurm's commands at it, and stops it
all on Ctrl-C or SIGTERM::

    .venv/bin/python -m tests.support.slurm --nodes 4 --gpus 2
    export SLURM_CONF=/tmp/vflow-slurm-.../slurm.conf   # in another shell, as printed
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import socket
import stat
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

KILL_WAIT_S = 60  # SIGTERM to SIGKILL on scancel: longer than a training step
_DAEMONS = ("munged", "slurmctld", "slurmd")
_INSTALL = "apt-get install slurm-wlm munge"


def missing() -> str | None:
    """Why a LocalSlurm cannot be made on this machine, or None when it can."""
    if os.name != "posix" or not hasattr(os, "geteuid") or os.geteuid() != 0:
        return f"needs root and Slurm ({_INSTALL})"
    absent = [d for d in _DAEMONS if _sbin(d) is None]
    if absent or shutil.which("sbatch") is None:
        return f"needs Slurm: {_INSTALL} (missing: {', '.join(absent) or 'sbatch'})"
    return None


def _sbin(name: str) -> str | None:
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin")


class LocalSlurm:
    """``nodes`` slurmd nodes (``n1`` ...) of ``gpus`` fake GPUs and ``cpus`` CPUs
    each, in one partition (``main``), under one controller."""

    def __init__(self, nodes: int = 4, gpus: int = 2, cpus: int = 2) -> None:
        if nodes < 1 or gpus < 0 or cpus < 1:
            raise ValueError(f"need nodes >= 1, gpus >= 0, cpus >= 1; got {nodes}, {gpus}, {cpus}")
        self.nodes = [f"n{i}" for i in range(1, nodes + 1)]
        self.gpus = gpus
        self.cpus = cpus
        self.root = Path(tempfile.mkdtemp(prefix="vflow-slurm-"))
        self.conf = self.root / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self.controller_port, *self.node_ports = _free_ports(1 + nodes)
        self._procs: list[subprocess.Popen[bytes]] = []
        self._slurmd: dict[str, subprocess.Popen[bytes]] = {}

    # ---- lifecycle ---------------------------------------------------------------

    def __enter__(self) -> LocalSlurm:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def start(self) -> None:
        """Starts munged, the controller and the nodes; returns once every node is idle."""
        os.chmod(self.root, 0o755)  # munged's socket must be reachable through it
        self._write_config()
        munge = self.root / "munge"
        munge.mkdir(mode=0o700)
        key = munge / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        socket_path = munge / "munge.socket"
        self._daemon(
            [_need("munged"), "-F", "--force", f"--key-file={key}", f"--socket={socket_path}",
             f"--pid-file={munge / 'munged.pid'}", f"--log-file={munge / 'munged.log'}",
             f"--seed-file={munge / 'munged.seed'}"],
        )  # fmt: skip
        self._wait_for(lambda: socket_path.exists(), "munged's socket")
        self._daemon([_need("slurmctld"), "-D", "-c", "-f", str(self.conf)])
        self._wait_for(lambda: _listening(self.controller_port), "slurmctld")
        for node in self.nodes:
            (self.root / "spool" / node).mkdir(parents=True)
            self._start_node(node)
        self._wait_for(
            lambda: sorted(self.node_states().values()) == ["idle"] * len(self.nodes),
            "every node idle",
        )

    def stop(self) -> None:
        """Cancels the jobs left, stops every daemon it started (SIGTERM, then
        SIGKILL), nodes first, kills by pid any process of a job that outlived its node
        (slurmstepd detaches from slurmd), and removes its folder."""
        if len(self._procs) > 1 and all(p.poll() is None for p in self._procs[:2]):
            with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
                jobs = list(self.squeue())
                if jobs:
                    self.run(["scancel", "--full", "--signal=KILL", *jobs], check=False)
                    self.run(["scancel", *jobs], check=False)
                    deadline = time.monotonic() + 15
                    while self.squeue() and time.monotonic() < deadline:
                        time.sleep(0.2)
        for proc in reversed(self._procs):
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + 15
        for proc in reversed(self._procs):
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._procs.clear()
        for pid in self._leftovers():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(self.root, ignore_errors=True)

    def _leftovers(self) -> list[int]:
        """Processes started under this cluster (their environment names its
        configuration), other than this one."""
        mark = f"SLURM_CONF={self.conf}".encode()
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            try:
                environ = (entry / "environ").read_bytes()
            except OSError:
                continue
            if mark in environ.split(b"\0"):
                found.append(int(entry.name))
        return found

    @property
    def pids(self) -> list[int]:
        """The daemons' pids: munged, the controller, then the nodes (a node restarted
        after the others)."""
        return [p.pid for p in self._procs]

    def lose_node(self, node: str) -> list[int]:
        """A node lost, as a machine that dies: its slurmd and every process of the
        jobs on it (their slurmstepd and their own) killed by pid (SIGKILL), then the
        node marked down, which the controller would do itself once the node stopped
        answering (after SlurmdTimeout). The pids killed."""
        daemon = self._slurmd[node]
        procs = self._job_processes()
        jobs = {job for job, where in procs.values() if where == node}
        doomed = [pid for pid, (job, where) in procs.items() if where == node]
        doomed += [pid for pid, job in self._stepds().items() if job in jobs]
        daemon.kill()
        daemon.wait()
        self._procs.remove(daemon)  # gone for good: restore_node starts another
        for pid in doomed:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.run(["scontrol", "update", f"nodename={node}", "state=down", "reason=lost"])
        return [daemon.pid, *doomed]

    def restore_node(self, node: str) -> None:
        """Starts a lost node's slurmd again; returns once the node is idle (with
        ReturnToService=2 a down node returns when its slurmd registers)."""
        if self._slurmd[node].poll() is None:
            raise RuntimeError(f"node {node} is not lost: its slurmd runs")
        self._start_node(node)
        self._wait_for(lambda: self.node_states().get(node) == "idle", f"node {node} idle")

    def _job_processes(self) -> dict[int, tuple[str, str]]:
        """The jobs' own processes: pid -> (job id, node)."""
        found = {}
        for pid in self._leftovers():
            with contextlib.suppress(OSError):
                environ = (Path("/proc") / str(pid) / "environ").read_bytes().split(b"\0")
                values = dict(
                    e.decode(errors="replace").split("=", 1) for e in environ if b"=" in e
                )
                if "SLURM_JOB_ID" in values and "SLURMD_NODENAME" in values:
                    found[pid] = (values["SLURM_JOB_ID"], values["SLURMD_NODENAME"])
        return found

    def _stepds(self) -> dict[int, str]:
        """The slurmstepd processes of this cluster: pid -> job id."""
        found = {}
        for pid in self._leftovers():
            with contextlib.suppress(OSError):
                cmdline = (Path("/proc") / str(pid) / "cmdline").read_bytes().decode()
                if cmdline.startswith("slurmstepd: ["):
                    found[pid] = cmdline.split("[", 1)[1].split(".", 1)[0]
        return found

    # ---- commands ----------------------------------------------------------------

    def run(self, argv: list[str], check: bool = True) -> str:
        """A Slurm command against this cluster; its output."""
        done = subprocess.run(argv, env=self.env, capture_output=True, text=True, timeout=60)
        if check and done.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} exited {done.returncode}: {done.stderr.strip()}")
        return done.stdout

    def sbatch(self, args: list[str]) -> str:
        """Submits a batch job; its id."""
        return self.run(["sbatch", "--parsable", *args]).strip().split(";")[0]

    def squeue(self) -> dict[str, tuple[str, str]]:
        """Every job in the queue: its state and its node (empty while pending)."""
        out = self.run(["squeue", "-h", "-o", "%i %T %N"])
        rows = ([*line.split(), ""] for line in out.splitlines() if line.strip())
        return {row[0]: (row[1], row[2]) for row in rows}

    def node_states(self) -> dict[str, str]:
        """Each node's state as sinfo says it (idle, mixed, allocated, down, ...)."""
        out = self.run(["sinfo", "-h", "-N", "-o", "%N %t"], check=False)
        return dict(line.split() for line in out.splitlines() if line.strip())

    def completed(self) -> dict[str, dict[str, str]]:
        """The jobs that ended, as ``sacct --completion`` lists them (from the job
        completion log: accounting proper needs a slurmdbd and a database, which this
        cluster does not run): each one's ``JobName``, ``State``, ``ExitCode`` and
        ``NodeList``, by job id."""
        fields = ("JobID", "JobName", "State", "ExitCode", "NodeList")
        if not (self.root / "jobcomp.log").exists():  # no job has ended yet: sacct fails
            return {}
        out = self.run(["sacct", "--completion", "-n", "-P", "-o", ",".join(fields)])
        rows = (dict(zip(fields, line.split("|"))) for line in out.splitlines() if line.strip())
        return {row.pop("JobID"): row for row in rows}

    # ---- internals ---------------------------------------------------------------

    def _write_config(self) -> None:
        host = socket.gethostname().split(".")[0]
        gpus = self.root / "gpus"
        gpus.mkdir()
        for i in range(self.gpus):
            os.mknod(gpus / f"nvidia{i}", 0o666 | stat.S_IFCHR, os.makedev(1, 3))  # /dev/null's
        names = f"n[1-{len(self.nodes)}]"
        gres = f" Gres=gpu:{self.gpus}" if self.gpus else ""
        self.conf.write_text(
            "\n".join(
                [
                    "ClusterName=vflowtest",
                    f"SlurmctldHost={host}",
                    f"SlurmctldPort={self.controller_port}",
                    "SlurmUser=root",
                    "AuthType=auth/munge",
                    f"AuthInfo=socket={self.root / 'munge' / 'munge.socket'}",
                    "ProctrackType=proctrack/linuxproc",
                    "TaskPlugin=task/none",
                    "SelectType=select/cons_tres",
                    "SelectTypeParameters=CR_Core",
                    "GresTypes=gpu",
                    "SlurmdParameters=config_overrides",
                    f"KillWait={KILL_WAIT_S}",
                    "ReturnToService=2",
                    "MpiDefault=none",
                    f"StateSaveLocation={self.root / 'state'}",
                    f"SlurmdSpoolDir={self.root / 'spool' / '%n'}",
                    f"SlurmctldPidFile={self.root / 'slurmctld.pid'}",
                    f"SlurmdPidFile={self.root / 'slurmd-%n.pid'}",
                    f"SlurmctldLogFile={self.root / 'slurmctld.log'}",
                    f"SlurmdLogFile={self.root / 'slurmd-%n.log'}",
                    "AccountingStorageType=accounting_storage/none",
                    "JobAcctGatherType=jobacct_gather/none",
                    "JobCompType=jobcomp/filetxt",
                    f"JobCompLoc={self.root / 'jobcomp.log'}",
                    *(
                        f"NodeName={node} NodeHostname={host} NodeAddr=127.0.0.1 Port={port} "
                        f"CPUs={self.cpus} RealMemory=2000{gres}"
                        for node, port in zip(self.nodes, self.node_ports, strict=True)
                    ),
                    f"PartitionName=main Nodes={names} Default=YES MaxTime=INFINITE State=UP",
                    "",
                ]
            )
        )
        (self.root / "state").mkdir()
        if self.gpus:
            files = f"{gpus}/nvidia[0-{self.gpus - 1}]"
            (self.root / "gres.conf").write_text(f"NodeName={names} Name=gpu File={files}\n")

    def _start_node(self, node: str) -> None:
        self._daemon([_need("slurmd"), "-D", "-c", "-N", node, "-f", str(self.conf)])
        self._slurmd[node] = self._procs[-1]

    def _daemon(self, argv: list[str]) -> None:
        # The child keeps its own copy of the descriptor: this process closes its own.
        with (self.root / f"{Path(argv[0]).name}-{len(self._procs)}.out").open("wb") as log:
            self._procs.append(
                subprocess.Popen(argv, env=self.env, stdout=log, stderr=subprocess.STDOUT)
            )

    def _wait_for(self, ready: Callable[[], bool], what: str, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not ready():
            dead = [p.args for p in self._procs if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                logs = sorted(self.root.glob("*.out")) + sorted(self.root.glob("*.log"))
                tail = "\n".join(f"{f.name}: {f.read_text()[-600:]}" for f in logs)
                raise RuntimeError(f"local Slurm: no {what} (exited: {dead})\n{tail}")
            time.sleep(0.1)


def _need(name: str) -> str:
    path = _sbin(name)
    if path is None:
        raise RuntimeError(f"{name} is not installed: {_INSTALL}")
    return path


def _free_ports(count: int) -> list[int]:
    """``count`` distinct loopback ports free now (held open together while chosen)."""
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(count)]
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.support.slurm",
        description="Run a local Slurm (one controller, slurmd nodes with fake GPUs, a "
        "munged of its own) until Ctrl-C or SIGTERM; root and slurm-wlm and munge needed.",
    )
    parser.add_argument("--nodes", type=int, default=4, help="slurmd nodes n1.. (default 4)")
    parser.add_argument("--gpus", type=int, default=2, help="fake GPUs a node (default 2)")
    parser.add_argument("--cpus", type=int, default=2, help="CPUs a node (default 2)")
    args = parser.parse_args(argv)
    reason = missing()
    if reason:
        parser.error(f"cannot run a local Slurm here: {reason}")
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        with LocalSlurm(args.nodes, args.gpus, args.cpus) as cluster:
            print(
                f"local Slurm up: {len(cluster.nodes)} nodes x {cluster.gpus} GPUs, partition "
                f"main; in another shell:\nexport SLURM_CONF={cluster.conf}",
                flush=True,
            )
            while not stop.wait(1.0):
                pass
    except KeyboardInterrupt:
        pass
    print("local Slurm stopped", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
