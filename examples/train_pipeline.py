"""Train the digits as a pipelined model: S stages per replica, V virtual nodes.

The model (an embedding, ``--blocks`` blocks with dropout, a head: a residual MLP, or
with ``--model transformer`` a small GPT-2-style transformer over the digits' rows whose
blocks pass hidden states and an attention mask on) is cut into ``--stages`` stages;
torchrun starts stages x replicas processes and each replica runs its share of the V
VNs as the microbatches of one pipeline schedule (``--schedule``, 1F1B or GPipe). The
global batch, V and the learning rate are the same for every grid, so half the
replicas train the same model with twice the VNs each::

    torchrun --nproc-per-node=4 examples/train_pipeline.py --stages 2 \\
        --virtual-nodes 8 --steps 50 --seed 0 --deterministic --out a.pt
    torchrun --nproc-per-node=2 examples/train_pipeline.py --stages 2 \\
        --virtual-nodes 8 --steps 50 --seed 0 --deterministic --out b.pt
    python examples/train_pipeline.py --stages 1 \\
        --virtual-nodes 8 --steps 50 --seed 0 --deterministic --out c.pt

With ``--deterministic`` the three files hold bitwise the same model: every segment
draws its dropout masks from its own stream per (seed, step, VN), and each stage sums
its VNs' gradients in one fixed order. ``--stages 1`` on one process is the model
trained without a pipeline. So do they with ``--max-grad-norm X`` (the norm of the
whole model's gradient, the same bits on every grid) and with ``--amp bf16`` or
``--amp fp16`` (autocast on every stage; fp16 with loss scaling, one inf/NaN verdict
for the grid), and with ``--model transformer``.

Each process is given only what it uses of its replica's share of the global batch
(``global_batch_size=B``): the images on a replica's first stage, the labels on its
last, nothing between.

Elastic (``--rdzv HOST:PORT --job ID``, on the store ``python -m vflow rendezvous``
hosts): each process is started on its own with ``--stage s`` and is one stage of a
replica; the job runs on whole replicas, which join, leave (SIGTERM) and crash (a
killed process takes its replica out: its partners wait, and come back once a process
of the lost stage is started again) while it runs, and with ``--deterministic`` it
ends bitwise as the lines above::

    python -m vflow rendezvous --port 29400 &
    for stage in 0 1 0 1; do
        python examples/train_pipeline.py --rdzv 127.0.0.1:29400 --job pipe \
            --stages 2 --stage $stage --min-workers 4 --virtual-nodes 8 --steps 50 \
            --seed 0 --deterministic --out d.pt &
    done

torchrun's store (and this script's Gloo connections) listen on the loopback interface
here; the c10d store has no authentication. The grid's first process writes
``{"model": the whole model's state dict, under the unsplit model's names, "step": N}``
to ``--out`` and logs the loss every ``--log-every`` steps, and every process logs its
peak memory and step time at the end.
"""

from __future__ import annotations

import argparse
import logging
import os
import resource
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import vflow
from vflow.demo import accuracy, load_digits_split, make_pipeline_model, make_transformer_model
from vflow.elastic import add_job_arguments, job_from_args
from vflow.world.devices import local_gpu
from vflow.world.group import use_loopback_for_gloo

