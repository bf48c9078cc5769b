"""The real runner: ``python -m vflow cluster run`` plays a trace under a policy with
real elastic vflow jobs, and measures what the simulator assumes.

    python -m vflow cluster run --trace TRACE.json --policy wfs --out RESULT.json
    python -m vflow cluster run --backend slurm --trace T --policy wfs --out R [--partition P]

It hosts the jobs' rendezvous store in-process and replays the trace in real time from
the run's start (t = 0): at each job's arrival, at each job's completion, at each
failure, when the cluster's usable slots change, and every ``interval_s`` of a policy
that has one, it calls the policy on the active jobs and applies the difference. A
start launches the job's workers, a grow launches more, a shrink asks the job's most
recently launched workers to leave (SIGTERM), which they do after their current step
(vflow.elastic). A job is done when its workers have logged its last step and exited.
A preemption (a running job put back to 0 workers, which ``las`` does) suspends the job
whole, and a restart resumes it from its checkpoint (Note [Preemption]).

Where a worker starts is the launcher's business (vflow/cluster/launchers): ``local``
(the default) starts processes on this machine, ``slurm`` one Slurm job per worker;
the policy, the event loop and the measurements are the same code for both.

Note [Failures are events]
A worker that ends without being asked to (a crash, SIGKILL, OOM, its node lost) does
not end the run: its job goes on without it (vflow.elastic drops a worker that stops
answering and the others redo the step), its slot is free, and the policy is asked
again (``why``: "J lost worker N (cause)"), which may give the job another worker. The
loss is a resize of kind ``failure`` in the job's history and a record in its
``failures``. A launcher that reports fewer usable slots (Slurm: a node down) makes the
policy share fewer until they return. What still ends the run: a job whose every
worker ended before its last step, since its state ended with them.

A slot of the local backend is an emulated device. Each worker is a process on this
machine that sleeps before every step for the job's device time at its current worker
count, less its real compute (Note [Emulated device time] in
vflow/demo/cluster_worker.py), so one CPU machine holds a cluster of slots, and a job's
throughput is what the trace's ``step_s`` says, measured through real processes,
rendezvous, joins, leaves and state transfers. What it does not show: contention for
real devices, network bandwidth between machines, the real compute of a large model (a
joiner's state transfer is that of a small CNN), and a machine's limits on how many
processes start at once (here they share the cores while they import, which is most of a
start's cost). On the slurm backend a slot is what ``--gres`` names (a GPU) on a node
Slurm picks; the default worker still emulates its device time, so the same trace runs
on a cluster of fake GPUs (tests/support/slurm.py) as on real ones.

Each job's workers append JSON lines to ``<workdir>/<job>/worker-<n>.jsonl`` (their
output goes to ``worker-<n>.out``); the runner reads them while the run goes on and,
at the end, measures from them what the simulator's model needs (Note [What the runner
measures]). RESULT.json::

    {"policy": "wfs", "avg_jct_s": ..., "makespan_s": ...,
     "jobs": [{"name", "arrival_s", "start_s", "end_s", "jct_s",
               "resizes": [{"t", "from", "to", "kind", "at_new_size_s", "after_release"}],
               "failures": [{"t", "worker", "cause", "returncode", "where", "output"}],
               "steps": ..., "workers": [{"log", "id", "where", "host", "device",
                                           "gpu", "launched_s", "placed_s", "ready_s",
                                           "first_step_s", "terminated_s", "exited_s",
                                           "returncode", "cause"}]}],
     "decisions": [{"t", "why", "slots", "allocation"}],
     "measured": {"start_s", "start_per_worker_s", "restart_s", "grow_s", "shrink_s",
                  "release_s", "launch_to_ready_s", "launch_to_first_step_s",
                  "step_s": {job: {count: s}}, "costs": [...]},
     "measured_trace": {"slots", "jobs"},
     "config": {...}}

Times are seconds from the run's start; ``end_s`` is the completion of the job's last
step, ``jct_s`` = ``end_s - arrival_s``, ``makespan_s`` the last ``end_s``.

Note [Starts that share the cores]
A job's start launches all its workers at once, and here they import torch and build
their executors on the same 2 cores: a start's cost grows with its workers (3.8 s for
one, 13-16 s for eight, measured), where on a cluster each would start on a machine of
its own. One median for every start would make the simulator wrong in both directions
(one job in eight off by a third in each validation run), so the runner fits a line through
the starts' costs by worker count and gives the simulator its intercept and slope
(``start_s`` and ``start_per_worker_s``).

Note [Preemption]
A policy that puts a running job back to 0 workers preempts it: the runner sends every
worker SIGUSR1 (the launcher's ``suspend``), and the job stops whole at one step, its
state saved once to its checkpoint (``{checkpoint}``, ``<workdir>/<job>/checkpoint.pt``;
Note [Suspending a job] in vflow/elastic/job.py); each worker logs
``{"suspended": true, "step": k}`` and exits. When the policy gives it workers again,
the runner launches them with the same job id and checkpoint, and they resume it from
step k (a resize of kind ``restart``, whose cost the simulator's ``restart_s`` is). A
restart decided while the suspended workers are still stopping waits until they have
exited, so that the newcomers never knock on the set that is suspending. A worker
template used under a preemptive policy must pass ``{checkpoint}``.

Note [Slots at a decision]
The simulator reassigns slots at the decision (unless its ``release_s`` says otherwise:
Note [Slots released late]); here a worker holds its slot from launch until its
process exits, and a worker sent SIGTERM finishes its current step first. When
one decision shrinks a job and grows or starts another, the new workers are launched at
once. On the local backend, for up to a step the leaver and the newcomer overlap on a
slot: slots are emulated devices, so the overlap costs nothing but a little CPU. On
Slurm the newcomer's job waits (pending) until the leaver's job ends and Slurm gives it
the GPU, as on any cluster. Waiting for the leavers to exit before submitting would add
their step to every start that follows a shrink, which the cluster's own queue already
avoids. The allocation itself never exceeds the trace's slots (the policy's contract,
checked on every call); ``config.peak_processes`` says how many workers were alive
(launched, not yet ended) at once.

Note [What the runner measures]
The simulator's model: a job progresses at 1/step_time(w) steps per second, and a start,
grow or shrink costs it C seconds without progress, after which it runs at the new size.
From the step logs (a step's completion: the latest of its workers' log lines):

* per job and worker count w, the median step time m(w): the times between consecutive
  steps both run on w workers (so the first step after a change of size, which holds
  the change's stall, is left out);
* per resize decided at t0 to size w', the first step completed at w' after t0, at t1
  (``at_new_size_s``), and the equivalent cost C = (t1 - t0) - n * m(w'), with n the
  steps completed in (t0, t1]: the seconds the job lost against running at w' from t0.
  A start's t0 is its launch. Steps the job ran at its old size while a joiner started
  count as progress, as they do for the job. A resize whose job decided again before it
  reached w', that never ran two steps in a row at w', or that was not running at its
  old size when decided (a job shrunk while its start was still under way: the sample
  would mostly be the start), gives no sample;
* a start or restart that needed slots released at or before its decision (the
  simulator's rule, Note [Slots released late] in vflow/cluster/simulator.py: its
  decision's gains exceed the slots nobody holds; ``after_release`` in its resize)
  waited for them: its t0 is when the last of its workers got a slot (``placed_s``; on
  the local backend, at launch), and the decision's ``release`` sample is that time
  less the step boundary the releasing jobs could stop at (the decision, or their first
  step if they were still starting). ``release_s`` is their median.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import shlex
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vflow.cluster.flags import add_policy_arguments, policy_from_args
from vflow.cluster.launchers import (
    BACKENDS,
    Launcher,
    LaunchError,
    LocalLauncher,
    SlurmLauncher,
    WorkerHandle,
)
from vflow.cluster.policies import JobState, Policy
from vflow.cluster.simulator import MEASURED, Costs
from vflow.cluster.trace import JobSpec, Trace, TraceError, load_trace, write_json
from vflow.elastic.server import serve

__all__ = [
    "DEFAULT_COMMAND",
    "PLACEHOLDERS",
    "RunError",
    "check_runnable",
    "main",
    "measured_costs",
    "run_trace",
]

# What a job's command template may name ({python} is this interpreter; {log} the file
# the runner reads the worker's steps from).
PLACEHOLDERS = (
    "python", "rdzv", "job", "steps", "virtual_nodes", "step_s", "seed", "log", "checkpoint"
)  # fmt: skip
DEFAULT_COMMAND = (
    "{python} -m vflow.demo.cluster_worker --rdzv {rdzv} --job {job} --steps {steps} "
    "--virtual-nodes {virtual_nodes} --step-s {step_s} --seed {seed} --log {log} "
    "--checkpoint {checkpoint}"
)
# Resizes that release slots, and those that begin a run of the job (Note [What the
# runner measures]).
_RELEASES = ("shrink", "preempt")
_BEGINS = ("start", "restart")
# Ends of a worker asked to leave (or to suspend its job) that are the leave itself: it
# left after its step, it died of the signal before it had installed its handler (it
# had not joined, so the job did not notice), or it was cancelled before it started.
_LEFT = ("exited", "cancelled")
_LEFT_SIGNALS = (-signal.SIGTERM, -signal.SIGUSR1)


class RunError(RuntimeError):
    """A run that could not finish: a worker failed, or the run ran out of time."""


@dataclass
class _Worker:
    """One worker process of a job, and what its log has said so far."""

    index: int
    handle: WorkerHandle
    log: Path
    output: Path
    launched_s: float
    # when the launcher placed it (on Slurm: its job started running on a node)
    placed_s: float | None = None
    terminated_s: float | None = None
    exited_s: float | None = None
    ready_s: float | None = None
    first_step_s: float | None = None
    host: str | None = None
    device: str | None = None
    gpu: int | None = None  # the index among ``device`` it would use (vflow.world.devices)
    suspended_step: int | None = None
    steps: list[dict[str, Any]] = field(default_factory=list)
    _offset: int = 0

    def read_log(self, t0: float) -> None:
        """Takes in the whole lines appended since the last read (a line being written
        waits for the next), with their times made relative to ``t0``."""
        try:
            with open(self.log, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return
        end = data.rfind(b"\n") + 1
        self._offset += end
        for line in data[:end].splitlines():
            try:
                record = json.loads(line)
                t = float(record["t"]) - t0
            except (ValueError, KeyError, TypeError):
                raise RunError(
                    f"{self.log}: not a worker's log line (JSON with a time 't'): {line[:200]!r}"
                ) from None
            if record.get("ready"):
                self.ready_s = t
                self.host = record.get("host")
                self.device = record.get("device")
                self.gpu = record.get("gpu")
            elif record.get("suspended"):
                self.suspended_step = record.get("step")
            elif "step" in record and "workers" in record:
                self.steps.append({**record, "t": t})
                if self.first_step_s is None:
                    self.first_step_s = t

    def left(self) -> bool:
        """Whether it ended as a worker asked to leave does (``_LEFT``)."""
        ended = self.handle.ended
        if ended is None or self.terminated_s is None:
            return False
        return ended.cause in _LEFT or ended.returncode in _LEFT_SIGNALS

    def summary(self) -> dict[str, Any]:
        ended = self.handle.ended
        return {
            "log": str(self.log),
            "id": self.handle.ident,
            "where": self.handle.where,
            "host": self.host,
            "device": self.device,
            "gpu": self.gpu,
            "launched_s": self.launched_s,
            "placed_s": self.placed_s,
            "ready_s": self.ready_s,
            "first_step_s": self.first_step_s,
            "terminated_s": self.terminated_s,
            "exited_s": self.exited_s,
            "returncode": None if ended is None else ended.returncode,
            "cause": None if ended is None else ended.cause,
            "suspended_step": self.suspended_step,
        }


class _Job:
    """A job of the trace: its worker processes, the allocation decided last, and its
    history."""

    def __init__(self, spec: JobSpec, argv: list[str], directory: Path, launcher: Launcher) -> None:
        self.spec = spec
        self.directory = directory
        self._argv = argv  # with "{log}" where each worker's log goes
        self._launcher = launcher
        self.allocation = 0
        self.workers: list[_Worker] = []
        self.resizes: list[dict[str, Any]] = []
        self.failures: list[dict[str, Any]] = []
        # Note [Preemption]: suspended (preempted, not yet restarted), and the workers a
        # restart launches once the suspending ones have exited.
        self.suspended = False
        self._deferred = 0
        self.start_s: float | None = None
        self.done_s: float | None = None
        self.attained_s = 0.0
        self._since = 0.0  # when attained_s was last brought up to date

    @property
    def name(self) -> str:
        return self.spec.name

    def alive(self) -> list[_Worker]:
        return [w for w in self.workers if w.exited_s is None]

    def end_s(self) -> float | None:
        """The completion of the job's last step, once a worker has logged it."""
        last = [s["t"] for w in self.workers for s in w.steps if s["step"] == self.spec.steps - 1]
        return max(last) if last else None

    def state(self, now: float) -> JobState:
        self._attain(now)
        return JobState(self.spec, self.allocation, self.start_s is not None, self.attained_s)

    def _attain(self, now: float) -> None:
        self.attained_s += self.allocation * (now - self._since)
        self._since = now

    def leaving(self) -> int:
        """Workers asked to leave or to suspend that still hold their slots."""
        return sum(w.terminated_s is not None for w in self.alive())

    def resize(self, to: int, now: float, after_release: bool = False) -> None:
        """Applies the policy's new allocation ``to`` (Note [Slots at a decision]);
        ``after_release``: a start or restart that needs slots released at or before
        this decision (Note [Slots released late], vflow/cluster/simulator.py)."""
        old = self.allocation
        if to == old:
            return
        self._attain(now)
        if to == 0:
            kind = "preempt"
        elif old == 0:
            kind = "start" if self.start_s is None else "restart"
        else:
            kind = "grow" if to > old else "shrink"
        self.allocation = to
        self.resizes.append({"t": now, "from": old, "to": to, "kind": kind, "at_new_size_s": None})
        if kind in ("start", "restart"):
            self.resizes[-1]["after_release"] = after_release
        if kind == "preempt":
            # Note [Preemption]: the whole set stops at one step, its state saved.
            self.suspended = True
            self._deferred = 0
            for worker in self.alive():
                if worker.terminated_s is None:
                    worker.handle.suspend()
                    worker.terminated_s = now
        elif kind == "restart" and self.alive():
            self._deferred = to  # launched once the suspending workers have exited
        elif to > old:
            if self.start_s is None:
                self.start_s = now
            self.suspended = False
            for _ in range(to - old):
                self._launch(now)
        else:
            staying = [w for w in self.alive() if w.terminated_s is None]
            for worker in staying[to:]:
                worker.handle.leave()
                worker.terminated_s = now

    def _launch(self, now: float) -> None:
        index = len(self.workers)
        log = self.directory / f"worker-{index}.jsonl"
        output = self.directory / f"worker-{index}.out"
        argv = [arg.replace("{log}", str(log)) for arg in self._argv]
        try:
            handle = self._launcher.launch(argv, output, f"{self.name}.{index}")
        except LaunchError as e:
            raise RunError(f"job {self.name!r}: {e}") from e
        worker = _Worker(index, handle, log, output, now)
        if handle.where is not None:
            worker.placed_s = now
        self.workers.append(worker)

    def poll(self, now: float, t0: float) -> list[str]:
        """Reads the workers' logs and notes the workers that ended (as of the
        launcher's last refresh). A worker that ended without being asked to is a
        failure (Note [Failures are events]): the job goes on without it, its slot is
        free, and the returned reason asks the policy again. RunError when the job has
        no worker left and its last step is not logged: its state is gone with them."""
        why = []
        for worker in self.workers:
            if worker.exited_s is not None:
                continue
            ended = worker.handle.ended
            if worker.placed_s is None and worker.handle.where is not None:
                worker.placed_s = now
            worker.read_log(t0)
            if ended is None:
                continue
            worker.exited_s = now
            if worker.terminated_s is not None and worker.left():
                continue
            if self.end_s() is not None and ended.ok:
                continue  # the job is done: a worker that had not joined yet ends at once
            failure = {
                "t": now,
                "worker": worker.index,
                "cause": ended.cause,
                "returncode": ended.returncode,
                "where": worker.handle.where,
                "output": _tail(worker.output, 5),
            }
            self.failures.append(failure)
            if worker.terminated_s is None:
                # Its slot is free: the job runs on one worker fewer until the policy
                # gives it another.
                self._attain(now)
                self.allocation -= 1
                worker.terminated_s = now
                self.resizes.append(
                    {"t": now, "from": self.allocation + 1, "to": self.allocation,
                     "kind": "failure", "at_new_size_s": None}
                )  # fmt: skip
            why.append(f"{self.name} lost worker {worker.index} ({ended.cause})")
        if self._deferred and not self.alive():
            count, self._deferred = self._deferred, 0
            self.suspended = False
            for _ in range(count):
                self._launch(now)
        if self.end_s() is not None:
            # Done: a worker still starting (on Slurm: perhaps waiting for a GPU) would
            # only find the job finished; it leaves now, and frees the job's slots.
            for worker in self.alive():
                if worker.ready_s is None and worker.terminated_s is None:
                    worker.handle.leave()
                    worker.terminated_s = now
        elif self.start_s is not None and not self.alive() and not self.suspended:
            raise RunError(
                f"job {self.name!r}: every worker ended before its last step "
                f"(step {self.spec.steps - 1}) was logged, and its state with them; see "
                f"{self.directory}"
                + "".join(
                    f"\nworker {f['worker']}: {f['cause']} (status {f['returncode']}), "
                    f"its output ends:\n{f['output']}"
                    for f in self.failures[-3:]
                )
            )
        return why

    def finished(self) -> bool:
        return self.done_s is None and self.end_s() is not None and not self.alive()

    def finish(self, now: float) -> None:
        self._attain(now)
        self.allocation = 0
        self.done_s = now

    def steps(self) -> list[tuple[int, float, int]]:
        """(step, completion, workers) of every step logged, in step order; a step's
        completion is the latest of its workers' lines."""
        seen: dict[int, tuple[float, int]] = {}
        for worker in self.workers:
            for record in worker.steps:
                t = seen.get(record["step"], (-math.inf, 0))[0]
                seen[record["step"]] = (max(t, record["t"]), record["workers"])
        return [(k, t, w) for k, (t, w) in sorted(seen.items())]


