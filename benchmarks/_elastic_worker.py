"""One worker process of benchmarks/elastic.py's vflow side: the benchmark MLP
(distributed.py's) trained by ``vflow.elastic.ElasticJob`` on a fixed synthetic
dataset, writing one JSON line per committed step with its wall-clock time, so that the
benchmark can time events from outside with the same reader as its torchrun side
(benchmarks/_torchrun_baseline.py).

    python benchmarks/_elastic_worker.py --rdzv HOST:PORT --job ID --log-path DIR/NODE
        --hidden H --layers L --batch-size B --virtual-nodes V
        --min-workers N --max-workers N --timeout S --last-call S
        --keep-alive S --keep-alive-attempts N [--steps N]

The benchmark starts one such process per node (a joiner is one more process) and
sends it signals: SIGTERM (ElasticJob's own handler: leave after the current step),
SIGSTOP, and SIGUSR1, which arms a crash: the next step that starts kills this process
with SIGKILL in the backward of its middle VN (of its last, with one VN), after writing
``{"kill": t, "step": s}``. A file ``DIR/NODE.crash`` holding ``{"step": s}`` arms the
same crash for global batch s (or the next step to start, if that is later): how the
benchmark kills several workers in one step. With ``--knock-at FILE`` a joiner builds its
executor, then waits for FILE before it asks to join: how the benchmark has several
joiners knock at once (their imports, seconds apart on a busy machine, are done by then).

Log files (``t``: ``time.time()`` when written), one per worker set this process trains
in, so that a file holds one process's part of one worker set, as a torchrun worker's
file holds one process of one worker group:

* ``DIR/NODE.p.jsonl``, the process: ``{"exec": t, "pid": p, "rank": -1, ...}`` first,
  before torch is imported; ``{"ready": t}`` once torch and vflow are imported;
  ``{"built": t}`` when ``make_executor`` returns: ElasticJob builds the executor once,
  on a group of this worker alone, before the worker asks to join (Note [Joining
  ahead], vflow/elastic/job.py; the first optimizer a process builds imports
  torch._dynamo, about a second); ``{"events": [...], "end": t}`` when
  ``ElasticJob.run`` returns.
* ``DIR/NODE.s<k>.jsonl``, its k-th worker set (a new one at every change of
  ``ex.process_group``, whose name says the round and the set: "round 3/set1"), opened
  when the first step in that set starts: ``{"exec": t, "pid": p, "rank": r, "restart":
  0, "workers": n, "master": "round 3/set1"}`` and ``{"begin": t, "step": s, "workers":
  n}`` (the same t: the set formed, its state received or caught up, and this step,
  global batch s, begins; in the first set this worker trains in, that is when it
  joined); then per committed step ``{"t": t, "step": s, "rank": r, "workers": n,
  "signals": [...]}`` (the signal words of every rank for that step);
  ``{"failed": t, "step": s}`` when a step raises CollectiveError (a peer died, hung
  or left the group), and ``{"kill": t, "step": s}`` right before an armed SIGKILL.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from typing import IO, Any

CLASSES = 10
SEED = 0
BATCHES_PER_EPOCH = 8
KNOCK_WAIT_S = 600.0  # the longest wait for --knock-at's file


class Log:
    """The current log file; ``switch`` moves on to another one."""

    def __init__(self, path: str) -> None:
        self._file: IO[str] = open(path, "w", buffering=1, encoding="utf-8")

    def write(self, **fields: Any) -> None:
        self._file.write(json.dumps(fields) + "\n")

    def switch(self, path: str, mode: str = "w") -> None:
        self._file.close()
        self._file = open(path, mode, buffering=1, encoding="utf-8")


def parse(argv: list[str]) -> argparse.Namespace:
    from vflow import elastic

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
    parser.add_argument("--log-path", required=True, help="DIR/NODE: the files' prefix")
    parser.add_argument("--hidden", type=int, required=True)
    parser.add_argument("--layers", type=int, required=True)
    parser.add_argument("--batch-size", type=int, required=True)
    parser.add_argument("--virtual-nodes", type=int, required=True)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--deterministic", action="store_true")
    parser.add_argument("--steps", type=int, default=10**9)
    parser.add_argument(
        "--knock-at",
        help="a file: once its executor is built, this worker waits until the file exists "
        "before it asks to join (the benchmark's joiners of one grow knock together)",
    )
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    prefix = argv[argv.index("--log-path") + 1] if "--log-path" in argv else None
    log = None
    if prefix is not None:
        # Before the imports: the benchmark splits a start into process start, imports
        # and set-up, and it needs this process's pid to signal it.
        log = Log(f"{prefix}.p.jsonl")
        log.write(exec=time.time(), pid=os.getpid(), rank=-1, restart=0, workers=0, master="")

    import torch
    import torch.nn.functional as F
    from torch import nn

    import vflow
    from vflow import elastic
    from vflow.world.group import use_loopback_for_gloo

    args = parse(argv)
    assert log is not None  # --log-path is required
    log.write(ready=time.time())
    use_loopback_for_gloo()
    torch.set_num_threads(args.threads)

    class Crash:
        """SIGUSR1 arms it; the next step to start dies in the backward of its middle VN.
        Or the crash file names the step."""

        def __init__(self, marker: str) -> None:
            self.marker = marker
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
            if self.step is None and os.path.exists(self.marker):
                with open(self.marker, encoding="utf-8") as f:
                    self.step = max(step, int(json.load(f)["step"]))

        def hook(self, out: torch.Tensor) -> None:
            position = self.vn
            self.vn += 1
            if self.step == self.current and position == self.vns_here // 2:
                out.register_hook(self._die)

        def _die(self, grad: torch.Tensor) -> torch.Tensor:
            log.write(kill=time.time(), step=self.current)
            os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(30)  # SIGKILL is asynchronous: never return into backward
            return grad

    crash = Crash(f"{args.log_path}.crash")
    signal.signal(signal.SIGUSR1, crash.arm)
    samples = args.batch_size * BATCHES_PER_EPOCH
    gen = torch.Generator().manual_seed(1234)
    x = torch.randn(samples, args.hidden, generator=gen)
    y = torch.randint(0, CLASSES, (samples,), generator=gen)
    sampler = vflow.VNBatchSampler(samples, args.batch_size, seed=SEED)  # bound in train_step

    def mlp() -> nn.Module:
        """distributed.py's benchmark MLP: ``layers`` x (Linear(hidden, hidden) + ReLU)
        and a 10-way head."""
        blocks: list[nn.Module] = []
        for _ in range(args.layers):
            blocks += [nn.Linear(args.hidden, args.hidden), nn.ReLU()]
        return nn.Sequential(*blocks, nn.Linear(args.hidden, CLASSES))

    def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        out = model(batch[0])
        crash.hook(out)
        return F.cross_entropy(out, batch[1])

    def make_executor(group: Any, timeout: float) -> vflow.Executor:
        # ElasticJob calls this once, before this worker asks to join, with a group of
        # this worker alone: it says nothing about the job's worker sets.
        torch.manual_seed(SEED)
        model = mlp()
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
        if args.knock_at is not None:
            # Once: ElasticJob builds again only after connecting, and this worker has
            # knocked by then.
            gate, args.knock_at = args.knock_at, None
            until = time.monotonic() + KNOCK_WAIT_S
            while not os.path.exists(gate):
                if time.monotonic() > until:
                    raise SystemExit(f"--knock-at: no {gate} within {KNOCK_WAIT_S:g} s")
                time.sleep(0.01)
        return ex

    sets = {"name": None, "count": 0}

    def train_step(ex: vflow.Executor, step: int) -> vflow.StepResult:
        group = ex.process_group
        name = group.group_name if group is not None else ""
        if name != sets["name"]:
            # A new worker set: a new file, as a new worker group is for torchrun.
            sets["name"] = name
            log.switch(f"{args.log_path}.s{sets['count']}.jsonl")
            sets["count"] += 1
            now = time.time()
            pid, rank, n = os.getpid(), ex.rank, ex.world_size
            log.write(exec=now, pid=pid, rank=rank, restart=0, workers=n, master=name)
            log.write(begin=now, step=step, workers=n)
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
        return result

    job = elastic.job_from_args(args)
    job.run(make_executor, train_step, args.steps)
    log.switch(f"{args.log_path}.p.jsonl", "a")
    log.write(events=[e.__dict__ for e in job.events], end=time.time())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
