"""Train the digits CNN as an elastic job: workers join, leave and crash while it runs.

The job is named by ``--job`` on a rendezvous store. A worker started while no job of
that name runs starts it and trains alone; a worker started while it runs joins at the
next step and receives the state; SIGTERM or Ctrl-C makes a worker leave after its
current step; a worker that is killed or hangs is dropped and the others redo that
step's global batch. B and V stay fixed, and the data position is the step count, so
with ``--deterministic`` the final model is bitwise the one that the same flags give on
one worker alone, whatever happened in between.

The store first (one per cluster; it serves many jobs). It prints ``HOST:PORT`` and runs
until SIGTERM or Ctrl-C. The c10d store has no authentication: anyone who reaches its
port can read and change the jobs' state, so it listens only on the ``--host`` address,
loopback (127.0.0.1) by default::

    python -m vflow rendezvous --port 29400

One machine: start a worker, and later as many more as you like, each in its own shell
(all with the same flags); stop one with Ctrl-C, or ``kill -9`` it, and the others go
on::

    python examples/train_elastic.py --rdzv 127.0.0.1:29400 --job digits \\
        --steps 2000 --virtual-nodes 8 --seed 0 --deterministic --out final.pt --sleep 0.2

Several machines: run the store on a host every worker reaches, listening on that
host's address on the network that connects them (only a trusted one), e.g.
``python -m vflow rendezvous --host 10.0.0.1 --port 29400``, and start workers anywhere
with ``--rdzv 10.0.0.1:29400``. Every worker must reach the store's port, and the workers
each other's Gloo ports (each listens on an ephemeral port of the interface Gloo binds).
A worker puts its collectives on the interface that reaches the store (loopback when the
store is on loopback); ``--interface NAME`` or ``GLOO_SOCKET_IFNAME`` choose another.
With ``--port``, the store keeps a journal of the running jobs, so that a store
restarted at the same address knows them (the running workers re-register their job,
and a worker started meanwhile joins it instead of starting it over).

The batches come from a ``torch.utils.data.DataLoader`` with ``--loader-workers``
worker processes (default 2) through ``vflow.data.StepLoader``, which follows the job's
step count, plan and rank across grows, shrinks and crashes (Note [Loading ahead of an
elastic job]). ``--lr-schedule onecycle`` steps a ``OneCycleLR`` over ``--steps`` once
per step, registered with the executor (``ex.register_state``), so that a worker joining
mid-schedule receives the schedule's position with the model and the optimizer.

SIGUSR1 to any worker suspends the whole job (``ElasticJob.suspend``): every worker
stops after the same step and exits 0, the lowest-ranked one having saved the state to
``--checkpoint`` (which suspending needs). Started again later with the same ``--job``
and ``--checkpoint``, on any number of workers, the job resumes from that step, and
with ``--deterministic`` it ends bitwise as if it had never stopped (the OneCycleLR
schedule, registered with the executor, is in the checkpoint too)::

    kill -USR1 <pid of any worker>    # or Slurm, before a time limit: --signal=USR1@60
    python examples/train_elastic.py --rdzv 127.0.0.1:29400 --job digits \\
        --steps 2000 --virtual-nodes 8 --seed 0 --deterministic --checkpoint digits.pt

When the job reaches ``--steps``, its lowest-ranked worker writes
``{"model", "optimizer", "scheduler", "step"}`` to ``--out`` (``torch.load(path)``;
``scheduler`` is None for a constant LR); the others write nothing, and so does a worker
that left early or arrived after the end. The rendezvous events (start, grow, leave,
crash, finish) are logged by the ``vflow`` logger, and rank 0 logs the loss every
``--log-every`` steps. ``--log FILE`` appends one JSON line per step this worker ran
(``{"t", "step", "rank", "workers", "pid", "loss", "lr", "samples"}``: ``t`` its end in
``time.time()``, ``lr`` the learning rate the step used, ``samples`` the dataset indices
this worker trained on) and a last line ``{"events": [...], "step": ...}``, for scripts
that watch a job.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time
from typing import Any, TextIO

import torch
from torch.utils.data import TensorDataset

import vflow
from vflow.demo import accuracy, cross_entropy, load_digits_split, make_model
from vflow.elastic import add_job_arguments, job_from_args

_log = logging.getLogger("train_elastic")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    # --rdzv, --job and the job's options; max_workers is --virtual-nodes (every worker
    # needs at least one VN; more wait until one leaves).
    add_job_arguments(
        parser, "store_timeout_s", "interface", timeout_s=30.0, min_workers=1, checkpoint=None
    )
    parser.add_argument("--steps", type=int, required=True, help="global steps of the job")
    parser.add_argument(
        "--virtual-nodes", type=int, default=8, help="V, also the most workers (default 8)"
    )
    parser.add_argument("--seed", type=int, default=0, help="data split, init, order, dropout")
    parser.add_argument(
        "--deterministic",
        action="store_true",
        help="bitwise the same training whatever the workers do",
    )
    parser.add_argument("--out", default=None, help="rank 0 writes the final state here")
    parser.add_argument("--batch-size", type=int, default=64, help="global batch B (default 64)")
    parser.add_argument("--lr", type=float, default=0.05, help="the (peak) learning rate")
    parser.add_argument(
        "--lr-schedule",
        choices=("constant", "onecycle"),
        default="constant",
        help="constant, or OneCycleLR over --steps peaking at --lr (default constant)",
    )
    parser.add_argument(
        "--loader-workers",
        type=int,
        default=2,
        help="DataLoader worker processes loading the batches (default 2; 0: in this process)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads per worker (default 1); bitwise results need the same everywhere",
    )
    parser.add_argument(
        "--sleep", type=float, default=0.0, help="seconds this worker sleeps before each step"
    )
    parser.add_argument(
        "--sleep-until-changes",
        type=int,
        default=0,
        help="stop sleeping once this worker has seen this many changes of the worker set "
        "(default 0: sleep before every step)",
    )
    parser.add_argument("--log-every", type=int, default=10, help="rank 0 logs the loss (steps)")
    parser.add_argument("--log", default=None, help="append one JSON line per step here")
    args = parser.parse_args(argv)
    if args.steps < 0:
        parser.error(f"--steps must be >= 0, got {args.steps}")
    if args.virtual_nodes < 1:
        parser.error(f"--virtual-nodes must be >= 1, got {args.virtual_nodes}")
    if args.batch_size < args.virtual_nodes:
        parser.error(
            f"--batch-size ({args.batch_size}) must be >= --virtual-nodes ({args.virtual_nodes})"
        )
    if not args.lr > 0:
        parser.error(f"--lr must be > 0, got {args.lr}")
    for flag, value in (("--threads", args.threads), ("--log-every", args.log_every)):
        if value < 1:
            parser.error(f"{flag} must be >= 1, got {value}")
    if args.loader_workers < 0:
        parser.error(f"--loader-workers must be >= 0, got {args.loader_workers}")
    if args.lr_schedule == "onecycle" and args.steps < 2:
        parser.error(f"--lr-schedule onecycle needs --steps >= 2, got {args.steps}")
    if not args.sleep >= 0 or args.sleep_until_changes < 0:
        parser.error("--sleep and --sleep-until-changes must be >= 0")
    if not 1 <= args.min_workers <= args.virtual_nodes:
        parser.error(f"--min-workers must be in 1..--virtual-nodes, got {args.min_workers}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        job = job_from_args(args, max_workers=args.virtual_nodes)
    except ValueError as e:  # a --rdzv host that does not resolve, an unknown --interface
        print(f"{os.path.basename(sys.argv[0])}: error: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(process)d %(name)s: %(message)s")
    torch.set_num_threads(args.threads)
    x_train, y_train, x_test, y_test = load_digits_split(args.seed)
    log_file: TextIO | None = open(args.log, "a", buffering=1) if args.log else None

    schedulers: dict[vflow.Executor, torch.optim.lr_scheduler.LRScheduler] = {}

    def make_executor(group: Any, timeout: float) -> vflow.Executor:
        model = make_model(args.seed)
        optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
        ex = vflow.Executor(
            model,
            optimizer,
            cross_entropy,
            args.virtual_nodes,
            seed=args.seed,
            process_group=group,
            timeout=timeout,
            deterministic=args.deterministic,
        )
        if args.lr_schedule == "onecycle":
            # Registered, it travels with the training state: a worker that joins at
            # step 400 goes on from step 400 of the schedule.
            scheduler = torch.optim.lr_scheduler.OneCycleLR(
                optimizer, max_lr=args.lr, total_steps=args.steps
            )
            ex.register_state("lr_scheduler", scheduler)
            schedulers[ex] = scheduler
        return ex

    # The loader's workers load the coming steps' batches ahead; StepLoader hands out
    # the batch of the step asked for, under the plan and rank of the executor that runs
    # it, and loads anew from there whenever the worker set changed.
    sampler = vflow.VNBatchSampler(len(y_train), args.batch_size, seed=args.seed)
    loader = vflow.data.StepLoader(
        TensorDataset(x_train, y_train), sampler, num_workers=args.loader_workers
    )

    def train_step(ex: vflow.Executor, step: int) -> vflow.StepResult:
        changes = len(job.events) - 1  # the first event is this worker's start
        if args.sleep > 0 and (args.sleep_until_changes == 0 or changes < args.sleep_until_changes):
            time.sleep(args.sleep)
        batch, size = loader.batch(ex, step)
        lr = ex.optimizer.param_groups[0]["lr"]
        result = ex.step(batch, global_batch_size=size)
        if ex in schedulers:
            schedulers[ex].step()
        if ex.rank == 0 and (step + 1) % args.log_every == 0:
            _log.info(
                "step %d/%d  loss %.4f  (%d worker(s))",
                step + 1,
                args.steps,
                result.loss,
                ex.world_size,
            )
        if log_file is not None:
            record = {
                "t": time.time(),
                "step": step,
                "rank": ex.rank,
                "workers": ex.world_size,
                "pid": os.getpid(),
                "loss": result.loss,
                "lr": lr,
                "samples": loader.last_indices,
            }
            log_file.write(json.dumps(record) + "\n")
        return result

    def leave_on_ctrl_c(signum: int, frame: Any) -> None:
        _log.info("leaving after this step (Ctrl-C again to stop at once)")
        job.leave()
        signal.signal(signal.SIGINT, signal.default_int_handler)

    # SIGTERM already means "leave after this step" (ElasticJob); Ctrl-C does the same,
    # so that the others go on without redoing a step.
    signal.signal(signal.SIGINT, leave_on_ctrl_c)
    try:
        try:
            ex = job.run(make_executor, train_step, args.steps)
        except RuntimeError as e:  # an unreachable store, too few workers: say why, briefly
            _log.error("%s", e)
            return 1
        if log_file is not None:
            events = [event.__dict__ for event in job.events]
            step = None if ex is None else ex.step_count
            log_file.write(json.dumps({"events": events, "step": step}) + "\n")
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        loader.close()
        if log_file is not None:
            log_file.close()
    if job.suspended:
        _log.info(
            "job %r suspended at step %d; start it again with the same --job and --checkpoint "
            "to resume it",
            args.job_id,
            job.suspended_step,
        )
        if ex is not None:
            ex.close()
        return 0
    if ex is None:
        _log.info("job %r had finished before this worker could join; nothing to do", args.job_id)
        return 0
    try:
        # A worker that left on the job's last step also has step_count == steps: only
        # the workers that saw the job finish are at its end.
        if not job.events or job.events[-1].reason != "finish":
            _log.info("left job %r at step %d of %d", args.job_id, ex.step_count, args.steps)
        elif ex.rank == 0:
            _log.info(
                "test accuracy %.4f after %d steps",
                accuracy(ex.model, x_test, y_test),
                ex.step_count,
            )
            if args.out is not None:
                save(ex, schedulers.get(ex), args.out)
                _log.info("saved the final state to %s", args.out)
    finally:
        ex.close()
    return 0


def save(
    ex: vflow.Executor, scheduler: torch.optim.lr_scheduler.LRScheduler | None, path: str
) -> None:
    state = {
        "model": ex.model.state_dict(),
        "optimizer": ex.optimizer.state_dict(),
        "scheduler": None if scheduler is None else scheduler.state_dict(),
        "step": ex.step_count,
    }
    # A reader never sees half a file, even if this worker dies while writing.
    partial = f"{path}.partial{os.getpid()}"
    torch.save(state, partial)
    os.replace(partial, path)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
