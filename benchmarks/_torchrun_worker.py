"""The torchrun side of benchmarks/elastic.py: the benchmark MLP trained the way a
torchrun user writes an elastic job (plain DDP over Gloo, a periodic checkpoint that a
restarted worker group resumes from), writing one JSON line per committed step with
its wall-clock time so that benchmarks/_torchrun_baseline.py can time events from
outside.

    torchrun --nnodes=1:2 --nproc-per-node=1 --rdzv-backend=c10d ... \\
        benchmarks/_torchrun_worker.py --log-path 'DIR/a.r{restart}.p{pid}.jsonl' \\
        --checkpoint DIR/ckpt.pt --checkpoint-every 10 --steps 100

Training is the same problem as benchmarks/_elastic_worker.py's: 12 x (Linear(1024,
1024) + ReLU) and a 10-way head (``--layers``, ``--hidden``), SGD lr 0.01 momentum 0.9,
one torch thread (``--threads``), the same synthetic dataset (8 global batches of
``--batch-size`` 128, drawn from a generator seeded 1234). Global batch ``s`` is
``s % 8`` of epoch ``s // 8`` of the same per-epoch order as VNBatchSampler(seed=0)
uses there, so step ``s`` trains on the same samples in both benchmarks whatever the
worker count. Rank ``r`` of ``n`` takes the ``r``-th of ``n`` contiguous shares of the
global batch (sizes differ by at most one); its loss is the sum over its share divided
by the global batch and multiplied by ``n``, so DDP's gradient mean is the mean over
the global batch even when the shares differ.

Rank 0 writes a checkpoint (model, optimizer, step count) after every step whose count
is a multiple of ``--checkpoint-every`` (K): to a temporary file, then ``os.replace``,
so a worker killed mid-write leaves the previous checkpoint intact. Every worker loads
the checkpoint, if there is one, before it wraps the model in DDP: after any restart
the group resumes from the last multiple of K and recomputes the steps since.

``--log-path`` is a path template; ``{rank}``, ``{restart}`` (TORCHELASTIC_RESTART_COUNT)
and ``{pid}`` are filled in, so every process writes its own file (the caller puts the
agent's node name into the template; the pid is what keeps names apart: the restart
count only counts failures, a membership change restarts workers without it).
Log lines (``t``: ``time.time()``):
``{"exec": t, "pid": p, "rank": r, "restart": c, "workers": n, "master": "ADDR:PORT"}``
first, before torch is imported;
``{"ready": t}`` once torch is imported;
``{"group": t, "workers": n}`` once ``init_process_group`` returned;
``{"built": t}`` once the model and optimizer are built;
``{"loaded": t, "step": s}`` after loading a checkpoint (``s``: the next step);
``{"begin": t, "step": s}`` when the first step of this process starts;
``{"t": t, "step": s, "rank": r, "workers": n, "restart": c}`` per committed
step (after ``optimizer.step()``);
``{"saved": t, "step": c, "seconds": d}`` after each checkpoint (``c``: step count);
``{"kill": t, "step": s}`` right before the SIGKILL of an armed crash;
``{"end": t}`` after the last step.

A daemon thread ends the process within a second of its agent's death
(``_exit_with_agent``: the benchmark's safety net when it is killed itself).

SIGUSR1 arms a crash: the next step to start kills this process with SIGKILL in its
backward, once the gradient reaches the middle block (DDP has sent some buckets by
then), after writing ``{"kill": ...}``. A peer's death makes the survivors' allreduce
raise, they exit non-zero, and the agents restart the whole group: that is torchrun's
recovery, and this script does nothing to help or hinder it.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from datetime import timedelta
from typing import IO, Any

CLASSES = 10
SEED = 0
DATA_SEED = 1234  # _elastic_worker.py's dataset generator
BATCHES_PER_EPOCH = 8  # _elastic_worker.py's dataset size, in global batches
_MASK64 = (1 << 64) - 1
_DATA_STREAM = 0x64617461  # vflow/data/sampler.py's stream for the epoch order


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # Not "--log": torchrun parses the script's options too, and rejects a prefix of
    # its own (--log-dir, --logs-specs) as ambiguous.
    parser.add_argument("--log-path", required=True, help="template: {rank} {restart} {pid}")
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--checkpoint-every", type=int, default=10)
    parser.add_argument("--steps", type=int, required=True, help="total steps of the job")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--pg-timeout",
        type=float,
        default=None,
        help="init_process_group timeout in seconds (default: torch's, 30 min for Gloo); "
        "bounds how long a collective waits for a stopped peer",
    )
    return parser.parse_args(argv)


class Log:
    def __init__(self, path: str) -> None:
        self._file: IO[str] = open(path, "w", buffering=1, encoding="utf-8")

    def write(self, **fields: Any) -> None:
        self._file.write(json.dumps(fields) + "\n")


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def epoch_seed(seed: int, epoch: int) -> int:
    """vflow.mapping.rng.vn_seed(seed, epoch, 0, stream=_DATA_STREAM), copied so that
    this script imports torch only (as a torchrun user's would) and still draws the
    same epoch order as VNBatchSampler."""
    prefix = _splitmix64(_splitmix64(seed & _MASK64) ^ (epoch & _MASK64))
    return _splitmix64(_splitmix64(prefix ^ 0) ^ _DATA_STREAM) >> 1


def share(batch: int, workers: int, rank: int) -> tuple[int, int]:
    """[start, stop) of ``rank``'s contiguous share of a global batch."""
    base, extra = divmod(batch, workers)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


def _exit_with_agent() -> None:
    """The benchmark's safety net, not torchrun's: this process ends within a second of
    its agent's death. torchrun starts its workers in sessions of their own, so a worker
    group whose agents died with a killed benchmark would otherwise train on alone (the
    benchmark runs them without a step limit). No measured event depends on it: an
    agent that gets SIGTERM stops its worker before it exits, a lost node loses both."""
    agent = os.getppid()

    def watch() -> None:
        while os.getppid() == agent:
            time.sleep(1.0)
        os._exit(70)

    threading.Thread(target=watch, name="exit-with-agent", daemon=True).start()


def main(argv: list[str]) -> int:
    args = parse(argv)
    rank = int(os.environ["RANK"])
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    log = Log(args.log_path.format(rank=rank, restart=restart, pid=os.getpid()))
    # Written before the imports: the baseline splits a restart into process start,
    # imports and set-up, and it needs this process's pid to signal and clean it up.
    # MASTER_ADDR:MASTER_PORT is new in every rendezvous round (the agent of rank 0
    # picks a free port): the baseline groups processes into worker groups by it.
    master = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
    log.write(
        exec=time.time(),
        pid=os.getpid(),
        rank=rank,
        restart=restart,
        workers=int(os.environ["WORLD_SIZE"]),
        master=master,
    )
    _exit_with_agent()

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn
    from torch.distributed.elastic.multiprocessing.errors import record
    from torch.nn.parallel import DistributedDataParallel

    log.write(ready=time.time())

    class Crash:
        """SIGUSR1 arms it; the next step to start dies in its backward."""

        def __init__(self) -> None:
            self.armed = False
            self.step: int | None = None  # the step to die in, once one has started armed

        def arm(self, *_: Any) -> None:
            self.armed = True

        def start_step(self, step: int) -> None:
            if self.armed and self.step is None:
                self.step = step

        def hook(self, step: int, out: torch.Tensor) -> None:
            if self.step == step and out.requires_grad:
                out.register_hook(lambda grad: self._die(step, grad))

        def _die(self, step: int, grad: torch.Tensor) -> torch.Tensor:
            log.write(kill=time.time(), step=step)
            os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(30)  # SIGKILL is asynchronous: never return into backward
            return grad

    @record
    def train() -> None:
        torch.set_num_threads(args.threads)
        crash = Crash()
        signal.signal(signal.SIGUSR1, crash.arm)
        kwargs: dict[str, Any] = {}
        if args.pg_timeout is not None:
            kwargs["timeout"] = timedelta(seconds=args.pg_timeout)
        dist.init_process_group("gloo", **kwargs)  # RANK, WORLD_SIZE, MASTER_*: torchrun's
        world = dist.get_world_size()
        log.write(group=time.time(), workers=world)

        samples = args.batch_size * BATCHES_PER_EPOCH
        gen = torch.Generator().manual_seed(DATA_SEED)
        x = torch.randn(samples, args.hidden, generator=gen)
        y = torch.randint(0, CLASSES, (samples,), generator=gen)
        lo, hi = share(args.batch_size, world, rank)

        torch.manual_seed(SEED)
        blocks: list[nn.Module] = []
        for _ in range(args.layers):
            blocks += [nn.Linear(args.hidden, args.hidden), nn.ReLU()]
        model = nn.Sequential(*blocks, nn.Linear(args.hidden, CLASSES))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        middle = model[2 * (args.layers // 2)]
        current = {"step": -1}
        middle.register_forward_hook(lambda _m, _i, out: crash.hook(current["step"], out))
        log.write(built=time.time())

        start = 0
        if os.path.exists(args.checkpoint):
            state = torch.load(args.checkpoint, map_location="cpu", weights_only=True)
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
            start = int(state["step"])
            log.write(loaded=time.time(), step=start)
        ddp = DistributedDataParallel(model)

        order: torch.Tensor | None = None
        order_epoch = -1
        for step in range(start, args.steps):
            if step == start:
                log.write(begin=time.time(), step=step)
            current["step"] = step
            crash.start_step(step)
            epoch, index = divmod(step, BATCHES_PER_EPOCH)
            if epoch != order_epoch:
                perm_gen = torch.Generator().manual_seed(epoch_seed(SEED, epoch))
                order, order_epoch = torch.randperm(samples, generator=perm_gen), epoch
            assert order is not None
            first = index * args.batch_size
            indices = order[first + lo : first + hi]
            out = ddp(x[indices])
            loss = F.cross_entropy(out, y[indices], reduction="sum") * (world / args.batch_size)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            log.write(
                t=time.time(),
                step=step,
                rank=rank,
                workers=world,
                restart=restart,
            )
            count = step + 1
            if rank == 0 and count % args.checkpoint_every == 0:
                began = time.time()
                tmp = f"{args.checkpoint}.tmp{os.getpid()}"
                state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
                torch.save({**state, "step": count}, tmp)
                os.replace(tmp, args.checkpoint)
                log.write(saved=time.time(), step=count, seconds=time.time() - began)
        dist.destroy_process_group()
        log.write(end=time.time())

    train()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
