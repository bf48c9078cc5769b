"""One worker of the elastic tests (tests/elastic/): a small MLP on a fixed synthetic
dataset, trained by ``vflow.elastic.ElasticJob``, with fault points to kill or stop
itself at an exact place of a step.

    python tests/support/elastic_worker.py --rdzv HOST:PORT --job ID --steps N --log FILE
        [--out FILE] [--deterministic] [--workers K] [--sleep SECONDS]
        [--sleep-while FILE]
        [--fault POINT --fault-step S] [--leave-step S] [--sigterm-step S]
        [--suspend-step S] [--sigusr1-step S] [--own-sigusr1] [--lapse-step S]
        [--min-workers K] [--timeout S] [--join-timeout S] [--last-call S]
        [--checkpoint FILE] [--max-recoveries N]
        [--auto] [--slow FACTOR] [--seed S] [--virtual-nodes V] [--hidden H]
        [--slow-build SECONDS] [--slow-load SECONDS] [--compile]

Until this worker has seen ``--workers`` workers in its worker set, it sleeps
``--sleep`` seconds per step, so that the others can join before the job ends; from
then on it runs at full speed. ``--sleep-while FILE`` replaces that rule: it sleeps
while FILE exists, so that a test holds the job's pace until its scenario is over,
however long its workers take to start, then lets it finish at full speed.
``--fault-step``, ``--leave-step`` and
``--sigterm-step`` count the steps this worker has run since (0: the first), so that a
fault always hits a worker set of the intended size; so do ``--suspend-step`` (this
worker calls ``job.suspend()`` then) and ``--sigusr1-step`` (it sends itself SIGUSR1).
``--lapse-step``: at that step the worker of rank 0 stops its rendezvous heartbeats
(torch's keep-alive timer) while its process, its beats and its probe go on, as a
worker starved of CPU for longer than the keep-alive allows; it then sleeps 4 s, for the
rendezvous to drop it before its next step.
``--own-sigusr1``: the program handles SIGUSR1 itself (a line ``{"own_sigusr1": n}``
per signal), installed before the job runs.
Fault points: start (before the step's first forward), middle-backward (in the
backward of this worker's middle VN; like start, before this worker took part in any
collective of the step), stats (first thing in the last VN's backward: the step's
statistics all-reduce has started, no gradient bucket has), allreduce (late in the last
VN's backward, with buckets of the later layers already reducing), finalize (waiting for
the reduction), optimizer (in optimizer.step), recovery (inside the first round after a
crash), answered (a joiner, right after the members answered its knock, before it
connects), receiving (a joiner, while it loads the state sent to it);
``--fault-signal``: SIGKILL (default) or SIGSTOP.

stderr gets the ``vflow`` logger from DEBUG up and everything else from WARNING up, as
``LEVEL name: message``, so that the tests can check what a recovery logs at which
level.

``--seed``, ``--virtual-nodes`` and ``--hidden`` (the MLP's width) make a worker that
the others must refuse; ``--slow-build`` sleeps that long in ``make_executor``,
``--slow-load`` that long before loading the state sent to it (a joiner past the
join deadline when longer than ``--timeout``).

``--auto`` trains with ``plan="auto"``; ``--slow`` makes this worker's compute that
many times slower (vflow.planning.emulation.SlowDown). The data comes from a
``VNBatchSampler`` bound to the current executor (``bind(ex)``, then
``step_indices(step)``), so it follows every plan and worker set.

``--compile`` trains the job of tests/elastic/test_compile.py instead: the dropout MLP
of tests/support/compiled.py wrapped in ``torch.compile``, its ``mean_ce`` loss, and
step s on the s-th of its ``batches(steps, 24)``, whatever the worker set. That
model's width is fixed and that loss has no fault points: ``--compile`` refuses
``--hidden`` and the fault points middle-backward, stats and allreduce.

The log file gets one JSON line per committed step ({"t": time.time(), "step", "rank",
"workers", "counts", "indices", "loss"}; "indices" is null with ``--compile``), one
per step that raised CollectiveError ({"failed": time.time(), "step"}) and a last line
{"events": [...], "step": ...}, with ``"suspended": k`` when the job was suspended at
step k. The lowest-ranked worker writes ``--out`` at the end of the job:
{"model", "optimizer", "step"}.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time
from typing import Any

import torch

import vflow
from vflow import elastic
from vflow.elastic.groups import Groups
from vflow.elastic.rendezvous import Rendezvous
from vflow.planning.emulation import SlowDown
from vflow.world import membership

V, B, SAMPLES, FEATURES, CLASSES = 6, 24, 24 * 8, 8, 3
SEED, HIDDEN = 5, 32
# Fault points inside make_loss's loss, which --compile does not use.
LOSS_FAULTS = ("middle-backward", "stats", "allreduce")


def dataset() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(123)
    x = torch.randn(SAMPLES, FEATURES, generator=gen)
    y = torch.randint(0, CLASSES, (SAMPLES,), generator=gen)
    return x, y


def build(hidden: int = HIDDEN) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(SEED)
    model = torch.nn.Sequential(
        torch.nn.Linear(FEATURES, hidden),
        torch.nn.Tanh(),
        torch.nn.Linear(hidden, hidden),
        torch.nn.Tanh(),
        torch.nn.Linear(hidden, CLASSES),
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return model, optimizer


class Faults:
    """Kills or stops this process at one point of one step."""

    def __init__(self, point: str | None, step: int, signum: int) -> None:
        self.point, self.step, self.signum = point, step, signum
        self.current_step = -1  # steps this worker has run before the current one
        self.vn_position = 0
        self.vns_here = 0

    def hit(self, point: str) -> None:
        if point == self.point and self.current_step == self.step:
            os.kill(os.getpid(), self.signum)
            time.sleep(30)  # SIGSTOP: stay here once continued; SIGKILL never returns


def make_loss(faults: Faults):
    def loss_fn(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        first = model[1](model[0](x))
        out = model[4](model[3](model[2](first)))
        position = faults.vn_position
        faults.vn_position += 1
        if position == faults.vns_here // 2 and faults.vns_here > 1:
            out.register_hook(lambda g: (faults.hit("middle-backward"), g)[1])
        if position == faults.vns_here - 1:
            # The output's gradient comes first in backward: the statistics all-reduce
            # started after this VN's forward, and no parameter gradient (so no bucket)
            # exists yet.
            out.register_hook(lambda g: (faults.hit("stats"), g)[1])
            # The first layer's gradient comes last: by then the later layers' buckets
            # are being all-reduced.
            first.register_hook(lambda g: (faults.hit("allreduce"), g)[1])
        return torch.nn.functional.cross_entropy(out, y)

    return loss_fn


def reference(steps: int, deterministic: bool, virtual_nodes: int = V) -> dict[str, Any]:
    """The uninterrupted job: one process, same V, seed and data order."""
    model, optimizer = build()
    ex = vflow.Executor(
        model,
        optimizer,
        make_loss(Faults(None, -1, signal.SIGKILL)),
        virtual_nodes,
        seed=SEED,
        deterministic=deterministic,
    )
    x, y = dataset()
    sampler = vflow.VNBatchSampler(SAMPLES, B, ex.plan, 0, seed=SEED)
    for step in range(steps):
        indices, size = sampler.step_indices(step)
        ex.step((x[indices], y[indices]), global_batch_size=size)
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": steps}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    elastic.add_job_arguments(
        parser,
        "min_workers",
        "max_workers",
        "checkpoint",
        "max_recoveries",
        timeout_s=5.0,
        join_timeout_s=60.0,
        last_call_s=0.5,
    )
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--log", required=True)
    parser.add_argument("--out")
    parser.add_argument("--deterministic", action="store_true")
    parser.add_argument("--fault")
    parser.add_argument("--fault-step", type=int, default=-1)
    parser.add_argument("--fault-signal", default="SIGKILL")
    parser.add_argument("--sleep", type=float, default=0.0)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--sleep-while")
    parser.add_argument("--sigterm-step", type=int)
    parser.add_argument("--leave-step", type=int)
    parser.add_argument("--suspend-step", type=int)
    parser.add_argument("--sigusr1-step", type=int)
    parser.add_argument("--own-sigusr1", action="store_true")
    parser.add_argument("--lapse-step", type=int)
    parser.add_argument("--virtual-nodes", type=int, default=V)
    parser.add_argument("--seed", type=int, default=SEED)
    parser.add_argument("--hidden", type=int, default=HIDDEN)
    parser.add_argument("--slow-build", type=float, default=0.0)
    parser.add_argument("--slow-load", type=float, default=0.0)
    parser.add_argument("--auto", action="store_true")
    parser.add_argument("--slow", type=float, default=1.0)
    parser.add_argument("--compile", action="store_true")
    args = parser.parse_args(argv)
    if args.compile and (args.fault in LOSS_FAULTS or args.hidden != HIDDEN):
        parser.error(f"--compile takes no --hidden and no --fault in {', '.join(LOSS_FAULTS)}")
    if args.compile:
        # Here, not at the top: the tests' package is on the path only when PYTHONPATH
        # holds the repository (as every test that passes --compile sets it).
        from tests.support.compiled import batches, dropout_mlp, mean_ce
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("vflow").setLevel(logging.DEBUG)
    torch.set_num_threads(1)
    faults = Faults(args.fault, args.fault_step, getattr(signal, args.fault_signal))
    x, y = dataset()
    log = open(args.log, "a", buffering=1)

    def make_executor(group: Any, timeout: float) -> vflow.Executor:
        time.sleep(args.slow_build)
        if args.compile:
            model = dropout_mlp()
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
            module, loss_fn = torch.compile(model), mean_ce
        else:
            model, optimizer = build(args.hidden)
            module, loss_fn = model, make_loss(faults)
        ex = vflow.Executor(
            module,
            optimizer,
            SlowDown(loss_fn, args.slow) if args.slow > 1 else loss_fn,
            args.virtual_nodes,
            seed=args.seed,
            plan="auto" if args.auto else None,
            process_group=group,
            timeout=timeout,
            deterministic=args.deterministic,
            bucket_cap_mb=0.002,
            first_bucket_mb=0.002,
        )
        grads = ex._grads
        finish = grads.finish

        def finish_with_fault(*a: Any) -> Any:
            faults.hit("finalize")
            return finish(*a)

        grads.finish = finish_with_fault
        optimizer.register_step_pre_hook(lambda *_: faults.hit("optimizer"))
        return ex

    sampler = vflow.VNBatchSampler(SAMPLES, B, seed=SEED)  # bound to each step's executor
    compiled_batches = batches(args.steps, B) if args.compile else []
    local_steps = {"n": 0}

    full = {"since": None}  # steps run before the worker set first had --workers

    def train_step(ex: vflow.Executor, step: int) -> vflow.StepResult:
        if full["since"] is None and ex.world_size >= args.workers:
            full["since"] = local_steps["n"]
        local_steps["n"] += 1
        faults.current_step = -1 if full["since"] is None else local_steps["n"] - 1 - full["since"]
        faults.vn_position = 0
        faults.vns_here = ex.plan.counts[ex.rank]
        if faults.current_step == args.leave_step:
            job.leave()
        if faults.current_step == args.sigterm_step:
            os.kill(os.getpid(), signal.SIGTERM)
        if faults.current_step == args.suspend_step:
            job.suspend()
        if faults.current_step == args.sigusr1_step:
            os.kill(os.getpid(), signal.SIGUSR1)
        if faults.current_step == args.lapse_step and ex.rank == 0:
            for rdzv in rendezvous:
                rdzv._handler._stop_heartbeats()
            time.sleep(4.0)
        if args.sleep_while is not None:
            if os.path.exists(args.sleep_while):
                time.sleep(args.sleep)
        elif full["since"] is None:
            time.sleep(args.sleep)
        faults.hit("start")
        if args.compile:
            batch, indices, size = compiled_batches[step], None, None
        else:
            sampler.bind(ex)  # a newcomer's executor is a new one
            indices, size = sampler.step_indices(step)
            batch = (x[indices], y[indices])
        counts = list(ex.plan.counts)
        try:
            result = ex.step(batch, global_batch_size=size)
        except vflow.CollectiveError:
            log.write(json.dumps({"failed": time.time(), "step": step}) + "\n")
            raise
        record = {
            "t": time.time(),
            "step": step,
            "rank": ex.rank,
            "workers": ex.world_size,
            "counts": counts,
            "indices": indices,
            "loss": result.loss,
        }
        log.write(json.dumps(record) + "\n")
        return result

    if args.own_sigusr1:
        own = {"n": 0}

        def own_sigusr1(*_: Any) -> None:
            own["n"] += 1
            log.write(json.dumps({"own_sigusr1": own["n"]}) + "\n")

        signal.signal(signal.SIGUSR1, own_sigusr1)
    job = elastic.job_from_args(args, keep_alive_s=0.5, keep_alive_attempts=4)
    rendezvous: list[Rendezvous] = []  # this worker's, for --lapse-step
    if args.lapse_step is not None:
        init = Rendezvous.__init__

        def init_and_keep(self: Rendezvous, *a: Any, **k: Any) -> None:
            init(self, *a, **k)
            rendezvous.append(self)

        Rendezvous.__init__ = init_and_keep  # type: ignore[method-assign]
    if args.fault == "recovery":
        # Dies while the survivors of a failed step form their worker set again, after
        # this worker answered: a second failure during the recovery.
        make_group, step_fn = Groups.make, train_step
        seen_crash = {"yes": False}

        def group_with_fault(self: Groups, *a: Any) -> Any:
            if seen_crash["yes"]:
                os.kill(os.getpid(), faults.signum)
            return make_group(self, *a)

        def train_step(ex: vflow.Executor, step: int) -> vflow.StepResult:
            try:
                return step_fn(ex, step)
            except vflow.CollectiveError:
                seen_crash["yes"] = True
                raise

        Groups.make = group_with_fault  # type: ignore[method-assign]
    if args.fault == "answered":
        knock = Rendezvous.knock

        def knock_then_die(
            self: Rendezvous, timeout_s: float, stage: int | None = None
        ) -> dict[str, Any] | None:
            answer = knock(self, timeout_s, stage)
            faults.current_step = faults.step
            faults.hit("answered")
            return answer

        Rendezvous.knock = knock_then_die  # type: ignore[method-assign]
    if args.fault == "receiving":
        deserialize = membership.deserialize

        def deserialize_with_fault(data: bytes) -> object:
            faults.current_step = faults.step
            faults.hit("receiving")
            return deserialize(data)

        membership.deserialize = deserialize_with_fault  # type: ignore[assignment]
    if args.slow_load > 0:
        deserialize_slowly = membership.deserialize

        def deserialize_with_delay(data: bytes) -> object:
            time.sleep(args.slow_load)
            return deserialize_slowly(data)

        membership.deserialize = deserialize_with_delay  # type: ignore[assignment]
    ex = job.run(make_executor, train_step, args.steps)
    events = [e.__dict__ for e in job.events]
    end: dict[str, Any] = {"events": events, "step": None if ex is None else ex.step_count}
    if job.suspended:
        end["suspended"] = job.suspended_step
    log.write(json.dumps(end) + "\n")
    if ex is not None and args.out and ex.rank == 0 and ex.step_count == args.steps:
        save_final(ex, args.out)
    return 0


def save_final(ex: vflow.Executor, path: str) -> None:
    """The state a test compares bit for bit: model, optimizer and step count."""
    state = {
        "model": ex.model.state_dict(),
        "optimizer": ex.optimizer.state_dict(),
        "step": ex.step_count,
    }
    torch.save(state, path)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