_log = logging.getLogger("train_pipeline")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--stages", type=int, required=True, help="pipeline stages per replica")
    parser.add_argument("--virtual-nodes", type=int, required=True, help="V")
    parser.add_argument("--steps", type=int, required=True, help="global steps")
    parser.add_argument("--seed", type=int, default=0, help="data order, init and dropout")
    parser.add_argument(
        "--deterministic", action="store_true", help="bitwise the same model on every grid"
    )
    parser.add_argument("--out", default=None, help="the first process writes the model here")
    parser.add_argument("--schedule", choices=["1F1B", "GPipe"], default="1F1B")
    parser.add_argument("--batch-size", type=int, default=64, help="global batch B (default 64)")
    parser.add_argument(
        "--model",
        choices=["mlp", "transformer"],
        default="mlp",
        help="a residual MLP (one tensor between segments), or a small transformer over the "
        "digits' rows whose blocks pass (hidden states, attention mask) on; default mlp",
    )
    parser.add_argument("--blocks", type=int, default=4, help="residual blocks (default 4)")
    parser.add_argument(
        "--width", type=int, default=None, help="block width (default 128 mlp, 64 transformer)"
    )
    parser.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate")
    parser.add_argument(
        "--max-grad-norm",
        type=float,
        default=None,
        help="clip the whole model's gradient (every stage's) to this global 2-norm",
    )
    parser.add_argument(
        "--amp",
        choices=["none", "bf16", "fp16"],
        default="none",
        help="autocast the forwards and the loss (fp16: with loss scaling); default none",
    )
    parser.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="cpu (Gloo) or cuda (NCCL; each process on the GPU of its LOCAL_RANK)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads per process (default 1); bitwise results need the same everywhere",
    )
    parser.add_argument("--log-every", type=int, default=10, help="log the loss every N steps")
    # Elastic: --rdzv, --job and the job's options, and this process's stage.
    add_job_arguments(parser, "min_workers", "timeout_s", "last_call_s", required=False)
    parser.add_argument(
        "--stage", type=int, default=None, help="elastic: the stage this process holds"
    )
    parser.add_argument(
        "--sleep", type=float, default=0.0, help="seconds this process sleeps before each step"
    )
    args = parser.parse_args(argv)
    elastic = args.rendezvous is not None or args.job_id is not None
    if elastic and (args.rendezvous is None or args.job_id is None):
        parser.error("an elastic job needs both --rdzv and --job")
    if elastic and args.stages < 2:
        parser.error("an elastic job of --stages 1 is examples/train_elastic.py's")
    if elastic and args.device == "cuda":
        parser.error("--device cuda with --rdzv: elastic pipelines run on CPUs (Gloo) so far")
    if elastic and args.stage is None:
        parser.error("--stage: an elastic pipeline's process says which stage it holds")
    if args.stage is not None and not (elastic and 0 <= args.stage < args.stages):
        parser.error(f"--stage must be in [0, --stages) and needs --rdzv, got {args.stage}")
    if not args.sleep >= 0:
        parser.error(f"--sleep must be >= 0, got {args.sleep}")
    for flag, value, minimum in (
        ("--stages", args.stages, 1),
        ("--virtual-nodes", args.virtual_nodes, 1),
        ("--steps", args.steps, 0),
        ("--blocks", args.blocks, 1),
        ("--width", 1 if args.width is None else args.width, 1),
        ("--threads", args.threads, 1),
        ("--log-every", args.log_every, 1),
    ):
        if value < minimum:
            parser.error(f"{flag} must be >= {minimum}, got {value}")
    if args.batch_size % args.virtual_nodes:
        parser.error(
            f"--batch-size ({args.batch_size}) must be a multiple of --virtual-nodes "
            f"({args.virtual_nodes}): a pipeline's microbatches share one shape"
        )
    if args.stages > args.blocks + 2:
        parser.error(f"--stages ({args.stages}) exceeds the model's {args.blocks + 2} segments")
    if args.width is None:
        args.width = 128 if args.model == "mlp" else 64
    if args.model == "transformer" and args.width % 4:
        parser.error(f"--width ({args.width}) must be a multiple of the transformer's 4 heads")
    if not args.lr > 0:
        parser.error(f"--lr must be > 0, got {args.lr}")
    if args.max_grad_norm is not None and not args.max_grad_norm > 0:
        parser.error(f"--max-grad-norm must be > 0, got {args.max_grad_norm}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(process)d %(name)s: %(message)s")
    torch.set_num_threads(args.threads)
    distributed = "WORLD_SIZE" in os.environ and args.rendezvous is None
    if args.device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: torch sees no CUDA device")
        try:
            torch.cuda.set_device(local_gpu())  # Note [A worker's GPU]: before the group
        except ValueError as e:
            raise SystemExit(f"--device cuda: {e}") from None
    if distributed:
        use_loopback_for_gloo()
        dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    try:
        return train(args)
    finally:
        if distributed:
            dist.destroy_process_group()


def build(args: argparse.Namespace, only: list[str] | None = None) -> torch.nn.Sequential:
    """The model, the same on every process; ``only``: the segments to build, the
    others on the meta device (None: all of them)."""
    if args.model == "transformer":
        return make_transformer_model(args.seed, args.width, args.blocks, only=only)
    return make_pipeline_model(args.seed, args.width, args.blocks, only=only)


