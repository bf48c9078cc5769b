"""Pipelined virtual nodes: vflow.PipelineExecutor's step against the bubble formula,
the halving of replicas, memory per stage against an unsplit worker, and
torch.distributed.pipelining used by hand.

    python benchmarks/pipeline.py [--quick] [--json PATH] [--vn-size N]

The model: ``embed`` (Linear(64, H)), ``block0`` .. ``block7`` (Linear(H, H) + GELU)
and ``head`` (Linear(H, 10)), H = 1024 (8.5 M parameters), trained with AdamW on a
mean cross-entropy, cut into S = 2 stages (``block4`` begins stage 1) or S = 4 (cuts
before ``block2``, ``block4``, ``block6``). Every segment is built from a seed of its
own, so that a process that holds only some segments builds them with the weights of
the whole model, and builds the others on the meta device: they never take memory.
Each process runs one torch thread (Gloo ranks of vflow.world.launch.run_ranks).
A replica runs M VNs of ``--vn-size`` samples as the M microbatches of one 1F1B
schedule; R replicas take a global batch of B = R x M x vn-size.

Measured (S = 2 always; S = 4 only with 8 or more usable CPUs, R = 2 only with R x S):

* step vs prediction: the median step of PipelineExecutor (R = 1, M = 4 and 8) against
  (M + S - 1) slots, a slot being the forward + backward of one microbatch through the
  slowest stage, timed on its own in calibration bursts between the timed rounds, on a
  copy of the stage's module, every process at once (as in the pipeline, each on its
  core); nothing of it comes from the pipelined steps it judges. The optimizer step,
  calibrated the same way, is shown beside it (the formula leaves it out).
* the halving: R replicas with M VNs each against R/2 replicas with 2M VNs each (same
  global batch, half the processes), predicted (2M + S - 1) / (M + S - 1). With R x S
  usable CPUs: R = 2 against R = 1. With fewer (2 cores), what the halved job's replica
  does: R = 1 with M VNs against R = 1 with 2M VNs of the same size (the global batch
  doubles); the table says which ran.
* memory: the peak growth of each process's resident set (VmHWM after the steps less
  VmRSS before the model was built, the high-water mark reset after that baseline by
  writing 5 to /proc/self/clear_refs), in fresh processes: each stage of S against a
  ``vflow.Executor`` worker holding the whole model with the same VNs. Target: the
  largest stage at S = 2 <= 0.6x the unsplit worker's.
* the peer: the same stages under torch.distributed.pipelining used by hand
  (``PipelineStage`` on the same stage module, ``Schedule1F1B`` with ``scale_grads``
  on (one schedule step per optimizer step, so it divides by M as the mean loss
  needs), then ``optimizer.step()`` and ``zero_grad()``), with DDP across the replicas
  when R >= 2 (``PipelineStage`` syncs a DDP submodule in the last backward only).
  Target: vflow / peer <= 1.05, paired.

Timing: after warm-up steps, each round steps every method once, in an order that
rotates every round, each step right after a barrier of all processes; a step's time
is the slowest process's. Ratios are medians over the rounds of the per-round ratio.
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import os
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _common import (
    CLASSES,
    Default,
    add_output_args,
    fmt_ms,
    format_table,
    iqr,
    median,
    open_process_session,
    usable_cpus,
)
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B
from torch.nn.parallel import DistributedDataParallel

import vflow
from vflow.bench import records as bench_records
from vflow.pipeline import ProcessGrid
from vflow.pipeline.spec import stage_bounds
from vflow.world.launch import RankError, run_ranks

IN_FEATURES = 64
HIDDEN = 1024
BLOCKS = 8
MICROBATCHES = (4, 8)
STAGE_COUNTS = (2, 4)
TARGET_MEMORY = 0.6  # largest stage's peak growth / the unsplit worker's, at S = 2
TARGET_PEER = 1.05  # vflow / torch.distributed.pipelining by hand, step time
# The per-round ratio needs this many rounds before a few percent can be told from noise.
MIN_ROUNDS = 10
MODEL_SEED = 1000
LR = 1e-4
TIMEOUT_S = Default(full=600.0, quick=120.0)
MIB = 2**20


@dataclass(frozen=True)
class Config:
    hidden: int
    blocks: int
    vn_size: int
    microbatches: tuple[int, ...]
    warmup: int
    rounds: int
    calibration_per_round: int
    memory_steps: int
    collective_timeout_s: float
    rank_timeout_s: float


@dataclass(frozen=True)
class Job:
    """One method on one grid: ``method`` is "vflow" or "peer"."""

    method: str
    replicas: int
    microbatches: int

    @property
    def name(self) -> str:
        return f"{self.method} R={self.replicas} M={self.microbatches}"


# ---- the model and its cut ----


def segment_names(blocks: int) -> list[str]:
    return ["embed", *(f"block{i}" for i in range(blocks)), "head"]


def split_points(blocks: int, stages: int) -> tuple[str, ...]:
    """Where stages 1 .. S-1 begin: the blocks dealt out evenly (embed and head ride on
    the first and last stage; they are small)."""
    if blocks % stages:
        raise ValueError(f"{blocks} blocks do not split into {stages} equal stages")
    per = blocks // stages
    return tuple(f"block{s * per}" for s in range(1, stages))


def pipeline_of(cfg: Config, stages: int) -> vflow.Pipeline:
    return vflow.Pipeline(stages, schedule="1F1B", split=split_points(cfg.blocks, stages))


def stage_range(cfg: Config, stages: int, stage: int) -> range:
    first, stop = stage_bounds(segment_names(cfg.blocks), pipeline_of(cfg, stages))[stage]
    return range(first, stop)


def _segment(name: str, hidden: int) -> nn.Module:
    if name == "embed":
        return nn.Linear(IN_FEATURES, hidden)
    if name == "head":
        return nn.Linear(hidden, CLASSES)
    return nn.Sequential(nn.Linear(hidden, hidden), nn.GELU())


def build_model(cfg: Config, keep: range | None = None) -> nn.Sequential:
    """The whole model, with only the segments in ``keep`` (all when None) on the CPU;
    the others are built on the meta device, so they never take memory."""
    segments: collections.OrderedDict[str, nn.Module] = collections.OrderedDict()
    for k, name in enumerate(segment_names(cfg.blocks)):
        if keep is None or k in keep:
            # A seed per segment: its weights are the same whichever segments are built.
            torch.manual_seed(MODEL_SEED + k)
            segments[name] = _segment(name, cfg.hidden)
        else:
            with torch.device("meta"):
                segments[name] = _segment(name, cfg.hidden)
    return nn.Sequential(segments)


def stage_module(cfg: Config, stages: int, stage: int) -> nn.Sequential:
    """Stage ``stage``'s segments under their own names, as vflow keeps them."""
    keep = stage_range(cfg, stages, stage)
    children = list(build_model(cfg, keep).named_children())
    return nn.Sequential(collections.OrderedDict(children[keep.start : keep.stop]))