def check_runnable(trace: Trace, policy: Policy, command: str | None = None) -> None:
    """ValueError naming the problem if the runner cannot play ``trace`` under
    ``policy`` with the default worker ``command`` template (None: DEFAULT_COMMAND): a
    job name that cannot name a folder, a template that does not format, or one without
    ``{checkpoint}`` under a policy that preempts (Note [Preemption])."""
    for spec in trace.jobs:
        if spec.name in (".", "..") or "/" in spec.name or "\0" in spec.name:
            raise ValueError(
                f"job {spec.name!r}: the real runner needs names that can name a folder "
                "(no '/', not '.' or '..')"
            )
        template = spec.command or command or DEFAULT_COMMAND
        _argv(spec, 0, "127.0.0.1:1", template, "checkpoint.pt")
        if policy.preemptive and "{checkpoint}" not in template:
            raise ValueError(
                f"job {spec.name!r}: policy {policy.name!r} preempts jobs, and a preempted "
                "job resumes from its checkpoint: its command must pass {checkpoint} "
                "(Note [Preemption] in vflow/cluster/runner.py)"
            )


def _argv(spec: JobSpec, seed: int, rdzv: str, template: str, checkpoint: str) -> list[str]:
    """The worker command of ``spec``, with the literal "{log}" left for each worker."""
    values = {
        "checkpoint": checkpoint,
        "python": sys.executable,
        "rdzv": rdzv,
        "job": spec.name,
        "steps": str(spec.steps),
        "virtual_nodes": str(spec.virtual_nodes),
        "step_s": json.dumps({str(c): s for c, s in sorted(spec.step_s.items())}),
        "seed": str(seed),
    }
    where = f"job {spec.name!r}: command {template!r}"
    try:
        # Quoted before splitting: the values hold JSON and paths.
        text = template.format(**{k: shlex.quote(v) for k, v in values.items()}, log="{log}")
        argv = shlex.split(text)
    except (KeyError, IndexError) as e:
        raise ValueError(
            f"{where} names an unknown placeholder {e} (known: "
            + ", ".join(f"{{{p}}}" for p in PLACEHOLDERS)
            + "; write {{ and }} for braces)"
        ) from None
    except ValueError as e:
        raise ValueError(f"{where} cannot be formatted and split: {e}") from None
    if not argv:
        raise ValueError(f"{where} is empty")
    if not any("{log}" in arg for arg in argv):
        raise ValueError(f"{where} must pass {{log}}: the runner reads the worker's steps there")
    return argv


