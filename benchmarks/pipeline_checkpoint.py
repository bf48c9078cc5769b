"""vflow.pipeline.save's memory: each process's peak resident set while it saves a
checkpoint per stage (torch.distributed.checkpoint, Note [Checkpoints per stage] in
vflow/pipeline/checkpoint.py) against its peak while it trains, on 2 replicas x 2
stages, beside the former gather-then-save.

    python benchmarks/pipeline_checkpoint.py [--quick] [--json PATH] [--rounds N]
                                             [--steps N] [--hidden H] [--blocks N]
                                             [--dir DIR] [--timeout S]

The model: ``embed`` (Linear(64, H)), ``block0`` .. ``block<N-1>`` (Linear(H, H) +
GELU) and ``head`` (Linear(H, 10)), H = 1024 and N = 8 (8.5 M parameters), trained
with AdamW on a mean cross-entropy, cut into 2 stages (``block<N/2>`` begins stage 1):
about 17 MiB of parameters per stage, 50 MiB with AdamW's two moments. 2 replicas of
the 2 stages, 4 Gloo processes of one torch thread each (vflow.world.launch.run_ranks),
V = 4 VNs of 16 samples.

Measured on every process, in MiB above its resident set before the model was built
(VmHWM read after the measured span, the high-water mark reset before it by writing 5
to /proc/self/clear_refs):

* steady: the peak over ``--steps`` training steps, after warm-up steps;
* save: the peak during ``vflow.pipeline.save`` (each process writes its own stage's
  part; DCP's planner spreads a stage's entries over its replicas);
* gather-then-save, the peer baseline: the former ``vflow.pipeline.save``, i.e.
  ``ex.full_state_dict()`` (every stage's part gathered onto every process, as raw bytes)
  then ``torch.save`` of it from the grid's first process, atomically, and a gather of
  whether it was written.

Each of ``--rounds`` rounds runs one training step, then both saves one after the
other, in an order that alternates every round; each process's figure is the median
over the rounds. glibc's mmap threshold is held fixed at 128 KiB in the processes (as
in benchmarks/pipeline.py's judged memory runs): a freed tensor then goes back to the
system, and a peak follows the tensors alive rather than what the heap kept from an
earlier span. Target: on every process, save / steady <= ``TARGET_RATIO`` (1.1): a
checkpoint costs a process no more memory than a step does, give or take what writing
one tensor at a time takes.
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from _common import (
    CLASSES,
    Default,
    add_output_args,
    format_table,
    malloc_env,
    median,
    memory_status,
    open_process_session,
    reset_peak,
)
from torch import nn

import vflow
from vflow.bench import records as bench_records
from vflow.pipeline import ProcessGrid
from vflow.runtime.checkpoint import write_atomically
from vflow.world.group import World
from vflow.world.launch import RankError, run_ranks

IN_FEATURES = 64
STAGES = 2
REPLICAS = 2
VIRTUAL_NODES = 4
VN_SIZE = 16
MODEL_SEED = 1000
# Each process's peak while saving / its peak while training: a checkpoint should cost
# a process what a step costs, give or take one tensor being serialised.
TARGET_RATIO = 1.1
MMAP_THRESHOLD = 128 * 1024  # as benchmarks/pipeline.py's judged memory runs
TIMEOUT_S = Default(full=600.0, quick=240.0)
MIB = 2**20


@dataclass(frozen=True)
class Config:
    hidden: int
    blocks: int
    warmup: int
    steps: int
    rounds: int
    collective_timeout_s: float
    timeout_s: float


# ---- the model ----


def segment_names(blocks: int) -> list[str]:
    return ["embed", *(f"block{i}" for i in range(blocks)), "head"]


def build_model(cfg: Config) -> nn.Sequential:
    segments: collections.OrderedDict[str, nn.Module] = collections.OrderedDict()
    for k, name in enumerate(segment_names(cfg.blocks)):
        torch.manual_seed(MODEL_SEED + k)
        if name == "embed":
            segments[name] = nn.Linear(IN_FEATURES, cfg.hidden)
        elif name == "head":
            segments[name] = nn.Linear(cfg.hidden, CLASSES)
        else:
            segments[name] = nn.Sequential(nn.Linear(cfg.hidden, cfg.hidden), nn.GELU())
    return nn.Sequential(segments)


def stage_parameter_bytes(cfg: Config, stage: int) -> int:
    """fp32 parameters of stage ``stage``: half the blocks, and embed or head."""
    h = cfg.hidden
    ends = IN_FEATURES * h + h if stage == 0 else h * CLASSES + CLASSES
    return 4 * (cfg.blocks // 2 * (h * h + h) + ends)


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(10_000 + step)
    samples = VIRTUAL_NODES * VN_SIZE
    return (
        torch.randn(samples, IN_FEATURES, generator=gen),
        torch.randint(0, CLASSES, (samples,), generator=gen),
    )


def _ce(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output, target)


# ---- memory ----


def _peak_of(fn: Callable[[], object]) -> tuple[int, float, bool]:
    """The high-water mark of the resident set while ``fn`` runs, its duration, and
    whether the mark could be reset before it."""
    gc.collect()
    reset = reset_peak()
    start = time.perf_counter()
    fn()
    elapsed = time.perf_counter() - start
    return memory_status()["VmHWM"], elapsed, reset


def gather_then_save(path: str, ex: vflow.PipelineExecutor) -> None:
    """The former vflow.pipeline.save: the whole state gathered onto every process,
    written from the grid's first process, and a gather of whether it was."""
    state = ex.full_state_dict()
    if ex.grid.rank == 0:
        write_atomically(path, state)
    del state
    World(ex.grid.group, ex.config.timeout).gather_ints(
        [1], f"gather of whether {path} was written", ex.step_count
    )


