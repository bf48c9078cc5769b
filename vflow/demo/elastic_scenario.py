"""The elastic part of the main job (``python -m vflow demo``; ``--no-elastic`` skips it).

The demo's CNN, data, loss and data order, in deterministic mode, trained by
``vflow.elastic.ElasticJob`` in worker processes while the worker set changes: worker
a starts alone, b and then c join, b is killed with SIGKILL in the middle of a step
(inside its backward), d joins, and the job finishes on a, c and d. Every finishing
worker's parameters are then compared with ``torch.equal`` against the same job run in
one process on fixed hardware (same V, seed and data order): deterministic mode makes
them bitwise equal.

The demo starts the store (``python -m vflow rendezvous``) and the four workers
(``python -m vflow.demo.elastic_scenario --worker ...``) at once; a worker prints ``ready`` once
it has imported everything and waits for ``go`` on its stdin, so that process start-up
(seconds on a busy machine) is not part of the scenario's timeline. The demo says
``go`` to a worker when the workers' logs show that the previous change is done.
Pacing: before each step in which they are fewer than three, the workers wait (at most
HOLD_S) until a worker waits to join; with three they run at full speed. Only the set's
rank 0 sees who waits (it watches the door for the set: Note [One member watches the
door] in vflow/elastic/rendezvous.py), so it holds, and the others wait for it inside
the step's first collective, whose timeout is longer than a hold. A
join then always takes two steps (the held one, and the next, which carries the
signal), however long the joiner needs to reach the store, so the scenario fits in few
steps without depending on the machine's speed. Every wait is bounded and every
process is killed on the way out.

Output: a table of the changes as the first worker saw them (``ElasticJob.events``),
the bitwise verdict, and in the demo's output folder ``elastic.png`` (the loss curve
with the changes marked, and the worker count per step), ``elastic.json`` (every
number) and ``elastic/`` (each worker's step log, stderr and final parameters).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import vflow
from vflow.bench.table import format_table
from vflow.demo import plots
from vflow.demo.digits import cross_entropy, epoch_order, make_model
from vflow.demo.progress import ProgressBar
from vflow.elastic import ElasticJob
from vflow.runtime.results import StepResult
from vflow.world.group import use_loopback_for_gloo

__all__ = ["Outcome", "ScenarioError", "run", "scenario_steps", "worker_main"]

WORKERS = 3  # the worker count the scenario grows to
FIRST, VICTIM, SECOND_JOINER, LATE_JOINER = "a", "b", "c", "d"
NAMES = (FIRST, VICTIM, SECOND_JOINER, LATE_JOINER)
# The victim dies in its second step with all three workers: the first one shows that
# the full worker set trains.
KILL_STEP = 1
# (reason, workers after) of the changes, as the first worker sees them.
PLANNED_EVENTS = [("start", 1), ("grow", 2), ("grow", WORKERS), ("crash", WORKERS - 1),
                  ("grow", WORKERS), ("finish", WORKERS)]  # fmt: skip
# The changes take 8 steps (two per join, the kill's step and its repetition); a few
# more show the final worker set train.
MIN_STEPS = 12
HOLD_S = 30.0  # the longest hold before a step (see the module docstring)
# The activation the kill hook sits on: the output of the second convolution's ReLU.
_HOOKED_LAYER = 3
# ElasticJob(timeout_s=): how long a hung worker stalls the others. The workers other
# than rank 0 wait out its hold in the step's first collective, so it exceeds HOLD_S
# (a killed worker is found at once: its connections close).
_COLLECTIVE_TIMEOUT_S = HOLD_S + 10.0
# The job's first round: workers started together within the last call start it
# together. It completes at the first poll of one of its participants after the last
# call, and they poll once a second (torch's DynamicRendezvousHandler); 1.5 s leaves
# every waiting worker one poll inside it.
_LAST_CALL_S = 1.5
_PHASE_TIMEOUT_S = 120.0
_POLL_S = 0.05


class ScenarioError(RuntimeError):
    """The scenario could not play out: a process failed, or a wait ran out."""


# ---- shared by the workers and the fixed-hardware reference ----------------------------


def scenario_steps(steps_per_epoch: int, epochs: int) -> tuple[int, int]:
    """(epochs, steps) of the scenario: ``epochs`` whole epochs, more if they have fewer
    than MIN_STEPS steps."""
    epochs = max(epochs, math.ceil(MIN_STEPS / steps_per_epoch))
    return epochs, epochs * steps_per_epoch


def build_executor(
    settings: dict[str, Any], group: dist.ProcessGroup | None, timeout: float
) -> vflow.Executor:
    """The demo's model and optimizer in deterministic mode: the same initial state in
    every worker and in the reference."""
    model = make_model(settings["seed"])
    optimizer = torch.optim.SGD(model.parameters(), lr=settings["lr"], momentum=0.9)
    return vflow.Executor(
        model,
        optimizer,
        cross_entropy,
        settings["virtual_nodes"],
        seed=settings["seed"],
        process_group=group,
        timeout=timeout,
        deterministic=True,
    )


def run_step(
    ex: vflow.Executor, step: int, x: torch.Tensor, y: torch.Tensor, settings: dict[str, Any]
) -> StepResult:
    """Global batch ``step``: the step count alone fixes the data position (epoch
    ``step // steps per epoch`` in vflow.demo.digits.epoch_order), so a batch is the same whichever
    workers compute it. This worker passes only its VNs' samples."""
    batch_size = settings["batch_size"]
    epoch, index = divmod(step, len(y) // batch_size)
    batch = epoch_order(len(y), settings["seed"], epoch)[
        index * batch_size : (index + 1) * batch_size
    ]
    lo, hi = ex.plan.worker_range(ex.rank, batch_size)
    mine = batch[lo:hi]
    return ex.step((x[mine], y[mine]), global_batch_size=batch_size)


def parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


# ---- one worker process ------------------------------------------------------------------


class Kill:
    """SIGKILLs this process inside backward: a tensor hook on an activation of this
    worker's middle VN, in its ``step``-th step (from 0) with WORKERS workers."""

    def __init__(self, step: int | None) -> None:
        self.step = step
        self.steps_run = 0
        self.full_since: int | None = None  # steps run before the worker set was full
        self.armed = False
        self.vn = 0
        self.vns_here = 0

    def begin_step(self, ex: vflow.Executor) -> None:
        if self.full_since is None and ex.world_size >= WORKERS:
            self.full_since = self.steps_run
        self.armed = (
            self.step is not None
            and self.full_since is not None
            and self.steps_run - self.full_since == self.step
        )
        self.steps_run += 1
        self.vn = 0
        self.vns_here = ex.plan.counts[ex.rank]

    def forward_hook(self, module: nn.Module, inputs: Any, output: torch.Tensor) -> None:
        if self.armed and self.vn == self.vns_here // 2:
            output.register_hook(self._fire)
        self.vn += 1

    @staticmethod
    def _fire(grad: torch.Tensor) -> torch.Tensor:
        os.kill(os.getpid(), signal.SIGKILL)
        return grad  # for the type checker: SIGKILL does not return


def _worker_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m vflow.demo.elastic_scenario",
        description="One worker of the demo's elastic scenario, started by python -m vflow "
        "demo: prints 'ready', waits for 'go' on stdin, then trains with vflow.elastic.",
    )
    parser.add_argument("--worker", action="store_true", required=True, help="run as a worker")
    parser.add_argument("--name", required=True, help="the worker's name in file names")
    parser.add_argument("--rdzv", required=True, help="HOST:PORT of the rendezvous store")
    parser.add_argument("--job", required=True, help="the job's id on the store")
    parser.add_argument("--steps", type=int, required=True, help="steps of the job")
    parser.add_argument("--dir", type=Path, required=True, help="folder for the worker's files")
    parser.add_argument("--settings", required=True, help="the demo's settings, as JSON")
    parser.add_argument("--kill-step", type=int, help="die in this step with all workers")
    parser.add_argument("--hold", type=float, default=HOLD_S, help="longest hold per step")
    parser.add_argument("--go-timeout", type=float, default=600.0, help="seconds to wait for go")
    return parser


def worker_main(argv: list[str]) -> int:
    """One worker. It reads the training set from ``DIR/data.pt``. Its log
    ``DIR/NAME.jsonl`` gets a line per committed step ({"step", "loss", "workers",
    "rank"}), one when it holds before a step ({"hold": step, "workers"}) and a last
    line {"events", "step"}; a worker that finishes the job writes its parameters to
    ``DIR/NAME.pt``."""
    args = _worker_parser().parse_args(argv)
    settings = json.loads(args.settings)
    # The job's changes, in the worker's stderr file: what to read when a run fails.
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s {args.name} %(name)s: %(message)s", force=True
    )
    # Same thread count as the reference: a condition of bitwise reproducibility on CPU.
    torch.set_num_threads(1)
    use_loopback_for_gloo()
    data = torch.load(args.dir / "data.pt", weights_only=True)
    x, y = data["x"], data["y"]
    kill = Kill(args.kill_step)
    print("ready", flush=True)
    ready, _, _ = select.select([sys.stdin], [], [], args.go_timeout)
    if not ready or sys.stdin.readline().strip() != "go":
        print(f"worker {args.name}: no 'go' on stdin within {args.go_timeout:g} s", file=sys.stderr)
        return 2

    def make_executor(group: dist.ProcessGroup, timeout: float) -> vflow.Executor:
        ex = build_executor(settings, group, timeout)
        if args.kill_step is not None:
            assert isinstance(ex.model, nn.Sequential)  # make_model's
            ex.model[_HOOKED_LAYER].register_forward_hook(kill.forward_hook)
        return ex

    with (args.dir / f"{args.name}.jsonl").open("a", buffering=1) as log:

        def train_step(ex: vflow.Executor, step: int) -> StepResult:
            kill.begin_step(ex)
            if ex.world_size < WORKERS and ex.rank == 0 and not job.waiting():
                log.write(json.dumps({"hold": step, "workers": ex.world_size}) + "\n")
                until = time.monotonic() + args.hold
                while not job.waiting() and time.monotonic() < until:
                    time.sleep(_POLL_S)
            result = run_step(ex, step, x, y, settings)
            line = {"step": step, "loss": result.loss, "workers": ex.world_size, "rank": ex.rank}
            log.write(json.dumps(line) + "\n")
            return result

        job = ElasticJob(
            args.rdzv,
            args.job,
            timeout_s=_COLLECTIVE_TIMEOUT_S,
            join_timeout_s=_PHASE_TIMEOUT_S,
            last_call_s=_LAST_CALL_S,
            keep_alive_s=0.5,
            keep_alive_attempts=4,
        )
        ex = job.run(make_executor, train_step, args.steps)
        events = [asdict(event) for event in job.events]
        log.write(json.dumps({"events": events, "step": None if ex is None else ex.step_count}))
        log.write("\n")
    if ex is not None and ex.step_count == args.steps:
        torch.save(parameters(ex.model), args.dir / f"{args.name}.pt")
    return 0