def make_optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR)


def global_batch(cfg: Config, samples: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(10_000 + step)
    return (
        torch.randn(samples, IN_FEATURES, generator=gen),
        torch.randint(0, CLASSES, (samples,), generator=gen),
    )


# ---- predictions and ratios (pure) ----


def predicted_step_s(slot_s: float, microbatches: int, stages: int) -> float:
    """A schedule of M microbatches over S stages takes M + S - 1 slots (GPipe and 1F1B
    alike: S - 1 of them are the fill and drain)."""
    return (microbatches + stages - 1) * slot_s


def halving_prediction(microbatches: int, stages: int) -> float:
    """Step time of half the replicas with 2M VNs each over that of R replicas with M."""
    return (2 * microbatches + stages - 1) / (microbatches + stages - 1)


def slowest(per_process: Sequence[Sequence[float]]) -> list[float]:
    """Each round's step time: the slowest process's."""
    return [max(times) for times in zip(*per_process, strict=True)]


def pair_ratios(numerator: Sequence[float], denominator: Sequence[float]) -> list[float]:
    return [a / b for a, b in zip(numerator, denominator, strict=True)]


def rotated_orders(jobs: Sequence[Job], rounds: int) -> list[tuple[Job, ...]]:
    """One order per round, rotating, so that each method runs in each position as often
    as the rounds allow (a warm cache or freed memory of the one before falls on all)."""
    n = len(jobs)
    return [tuple(jobs[(r + k) % n] for k in range(n)) for r in range(rounds)]


def peak_growth(status_before: dict[str, int], status_after: dict[str, int]) -> int:
    """Bytes of the resident set's peak above where it stood before the model."""
    return status_after["VmHWM"] - status_before["VmRSS"]


def parse_status(text: str) -> dict[str, int]:
    """VmRSS and VmHWM of a /proc/<pid>/status text, in bytes."""
    out = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            number, unit = value.split()
            if unit != "kB":
                raise ValueError(f"unexpected unit in {line!r}")
            out[key] = int(number) * 1024
    if set(out) != {"VmRSS", "VmHWM"}:
        raise ValueError("no VmRSS/VmHWM in the status text")
    return out


def stage_slot_s(samples: Sequence[tuple[int, Sequence[float]]]) -> dict[int, float]:
    """Per stage, the median of the calibrated slots of every process holding it."""
    pooled: dict[int, list[float]] = collections.defaultdict(list)
    for stage, times in samples:
        pooled[stage] += list(times)
    return {stage: median(times) for stage, times in sorted(pooled.items())}


# ---- memory: fresh processes, one measurement each ----


def _status() -> dict[str, int]:
    with open("/proc/self/status", encoding="ascii") as f:
        return parse_status(f.read())


def _reset_peak() -> bool:
    """Resets VmHWM to the current resident set (Linux); False when it cannot."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
    except OSError:
        return False
    return True


def _ce(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output, target)


def _unsplit_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(model(batch[0]), batch[1])


def _memory_rank(rank: int, world_size: int, cfg: Config, stages: int) -> dict[str, Any]:
    """One process's peak growth: stage ``rank`` of one replica of ``stages`` stages, or,
    with ``stages`` = 0, the unsplit worker (vflow.Executor on the whole model)."""
    microbatches = max(cfg.microbatches)
    batches = [
        global_batch(cfg, microbatches * cfg.vn_size, s) for s in range(cfg.memory_steps)
    ]
    gc.collect()
    before = _status()
    reset = _reset_peak()
    if stages == 0:
        model = build_model(cfg)
        ex = vflow.Executor(
            model,
            make_optimizer(model.parameters()),
            _unsplit_loss,
            microbatches,
            timeout=cfg.collective_timeout_s,
        )
        for batch in batches:
            ex.step(batch)
    else:
        grid = ProcessGrid.of(stages, timeout=cfg.collective_timeout_s)
        pex = vflow.PipelineExecutor(
            build_model(cfg, stage_range(cfg, stages, grid.stage)),
            make_optimizer,
            _ce,
            microbatches,
            pipeline=pipeline_of(cfg, stages),
            grid=grid,
            timeout=cfg.collective_timeout_s,
        )
        for x, y in batches:
            pex.step(x, y)
    after = _status()
    return {
        "stage": None if stages == 0 else rank,
        "rss_before": before["VmRSS"],
        "hwm_before": before["VmHWM"],
        "hwm": after["VmHWM"],
        "rss_after": after["VmRSS"],
        "peak_reset": reset,
        "peak_growth": peak_growth(before, after),
    }


def measure_memory(cfg: Config, stages: int) -> list[dict[str, Any]]:
    """Every stage's measurement (stages > 0), or the unsplit worker's (stages = 0)."""
    results = run_ranks(
        max(stages, 1),
        _memory_rank,
        cfg,
        stages,
        timeout=cfg.rank_timeout_s,
        collective_timeout=cfg.collective_timeout_s,
        fail_fast=True,
    )
    return [r.value for r in results]


# ---- timing: both methods side by side on the same processes ----


class _VflowRunner:
    def __init__(self, cfg: Config, stages: int, grid: ProcessGrid, microbatches: int) -> None:
        self.ex = vflow.PipelineExecutor(
            build_model(cfg, stage_range(cfg, stages, grid.stage)),
            make_optimizer,
            _ce,
            microbatches * grid.replicas,
            pipeline=pipeline_of(cfg, stages),
            grid=grid,
            timeout=cfg.collective_timeout_s,
        )
        self.module = self.ex.stage_module

    def step(self, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float, float]:
        """The step's phases: the schedule, what follows it before the optimizer (the
        VN losses' all-reduce, the reduction of the gradients), the optimizer."""
        timings = self.ex.step(x, y).timings
        return timings.forward_backward, timings.reduce, timings.optimizer


class _PeerRunner:
    """torch.distributed.pipelining as its documentation has a user drive it."""

    def __init__(self, cfg: Config, stages: int, grid: ProcessGrid, microbatches: int) -> None:
        self.grid = grid
        self.microbatches = microbatches
        self.vn_size = cfg.vn_size
        self.module = stage_module(cfg, stages, grid.stage)
        submodule: nn.Module = self.module
        if grid.replicas > 1:
            submodule = DistributedDataParallel(
                self.module, process_group=grid.replica_group, gradient_as_bucket_view=True
            )
        stage = PipelineStage(
            submodule, grid.stage, stages, torch.device("cpu"), group=grid.stage_group
        )
        self.schedule = Schedule1F1B(stage, microbatches, loss_fn=_ce, scale_grads=True)
        self.optimizer = make_optimizer(self.module.parameters())

    def step(self, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float, float]:
        samples = self.microbatches * self.vn_size
        lo = self.grid.replica * samples
        start = time.perf_counter()
        if self.grid.is_first:
            self.schedule.step(x[lo : lo + samples])
        elif self.grid.is_last:
            losses: list[torch.Tensor] = []
            self.schedule.step(target=y[lo : lo + samples], losses=losses)
        else:
            self.schedule.step()
        scheduled = time.perf_counter()
        self.optimizer.step()
        # Zeroing in place beats fresh gradients in newly mapped pages on a CPU
        # (benchmarks/distributed.py measures the same for DDP).
        self.optimizer.zero_grad(set_to_none=False)
        return scheduled - start, 0.0, time.perf_counter() - scheduled


class _Calibration:
    """This process's stage on one microbatch, alone: forward and backward (the loss too
    on the last stage) on a copy of the stage's module, and the optimizer step on it."""

    def __init__(self, cfg: Config, stages: int, stage: int) -> None:
        self.module = stage_module(cfg, stages, stage)
        self.optimizer = make_optimizer(self.module.parameters())
        self.first, self.last = stage == 0, stage == stages - 1
        gen = torch.Generator().manual_seed(20_000 + stage)
        width = IN_FEATURES if self.first else cfg.hidden
        self.x = torch.randn(cfg.vn_size, width, generator=gen)
        self.y = torch.randint(0, CLASSES, (cfg.vn_size,), generator=gen)
        self.grad = torch.randn(cfg.vn_size, cfg.hidden, generator=gen)
        self.slot_s: list[float] = []
        self.optimizer_s: list[float] = []
        for _ in range(2):  # first touches of gradients and optimizer state
            self._slot()
            self.optimizer.step()

    def _slot(self) -> float:
        # As in a pipeline, a stage after the first takes an input that needs its grad.
        x = self.x if self.first else self.x.detach().requires_grad_()
        start = time.perf_counter()
        out = self.module(x)
        if self.last:
            F.cross_entropy(out, self.y).backward()
        else:
            out.backward(self.grad)
        return time.perf_counter() - start

    def burst(self, slots: int) -> None:
        for _ in range(slots):
            self.slot_s.append(self._slot())
        start = time.perf_counter()
        self.optimizer.step()
        self.optimizer_s.append(time.perf_counter() - start)


def _max_rel_diff(a: nn.Module, b: nn.Module) -> float:
    """max |a - b| / max |b| over each tensor, the largest over tensors."""
    worst = 0.0
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        scale = float(q.detach().abs().max()) or 1.0
        worst = max(worst, float((p.detach() - q.detach()).abs().max()) / scale)
    return worst


def _timing_rank(
    rank: int, world_size: int, cfg: Config, stages: int, jobs: list[Job]
) -> dict[str, Any]:
    """Builds every job's grid (a collective of all processes, in the same order), its
    runner where this process is a member, then the warm-up, the timed rounds and the
    calibration bursts between them."""
    grids = {
        replicas: ProcessGrid.of(
            stages, list(range(replicas * stages)), timeout=cfg.collective_timeout_s
        )
        for replicas in sorted({job.replicas for job in jobs})
    }
    runners: dict[Job, _VflowRunner | _PeerRunner] = {}
    for job in jobs:
        grid = grids[job.replicas]
        if grid.member:
            kind = _VflowRunner if job.method == "vflow" else _PeerRunner
            runners[job] = kind(cfg, stages, grid, job.microbatches)
    # Every process holds a stage of the job with the most replicas.
    widest = grids[max(grids)]
    calibration = _Calibration(cfg, stages, widest.stage)
    samples = {job: job.replicas * job.microbatches * cfg.vn_size for job in jobs}
    batches = {
        job: [global_batch(cfg, samples[job], k) for k in range(cfg.warmup + cfg.rounds)]
        for job in jobs
    }
    for k in range(cfg.warmup):
        for job in jobs:
            dist.barrier()
            if job in runners:
                runners[job].step(*batches[job][k])
    times: dict[str, list[float]] = {job.name: [] for job in jobs}
    phases: dict[str, list[tuple[float, float, float]]] = {job.name: [] for job in jobs}
    for r, order in enumerate(rotated_orders(jobs, cfg.rounds)):
        for job in order:
            dist.barrier()
            if job not in runners:
                continue
            start = time.perf_counter()
            phase = runners[job].step(*batches[job][cfg.warmup + r])
            times[job.name].append(time.perf_counter() - start)
            phases[job.name].append(phase)
        dist.barrier()
        calibration.burst(cfg.calibration_per_round)
    # Both methods have taken the same steps on the same batches from the same weights.
    diffs = {}
    for job in jobs:
        twin = Job("peer", job.replicas, job.microbatches)
        if job.method == "vflow" and job in runners and twin in runners:
            diffs[job.name] = _max_rel_diff(runners[job].module, runners[twin].module)
    for runner in runners.values():
        if isinstance(runner, _VflowRunner):
            runner.ex.close()
    return {
        "rank": rank,
        "stage": widest.stage,
        "times_s": times,
        "phases_s": phases,
        "slot_s": calibration.slot_s,
        "optimizer_s": calibration.optimizer_s,
        "param_diffs": diffs,
    }


def measure_timing(cfg: Config, stages: int, replicas: int, jobs: list[Job]) -> list[dict]:
    results = run_ranks(
        replicas * stages,
        _timing_rank,
        cfg,
        stages,
        jobs,
        timeout=cfg.rank_timeout_s,
        collective_timeout=cfg.collective_timeout_s,
        fail_fast=True,
    )
    return [r.value for r in results]


# ---- what runs on this machine ----


@dataclass(frozen=True)
class Runs:
    """The measurements this machine's CPUs allow, and why the others are not run."""

    stages: tuple[int, ...]
    two_replicas: tuple[int, ...]  # stage counts whose R = 2 grid runs
    not_run: tuple[str, ...]


def runs_for(cpus: int, microbatches: Sequence[int], *, force_replicas: bool = False) -> Runs:
    """S = 2 always (2 processes); S = 4 with 8 or more CPUs (its 4 processes and the 8
    of R = 2); R = 2 with R x S CPUs, or everywhere with ``force_replicas``."""
    stages, two, not_run = [2], [], []
    if cpus >= 8:
        stages.append(4)
    else:
        not_run.append(f"S = 4: not run: needs 8 cores, this machine has {cpus}")
    for s in stages:
        if cpus >= 2 * s or force_replicas:
            two.append(s)
        else:
            not_run.append(
                f"S = {s}, R = 2 (vflow vs peer at 2 replicas; the halving 2 -> 1 replica): "
                f"not run: needs {2 * s} cores, this machine has {cpus}; the halving is "
                "measured on one replica instead (M -> 2M VNs)"
            )
    del microbatches
    return Runs(tuple(stages), tuple(two), tuple(not_run))