def _rank(rank: int, world_size: int, cfg: Config, directory: str) -> dict[str, Any]:
    grid = ProcessGrid.of(STAGES, timeout=cfg.collective_timeout_s)
    batches = [global_batch(s) for s in range(cfg.warmup + cfg.steps + cfg.rounds)]
    gc.collect()
    before = memory_status()["VmRSS"]
    ex = vflow.PipelineExecutor(
        build_model(cfg),
        lambda params: torch.optim.AdamW(params, lr=1e-4),
        _ce,
        VIRTUAL_NODES,
        pipeline=vflow.Pipeline(STAGES, schedule="1F1B", split=(f"block{cfg.blocks // 2}",)),
        grid=grid,
        timeout=cfg.collective_timeout_s,
    )
    step = 0
    for _ in range(cfg.warmup):
        ex.step(*batches[step])
        step += 1

    def train() -> None:
        nonlocal step
        for _ in range(cfg.steps):
            ex.step(*batches[step])
            step += 1

    steady, _, reset = _peak_of(train)
    per_stage = os.path.join(directory, "per_stage")
    gathered = os.path.join(directory, "gathered.pt")
    methods: dict[str, Callable[[], object]] = {
        "save": lambda: vflow.pipeline.save(per_stage, ex),
        "gather": lambda: gather_then_save(gathered, ex),
    }
    peaks: dict[str, list[int]] = {name: [] for name in methods}
    times: dict[str, list[float]] = {name: [] for name in methods}
    for r in range(cfg.rounds):
        ex.step(*batches[step])
        step += 1
        order = list(methods) if r % 2 == 0 else list(reversed(methods))
        for name in order:
            hwm, elapsed, ok = _peak_of(methods[name])
            reset = reset and ok
            peaks[name].append(hwm - before)
            times[name].append(elapsed)
    ex.close()
    return {
        "rank": rank,
        "stage": grid.stage,
        "replica": grid.replica,
        "rss_before": before,
        "steady_peak_growth": steady - before,
        "save_peak_growth": peaks["save"],
        "gather_peak_growth": peaks["gather"],
        "save_s": times["save"],
        "gather_s": times["gather"],
        "peak_reset": reset,
    }


def _directory_bytes(path: str) -> int:
    real = os.path.realpath(path)
    return sum(os.path.getsize(os.path.join(real, name)) for name in os.listdir(real))


def measure(cfg: Config, directory: str) -> dict[str, Any]:
    with malloc_env(MMAP_THRESHOLD):
        results = run_ranks(
            REPLICAS * STAGES,
            _rank,
            cfg,
            directory,
            timeout=cfg.timeout_s,
            collective_timeout=cfg.collective_timeout_s,
            fail_fast=True,
        )
    processes = [r.value for r in results]
    for p in processes:
        p["save_median"] = median(p["save_peak_growth"])
        p["gather_median"] = median(p["gather_peak_growth"])
        p["ratio"] = p["save_median"] / p["steady_peak_growth"]
        p["gather_ratio"] = p["gather_median"] / p["steady_peak_growth"]
    return {
        "processes": processes,
        "worst": max(processes, key=lambda p: p["ratio"]),
        "checkpoint_bytes": _directory_bytes(os.path.join(directory, "per_stage")),
        "gathered_file_bytes": os.path.getsize(os.path.join(directory, "gathered.pt")),
        "stage_parameter_bytes": [stage_parameter_bytes(cfg, s) for s in range(STAGES)],
    }


# ---- the report ----


def _mib(n: float) -> str:
    return f"{n / MIB:.1f}"


def _verdict(ok: bool) -> str:
    return "met" if ok else "MISSED"