class _Run:
    """The event loop of one run (module docstring)."""

    def __init__(
        self,
        trace: Trace,
        policy: Policy,
        workdir: Path,
        command: str | None,
        rdzv: str,
        timeout_s: float,
        poll_s: float,
        launcher: Launcher,
    ) -> None:
        self.trace = trace
        self.policy = policy
        self.timeout_s = timeout_s
        self.poll_s = poll_s
        self.launcher = launcher
        self.jobs: list[_Job] = []
        for seed, spec in enumerate(trace.jobs):
            directory = workdir / spec.name
            directory.mkdir()
            template = spec.command or command or DEFAULT_COMMAND
            argv = _argv(spec, seed, rdzv, template, str(directory / "checkpoint.pt"))
            self.jobs.append(_Job(spec, argv, directory, launcher))
        self.decisions: list[dict[str, Any]] = []
        self.peak_processes = 0
        self.slots = self._slots()
        self.t0 = time.time()

    def _slots(self) -> int:
        """The slots the policy may give out: the trace's, less those the cluster lost
        (Note [Failures are events])."""
        capacity = self.launcher.capacity()
        return self.trace.slots if capacity is None else min(self.trace.slots, capacity)

    def now(self) -> float:
        return time.time() - self.t0

    def run(self) -> None:
        pending = list(self.jobs)  # in order of arrival (the trace's order)
        active: list[_Job] = []
        interval = self.policy.interval_s
        next_interval = interval if interval else math.inf
        while pending or active:
            now = self.now()
            if now > self.timeout_s:
                raise RunError(
                    f"the run did not finish within its timeout ({self.timeout_s:g} s); jobs "
                    f"not done: {', '.join(job.name for job in [*active, *pending])}"
                )
            why = []
            self.launcher.refresh()
            slots = self._slots()
            if slots != self.slots:
                why.append(f"slots {self.slots} -> {slots}")
                self.slots = slots
            for job in active:
                why += job.poll(now, self.t0)
                if job.finished():
                    job.finish(now)
                    why.append(f"{job.name} finished")
            active = [job for job in active if job.done_s is None]
            while pending and pending[0].spec.arrival_s <= now:
                why.append(f"{pending[0].name} arrived")
                active.append(pending.pop(0))
            if now >= next_interval:
                why.append("interval")
                while next_interval <= now:
                    next_interval += interval or math.inf
            if why and active:
                self._decide(now, why, active)
            self.peak_processes = max(
                self.peak_processes, sum(len(job.alive()) for job in self.jobs)
            )
            wake = min(
                pending[0].spec.arrival_s if pending else math.inf, next_interval, self.timeout_s
            )
            time.sleep(min(self.poll_s, max(wake - self.now(), 0.0)) or 0.001)

    def _decide(self, now: float, why: list[str], active: list[_Job]) -> None:
        allocation = self.policy(self.slots, [job.state(now) for job in active])
        self.decisions.append(
            {"t": now, "why": why, "slots": self.slots, "allocation": dict(allocation)}
        )
        # The simulator's rule (Note [Slots released late]): starts wait for released
        # slots when the gains exceed the slots nobody holds.
        free = self.slots - sum(job.allocation for job in active)
        free -= sum(job.leaving() for job in self.jobs)
        gains = sum(max(0, allocation[job.name] - job.allocation) for job in active)
        # Shrinks first, so that the leavers are on their way before newcomers start.
        for job in sorted(active, key=lambda j: allocation[j.name] - j.allocation):
            job.resize(allocation[job.name], now, after_release=gains > free)


