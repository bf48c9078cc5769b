"""The real runner: ``python -m vflow cluster run`` plays a trace under a policy with
real elastic vflow jobs on this machine, and measures what the simulator assumes.

    python -m vflow cluster run --trace TRACE.json --policy wfs --out RESULT.json

It hosts the jobs' rendezvous store in-process and replays the trace in real time from
the run's start (t = 0): at each job's arrival, at each job's completion, and every
``interval_s`` of a policy that has one, it calls the policy on the active jobs and
applies the difference. A start launches the job's worker processes, a grow launches
more, a shrink sends SIGTERM to the job's most recently launched workers, which leave
after their current step (vflow.elastic). A job is done when its workers have logged its
last step and exited. Preemption (a running job put back to 0 workers, which only
``las`` does) is not supported: ``las`` is refused before anything starts (Note
[No preemption]).

A slot is an emulated device. Each worker is a process on this machine that sleeps
before every step for the job's device time at its current worker count, less its real
compute (Note [Emulated device time] in vflow/demo/cluster_worker.py), so one CPU machine
holds a cluster of slots, and a job's throughput is what the trace's ``step_s`` says,
measured through real processes, rendezvous, joins, leaves and state transfers. What it
does not show: contention for real devices, network bandwidth between machines, the
real compute of a large model (a joiner's state transfer is that of a small CNN), and a
machine's limits on how many processes start at once (here they share the cores while
they import, which is most of a start's cost).

Each job's workers append JSON lines to ``<workdir>/<job>/worker-<n>.jsonl`` (their
output goes to ``worker-<n>.out``); the runner reads them while the run goes on and,
at the end, measures from them what the simulator's model needs (Note [What the runner
measures]). RESULT.json::

    {"policy": "wfs", "avg_jct_s": ..., "makespan_s": ...,
     "jobs": [{"name", "arrival_s", "start_s", "end_s", "jct_s",
               "resizes": [{"t", "from", "to", "kind", "at_new_size_s"}],
               "steps": ..., "workers": [{"launched_s", "ready_s", "first_step_s",
                                           "terminated_s", "exited_s", "returncode"}]}],
     "decisions": [{"t", "why", "allocation"}],
     "measured": {"start_s", "start_per_worker_s", "grow_s", "shrink_s", "launch_to_ready_s",
                  "launch_to_first_step_s", "step_s": {job: {count: s}}, "costs": [...]},
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

Note [No preemption]
Suspending a job means every worker leaving, the state saved, and a new worker set
resuming from it under a new rendezvous job id. ElasticJob has no such path: its last
leaver returns without saving, and a job whose last worker left cannot be rejoined. The
runner therefore refuses ``las`` before it launches anything, and a custom policy that
preempts anyway stops the run with RunError.

Note [Slots at a decision]
The simulator reassigns slots at the decision; here a worker holds its slot from launch
until its process exits, and a worker sent SIGTERM finishes its current step first. When
one decision shrinks a job and grows or starts another, the new workers are launched at
once, so for up to a step the leaver and the newcomer overlap on a slot. Slots are
emulated devices, so the overlap costs nothing but a little CPU; waiting for the leavers
to exit would add their step to every start that follows a shrink, a cost a real cluster
does not pay either (its scheduler reassigns the device when the leaver is done, while
the newcomer still starts up). The allocation itself never exceeds the trace's slots
(the policy's contract, checked on every call); ``config.peak_processes`` says how many
worker processes were alive at once.

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
  would mostly be the start), gives no sample.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from vflow.cluster.policies import JobState, Policy, get_policy
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
PLACEHOLDERS = ("python", "rdzv", "job", "steps", "virtual_nodes", "step_s", "seed", "log")
DEFAULT_COMMAND = (
    "{python} -m vflow.demo.cluster_worker --rdzv {rdzv} --job {job} --steps {steps} "
    "--virtual-nodes {virtual_nodes} --step-s {step_s} --seed {seed} --log {log}"
)
_PREEMPTIVE = ("las",)  # Note [No preemption]
_KILL_WAIT_S = 10.0  # a SIGKILLed process is gone within this


class RunError(RuntimeError):
    """A run that could not finish: a worker failed, or the run ran out of time."""


@dataclass
class _Worker:
    """One worker process of a job, and what its log has said so far."""

    index: int
    process: subprocess.Popen[bytes]
    log: Path
    output: IO[bytes]
    launched_s: float
    terminated_s: float | None = None
    exited_s: float | None = None
    ready_s: float | None = None
    first_step_s: float | None = None
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
            elif "step" in record and "workers" in record:
                self.steps.append({**record, "t": t})
                if self.first_step_s is None:
                    self.first_step_s = t

    def signal(self, signum: int) -> None:
        # Its process group: a template that wraps the worker in a shell stops too.
        try:
            os.killpg(self.process.pid, signum)
        except ProcessLookupError:
            pass

    def summary(self) -> dict[str, Any]:
        return {
            "log": str(self.log),
            "launched_s": self.launched_s,
            "ready_s": self.ready_s,
            "first_step_s": self.first_step_s,
            "terminated_s": self.terminated_s,
            "exited_s": self.exited_s,
            "returncode": self.process.returncode,
        }


class _Job:
    """A job of the trace: its worker processes, the allocation decided last, and its
    history."""

    def __init__(self, spec: JobSpec, argv: list[str], directory: Path) -> None:
        self.spec = spec
        self.directory = directory
        self._argv = argv  # with "{log}" where each worker's log goes
        self.allocation = 0
        self.workers: list[_Worker] = []
        self.resizes: list[dict[str, Any]] = []
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

    def resize(self, to: int, now: float) -> None:
        """Applies the policy's new allocation ``to`` (Note [Slots at a decision])."""
        old = self.allocation
        if to == old:
            return
        if to == 0:
            raise RunError(
                f"the policy preempted job {self.name!r} ({old} -> 0 workers), which the real "
                "runner cannot do (Note [No preemption] in vflow/cluster/runner.py)"
            )
        self._attain(now)
        kind = "start" if old == 0 else "grow" if to > old else "shrink"
        self.allocation = to
        self.resizes.append({"t": now, "from": old, "to": to, "kind": kind, "at_new_size_s": None})
        if to > old:
            if self.start_s is None:
                self.start_s = now
            for _ in range(to - old):
                self._launch(now)
        else:
            staying = [w for w in self.alive() if w.terminated_s is None]
            for worker in staying[to:]:
                worker.signal(signal.SIGTERM)
                worker.terminated_s = now

    def _launch(self, now: float) -> None:
        index = len(self.workers)
        log = self.directory / f"worker-{index}.jsonl"
        argv = [arg.replace("{log}", str(log)) for arg in self._argv]
        output = open(self.directory / f"worker-{index}.out", "wb")
        try:
            process = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=output,
                stderr=subprocess.STDOUT,
                # Its own process group: the runner alone decides when it stops (a Ctrl-C
                # in the terminal reaches the runner, which kills it).
                start_new_session=True,
            )
        except OSError as e:
            output.close()
            raise RunError(f"job {self.name!r}: cannot start {shlex.join(argv)}: {e}") from e
        self.workers.append(_Worker(index, process, log, output, now))

    def poll(self, now: float, t0: float) -> None:
        """Reads the workers' logs and notes the workers that exited; RunError for one
        that failed."""
        for worker in self.workers:
            if worker.exited_s is not None:
                continue
            returncode = worker.process.poll()
            worker.read_log(t0)
            if returncode is None:
                continue
            worker.exited_s = now
            worker.output.close()
            # A worker sent SIGTERM before it installed its handler dies of it: it had
            # not joined, so the job did not notice.
            ok = (0, -signal.SIGTERM) if worker.terminated_s is not None else (0,)
            if returncode not in ok:
                raise RunError(
                    f"job {self.name!r}: worker {worker.index} exited with status {returncode}; "
                    f"its output ({self.directory / f'worker-{worker.index}.out'}) ends:\n"
                    + _tail(self.directory / f"worker-{worker.index}.out")
                )
        if self.allocation and not self.alive() and self.end_s() is None:
            raise RunError(
                f"job {self.name!r}: every worker exited before its last step "
                f"(step {self.spec.steps - 1}) was logged; see {self.directory}"
            )

    def finished(self) -> bool:
        return self.done_s is None and self.end_s() is not None and not self.alive()

    def finish(self, now: float) -> None:
        self._attain(now)
        self.allocation = 0
        self.done_s = now

    def kill(self) -> None:
        for worker in self.alive():
            worker.signal(signal.SIGKILL)
        for worker in self.alive():
            try:
                worker.process.wait(timeout=_KILL_WAIT_S)
            except subprocess.TimeoutExpired:
                pass
        for worker in self.workers:
            worker.output.close()

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
    preemptive policy (Note [No preemption]), a job name that cannot name a folder, a
    template that does not format."""
    if policy.name in _PREEMPTIVE:
        raise ValueError(
            f"policy {policy.name!r} preempts jobs, which the real runner does not support "
            "(an elastic job cannot be suspended and resumed; Note [No preemption] in "
            "vflow/cluster/runner.py); use the simulator for it, or an elastic or static policy"
        )
    for spec in trace.jobs:
        if spec.name in (".", "..") or "/" in spec.name or "\0" in spec.name:
            raise ValueError(
                f"job {spec.name!r}: the real runner needs names that can name a folder "
                "(no '/', not '.' or '..')"
            )
        _argv(spec, 0, "127.0.0.1:1", spec.command or command or DEFAULT_COMMAND)


def _argv(spec: JobSpec, seed: int, rdzv: str, template: str) -> list[str]:
    """The worker command of ``spec``, with the literal "{log}" left for each worker."""
    values = {
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
    ) -> None:
        self.trace = trace
        self.policy = policy
        self.timeout_s = timeout_s
        self.poll_s = poll_s
        self.jobs: list[_Job] = []
        for seed, spec in enumerate(trace.jobs):
            directory = workdir / spec.name
            directory.mkdir()
            template = spec.command or command or DEFAULT_COMMAND
            self.jobs.append(_Job(spec, _argv(spec, seed, rdzv, template), directory))
        self.decisions: list[dict[str, Any]] = []
        self.peak_processes = 0
        self.t0 = time.time()

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
            for job in active:
                job.poll(now, self.t0)
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
        allocation = self.policy(self.trace.slots, [job.state(now) for job in active])
        self.decisions.append({"t": now, "why": why, "allocation": dict(allocation)})
        # Shrinks first, so that the leavers are on their way before newcomers start.
        for job in sorted(active, key=lambda j: allocation[j.name] - j.allocation):
            job.resize(allocation[job.name], now)

    def kill(self) -> None:
        for job in self.jobs:
            job.kill()


def run_trace(
    trace: Trace,
    policy: Policy,
    workdir: str | Path,
    *,
    command: str | None = None,
    timeout_s: float = 3600.0,
    poll_s: float = 0.05,
) -> dict[str, Any]:
    """Plays ``trace`` under ``policy`` for real (module docstring) and returns the
    result (RESULT.json's content). ``workdir``: an empty or new folder for the workers'
    logs and output. ``command``: the worker command template of jobs without one of
    their own (default DEFAULT_COMMAND; placeholders PLACEHOLDERS, formatted with
    shell-quoted values, then split like a shell line). Every worker process is killed
    when the run ends, by success, error or interrupt. Raises ValueError before starting
    anything when it cannot play the trace, RunError when a worker fails or the run takes
    longer than ``timeout_s`` seconds."""
    check_runnable(trace, policy, command)
    if not (math.isfinite(timeout_s) and timeout_s > 0):
        raise ValueError(f"timeout_s must be seconds > 0, got {timeout_s!r}")
    if not (math.isfinite(poll_s) and poll_s > 0):
        raise ValueError(f"poll_s must be seconds > 0, got {poll_s!r}")
    folder = Path(workdir)
    if folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
        raise ValueError(f"workdir must be an empty or new folder, got {str(folder)!r}")
    folder.mkdir(parents=True, exist_ok=True)
    # The c10d store has no authentication: it listens on loopback only, which the
    # workers, all on this machine, reach.
    try:
        store = serve("127.0.0.1", 0)
    except OSError as e:
        raise RunError(f"cannot host the rendezvous store on 127.0.0.1: {e}") from e
    rdzv = f"127.0.0.1:{store.port}"
    run = _Run(trace, policy, folder, command, rdzv, timeout_s, poll_s)
    try:
        run.run()
    finally:
        run.kill()
        del store
    wall_s = run.now()
    return _result(run, rdzv, str(folder), wall_s)


def _result(run: _Run, rdzv: str, workdir: str, wall_s: float) -> dict[str, Any]:
    jobs = []
    step_s: dict[str, dict[str, float]] = {}
    costs: list[dict[str, Any]] = []
    for job in run.jobs:
        steps = job.steps()
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
                "steps": len(steps),
                "workers": [worker.summary() for worker in job.workers],
            }
        )
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
        },
    }


def _simulator_costs(costs: list[dict[str, Any]]) -> dict[str, float | None]:
    """The simulator's costs from the samples (Note [What the runner measures]): grow and
    shrink, the medians; a start, a line through its costs by worker count (Note [Starts
    that share the cores]). A cost below 0 (a shrink: the step in flight still ran at the
    faster old size) is 0 to the simulator; None where no sample was taken."""
    grow = _median([c["cost_s"] for c in costs if c["kind"] == "grow"])
    shrink = _median([c["cost_s"] for c in costs if c["kind"] == "shrink"])
    starts = [(c["to"], c["cost_s"]) for c in costs if c["kind"] == "start"]
    start: float | None = _median([cost for _, cost in starts])
    per_worker = 0.0
    if len({workers for workers, _ in starts}) >= 2:
        slope, intercept = statistics.linear_regression(*zip(*starts))
        if slope > 0:
            start, per_worker = intercept, slope
    return {
        "start_s": None if start is None else max(0.0, start),
        "start_per_worker_s": per_worker,
        "grow_s": None if grow is None else max(0.0, grow),
        "shrink_s": None if shrink is None else max(0.0, shrink),
    }


def measured_costs(result: dict[str, Any]) -> Costs:
    """The simulator's costs from a run's RESULT.json (``result["measured"]``): a
    start's intercept and slope per worker (its restart alike), the medians of grows and
    shrinks; where the run saw no such event, vflow's usual one (``MEASURED``)."""
    measured = result.get("measured") or {}

    def pick(name: str) -> float:
        value = measured.get(name)
        return float(value) if isinstance(value, (int, float)) else getattr(MEASURED, name)

    start = pick("start_s")
    return Costs(start, pick("grow_s"), pick("shrink_s"), start, pick("start_per_worker_s"))


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
        t1 = next((t for _, t, w in steps if t > t0 and w == size), None)
        if t1 is None or t1 > limit:
            continue
        resize["at_new_size_s"] = t1
        before = [w for _, t, w in steps if t <= t0]
        running = before[-1:] == [resize["from"]] if resize["kind"] != "start" else not before
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
            "Play a cluster trace under a scheduling policy with real elastic vflow jobs on "
            "this machine (each slot an emulated device), and measure the start, grow and "
            "shrink costs and step times the simulator assumes. The jobs' rendezvous store "
            "runs in this process; the c10d store has no authentication, so it listens on "
            "loopback (127.0.0.1) only."
        ),
    )
    parser.add_argument("--trace", required=True, metavar="TRACE.json", help="the trace")
    parser.add_argument("--policy", required=True, metavar="NAME", help="a policy, not las")
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
        policy = get_policy(args.policy)
        check_runnable(trace, policy)
    except (TraceError, ValueError) as e:
        return refuse(str(e))
    workdir = args.workdir
    if workdir is not None and Path(workdir).exists():
        folder = Path(workdir)
        if not folder.is_dir() or any(folder.iterdir()):
            return refuse(f"--workdir must be an empty or new folder, got {workdir!r}")
    if workdir is None:
        workdir = tempfile.mkdtemp(prefix=f"{out.stem}-", suffix=".work", dir=out.parent)

    def interrupted(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupted)
    try:
        result = run_trace(trace, policy, workdir, timeout_s=args.timeout)
    except ValueError as e:  # the workdir filled up since it was checked
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