# ---- the demo's side ---------------------------------------------------------------------


@dataclass
class Outcome:
    """What the scenario did and whether it ended bitwise equal to the reference."""

    epochs: int
    steps: int
    endpoint: str = ""
    exit_codes: dict[str, int | None] = field(default_factory=dict)
    events: dict[str, list[dict[str, Any]]] = field(default_factory=dict)  # per worker
    first_steps: dict[str, int | None] = field(default_factory=dict)  # per worker
    losses: list[float] = field(default_factory=list)  # per step, as committed
    workers_per_step: list[int] = field(default_factory=list)
    reference_losses: list[float] = field(default_factory=list)
    identical: bool = False  # every finishing worker's parameters, torch.equal
    same_losses: bool = False
    max_param_diff: float = math.nan
    finishers: list[str] = field(default_factory=list)
    seconds: float = math.nan  # from starting the processes to the last worker's exit
    reference_seconds: float = math.nan

    def table_rows(self) -> list[dict[str, Any]]:
        """The changes as the first worker saw them (it is in every worker set), each
        with what caused it ("what") and a short form for the plot ("label")."""
        rows = []
        for event in self.events.get(FIRST, []):
            reason = event["reason"]
            if reason == "start":
                what, label = f"{FIRST} starts the job alone", f"start: {FIRST}"
            elif reason == "grow":
                joined = " and ".join(
                    name
                    for name, first in self.first_steps.items()
                    if name != FIRST and first == event["step"]
                )
                what, label = f"{joined or 'a worker'} joins", f"+{joined or '?'}"
            elif reason == "crash":
                what = (
                    f"{VICTIM} killed by SIGKILL in its backward; the others redo step "
                    f"{event['step']}"
                )
                label = f"{VICTIM} killed"
            elif reason == "finish":
                what, label = f"done; {', '.join(self.finishers)} hold the final state", "done"
            else:
                what = label = reason
            rows.append({**event, "what": what, "label": f"{label} → {event['workers']}"})
        return rows

    def as_planned(self) -> bool:
        """Whether the first worker saw the planned changes, and no others."""
        seen = [(event["reason"], event["workers"]) for event in self.events.get(FIRST, [])]
        return seen == PLANNED_EVENTS

    def one_worker_set(self) -> str | None:
        """None when the workers that finished the job did so as one worker set, else
        what they reported: two sets that each finished would be a split job."""
        ends = {name: events[-1] for name, events in self.events.items() if name in self.finishers}
        if (
            all(e["reason"] == "finish" for e in ends.values())
            and len({(e["round"], e["workers"]) for e in ends.values()}) == 1
            and all(e["workers"] == len(self.finishers) for e in ends.values())
        ):
            return None
        return ", ".join(f"{name}: {end}" for name, end in sorted(ends.items()))

    def verdict(self, tensors: int, virtual_nodes: int) -> str:
        if not self.identical:
            return (
                "elastic: the final parameters DIFFER from the fixed-hardware run's (expected "
                f"bitwise-equal; max difference {self.max_param_diff:.2e})"
            )
        return (
            f"elastic: the final parameters of {', '.join(self.finishers)} equal the "
            f"fixed-hardware run's bitwise (torch.equal on all {tensors} tensors; 1 process, "
            f"V={virtual_nodes}, same seed and data order)"
            + ("" if self.same_losses else ", but the loss curves differ")
        )

    def record(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "table": self.table_rows(),
            "as_planned": self.as_planned(),
            "split": self.one_worker_set(),
        }