def run_trace(
    trace: Trace,
    policy: Policy,
    workdir: str | Path,
    *,
    command: str | None = None,
    timeout_s: float = 3600.0,
    poll_s: float = 0.05,
    launcher: Launcher | None = None,
    host: str = "127.0.0.1",
) -> dict[str, Any]:
    """Plays ``trace`` under ``policy`` for real (module docstring) and returns the
    result (RESULT.json's content). ``workdir``: an empty or new folder for the workers'
    logs and output (on a cluster, one every node reaches at the same path).
    ``command``: the worker command template of jobs without one of their own (default
    DEFAULT_COMMAND; placeholders PLACEHOLDERS, formatted with shell-quoted values, then
    split like a shell line). ``launcher``: where workers start (default: a
    LocalLauncher, processes on this machine). ``host``: the address the jobs' store
    listens on, which every worker must reach; the c10d store has no authentication, so
    only an address on a trusted network (default loopback, enough when every worker
    runs on this machine). Every worker is stopped when the run ends, by success, error
    or interrupt. Raises ValueError or LaunchError before starting anything when it
    cannot play the trace (LaunchError: the cluster cannot), RunError when a job loses
    every worker before its end or the run takes longer than ``timeout_s`` seconds."""
    check_runnable(trace, policy, command)
    if not (math.isfinite(timeout_s) and timeout_s > 0):
        raise ValueError(f"timeout_s must be seconds > 0, got {timeout_s!r}")
    if not (math.isfinite(poll_s) and poll_s > 0):
        raise ValueError(f"poll_s must be seconds > 0, got {poll_s!r}")
    if not isinstance(host, str) or not host or host.strip() != host:
        raise ValueError(f"host must be an address the workers reach, got {host!r}")
    folder = Path(workdir)
    if folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
        raise ValueError(f"workdir must be an empty or new folder, got {str(folder)!r}")
    launcher = LocalLauncher() if launcher is None else launcher
    launcher.check(trace.slots)
    folder.mkdir(parents=True, exist_ok=True)
    try:
        store = serve(host, 0)
    except OSError as e:
        raise RunError(f"cannot host the rendezvous store on {host}: {e}") from e
    rdzv = f"{host}:{store.port}"
    try:
        run = _Run(trace, policy, folder.resolve(), command, rdzv, timeout_s, poll_s, launcher)
        run.run()
    finally:
        launcher.close()
        del store
    wall_s = run.now()
    return _result(run, rdzv, str(folder), wall_s)


