"""Train a small CNN on scikit-learn's digits with vflow, on any number of processes.

The global batch B and the number of virtual nodes V are properties of the *job*, not
of the hardware: the same command line gives the same model (up to float32 rounding in
the gradient all-reduce) whether it runs as one process, as two, as four, or with an
uneven plan that gives one worker more VNs than another.

One process, no process group::

    python examples/train_digits.py

One node, two processes (``--standalone`` starts a local rendezvous on a free port)::

    torchrun --standalone --nproc_per_node=2 examples/train_digits.py
    torchrun --standalone --nproc_per_node=2 examples/train_digits.py --plan 5,3

Two nodes with two processes each; run the same command on both nodes. The c10d
rendezvous assigns the ranks, so no node rank is given (torchrun ignores one)::

    torchrun --nnodes=2 --nproc_per_node=2 --rdzv_id=digits --rdzv_backend=c10d \\
        --rdzv_endpoint=node0.example.com:29400 examples/train_digits.py

or with torchrun's static rendezvous, where every node names its own rank::

    torchrun --nnodes=2 --nproc_per_node=2 --node_rank=0 --master_addr=node0.example.com \\
        --master_port=29500 examples/train_digits.py    # --node_rank=1 on the other node

With CUDA each process uses the GPU of its LOCAL_RANK and NCCL; otherwise the CPU and
Gloo. Rank 0 prints the loss of every epoch and the final test accuracy, and with
``--save`` writes the final ``state_dict``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import time

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

import vflow
from vflow.demo import cross_entropy, load_digits_split, make_model
from vflow.world.devices import local_gpu


def parse_plan(text: str) -> vflow.Plan:
    try:
        counts = [int(part) for part in text.split(",")]
        return vflow.Plan(counts=counts)
    except (TypeError, ValueError) as exc:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated VN counts per worker such as 5,3; got {text!r} ({exc})"
        ) from exc


def parse_args(argv: list[str] | None, world_size: int) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--virtual-nodes", type=int, default=8, help="V (default 8)")
    parser.add_argument("--batch-size", type=int, default=64, help="global batch B (default 64)")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0, help="data split, init, order, dropout")
    parser.add_argument(
        "--plan",
        type=parse_plan,
        default=None,
        help="VNs per worker, e.g. 5,3 (one entry per process; default: as even as possible)",
    )
    parser.add_argument(
        "--max-steps", type=int, default=None, help="stop after this many global steps in all"
    )
    parser.add_argument("--save", default=None, help="rank 0 saves the final state_dict here")
    parser.add_argument(
        "--timeout", type=float, default=600.0, help="seconds any rank waits for the others"
    )
    args = parser.parse_args(argv)
    # Checked before the process group exists so that a bad flag fails with a usage
    # message on every rank instead of a traceback from inside a collective.
    if args.epochs < 1:
        parser.error(f"--epochs must be >= 1, got {args.epochs}")
    if args.virtual_nodes < world_size:
        parser.error(
            f"--virtual-nodes ({args.virtual_nodes}) must be >= the number of processes "
            f"({world_size}): every worker needs at least one virtual node"
        )
    if args.batch_size < args.virtual_nodes:
        parser.error(
            f"--batch-size ({args.batch_size}) must be >= --virtual-nodes ({args.virtual_nodes})"
        )
    if not args.lr > 0:
        parser.error(f"--lr must be > 0, got {args.lr}")
    if args.max_steps is not None and args.max_steps < 1:
        parser.error(f"--max-steps must be >= 1, got {args.max_steps}")
    if not args.timeout > 0:
        parser.error(f"--timeout must be > 0, got {args.timeout}")
    if args.plan is not None:
        if args.plan.num_workers != world_size:
            parser.error(
                f"--plan has {args.plan.num_workers} entries but {world_size} process(es) run; "
                "give one VN count per process"
            )
        if args.plan.virtual_nodes != args.virtual_nodes:
            parser.error(
                f"--plan's VN counts sum to {args.plan.virtual_nodes} but --virtual-nodes is "
                f"{args.virtual_nodes}"
            )
    return args


def pick_device() -> torch.device:
    if not torch.cuda.is_available():
        return torch.device("cpu")
    try:
        index = local_gpu()  # LOCAL_RANK under torchrun (Note [A worker's GPU])
    except ValueError as e:
        raise SystemExit(f"{e}") from None
    # NCCL binds a rank to the current device, so it must be set before the group exists.
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def main(argv: list[str] | None = None) -> int:
    # torchrun sets WORLD_SIZE (and RANK, MASTER_ADDR, ...) for env:// initialisation;
    # without it this is a plain single-process run and no process group is created.
    launched = "WORLD_SIZE" in os.environ
    world_size = int(os.environ["WORLD_SIZE"]) if launched else 1
    args = parse_args(argv, world_size)
    device = pick_device()
    if launched:
        dist.init_process_group(
            "nccl" if device.type == "cuda" else "gloo",
            init_method="env://",
            timeout=datetime.timedelta(seconds=args.timeout),
        )
    try:
        return train(args, device)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def train(args: argparse.Namespace, device: torch.device) -> int:
    x_train, y_train, x_test, y_test = load_digits_split(args.seed)
    # Every rank builds the same model; the Executor still broadcasts rank 0's
    # parameters, so replicas start equal even if initialisation were not seeded.
    model = make_model(args.seed).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    ex = vflow.Executor(
        model,
        optimizer,
        cross_entropy,
        args.virtual_nodes,
        seed=args.seed,
        plan=args.plan,
        timeout=args.timeout,
    )
    rank, plan, size_b = ex.rank, ex.plan, args.batch_size

    def log(message: str) -> None:
        if rank == 0:
            print(message, flush=True)

    # The sampler hands this rank only the indices of its own VNs' samples; the global
    # order depends on (seed, epoch) alone, so the VNs see the same samples on any
    # number of workers. Bound to the executor, it splits every global batch under the
    # plan that step runs with, so it follows any plan change (plan="auto", set_plan).
    # (The digits fit in memory; a real dataset would read lazily in __getitem__, so
    # each rank would also read only its own samples.)
    sampler = vflow.VNBatchSampler(len(y_train), size_b, executor=ex, seed=args.seed)
    loader = DataLoader(TensorDataset(x_train, y_train), batch_sampler=sampler)
    log(
        f"vflow {vflow.__version__}: digits ({len(y_train)} train / {len(y_test)} test), "
        f"global batch B={size_b}, V={args.virtual_nodes} virtual nodes, "
        f"{ex.world_size} worker(s) on {device.type}, {plan}"
    )

    steps = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        start = time.perf_counter()
        losses = []
        for x, y in loader:
            result = ex.step((x.to(device), y.to(device)), global_batch_size=size_b)
            losses.append(result.loss)  # already the loss over the whole global batch
            steps += 1
            if args.max_steps is not None and steps >= args.max_steps:
                break
        log(
            f"epoch {epoch + 1}/{args.epochs}  loss {sum(losses) / len(losses):.4f}  "
            f"({len(losses)} steps, {time.perf_counter() - start:.1f} s)"
        )
        if args.max_steps is not None and steps >= args.max_steps:
            break

    # Inference is split like training: each rank runs the forward of its own VNs'
    # slice of the test set and infer() gathers the logits of all of them.
    n_test = len(y_test)
    lo, hi = plan.worker_range(rank, n_test)
    model.eval()
    logits = ex.infer(x_test[lo:hi].to(device), global_batch_size=n_test)
    model.train()
    accuracy = (logits.argmax(1).cpu() == y_test).float().mean().item()
    log(f"final test accuracy {accuracy:.4f} after {steps} steps")

    if args.save is not None and rank == 0:
        # CPU tensors, so that the file loads on a machine without the training device.
        state = {name: t.detach().cpu() for name, t in model.state_dict().items()}
        torch.save(state, args.save)
        log(f"saved the final state_dict to {args.save}")
    ex.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