class _Processes:
    """The store and the workers of one scenario: bounded waits; ``close`` kills every
    process still running."""

    def __init__(self, folder: Path, deadline: float) -> None:
        self.folder, self.deadline = folder, deadline
        self.store: subprocess.Popen[str] | None = None
        self.workers: dict[str, subprocess.Popen[str]] = {}
        self.env = dict(os.environ)
        # The workers import this vflow, installed or not.
        root = str(Path(vflow.__file__).resolve().parents[1])
        self.env["PYTHONPATH"] = os.pathsep.join(
            filter(None, [root, os.environ.get("PYTHONPATH", "")])
        )

    def start_store(self) -> str:
        with (self.folder / "rendezvous.err").open("w") as err:
            self.store = subprocess.Popen(
                [sys.executable, "-m", "vflow", "rendezvous", "--port", "0"],
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
                env=self.env,
            )
        return self._read_line(self.store, "the rendezvous store's address")

    def start_worker(self, name: str, argv: list[str]) -> None:
        with (self.folder / f"{name}.err").open("w") as err:
            self.workers[name] = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "vflow.demo.elastic_scenario",
                    "--worker",
                    "--name",
                    name,
                    *argv,
                ],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
                env=self.env,
            )

    def wait_ready(self, name: str) -> None:
        line = self._read_line(self.workers[name], f"worker {name} to start")
        if line != "ready":
            raise ScenarioError(f"worker {name} printed {line!r} instead of 'ready'")

    def go(self, name: str) -> None:
        stdin = self.workers[name].stdin
        assert stdin is not None
        stdin.write("go\n")
        stdin.flush()

    def wait_until(
        self, what: str, done: Callable[[], bool], alive: list[str], tick: Callable[[], None]
    ) -> None:
        """Polls ``done`` until it holds; ScenarioError when a worker of ``alive`` ends
        first or the time is up."""
        until = min(self.deadline, time.monotonic() + _PHASE_TIMEOUT_S)
        while not done():
            tick()
            for name in alive:
                code = self.workers[name].poll()
                if code is not None:
                    raise ScenarioError(
                        f"worker {name} ended (exit status {code}) while waiting for {what}"
                        f"{self.stderr_tail(name)}"
                    )
            if time.monotonic() > until:
                raise ScenarioError(f"timed out waiting for {what}")
            time.sleep(_POLL_S)
        tick()

    def stderr_tail(self, name: str) -> str:
        path = self.folder / f"{name}.err"
        text = path.read_text(errors="replace")[-3000:] if path.exists() else ""
        return f"; its stderr ({path}) ends:\n{text}" if text.strip() else ""

    def close(self) -> None:
        for proc in self.workers.values():
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=30)
        if self.store is not None:
            if self.store.poll() is None:
                self.store.terminate()
            try:
                self.store.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.store.kill()
                self.store.wait(timeout=30)
        for proc in [*self.workers.values(), *([self.store] if self.store else [])]:
            for pipe in (proc.stdin, proc.stdout):
                if pipe is not None:
                    pipe.close()

    def _read_line(self, proc: subprocess.Popen[str], what: str) -> str:
        assert proc.stdout is not None
        wait = max(0.0, min(self.deadline, time.monotonic() + _PHASE_TIMEOUT_S) - time.monotonic())
        ready, _, _ = select.select([proc.stdout], [], [], wait)
        if not ready:
            raise ScenarioError(f"timed out waiting for {what}")
        line = proc.stdout.readline().strip()
        if not line:
            raise ScenarioError(f"{what}: the process ended (exit status {proc.wait(timeout=30)})")
        return line