def make_executor(
    args: argparse.Namespace, grid: vflow.pipeline.ProcessGrid, timeout_s: float
) -> vflow.PipelineExecutor:
    """This process's stage of the model and its executor on ``grid``. Each process
    builds only its own stage's segments: the whole model never exists in one process
    (the names of the segments come from a build on the meta device)."""
    device = (
        torch.device(args.device, torch.cuda.current_device()) if args.device == "cuda" else None
    )
    pipeline = vflow.Pipeline(args.stages, schedule=args.schedule)
    names = [name for name, _ in build(args, only=[]).named_children()]
    own = pipeline.cut(names)[grid.stage]
    model = build(args, only=own)
    for name in own if device is not None else ():
        getattr(model, name).to(device)
    return vflow.PipelineExecutor(
        model,
        lambda params: torch.optim.AdamW(params, lr=args.lr),
        lambda output, target: F.cross_entropy(output, target),
        args.virtual_nodes,
        seed=args.seed,
        pipeline=pipeline,
        grid=grid,
        deterministic=args.deterministic,
        amp=None if args.amp == "none" else args.amp,
        max_grad_norm=args.max_grad_norm,
        timeout=timeout_s,
    )


def train(args: argparse.Namespace) -> int:
    x_train, y_train, x_test, y_test = load_digits_split(args.seed)
    if args.device == "cuda":
        x_train, y_train = x_train.to("cuda"), y_train.to("cuda")
    # Every process draws the same global batch, and keeps what it uses of its
    # replica's share: the images on the first stage, the labels on the last.
    sampler = vflow.VNBatchSampler(
        len(y_train), args.batch_size, vflow.Plan([1]), 0, seed=args.seed
    )

    def train_step(ex: vflow.PipelineExecutor, step: int) -> vflow.StepResult:
        if args.sleep > 0:
            time.sleep(args.sleep)
        # The replica's share under the plan of this step's grid (an elastic job's grid
        # changes with its workers).
        start, stop = ex.plan.worker_range(ex.grid.replica, args.batch_size)
        mine = sampler.step_indices(step)[0][start:stop]
        result = ex.step(
            x_train[mine] if ex.grid.is_first else None,
            y_train[mine] if ex.grid.is_last else None,
            global_batch_size=args.batch_size,
        )
        _log_step(args, ex, step, result)
        return result

    started = time.perf_counter()
    if args.rendezvous is not None:
        job = job_from_args(args, stages=args.stages, stage=args.stage)
        ran = job.run(
            lambda grid, timeout_s: make_executor(args, grid, timeout_s), train_step, args.steps
        )
        if ran is None or ran.step_count < args.steps:
            return 0  # the job ended without this process, or it left: no model to write
        ex = ran
    else:
        grid = vflow.pipeline.ProcessGrid.of(args.stages, timeout=600.0)
        ex = make_executor(args, grid, 600.0)
        for step in range(args.steps):
            train_step(ex, step)
    seconds = (time.perf_counter() - started) / max(args.steps, 1)
    finish(args, ex, seconds, x_test, y_test)
    return 0


def _log_step(
    args: argparse.Namespace, ex: vflow.PipelineExecutor, step: int, result: vflow.StepResult
) -> None:
    if ex.grid.rank == 0 and (step + 1) % args.log_every == 0:
        norm = "" if result.grad_norm is None else f"  gradient norm {result.grad_norm:.4f}"
        scale = "" if result.loss_scale is None else f"  loss scale {result.loss_scale:g}"
        skipped = "  (skipped: inf/NaN)" if result.skipped else ""
        _log.info(
            "step %d/%d  loss %.4f%s%s%s",
            step + 1,
            args.steps,
            result.loss,
            norm,
            scale,
            skipped,
        )


def finish(
    args: argparse.Namespace,
    ex: vflow.PipelineExecutor,
    seconds: float,
    x_test: torch.Tensor,
    y_test: torch.Tensor,
) -> None:
    """Every process of the grid gathers the model; the first one tests and writes it."""
    first = ex.grid.rank == 0
    state = ex.full_state_dict()
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    _log.info(
        "stage %d of replica %d: %.1f ms a step, peak memory %.0f MiB",
        ex.grid.stage,
        ex.grid.replica,
        1e3 * seconds,
        peak_mib,
    )
    if first:
        whole = build(args)
        whole.load_state_dict(state["model"])
        _log.info("test accuracy %.4f after %d steps", accuracy(whole, x_test, y_test), args.steps)
        if args.out is not None:
            partial = f"{args.out}.partial{os.getpid()}"
            torch.save({"model": state["model"], "step": ex.step_count}, partial)
            os.replace(partial, args.out)
    ex.close()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