def print_results(results: dict[str, Any]) -> None:
    rows = []
    for p in results["processes"]:
        rows.append(
            [
                str(p["rank"]),
                f"{p['stage']}",
                f"{p['replica']}",
                _mib(p["steady_peak_growth"]),
                _mib(p["save_median"]),
                f"{p['ratio']:.3f}",
                _verdict(p["ratio"] <= TARGET_RATIO),
                _mib(p["gather_median"]),
                f"{p['gather_ratio']:.3f}",
                f"{median(p['save_s']):.3f}",
                f"{median(p['gather_s']):.3f}",
            ]
        )
    print()
    print(
        format_table(
            [
                "process",
                "stage",
                "replica",
                "steady MiB",
                "save MiB",
                "save / steady",
                f"<= {TARGET_RATIO}",
                "gather-then-save MiB",
                "gather / steady",
                "save s",
                "gather s",
            ],
            rows,
        )
    )
    worst = results["worst"]
    ok = all(p["ratio"] <= TARGET_RATIO for p in results["processes"])
    print(
        f"\ntarget: every process's peak while saving <= {TARGET_RATIO}x its steady peak: "
        f"{_verdict(ok)} (largest: process {worst['rank']}, {worst['ratio']:.3f})"
    )
    print(
        f"parameters per stage: {' / '.join(_mib(b) for b in results['stage_parameter_bytes'])} "
        f"MiB; the checkpoint's files: {_mib(results['checkpoint_bytes'])} MiB (per stage, "
        f"DCP), {_mib(results['gathered_file_bytes'])} MiB (gathered, one file)"
    )
    print(
        "  MiB: the resident set's high-water mark above where it stood before the model "
        "was built (medians over the rounds for the saves); steady: over the training "
        "steps; save: vflow.pipeline.save (each process its own stage); gather-then-save: "
        "ex.full_state_dict() on every process + torch.save from the first (the former save)"
        + (
            ""
            if all(p["peak_reset"] for p in results["processes"])
            else " (the reset of the high-water mark FAILED: the peaks may predate the spans)"
        )
    )


def headline_records(results: dict[str, Any]) -> list[dict[str, Any]]:
    m = bench_records.measurement
    worst = results["worst"]
    steady = m(nbytes=worst["steady_peak_growth"], label="training steps", note=_STEADY_NOTE)
    return [
        bench_records.headline(
            "pipeline_checkpoint",
            "pipeline_checkpoint/save-vs-steady",
            "2x2: peak RSS growth while saving / while training, largest process",
            vflow=m(nbytes=int(worst["save_median"]), label="vflow.pipeline.save (per stage)"),
            limit=steady,
            compare="vflow/limit",
            target=bench_records.target("<=", TARGET_RATIO),
            stated_ratio=worst["ratio"],
        ),
        bench_records.headline(
            "pipeline_checkpoint",
            "pipeline_checkpoint/gather-vs-steady",
            "2x2: peak RSS growth, gather-then-save / training, same process",
            vflow=m(nbytes=int(worst["gather_median"]), label="full_state_dict() + torch.save"),
            limit=steady,
            compare="vflow/limit",
            stated_ratio=worst["gather_ratio"],
        ),
    ]


_STEADY_NOTE = (
    "the process's peak resident set growth over training steps: its stage's parameters, "
    "gradients, optimizer state and activations"
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_output_args(parser, quick="fewer rounds and a smaller model (CI smoke test)")
    parser.add_argument("--rounds", type=int, default=None, help="rounds (default 5, 2 quick)")
    parser.add_argument("--steps", type=int, default=None, help="steady steps (default 3)")
    parser.add_argument("--hidden", type=int, default=None, help="H (default 1024, 512 quick)")
    parser.add_argument("--blocks", type=int, default=8, help="blocks, even (default 8)")
    parser.add_argument(
        "--dir", default=None, help="where to write the checkpoints (default: a temporary one)"
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=None,
        help=f"give up (and stop every process) after this many seconds ({TIMEOUT_S.text()})",
    )
    args = parser.parse_args(argv)
    for name in ("rounds", "steps", "hidden", "blocks", "timeout"):
        value = getattr(args, name)
        if value is not None and value <= 0:
            raise SystemExit(f"--{name} must be > 0, got {value}")
    if args.blocks % 2:
        raise SystemExit(f"--blocks must be even (two equal stages), got {args.blocks}")
    cfg = Config(
        hidden=args.hidden or (512 if args.quick else 1024),
        blocks=args.blocks,
        warmup=2,
        steps=args.steps or 3,
        rounds=args.rounds or (2 if args.quick else 5),
        collective_timeout_s=120.0,
        timeout_s=TIMEOUT_S.of(args, "timeout"),
    )
    session = open_process_session(
        args,
        "vflow benchmark: vflow.pipeline.save's memory per process against its training "
        "steps, and the former gather-then-save",
        threads=1,
        backend="gloo",
        threads_per_rank=1,
    )
    print(f"config: {json.dumps(asdict(cfg))}; 2 replicas x 2 stages, 4 processes", flush=True)
    directory = tempfile.mkdtemp(prefix="vflow-ckpt-bench-", dir=args.dir)
    try:
        results = measure(cfg, directory)
    except (RankError, TimeoutError) as e:
        raise SystemExit(f"benchmark failed: {e}") from None
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    results["config"] = asdict(cfg)
    print_results(results)
    records = [
        {"benchmark": "pipeline_checkpoint", **{k: v for k, v in results.items() if k != "worst"}},
        *headline_records(results),
    ]
    return session.finish(records)


if __name__ == "__main__":
    sys.exit(main())