@dataclass
class WorkerLog:
    """What a worker's log says so far."""

    steps: list[dict[str, Any]] = field(default_factory=list)  # committed steps
    holds: list[dict[str, Any]] = field(default_factory=list)  # holds before a step
    end: dict[str, Any] | None = None  # the last line: {"events", "step"}

    @classmethod
    def read(cls, path: Path) -> WorkerLog:
        log = cls()
        if path.exists():
            for line in path.read_text().splitlines():
                try:
                    entry = json.loads(line)
                except json.JSONDecodeError:
                    continue  # the line being written
                if "events" in entry:
                    log.end = entry
                elif "hold" in entry:
                    log.holds.append(entry)
                else:
                    log.steps.append(entry)
        return log

    def holds_with(self, workers: int) -> int:
        return sum(hold["workers"] == workers for hold in self.holds)


def _play(procs: _Processes, outcome: Outcome, settings: dict[str, Any], bar: ProgressBar) -> None:
    """Starts the processes and says ``go`` to each worker at its moment (see the
    module docstring); returns when the job has finished."""

    def log(name: str) -> WorkerLog:
        return WorkerLog.read(procs.folder / f"{name}.jsonl")

    def tick() -> None:
        bar.update(max(len(log(name).steps) for name in NAMES))

    outcome.endpoint = procs.start_store()
    common = [
        "--rdzv",
        outcome.endpoint,
        "--job",
        f"demo-{os.getpid()}-{time.time_ns()}",
        "--steps",
        str(outcome.steps),
        "--dir",
        str(procs.folder),
        "--settings",
        json.dumps(settings),
        "--go-timeout",
        str(max(1.0, procs.deadline - time.monotonic())),
    ]
    for name in NAMES:
        extra = ["--kill-step", str(KILL_STEP)] if name == VICTIM else []
        procs.start_worker(name, common + extra)
    for name in NAMES:
        procs.wait_ready(name)

    # The first worker is in every worker set and holds in each one below three.
    procs.go(FIRST)
    procs.wait_until(f"{FIRST} to train alone", lambda: log(FIRST).holds_with(1) > 0, [FIRST], tick)
    procs.go(VICTIM)
    procs.wait_until(
        f"{VICTIM} to join", lambda: log(FIRST).holds_with(2) > 0, [FIRST, VICTIM], tick
    )
    holds_before = log(FIRST).holds_with(WORKERS - 1)
    procs.go(SECOND_JOINER)
    victim = procs.workers[VICTIM]
    procs.wait_until(
        f"{VICTIM} to kill itself", lambda: victim.poll() is not None, [FIRST, SECOND_JOINER], tick
    )
    if victim.returncode != -signal.SIGKILL:
        raise ScenarioError(
            f"worker {VICTIM} ended with exit status {victim.returncode}, not by its SIGKILL"
            f"{procs.stderr_tail(VICTIM)}"
        )
    # The late joiner goes once the survivors have re-formed without the victim, so that
    # it joins the running job, not the recovery round.
    procs.wait_until(
        "the survivors to recover",
        lambda: log(FIRST).holds_with(WORKERS - 1) > holds_before,
        [FIRST, SECOND_JOINER],
        tick,
    )
    procs.go(LATE_JOINER)
    finishing = [FIRST, SECOND_JOINER, LATE_JOINER]
    procs.wait_until(
        "the job to finish",
        lambda: all(procs.workers[name].poll() is not None for name in finishing),
        [],
        tick,
    )
    for name in finishing:
        if procs.workers[name].returncode != 0:
            raise ScenarioError(
                f"worker {name} ended with exit status {procs.workers[name].returncode}"
                f"{procs.stderr_tail(name)}"
            )