def _result(run: _Run, rdzv: str, workdir: str, wall_s: float) -> dict[str, Any]:
    jobs = []
    step_s: dict[str, dict[str, float]] = {}
    costs: list[dict[str, Any]] = []
    steps_of = {job.name: job.steps() for job in run.jobs}
    for job in run.jobs:
        steps = steps_of[job.name]
        medians = _medians(steps)
        step_s[job.name] = {str(w): s for w, s in sorted(medians.items())}
        costs += _resize_costs(job, steps, medians)
        end_s = job.end_s()
        if end_s is None:
            raise RunError(f"job {job.name!r} ended without its last step in the logs")
        jobs.append(
            {
                "name": job.name,
                "arrival_s": job.spec.arrival_s,
                "start_s": job.start_s,
                "end_s": end_s,
                "jct_s": end_s - job.spec.arrival_s,
                "resizes": job.resizes,
                "failures": job.failures,
                "steps": len(steps),
                "workers": [worker.summary() for worker in job.workers],
            }
        )
    costs += _release_costs(run.jobs, steps_of)
    workers = [w for job in run.jobs for w in job.workers]
    measured = {
        **_simulator_costs(costs),
        "launch_to_ready_s": _median(
            [w.ready_s - w.launched_s for w in workers if w.ready_s is not None]
        ),
        "launch_to_first_step_s": _median(
            [w.first_step_s - w.launched_s for w in workers if w.first_step_s is not None]
        ),
        "step_s": step_s,
        "costs": costs,
    }
    measured_trace = run.trace.to_json()
    for record in measured_trace["jobs"]:
        table = {int(c): s for c, s in record["step_s"].items()}
        table.update({int(c): s for c, s in step_s[record["name"]].items()})
        record["step_s"] = {str(c): s for c, s in sorted(table.items())}
    return {
        "policy": run.policy.name,
        "avg_jct_s": statistics.fmean(job["jct_s"] for job in jobs),
        "makespan_s": max(job["end_s"] for job in jobs),
        "jobs": jobs,
        "decisions": run.decisions,
        "measured": measured,
        "measured_trace": measured_trace,
        "config": {
            "slots": run.trace.slots,
            "policy": run.policy.name,
            "elastic": run.policy.elastic,
            "interval_s": run.policy.interval_s,
            "timeout_s": run.timeout_s,
            "poll_s": run.poll_s,
            "rendezvous": rdzv,
            "workdir": workdir,
            "started_at": run.t0,
            "wall_s": wall_s,
            "peak_processes": run.peak_processes,
            "launcher": run.launcher.describe(),
        },
    }


