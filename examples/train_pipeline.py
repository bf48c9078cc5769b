"""Train the digits as a pipelined residual MLP: S stages per replica, V virtual nodes.

The model (an embedding, ``--blocks`` residual blocks with dropout, a head) is cut into
``--stages`` stages; torchrun starts stages x replicas processes and each replica runs
its share of the V VNs as the microbatches of one pipeline schedule (``--schedule``,
1F1B or GPipe). The global batch, V and the learning rate are the same for every
grid, so half the replicas train the same model with twice the VNs each::

    torchrun --nproc-per-node=4 examples/train_pipeline.py --stages 2 \\
        --virtual-nodes 8 --steps 50 --seed 0 --deterministic --out a.pt
    torchrun --nproc-per-node=2 examples/train_pipeline.py --stages 2 \\
        --virtual-nodes 8 --steps 50 --seed 0 --deterministic --out b.pt
    python examples/train_pipeline.py --stages 1 \\
        --virtual-nodes 8 --steps 50 --seed 0 --deterministic --out c.pt

With ``--deterministic`` the three files hold bitwise the same model: every segment
draws its dropout masks from its own stream per (seed, step, VN), and each stage sums
its VNs' gradients in one fixed order. ``--stages 1`` on one process is the model
trained without a pipeline.

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
from vflow.demo import accuracy, load_digits_split, make_pipeline_model
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
    parser.add_argument("--blocks", type=int, default=4, help="residual blocks (default 4)")
    parser.add_argument("--width", type=int, default=128, help="block width (default 128)")
    parser.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads per process (default 1); bitwise results need the same everywhere",
    )
    parser.add_argument("--log-every", type=int, default=10, help="log the loss every N steps")
    args = parser.parse_args(argv)
    for flag, value, minimum in (
        ("--stages", args.stages, 1),
        ("--virtual-nodes", args.virtual_nodes, 1),
        ("--steps", args.steps, 0),
        ("--blocks", args.blocks, 1),
        ("--width", args.width, 1),
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
    if not args.lr > 0:
        parser.error(f"--lr must be > 0, got {args.lr}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(process)d %(name)s: %(message)s")
    torch.set_num_threads(args.threads)
    distributed = "WORLD_SIZE" in os.environ
    if distributed:
        use_loopback_for_gloo()
        dist.init_process_group("gloo")
    try:
        return train(args)
    finally:
        if distributed:
            dist.destroy_process_group()


def train(args: argparse.Namespace) -> int:
    x_train, y_train, x_test, y_test = load_digits_split(args.seed)
    model = make_pipeline_model(args.seed, args.width, args.blocks)
    ex = vflow.PipelineExecutor(
        model,
        lambda params: torch.optim.AdamW(params, lr=args.lr),
        lambda output, target: F.cross_entropy(output, target),
        args.virtual_nodes,
        seed=args.seed,
        pipeline=vflow.Pipeline(args.stages, schedule=args.schedule),
        deterministic=args.deterministic,
    )
    first = ex.grid.rank == 0
    # The whole global batch on every process: each stage takes what it needs.
    sampler = vflow.VNBatchSampler(
        len(y_train), args.batch_size, vflow.Plan([1]), 0, seed=args.seed
    )
    started = time.perf_counter()
    for step in range(args.steps):
        indices, _ = sampler.step_indices(step)
        result = ex.step(x_train[indices], y_train[indices])
        if first and (step + 1) % args.log_every == 0:
            _log.info("step %d/%d  loss %.4f", step + 1, args.steps, result.loss)
    seconds = (time.perf_counter() - started) / max(args.steps, 1)
    state = ex.state_dict()
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    _log.info(
        "stage %d of replica %d: %.1f ms a step, peak memory %.0f MiB",
        ex.grid.stage,
        ex.grid.replica,
        1e3 * seconds,
        peak_mib,
    )
    if first:
        whole = make_pipeline_model(args.seed, args.width, args.blocks)
        whole.load_state_dict(state["model"])
        _log.info("test accuracy %.4f after %d steps", accuracy(whole, x_test, y_test), args.steps)
        if args.out is not None:
            partial = f"{args.out}.partial{os.getpid()}"
            torch.save({"model": state["model"], "step": ex.step_count}, partial)
            os.replace(partial, args.out)
    ex.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