def _collect(outcome: Outcome, folder: Path) -> dict[str, dict[str, torch.Tensor]]:
    """Fills the outcome from the workers' files; returns the finishing workers'
    parameters."""
    by_step: dict[int, list[dict[str, Any]]] = {}
    for name in NAMES:
        log = WorkerLog.read(folder / f"{name}.jsonl")
        outcome.events[name] = [] if log.end is None else log.end["events"]
        outcome.first_steps[name] = log.steps[0]["step"] if log.steps else None
        for line in log.steps:
            by_step.setdefault(line["step"], []).append(line)
    if sorted(by_step) != list(range(outcome.steps)):
        missing = sorted(set(range(outcome.steps)) - set(by_step))
        raise ScenarioError(f"the workers' logs lack steps {missing}")
    for step in range(outcome.steps):
        lines = by_step[step]
        if len({line["loss"] for line in lines}) != 1:
            raise ScenarioError(f"the workers disagree on the loss of step {step}: {lines}")
        outcome.losses.append(lines[0]["loss"])
        outcome.workers_per_step.append(lines[0]["workers"])
    finished = {}
    for name in NAMES:
        path = folder / f"{name}.pt"
        if path.exists():
            finished[name] = torch.load(path, weights_only=True)
    outcome.finishers = sorted(finished)
    if not finished:
        raise ScenarioError("no worker wrote its final parameters")
    return finished