def _simulator_costs(costs: list[dict[str, Any]]) -> dict[str, float | None]:
    """The simulator's costs from the samples (Note [What the runner measures]): grow and
    shrink, the medians; a start, a line through its costs by worker count (Note [Starts
    that share the cores]). A cost below 0 (a shrink: the step in flight still ran at the
    faster old size) is 0 to the simulator; None where no sample was taken. A restart
    (Note [Preemption]): the median of its costs less the start's slope per worker
    launched, which the simulator adds to a restart as to a start. A release: the
    median of its samples."""
    grow = _median([c["cost_s"] for c in costs if c["kind"] == "grow"])
    shrink = _median([c["cost_s"] for c in costs if c["kind"] == "shrink"])
    starts = [(c["to"], c["cost_s"]) for c in costs if c["kind"] == "start"]
    start: float | None = _median([cost for _, cost in starts])
    per_worker = 0.0
    if len({workers for workers, _ in starts}) >= 2:
        slope, intercept = statistics.linear_regression(*zip(*starts))
        if slope > 0:
            start, per_worker = intercept, slope
    restart = _median([c["cost_s"] - per_worker * c["to"] for c in costs if c["kind"] == "restart"])
    release = _median([c["cost_s"] for c in costs if c["kind"] == "release"])
    return {
        "start_s": None if start is None else max(0.0, start),
        "release_s": None if release is None else max(0.0, release),
        "restart_s": None if restart is None else max(0.0, restart),
        "start_per_worker_s": per_worker,
        "grow_s": None if grow is None else max(0.0, grow),
        "shrink_s": None if shrink is None else max(0.0, shrink),
    }


