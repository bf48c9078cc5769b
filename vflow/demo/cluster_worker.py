"""One worker of one job of a real cluster run (``python -m vflow cluster run``,
vflow/cluster/runner.py), started as ``python -m vflow.demo.cluster_worker``.

It trains the demo's digits CNN (deterministic mode, SGD with momentum, B and V fixed)
as an elastic job (``vflow.elastic.ElasticJob``): the runner starts a job by launching
its workers, grows it by launching more, and shrinks it with SIGTERM, after which a
worker leaves once its current step is done.

A job is suspended by SIGUSR1 to any of its workers (``ElasticJob.suspend``): every
worker stops at the same step, rank 0 saving the state to ``--checkpoint`` (required
for it), and workers started later with the same ``--job`` and ``--checkpoint`` resume
it from there, on any number of workers (Note [Suspending a job] in
vflow/elastic/job.py).

A cluster slot is an emulated device (Note [Emulated device time]). The worker appends
one JSON line per line of news to ``--log``, flushed at once, for the runner to read
while it runs::

    {"t": ..., "ready": true, "pid": ..., "host": ..., "device": ..., "gpu": ...}
                                                     imported, data loaded
    {"t": ..., "step": k, "workers": w, "rank": r}   step k done on w workers
    {"t": ..., "events": [...], "step": n, "params_sha256": ...}
                                                     the ElasticJob's events, at the end
    {"t": ..., "suspended": true, "step": k}         last, when the job was suspended at
                                                     step k (also when this worker was
                                                     told so while it waited to join)

``t`` is ``time.time()``. ``host`` is the node (Slurm's ``SLURMD_NODENAME``, else the
host name), ``device`` the devices the cluster gave it (``CUDA_VISIBLE_DEVICES``, None
when unset: the slot is emulated), ``gpu`` the index among them that an NCCL worker
would make its own (Note [A worker's GPU], vflow/world/devices.py: Slurm's
``SLURM_LOCALID`` against what it bound; None when emulated). ``params_sha256``
digests the model's parameters after the worker's last step (bitwise equal runs, equal
digests). ``--timeout`` (how long a collective may wait for a late peer) defaults to
three of the job's slowest steps, at least 30 s. Exit status 0 when the job finished,
when this worker left, when the job was suspended, and when the job had finished before
it could join; 1 when the job could not go on (an unreachable store, a refused join, a
suspended job without its checkpoint), with the reason on stderr.

Note [Emulated device time]
On a real cluster a step of the job takes ``step_time(w)`` on w devices; here every
worker is a process on a small CPU machine, where the model's real compute is fast and
does not scale with w (the workers share the cores). So before each step the worker
sleeps ``step_time(w)`` less what its previous step's real work took (at least 0): the
step then lasts about ``step_time(w)``, real compute is a small part of it, and sleeping
workers leave the cores to the others. The step's collectives keep the workers in step:
one that waited for a slower peer measures a longer step and sleeps less before the next.
``step_time`` is ``vflow.cluster.JobSpec.step_time``, so the throughput between the
given counts is interpolated as the simulator does (Note [Step time between the given
counts] in vflow/cluster/trace.py).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import socket
import sys
import time
from typing import Any, TextIO

import torch

import vflow
from vflow.cluster.trace import JobSpec, TraceError, parse_trace
from vflow.demo.digits import load_digits_split
from vflow.demo.elastic_scenario import build_executor, run_step
from vflow.elastic import add_job_arguments, job_from_args
from vflow.runtime.results import StepResult
from vflow.world.devices import local_gpu
from vflow.world.group import use_loopback_for_gloo

__all__ = ["main", "params_digest", "parse_args"]

_LR = 0.05
_MIN_TIMEOUT_S = 30.0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m vflow.demo.cluster_worker",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    # No default here: the job's timeout follows its step time (below).
    add_job_arguments(parser, "last_call_s", timeout_s=None, checkpoint=None)
    parser.add_argument("--steps", type=int, required=True, help="global steps of the job")
    parser.add_argument("--virtual-nodes", type=int, required=True, help="V, also the most workers")
    parser.add_argument(
        "--step-s",
        required=True,
        metavar="JSON",
        help='seconds per step by worker count, e.g. \'{"1": 0.8, "2": 0.42}\'',
    )
    parser.add_argument("--batch-size", type=int, default=32, help="global batch B (default 32)")
    parser.add_argument("--seed", type=int, default=0, help="data split, init and order")
    parser.add_argument("--log", required=True, metavar="FILE", help="append JSON lines here")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps must be >= 1, got {args.steps}")
    if args.virtual_nodes < 1:
        parser.error(f"--virtual-nodes must be >= 1, got {args.virtual_nodes}")
    if args.batch_size < args.virtual_nodes:
        parser.error(
            f"--batch-size ({args.batch_size}) must be >= --virtual-nodes ({args.virtual_nodes})"
        )
    try:
        args.spec = _job_spec(args)
    except (TraceError, json.JSONDecodeError) as e:
        parser.error(f"--step-s: {e}")
    if args.timeout_s is None:
        # A peer may be a whole emulated step late into a collective (it joined, or was
        # slow to wake): a few of the job's slowest steps, and never under 30 s.
        args.timeout_s = max(_MIN_TIMEOUT_S, 3 * max(args.spec.step_s.values()))
    return args


def _job_spec(args: argparse.Namespace) -> JobSpec:
    """The job as the trace describes it, checked by the trace's own rules."""
    table = json.loads(args.step_s)
    record = {
        "name": args.job_id,
        "arrival_s": 0.0,
        "demand": 1,
        "priority": 1,
        "virtual_nodes": args.virtual_nodes,
        "steps": args.steps,
        "step_s": table,
    }
    return parse_trace({"slots": 1, "jobs": [record]}).jobs[0]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    spec: JobSpec = args.spec
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(process)d %(name)s: %(message)s")
    use_loopback_for_gloo()
    # One thread: the workers of every job share the machine's few cores.
    torch.set_num_threads(1)
    x_train, y_train, _, _ = load_digits_split(args.seed)
    settings = {
        "seed": args.seed,
        "lr": _LR,
        "virtual_nodes": args.virtual_nodes,
        "batch_size": args.batch_size,
    }
    job = job_from_args(args, min_workers=1, max_workers=spec.max_workers)
    with open(args.log, "a", buffering=1) as log:
        device = os.environ.get("CUDA_VISIBLE_DEVICES")
        where = {
            "host": os.environ.get("SLURMD_NODENAME") or socket.gethostname(),
            "device": device,
            # The slots' GPUs may be a test cluster's files, not devices torch sees: the
            # choice is made against what the cluster bound.
            "gpu": None if not device else local_gpu(visible=len(device.split(","))),
        }
        _write(log, {"ready": True, "pid": os.getpid(), **where})
        work_s = 0.0  # real seconds of this worker's previous step (Note [Emulated device time])

        def train_step(ex: vflow.Executor, step: int) -> StepResult:
            nonlocal work_s
            time.sleep(max(0.0, spec.step_time(ex.world_size) - work_s))
            begin = time.perf_counter()
            result = run_step(ex, step, x_train, y_train, settings)
            work_s = time.perf_counter() - begin
            _write(log, {"step": step, "workers": ex.world_size, "rank": ex.rank})
            return result

        try:
            ex = job.run(
                lambda group, timeout: build_executor(settings, group, timeout),
                train_step,
                args.steps,
            )
        except RuntimeError as e:  # an unreachable store, a refused join: say why, briefly
            logging.getLogger("cluster_worker").error("%s", e)
            return 1
        events = [event.__dict__ for event in job.events]
        end: dict[str, Any] = {"events": events, "step": None if ex is None else ex.step_count}
        if ex is not None:
            end["params_sha256"] = params_digest(ex.model)
        _write(log, end)
        if job.suspended:
            # For the scheduler: the job stopped whole, and resumes from --checkpoint.
            _write(log, {"suspended": True, "step": job.suspended_step})
    if ex is not None:
        ex.close()
    return 0


def params_digest(model: torch.nn.Module) -> str:
    """SHA-256 of the parameters' bytes, in order: equal only for bitwise equal models."""
    digest = hashlib.sha256()
    for param in model.parameters():
        digest.update(param.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def _write(log: TextIO, record: dict[str, Any]) -> None:
    log.write(json.dumps({"t": time.time(), **record}) + "\n")
    log.flush()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
