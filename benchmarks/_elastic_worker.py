"""One worker process of benchmarks/elastic.py: the benchmark MLP (distributed.py's)
trained by ``vflow.elastic.ElasticJob`` on a fixed synthetic dataset, writing one JSON
line per committed step with its wall-clock time, so that the benchmark can time events
from outside.

    python benchmarks/_elastic_worker.py --rdzv HOST:PORT --job ID --log FILE
        --hidden H --layers L --batch-size B --virtual-nodes V
        --min-workers N --max-workers N --timeout S --last-call S
        --keep-alive S --keep-alive-attempts N [--checkpoint FILE --checkpoint-every K]

Two roles:

* elastic (no ``--checkpoint``): a worker of a long-lived elastic job; the benchmark
  starts joiners and sends SIGTERM to make one leave (ElasticJob's own handler).
* restart (``--checkpoint``): a freshly started worker of the torchrun way: its job
  id is new, ``--min-workers`` = ``--max-workers`` = the worker count, it loads
  ``--checkpoint`` (if present) with ``vflow.load`` right after building its executor
  and writes it with ``vflow.save`` whenever the step count is a multiple of
  ``--checkpoint-every``. The benchmark stops such workers with SIGKILL.

In both roles SIGUSR1 arms a crash: the next step that starts kills this process with
SIGKILL in the backward of its middle VN (of its last, with one VN), after writing
``{"kill": time}`` to the log.

Log lines (``t``: ``time.time()`` when written):
``{"ready": t}`` once torch and vflow are imported;
``{"joined": t, "workers": n}`` when this worker is first in a round (its group formed);
``{"built": t}`` once its model, optimizer and Executor are built (the first
optimizer a process builds imports torch._dynamo: about a second);
``{"loaded": t, "step": s}`` after ``vflow.load`` (restart role);
``{"begin": t}`` when this process's first step starts (its worker set formed, its
state received or loaded);
``{"failed": t, "step": s}`` when a step raises CollectiveError (a peer died);
``{"t": t, "step": s, "rank": r, "workers": n, "signals": [...]}`` per committed step
(global batch ``s``; the signal words of every rank for that step);
``{"saved": t, "step_count": c, "seconds": d}`` after each checkpoint;
``{"kill": t, "step": s}`` right before the SIGKILL;
``{"events": [...], "end": t}`` when ``ElasticJob.run`` returns.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from typing import IO, Any

import torch
import torch.nn.functional as F
from torch import nn

import vflow
from vflow import elastic
from vflow.world.group import use_loopback_for_gloo

CLASSES = 10
SEED = 0
BATCHES_PER_EPOCH = 8


def mlp(hidden: int, layers: int) -> nn.Module:
    """distributed.py's benchmark MLP: ``layers`` x (Linear(hidden, hidden) + ReLU) and
    a 10-way head."""
    blocks: list[nn.Module] = []
    for _ in range(layers):
        blocks += [nn.Linear(hidden, hidden), nn.ReLU()]
    return nn.Sequential(*blocks, nn.Linear(hidden, CLASSES))


class Log:
    def __init__(self, path: str) -> None:
        self._file: IO[str] = open(path, "w", buffering=1, encoding="utf-8")

    def write(self, **fields: Any) -> None:
        self._file.write(json.dumps(fields) + "\n")


class Crash:
    """SIGUSR1 arms it; the next step to start dies in the backward of its middle VN."""

    def __init__(self, log: Log) -> None:
        self.log = log
        self.armed = False
        self.step: int | None = None  # the global batch to die in, once armed
        self.current = -1
        self.vn = 0
        self.vns_here = 1

    def arm(self, *_: Any) -> None:
        self.armed = True

    def start_step(self, step: int, vns_here: int) -> None:
        self.current, self.vn, self.vns_here = step, 0, vns_here
        if self.armed and self.step is None:
            self.step = step

    def hook(self, out: torch.Tensor) -> None:
        position = self.vn
        self.vn += 1
        if self.step == self.current and position == self.vns_here // 2:
            out.register_hook(self._die)

    def _die(self, grad: torch.Tensor) -> torch.Tensor:
        self.log.write(kill=time.time(), step=self.current)
        os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(30)  # SIGKILL is asynchronous: never return into backward
        return grad


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    elastic.add_job_arguments(
        parser,
        "min_workers",
        "max_workers",
        "timeout_s",
        "last_call_s",
        "keep_alive_s",
        "keep_alive_attempts",
        join_timeout_s=120.0,
    )
    parser.add_argument("--log", required=True)
    parser.add_argument("--hidden", type=int, required=True)
    parser.add_argument("--layers", type=int, required=True)
    parser.add_argument("--batch-size", type=int, required=True)
    parser.add_argument("--virtual-nodes", type=int, required=True)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--deterministic", action="store_true")
    parser.add_argument("--steps", type=int, default=10**9)
    # The restart role's vflow.save file, not ElasticJob's checkpoint (no flag here).
    parser.add_argument("--checkpoint")
    parser.add_argument("--checkpoint-every", type=int, default=10)
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse(argv)
    log = Log(args.log)
    log.write(ready=time.time())
    use_loopback_for_gloo()
    torch.set_num_threads(args.threads)
    crash = Crash(log)
    signal.signal(signal.SIGUSR1, crash.arm)
    samples = args.batch_size * BATCHES_PER_EPOCH
    gen = torch.Generator().manual_seed(1234)
    x = torch.randn(samples, args.hidden, generator=gen)
    y = torch.randint(0, CLASSES, (samples,), generator=gen)
    sampler = vflow.VNBatchSampler(samples, args.batch_size, seed=SEED)  # bound in train_step

    def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        out = model(batch[0])
        crash.hook(out)
        return F.cross_entropy(out, batch[1])

    def make_executor(group: Any, timeout: float) -> vflow.Executor:
        log.write(joined=time.time(), workers=group.size())
        torch.manual_seed(SEED)
        model = mlp(args.hidden, args.layers)
        ex = vflow.Executor(
            model,
            torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
            loss_fn,
            args.virtual_nodes,
            seed=SEED,
            process_group=group,
            timeout=timeout,
            deterministic=args.deterministic,
        )
        log.write(built=time.time())
        if args.checkpoint and os.path.exists(args.checkpoint):
            vflow.load(args.checkpoint, ex)
            log.write(loaded=time.time(), step=ex.step_count)
        return ex

    begun = {"yes": False}

    def train_step(ex: vflow.Executor, step: int) -> vflow.StepResult:
        if not begun["yes"]:
            begun["yes"] = True
            log.write(begin=time.time())
        crash.start_step(step, ex.plan.counts[ex.rank])
        sampler.bind(ex)  # follows the step's executor, plan and rank
        indices, size = sampler.step_indices(step)
        try:
            result = ex.step((x[indices], y[indices]), global_batch_size=size)
        except vflow.CollectiveError:
            log.write(failed=time.time(), step=step)
            raise  # ElasticJob recovers from it (the contract of train_step)
        log.write(
            t=time.time(),
            step=step,
            rank=ex.rank,
            workers=ex.world_size,
            signals=[int(w) for w in result.signals],
        )
        if args.checkpoint and ex.step_count % args.checkpoint_every == 0:
            start = time.time()
            vflow.save(args.checkpoint, ex)
            log.write(saved=time.time(), step_count=ex.step_count, seconds=time.time() - start)
        return result

    job = elastic.job_from_args(args)
    job.run(make_executor, train_step, args.steps)
    log.write(events=[e.__dict__ for e in job.events], end=time.time())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