def measured_costs(result: dict[str, Any]) -> Costs:
    """The simulator's costs from a run's RESULT.json (``result["measured"]``): a
    start's intercept and slope per worker, the medians of grows, shrinks, releases and
    restarts (a run without restarts: a start's); where the run saw no such event,
    vflow's usual one (``MEASURED``)."""
    measured = result.get("measured") or {}

    def pick(name: str) -> float:
        value = measured.get(name)
        return float(value) if isinstance(value, (int, float)) else getattr(MEASURED, name)

    start = pick("start_s")
    restart = measured.get("restart_s")
    restart = float(restart) if isinstance(restart, (int, float)) else start
    return Costs(
        start,
        pick("grow_s"),
        pick("shrink_s"),
        restart,
        pick("start_per_worker_s"),
        pick("release_s"),
    )


def _median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def _medians(steps: list[tuple[int, float, int]]) -> dict[int, float]:
    """Median step time per worker count (Note [What the runner measures])."""
    gaps: dict[int, list[float]] = {}
    for (k0, t0, w0), (k1, t1, w1) in itertools.pairwise(steps):
        if k1 == k0 + 1 and w1 == w0:
            gaps.setdefault(w1, []).append(t1 - t0)
    return {w: statistics.median(values) for w, values in gaps.items()}


def _resize_costs(
    job: _Job, steps: list[tuple[int, float, int]], medians: dict[int, float]
) -> list[dict[str, Any]]:
    """Fills each resize's ``at_new_size_s`` and returns its cost sample (Note [What the
    runner measures])."""
    samples = []
    for resize, following in zip(job.resizes, [*job.resizes[1:], None]):
        t0, size = resize["t"], resize["to"]
        limit = following["t"] if following else math.inf
        if resize.get("after_release"):
            # From when the slots it waited for were free (Note [Slots released late]).
            placed = _placed(job, t0, limit)
            if placed is None:
                continue
            t0 = max(t0, placed)
        t1 = next((t for _, t, w in steps if t > t0 and w == size), None)
        if t1 is None or t1 > limit:
            continue
        resize["at_new_size_s"] = t1
        before = [w for _, t, w in steps if t <= t0]
        if resize["kind"] == "start":
            running = not before
        elif resize["kind"] == "restart":
            running = True  # from nothing, as a start: the suspended set's steps are done
        else:
            running = before[-1:] == [resize["from"]]
        if size not in medians or not running:
            continue
        n = sum(t0 < t <= t1 for _, t, _ in steps)
        samples.append(
            {
                "job": job.name,
                "kind": resize["kind"],
                "t": t0,
                "from": resize["from"],
                "to": size,
                "cost_s": (t1 - t0) - n * medians[size],
                "steps": n,
            }
        )
    return samples


def _placed(job: _Job, since: float, until: float) -> float | None:
    """When the last of the workers ``job`` launched in [since, until) was placed; None
    if one never was."""
    placed = [w.placed_s for w in job.workers if since <= w.launched_s < until]
    if not placed or None in placed:
        return None
    return max(t for t in placed if t is not None)


def _release_costs(
    jobs: list[_Job], steps: dict[str, list[tuple[int, float, int]]]
) -> list[dict[str, Any]]:
    """The samples of ``release_s`` (Note [What the runner measures]): at each decision
    whose starts waited for released slots, the wait of the last of their workers to be
    placed, from the step boundary the releasing jobs could stop at (the decision, or
    their first step if they were still starting). ``steps``: each job's ``steps()``."""
    samples = []
    waiting: dict[float, list[_Job]] = {}
    for job in jobs:
        for resize in job.resizes:
            if resize.get("after_release"):
                waiting.setdefault(resize["t"], []).append(job)
    for t, starters in sorted(waiting.items()):
        stops = []
        for job in jobs:
            released = [r for r in job.resizes if r["t"] == t and r["kind"] in _RELEASES]
            if not released:
                continue
            runs = [r["t"] for r in job.resizes if r["t"] < t and r["kind"] in _BEGINS]
            first = next((at for _, at, _ in steps[job.name] if runs and at > runs[-1]), None)
            stops.append(None if first is None else max(t, first))
        if not stops or None in stops:
            continue  # no release here, or one whose job never stepped: no boundary
        placed = []
        for job in starters:
            following = [r["t"] for r in job.resizes if r["t"] > t]
            placed.append(_placed(job, t, following[0] if following else math.inf))
        if None in placed:
            continue
        stop = max(at for at in stops if at is not None)
        samples.append(
            {
                "job": ",".join(job.name for job in starters),
                "kind": "release",
                "t": t,
                "from": None,
                "to": None,
                "cost_s": max(at for at in placed if at is not None) - stop,
                "steps": 0,
            }
        )
    return samples


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError as e:
        return f"(unreadable: {e})"