def reference(
    settings: dict[str, Any], x: torch.Tensor, y: torch.Tensor, steps: int
) -> tuple[dict[str, torch.Tensor], list[float]]:
    """The same job on fixed hardware: this process alone, one torch thread (as each
    worker), the same V, seed and data order. Returns its parameters and losses."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ex = build_executor(settings, None, _COLLECTIVE_TIMEOUT_S)
        losses = [run_step(ex, step, x, y, settings).loss for step in range(steps)]
        ex.close()
        return parameters(ex.model), losses
    finally:
        torch.set_num_threads(threads)


def compare(
    finished: dict[str, dict[str, torch.Tensor]], want: dict[str, torch.Tensor]
) -> tuple[bool, float]:
    """Whether every worker's parameters equal ``want`` bitwise, and the largest
    difference."""
    identical, worst = True, 0.0
    for params in finished.values():
        if params.keys() != want.keys():
            return False, math.inf
        for name, value in want.items():
            identical &= torch.equal(params[name], value)
            worst = max(worst, (params[name] - value).abs().max().item())
    return identical, worst


def run(settings: dict[str, Any], data: tuple[torch.Tensor, ...], out: Path) -> bool:
    """Plays the scenario with the demo's ``settings`` (epochs, batch_size,
    virtual_nodes >= WORKERS, lr, seed, timeout) and data, prints its table and verdict,
    and writes its files to ``out``. True when it played out as one worker set to the
    end and ended bitwise equal to the fixed-hardware run."""
    x_train, y_train = data[0], data[1]
    steps_per_epoch = len(y_train) // settings["batch_size"]
    epochs, steps = scenario_steps(steps_per_epoch, settings["epochs"])
    outcome = Outcome(epochs, steps)
    folder, png, record = out / "elastic", out / "elastic.png", out / "elastic.json"
    folder.mkdir(parents=True, exist_ok=True)
    for stale in [*folder.iterdir(), png, record]:
        stale.unlink(missing_ok=True)
    # Saves each worker importing scikit-learn.
    torch.save({"x": x_train, "y": y_train}, folder / "data.pt")
    print(
        f"\nelastic: the same training ({steps} steps, {epochs} epoch(s)) by "
        f"vflow.elastic.ElasticJob in worker processes: {FIRST} starts alone, {VICTIM} and "
        f"{SECOND_JOINER} join, {VICTIM} is killed by SIGKILL during its backward, "
        f"{LATE_JOINER} joins",
        flush=True,
    )
    bar = ProgressBar(steps)
    bar.start_run(f"elastic: {FIRST}, +{VICTIM}, +{SECOND_JOINER}, {VICTIM} killed, +{LATE_JOINER}")
    started = time.monotonic()
    procs = _Processes(folder, started + settings["timeout"])
    try:
        _play(procs, outcome, settings, bar)
        outcome.seconds = time.monotonic() - started
        bar.end_run()
        finished = _collect(outcome, folder)
    except ScenarioError as e:
        bar.finish()
        record.write_text(json.dumps({"settings": settings, "error": str(e)}, indent=2) + "\n")
        print(f"elastic: FAILED: {e}\n(the workers' files are in {folder})")
        return False
    finally:
        procs.close()
        outcome.exit_codes = {name: proc.returncode for name, proc in procs.workers.items()}
    bar.finish()
    began = time.monotonic()
    want, outcome.reference_losses = reference(settings, x_train, y_train, steps)
    outcome.reference_seconds = time.monotonic() - began
    outcome.identical, outcome.max_param_diff = compare(finished, want)
    outcome.same_losses = outcome.losses == outcome.reference_losses

    rows = [
        [str(r["step"]), r["reason"], str(r["workers"]), f"{r['seconds']:.2f}", r["what"]]
        for r in outcome.table_rows()
    ]
    print()
    print(format_table(["step", "event", "workers after", "seconds", "what happened"], rows))
    print()
    split = outcome.one_worker_set()
    if split is not None:
        print(f"elastic: the finishing workers were not one worker set: {split}")
    elif not outcome.as_planned():
        print(
            "elastic: note: the worker set changed other than planned "
            f"({', '.join(f'{reason} → {n}' for reason, n in PLANNED_EVENTS)})"
        )
    print(outcome.verdict(len(want), settings["virtual_nodes"]))
    plots.elastic(
        png,
        outcome.table_rows(),
        outcome.losses,
        outcome.reference_losses,
        outcome.workers_per_step,
        f"digits, B={settings['batch_size']}, V={settings['virtual_nodes']}, deterministic: "
        "an elastic job and the same job on fixed hardware",
    )
    record.write_text(json.dumps({"settings": settings, **outcome.record()}, indent=2) + "\n")
    print(f"wrote {png}, {record} and the workers' files in {folder}/")
    return outcome.identical and outcome.same_losses and split is None


if __name__ == "__main__":
    sys.exit(worker_main(sys.argv[1:]))