def main(argv: list[str]) -> int:
    """``python -m vflow cluster run``; returns the exit status (2: refused input, before
    anything started; 1: the run failed; 130: interrupted)."""
    parser = argparse.ArgumentParser(
        prog="python -m vflow cluster run",
        description=(
            "Play a cluster trace under a scheduling policy with real elastic vflow jobs, "
            "and measure the start, grow and shrink costs and step times the simulator "
            "assumes. Backends: local (worker processes on this machine, each slot an "
            "emulated device) and slurm (one Slurm job per worker, a slot per --gres). "
            "The jobs' rendezvous store runs in this process, listening on --host; the "
            "c10d store has no authentication, so only an address on a trusted network."
        ),
    )
    parser.add_argument("--trace", required=True, metavar="TRACE.json", help="the trace")
    parser.add_argument("--policy", required=True, metavar="NAME", help="a policy")
    parser.add_argument("--out", required=True, metavar="RESULT.json", help="the result")
    parser.add_argument(
        "--workdir",
        default=None,
        metavar="DIR",
        help="an empty or new folder for the workers' logs (default: a new one beside --out)",
    )
    parser.add_argument(
        "--timeout", type=float, default=3600.0, metavar="S", help="bound on the whole run"
    )
    add_policy_arguments(parser)
    parser.add_argument(
        "--backend", choices=BACKENDS, default="local", help="where workers run (default local)"
    )
    parser.add_argument(
        "--host",
        default="127.0.0.1",
        help="the address the jobs' store listens on, reached by every worker (default "
        "127.0.0.1: enough when every node is this machine)",
    )
    slurm = parser.add_argument_group("slurm backend")
    slurm.add_argument("--partition", default=None, help="default: the cluster's default")
    slurm.add_argument(
        "--gres",
        default="gpu:1",
        help="what each worker takes, NAME:COUNT (default gpu:1); 'none': CPUs only",
    )
    slurm.add_argument(
        "--cpus-per-worker", type=int, default=1, metavar="N", help="CPUs per worker (default 1)"
    )
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:
        return int(e.code or 0)
    out = Path(args.out)

    def refuse(message: str) -> int:
        print(f"{parser.prog}: error: {message}", file=sys.stderr)
        return 2

    if not out.parent.is_dir():
        return refuse(f"--out: the folder {str(out.parent)!r} does not exist")
    if not (math.isfinite(args.timeout) and args.timeout > 0):
        return refuse(f"--timeout must be seconds > 0, got {args.timeout}")
    try:
        trace = load_trace(args.trace)
        policy = policy_from_args(args)
        check_runnable(trace, policy)
        launcher: Launcher = LocalLauncher()
        if args.backend == "slurm":
            gres = None if args.gres == "none" else args.gres
            launcher = SlurmLauncher(args.partition, gres, args.cpus_per_worker)
        elif args.partition is not None:
            return refuse("--partition is for --backend slurm")
    except (TraceError, ValueError) as e:
        return refuse(str(e))
    workdir = args.workdir
    if workdir is not None and Path(workdir).exists():
        folder = Path(workdir)
        if not folder.is_dir() or any(folder.iterdir()):
            return refuse(f"--workdir must be an empty or new folder, got {workdir!r}")
    made = workdir is None
    if workdir is None:
        workdir = tempfile.mkdtemp(prefix=f"{out.stem}-", suffix=".work", dir=out.parent)

    def interrupted(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupted)
    try:
        result = run_trace(
            trace, policy, workdir, timeout_s=args.timeout, launcher=launcher, host=args.host
        )
    except (ValueError, LaunchError) as e:  # a cluster that cannot, a workdir filled up
        if made:
            with contextlib.suppress(OSError):
                Path(workdir).rmdir()  # still empty: nothing was started
        return refuse(str(e))
    except RunError as e:
        print(f"{parser.prog}: the run failed: {e}\n(worker logs in {workdir})", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{parser.prog}: interrupted; every worker stopped", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
    write_json(out, result)
    for job in result["jobs"]:
        print(
            f"{job['name']}: arrived {job['arrival_s']:.1f} s, started {job['start_s']:.1f} s, "
            f"ended {job['end_s']:.1f} s (JCT {job['jct_s']:.1f} s, {len(job['resizes'])} "
            "resizes)"
        )
    print(
        f"{policy.name}: average JCT {result['avg_jct_s']:.1f} s, makespan "
        f"{result['makespan_s']:.1f} s; result in {out}, worker logs in {workdir}"
    )
    return 0
