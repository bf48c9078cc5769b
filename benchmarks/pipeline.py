"""Pipelined virtual nodes: vflow.PipelineExecutor's step against the bubble formula,
the halving of replicas, memory per stage against an unsplit worker, and
torch.distributed.pipelining used by hand.

    python benchmarks/pipeline.py [--quick] [--json PATH] [--vn-size N] [--rounds N]
                                  [--oversubscribe]

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
  calibrated the same way, is shown beside it (the formula leaves it out), and a "where
  the time goes" table splits each process's step into the schedule, what follows it
  and the optimizer.
* the halving: R replicas with M VNs each against R/2 replicas with 2M VNs each (same
  global batch, half the processes), predicted (2M + S - 1) / (M + S - 1). With R x S
  usable CPUs: R = 2 against R = 1. With fewer (2 cores), what the halved job's replica
  does: R = 1 with M VNs against R = 1 with 2M VNs of the same size (the global batch
  doubles); the table says which ran. Beside it the same ratio with the calibrated
  optimizer step added to both sides (it does not grow with M).
* memory: the peak growth of each process's resident set (VmHWM after the steps less
  VmRSS before the model was built, the high-water mark reset after that baseline by
  writing 5 to /proc/self/clear_refs), in fresh processes, each of which first takes one
  step of a tiny model of the same kinds in plain torch (``warm_torch``) before that
  baseline: torch's one-time set-up on first use (the modules the first optimizer step
  imports, tens of MiB and more with newer packages) is the same in every process,
  whatever its share of the model, so the target judges what a process holds for its
  model (the growth from before the warm-up is shown beside it, not judged). One spawn
  of 2S + 1 processes: each stage of S, under vflow and under the peer, against a
  ``vflow.Executor`` worker holding the whole model with the same VNs. Measured twice:
  with glibc's mmap threshold held fixed (``MMAP_THRESHOLD``), which the target judges,
  and with glibc's default, shown beside it. Target: vflow's largest stage at S = 2
  <= 0.6x the unsplit worker's.
* the peer: the same stages under torch.distributed.pipelining used by hand
  (``PipelineStage`` on the same stage module, ``Schedule1F1B`` with ``scale_grads``
  on (one schedule step per optimizer step, so it divides by M as the mean loss
  needs), then ``optimizer.step()`` and ``zero_grad()``), with DDP across the replicas
  when R >= 2 (``PipelineStage`` syncs a DDP submodule in the last backward only; not
  where M = S, see ``DDP_PEER_FAILS``). Target: vflow / peer <= 1.05, paired.

Timing: after warm-up steps, each round steps every method once, in an order that
rotates every round, each step right after a barrier of all processes; a step's time
is the slowest process's. Ratios are medians over the rounds of the per-round ratio.
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import resource
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
    malloc_env,
    median,
    memory_status,
    open_process_session,
    reset_peak,
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
TARGET_MEMORY = 0.6  # largest stage's peak growth / the unsplit worker's, at S = 2
TARGET_PEER = 1.05  # vflow / torch.distributed.pipelining by hand, step time
# The per-round ratio needs this many rounds before a few percent can be told from noise.
MIN_ROUNDS = 10
MODEL_SEED = 1000
LR = 1e-4
# The whole run's limit, shared by its groups of processes: below run.py's (300 s quick,
# 1200 s full), so that a hung group is reported here, by name.
TIMEOUT_S = Default(full=1100.0, quick=270.0)
MIB = 2**20
DDP_PEER_FAILS = (
    "with torch 2.13, Schedule1F1B over a DDP-wrapped stage fails when M = S (the first "
    "stage runs every forward in its warm-up; in the second step's forward DDP's reducer "
    "asserts 'rebuilt parameter indices size is not same as original model parameters "
    "size', having recorded two synchronised backwards; also at S = 2, R = 2, M = 2)"
)
# glibc's initial mmap threshold, held fixed in the judged memory runs. By default glibc
# raises it to the largest block freed so far: the transient 4 MiB gradients and
# optimizer temporaries of a step then stay in the heap, and how much of it stays
# resident depends on the order of the frees (a stage's peak varied by 20-30 MiB from
# run to run, vflow's and the peer's alike). Fixed, a freed tensor goes back to the
# system and the peak follows the tensors alive.
MMAP_THRESHOLD = 128 * 1024


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
    timeout_s: float  # for every group of processes together


@dataclass(frozen=True)
class Job:
    """One method on one grid: ``method`` is "vflow", "peer" or "peer+sync"
    (``_PeerRunner``)."""

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


def halving_prediction(
    microbatches: int, stages: int, slot_s: float = 1.0, fixed_s: float = 0.0
) -> float:
    """Step time of half the replicas with 2M VNs each over that of R replicas with M:
    (2M + S - 1) / (M + S - 1), or with ``fixed_s`` per step that M does not change (the
    optimizer step) beside the slots of ``slot_s``."""
    return (predicted_step_s(slot_s, 2 * microbatches, stages) + fixed_s) / (
        predicted_step_s(slot_s, microbatches, stages) + fixed_s
    )


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


def stage_slot_s(samples: Sequence[tuple[int, Sequence[float]]]) -> dict[int, float]:
    """Per stage, the median of the calibrated slots of every process holding it."""
    pooled: dict[int, list[float]] = collections.defaultdict(list)
    for stage, times in samples:
        pooled[stage] += list(times)
    return {stage: median(times) for stage, times in sorted(pooled.items())}


# ---- memory: fresh processes, one measurement each ----


def _ce(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output, target)


def _unsplit_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(model(batch[0]), batch[1])


def memory_role(rank: int, stages: int) -> tuple[str, int | None]:
    """Who process ``rank`` of a memory run is: vflow's stages first, then the peer's,
    then the unsplit worker."""
    if rank < stages:
        return "vflow", rank
    if rank < 2 * stages:
        return "peer", rank - stages
    return "unsplit", None


def warm_torch() -> None:
    """One training step of a tiny model of the benchmark's kinds (Linear, GELU,
    cross-entropy, AdamW), in plain torch: what torch sets up once per process on first
    use (the modules the first optimizer step imports, the kernels' first allocations;
    tens of MiB, more with newer packages) then lies below the memory baseline of every
    method alike, and the growth measured is what the process holds for its model."""
    model = nn.Sequential(nn.Linear(4, 4), nn.GELU(), nn.Linear(4, CLASSES))
    optimizer = make_optimizer(model.parameters())
    F.cross_entropy(model(torch.randn(3, 4)), torch.tensor([0, 1, 2])).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=False)


def _memory_rank(rank: int, world_size: int, cfg: Config, stages: int) -> dict[str, Any]:
    """One process's peak growth (``memory_role``). The processes run at the same time,
    which changes their speed, not what they hold."""
    method, stage = memory_role(rank, stages)
    # Collectives of every process: the groups exist before any baseline is taken, as
    # the default group does.
    grids = {
        "vflow": ProcessGrid.of(stages, list(range(stages)), timeout=cfg.collective_timeout_s),
        "peer": ProcessGrid.of(
            stages, list(range(stages, 2 * stages)), timeout=cfg.collective_timeout_s
        ),
    }
    alone = dist.new_group([2 * stages])
    microbatches = max(cfg.microbatches)
    batches = [global_batch(cfg, microbatches * cfg.vn_size, s) for s in range(cfg.memory_steps)]
    gc.collect()
    cold = memory_status()
    warm_torch()
    gc.collect()
    before = memory_status()
    reset = reset_peak()
    if method == "unsplit":
        model = build_model(cfg)
        ex = vflow.Executor(
            model,
            make_optimizer(model.parameters()),
            _unsplit_loss,
            microbatches,
            process_group=alone,
            timeout=cfg.collective_timeout_s,
        )
        for batch in batches:
            ex.step(batch)
    else:
        kind = _VflowRunner if method == "vflow" else _PeerRunner
        runner = kind(cfg, stages, grids[method], microbatches)
        for x, y in batches:
            runner.step(x, y)
    after = memory_status()
    return {
        "method": method,
        "stage": stage,
        "rss_before": before["VmRSS"],
        "hwm_before": before["VmHWM"],
        "hwm": after["VmHWM"],
        "rss_after": after["VmRSS"],
        "peak_reset": reset,
        "peak_growth": peak_growth(before, after),
        # From before torch's one-time set-up (warm_torch), as measured before it was
        # left out: shown, not judged.
        "cold_growth": peak_growth(cold, after),
    }


def _time_left(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("the run's time (--timeout) is up")
    return left


def measure_memory(
    cfg: Config, stages: int, mmap_threshold: int | None, deadline: float
) -> list[dict[str, Any]]:
    """Every process's measurement: vflow's S stages, the peer's, the unsplit worker."""
    with malloc_env(mmap_threshold):
        results = run_ranks(
            2 * stages + 1,
            _memory_rank,
            cfg,
            stages,
            timeout=_time_left(deadline),
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
    """torch.distributed.pipelining as its documentation has a user drive it; with
    ``sync``, plus what vflow's step adds between the schedule and the optimizer: one
    all-reduce over the grid of a row of 2V + 2 float64 (the VN losses and item counts),
    which makes every stage wait for the last schedule to end."""

    def __init__(
        self,
        cfg: Config,
        stages: int,
        grid: ProcessGrid,
        microbatches: int,
        *,
        sync: bool = False,
    ) -> None:
        self.grid = grid
        self.sync_row = (
            torch.zeros(2 * microbatches * grid.replicas + 2, dtype=torch.float64) if sync else None
        )
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
        if self.sync_row is not None:
            dist.all_reduce(self.sync_row, group=self.grid.group)
        synced = time.perf_counter()
        self.optimizer.step()
        # Zeroing in place beats fresh gradients in newly mapped pages on a CPU
        # (benchmarks/distributed.py measures the same for DDP).
        self.optimizer.zero_grad(set_to_none=False)
        return scheduled - start, synced - scheduled, time.perf_counter() - synced


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


def _minor_faults() -> int:
    # First touches of freshly mapped pages: microseconds each, so a step whose tensors
    # land in new mappings pays for every 4 KiB of them.
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _cpu_s() -> float:
    """CPU time of the whole process, its Gloo threads included: what a step costs
    whatever else runs on the machine, unlike its wall time."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


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
            if job.method == "vflow":
                runners[job] = _VflowRunner(cfg, stages, grid, job.microbatches)
            else:
                sync = job.method == "peer+sync"
                runners[job] = _PeerRunner(cfg, stages, grid, job.microbatches, sync=sync)
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
    faults: dict[str, list[int]] = {job.name: [] for job in jobs}
    cpu: dict[str, list[float]] = {job.name: [] for job in jobs}
    for r, order in enumerate(rotated_orders(jobs, cfg.rounds)):
        for job in order:
            dist.barrier()
            if job not in runners:
                continue
            faults_before, cpu_before = _minor_faults(), _cpu_s()
            start = time.perf_counter()
            phase = runners[job].step(*batches[job][cfg.warmup + r])
            times[job.name].append(time.perf_counter() - start)
            faults[job.name].append(_minor_faults() - faults_before)
            cpu[job.name].append(_cpu_s() - cpu_before)
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
        "minor_faults": faults,
        "cpu_s": cpu,
        "slot_s": calibration.slot_s,
        "optimizer_s": calibration.optimizer_s,
        "param_diffs": diffs,
    }


def measure_timing(
    cfg: Config, stages: int, replicas: int, jobs: list[Job], deadline: float
) -> list[dict]:
    results = run_ranks(
        replicas * stages,
        _timing_rank,
        cfg,
        stages,
        jobs,
        timeout=_time_left(deadline),
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


def runs_for(cpus: int, *, oversubscribe: bool = False) -> Runs:
    """S = 2 always (2 processes); S = 4 with 8 or more CPUs (its 4 processes and the 8
    of R = 2); R = 2 with R x S CPUs; everything with ``oversubscribe``."""
    stages, two, not_run = [2], [], []
    if cpus >= 8 or oversubscribe:
        stages.append(4)
    else:
        not_run.append(f"S = 4: not run: needs 8 cores, this machine has {cpus}")
    for s in stages:
        if cpus >= 2 * s or oversubscribe:
            two.append(s)
        else:
            not_run.append(
                f"S = {s}, R = 2 (vflow vs peer on 2 replicas, the halving 2 -> 1 replica): "
                f"not run: needs {2 * s} cores, this machine has {cpus}; the halving is "
                "measured on one replica (M -> 2M VNs) instead"
            )
    return Runs(tuple(stages), tuple(two), tuple(not_run))


def one_replica_jobs(microbatches: Sequence[int]) -> list[Job]:
    """vflow, the peer, and the peer synchronised as vflow's step is (``_PeerRunner``)."""
    methods = ("vflow", "peer", "peer+sync")
    return [Job(method, 1, m) for m in microbatches for method in methods]


def two_replica_jobs(microbatches: Sequence[int], stages: int) -> list[Job]:
    """Both methods on 2 replicas, and each halved job: 1 replica with twice the VNs. No
    peer where M = S (``DDP_PEER_FAILS``)."""
    jobs = [Job("vflow", 2, m) for m in microbatches]
    jobs += [Job("peer", 2, m) for m in microbatches if m != stages]
    return jobs + [Job("vflow", 1, 2 * m) for m in microbatches]


def peer_not_run(microbatches: Sequence[int], stages: int) -> list[str]:
    return [
        f"S = {stages}, R = 2, M = {m}: the peer not run: {DDP_PEER_FAILS}"
        for m in microbatches
        if m == stages
    ]


# ---- summaries (pure: the tests feed them hand-made numbers) ----


def summarise_timing(
    per_rank: Sequence[dict[str, Any]], stages: int, replicas: int, jobs: Sequence[Job]
) -> dict[str, Any]:
    """One spawn's measurements: each job's step times (the slowest process's per round),
    replica 0's step and phases per stage (medians), the calibrated slot and optimizer
    step of the slowest stage, the predictions, the paired ratios."""
    slots = stage_slot_s([(r["stage"], r["slot_s"]) for r in per_rank])
    optimizers = stage_slot_s([(r["stage"], r["optimizer_s"]) for r in per_rank])
    slot_s = max(slots.values())
    optimizer_s = max(optimizers.values())
    out_jobs: dict[str, dict[str, Any]] = {}
    for job in jobs:
        members = [r["times_s"][job.name] for r in per_rank if r["times_s"][job.name]]
        times = slowest(members)
        # Replica 0's processes, by stage (ranks 0 .. S-1).
        phases = [per_rank[stage]["phases_s"][job.name] for stage in range(stages)]
        own = [per_rank[stage]["times_s"][job.name] for stage in range(stages)]
        diffs = [r["param_diffs"][job.name] for r in per_rank if job.name in r["param_diffs"]]
        out_jobs[job.name] = {
            **asdict(job),
            "name": job.name,
            "processes": job.replicas * stages,
            "times_s": times,
            "median_s": median(times),
            "iqr_s": iqr(times),
            "stage_phases_s": [
                [median(t), *(median([p[i] for p in ph]) for i in range(3))]
                for t, ph in zip(own, phases, strict=True)
            ],
            "stage_minor_faults": [
                median(per_rank[stage]["minor_faults"][job.name]) for stage in range(stages)
            ],
            "stage_cpu_s": [median(per_rank[stage]["cpu_s"][job.name]) for stage in range(stages)],
            "predicted_s": predicted_step_s(slot_s, job.microbatches, stages),
            "max_param_rel_diff_to_peer": max(diffs) if diffs else None,
        }
    peers = []
    for job in jobs:
        twin = Job("peer", job.replicas, job.microbatches)
        if job.method == "vflow" and twin in jobs:
            mine = out_jobs[job.name]["times_s"]
            ratios = pair_ratios(mine, out_jobs[twin.name]["times_s"])
            synced = Job("peer+sync", job.replicas, job.microbatches)
            peers.append(
                {
                    "replicas": job.replicas,
                    "microbatches": job.microbatches,
                    "processes": job.replicas * stages,
                    "vflow": job.name,
                    "peer": twin.name,
                    "ratio": median(ratios),
                    "ratio_iqr": iqr(ratios),
                    # vflow against the peer that waits as vflow does: what remains is
                    # vflow's own cost.
                    "synced_peer": synced.name if synced in jobs else None,
                    "ratio_to_synced_peer": median(
                        pair_ratios(mine, out_jobs[synced.name]["times_s"])
                    )
                    if synced in jobs
                    else None,
                }
            )
    halvings = []
    for job in jobs:
        if job.method != "vflow":
            continue
        # R replicas x M VNs -> R/2 replicas x 2M VNs; with R = 1 the replica alone.
        halved = Job("vflow", max(job.replicas // 2, 1), 2 * job.microbatches)
        if halved in jobs and halved != job:
            ratios = pair_ratios(out_jobs[halved.name]["times_s"], out_jobs[job.name]["times_s"])
            halvings.append(
                {
                    "mode": "replicas" if job.replicas > 1 else "replica",
                    "from": job.name,
                    "to": halved.name,
                    "microbatches": job.microbatches,
                    "ratio": median(ratios),
                    "ratio_iqr": iqr(ratios),
                    "predicted": halving_prediction(job.microbatches, stages),
                    "predicted_with_optimizer": halving_prediction(
                        job.microbatches, stages, slot_s, optimizer_s
                    ),
                }
            )
    return {
        "stages": stages,
        "replicas": replicas,
        "processes": replicas * stages,
        "slots_s": {str(s): v for s, v in slots.items()},
        "slot_s": slot_s,
        "optimizers_s": {str(s): v for s, v in optimizers.items()},
        "optimizer_s": optimizer_s,
        "jobs": out_jobs,
        "peers": peers,
        "halvings": halvings,
    }


def summarise_memory(
    stages: int, processes: Sequence[dict], mmap_threshold: int | None
) -> dict[str, Any]:
    """Peak growths by stage, vflow's largest against the unsplit worker's."""

    def by_stage(method: str, key: str = "peak_growth") -> list[int]:
        rows = sorted((r for r in processes if r["method"] == method), key=lambda r: r["stage"])
        return [r[key] for r in rows]

    growth = by_stage("vflow")
    (unsplit,) = by_stage("unsplit")
    (unsplit_cold,) = by_stage("unsplit", "cold_growth")
    return {
        "stages": stages,
        "mmap_threshold": mmap_threshold,
        "stage_peak_growth": growth,
        "peer_stage_peak_growth": by_stage("peer"),
        "largest_peak_growth": max(growth),
        "unsplit_peak_growth": unsplit,
        "ratio": max(growth) / unsplit,
        "cold_ratio": max(by_stage("vflow", "cold_growth")) / unsplit_cold,
        "peak_reset": all(r["peak_reset"] for r in processes),
        "processes": list(processes),
    }


# ---- headline records for the suite's summary (vflow/bench/records.py) ----

_SLOT_NOTE = (
    "(M + S - 1) slots; a slot = forward + backward of one microbatch through the slowest "
    "stage, timed alone on a copy of the stage between the timed rounds (every process at "
    "once); the optimizer step and the step's bookkeeping are not in it"
)


def headline_records(results: dict[str, Any]) -> list[dict[str, Any]]:
    m = bench_records.measurement
    out = []
    for mem in results["memory"]:
        s, fixed = mem["stages"], mem["mmap_threshold"] is not None
        judged = fixed and s == 2
        out.append(
            bench_records.headline(
                "pipeline",
                f"pipeline/S{s}/memory" + ("" if fixed else "-glibc-default"),
                f"S={s}: peak RSS growth, largest stage / unsplit worker"
                + ("" if fixed else " (glibc's default malloc)"),
                vflow=m(nbytes=mem["largest_peak_growth"], label=f"largest of {s} stages"),
                baseline=m(nbytes=mem["unsplit_peak_growth"], label="vflow.Executor, whole model"),
                target=bench_records.target("<=", TARGET_MEMORY) if judged else None,
                stated_ratio=mem["ratio"],
            )
        )
    for t in results["timing"]:
        s, jobs = t["stages"], t["jobs"]
        for p in t["peers"]:
            r, mb = p["replicas"], p["microbatches"]
            out.append(
                bench_records.headline(
                    "pipeline",
                    f"pipeline/S{s}-R{r}-M{mb}/vflow-vs-peer",
                    f"S={s} R={r} M={mb}: vflow / torch pipelining by hand, step",
                    vflow=m(jobs[p["vflow"]]["times_s"], label="PipelineExecutor"),
                    baseline=m(
                        jobs[p["peer"]]["times_s"],
                        label="PipelineStage + Schedule1F1B" + (" + DDP" if r > 1 else ""),
                    ),
                    paired=True,
                    target=bench_records.target(
                        "<=",
                        TARGET_PEER,
                        requires={"min_samples": MIN_ROUNDS, "min_cpus": r * s},
                        why="a process per core, and a few percent need many rounds",
                    ),
                    stated_ratio=p["ratio"],
                )
            )
            if r == 1:
                job = jobs[p["vflow"]]
                out.append(
                    bench_records.headline(
                        "pipeline",
                        f"pipeline/S{s}-R1-M{mb}/step-vs-slots",
                        f"S={s} R=1 M={mb}: vflow step / (M+S-1) slots",
                        vflow=m(job["times_s"], label="PipelineExecutor"),
                        limit=m([job["predicted_s"]], label="(M+S-1) slots", note=_SLOT_NOTE),
                        compare="vflow/limit",
                    )
                )
        for h in t["halvings"]:
            mb = h["microbatches"]
            what = "R=2 M={0} -> R=1 M={1}" if h["mode"] == "replicas" else "R=1: M={0} -> M={1}"
            out.append(
                bench_records.headline(
                    "pipeline",
                    f"pipeline/S{s}/halving-{h['mode']}-M{mb}",
                    f"S={s} {what.format(mb, 2 * mb)}: step ratio (predicted {h['predicted']:.2f})",
                    vflow=m(jobs[h["to"]]["times_s"], label=h["to"]),
                    baseline=m(jobs[h["from"]]["times_s"], label=h["from"]),
                    paired=True,
                    stated_ratio=h["ratio"],
                )
            )
    return out


# ---- the report ----


def _mib(n: float) -> str:
    return f"{n / MIB:.1f}"


def _verdict(ok: bool) -> str:
    return "met" if ok else "MISSED"


def _step_rows(results: dict[str, Any]) -> list[list[str]]:
    rows = []
    for t in results["timing"]:
        for job in t["jobs"].values():
            rows.append(
                [
                    str(t["stages"]),
                    str(job["replicas"]),
                    str(job["microbatches"]),
                    job["method"],
                    fmt_ms(t["slot_s"]),
                    fmt_ms(job["predicted_s"]),
                    fmt_ms(job["predicted_s"] + t["optimizer_s"]),
                    fmt_ms(job["median_s"]),
                    f"{job['median_s'] / job['predicted_s']:.2f}",
                    f"{job['median_s'] / (job['predicted_s'] + t['optimizer_s']):.2f}",
                ]
            )
    return rows


def _phase_rows(results: dict[str, Any]) -> list[list[str]]:
    rows = []
    for t in results["timing"]:
        for job in t["jobs"].values():
            for stage, (phases, faults, cpu_s) in enumerate(
                zip(
                    job["stage_phases_s"],
                    job["stage_minor_faults"],
                    job["stage_cpu_s"],
                    strict=True,
                )
            ):
                rows.append(
                    [
                        f"{job['name']}, S={t['stages']}",
                        str(stage),
                        *(fmt_ms(x) for x in phases),
                        fmt_ms(cpu_s),
                        f"{faults:.0f}",
                    ]
                )
    return rows


def _halving_rows(results: dict[str, Any]) -> list[list[str]]:
    rows = []
    for t in results["timing"]:
        for h in t["halvings"]:
            what = (
                f"{h['from']} -> {h['to']} (half the processes, same B)"
                if h["mode"] == "replicas"
                else f"{h['from']} -> {h['to']} (the halved job's replica alone; B doubles)"
            )
            rows.append(
                [
                    str(t["stages"]),
                    what,
                    f"{h['ratio']:.3f}",
                    f"{h['ratio_iqr']:.3f}",
                    f"{h['predicted']:.3f}",
                    f"{h['ratio'] / h['predicted']:.3f}",
                    f"{h['predicted_with_optimizer']:.3f}",
                ]
            )
    return rows


def _malloc_label(mmap_threshold: int | None) -> str:
    return "glibc default" if mmap_threshold is None else f"fixed {mmap_threshold // 1024} KiB"


def _memory_rows(results: dict[str, Any]) -> list[list[str]]:
    rows = []
    for mem in results["memory"]:
        s = mem["stages"]
        if s == 2 and mem["mmap_threshold"] is not None:
            target = f"<= {TARGET_MEMORY}: {_verdict(mem['ratio'] <= TARGET_MEMORY)}"
        else:
            target = "-"
        rows.append(
            [
                str(s),
                _malloc_label(mem["mmap_threshold"]),
                " / ".join(_mib(g) for g in mem["stage_peak_growth"]),
                " / ".join(_mib(g) for g in mem["peer_stage_peak_growth"]),
                _mib(mem["unsplit_peak_growth"]),
                f"{mem['ratio']:.3f}",
                target,
                f"{mem['cold_ratio']:.3f}",
            ]
        )
    return rows


def _peer_rows(results: dict[str, Any]) -> list[list[str]]:
    rows = []
    cpus = results["cpus"]
    for t in results["timing"]:
        for p in t["peers"]:
            vj, pj = t["jobs"][p["vflow"]], t["jobs"][p["peer"]]
            if results["config"]["rounds"] < MIN_ROUNDS:
                verdict = f"n/a (< {MIN_ROUNDS} rounds)"
            elif cpus < p["processes"]:
                verdict = "n/a (oversubscribed)"
            else:
                verdict = _verdict(p["ratio"] <= TARGET_PEER)
            diff = vj["max_param_rel_diff_to_peer"]
            synced = p["synced_peer"]
            rows.append(
                [
                    str(t["stages"]),
                    str(p["replicas"]),
                    str(p["microbatches"]),
                    f"{p['processes']} on {cpus} CPUs",
                    fmt_ms(vj["median_s"]),
                    fmt_ms(pj["median_s"]),
                    f"{p['ratio']:.3f}",
                    f"{p['ratio_iqr']:.3f}",
                    f"<= {TARGET_PEER}: {verdict}",
                    "-" if synced is None else fmt_ms(t["jobs"][synced]["median_s"]),
                    "-" if synced is None else f"{p['ratio_to_synced_peer']:.3f}",
                    "n/a" if diff is None else f"{diff:.1e}",
                ]
            )
    return rows


def print_results(results: dict[str, Any]) -> None:
    cfg = results["config"]
    print("\nstep time against the bubble formula (medians, ms)")
    print(
        format_table(
            [
                "S",
                "R",
                "M",
                "method",
                "slot",
                "(M+S-1) slots",
                "+ optimizer",
                "measured",
                "measured / slots",
                "measured / (+ optimizer)",
            ],
            _step_rows(results),
        )
    )
    print("\nwhere the time goes: replica 0, by stage (medians, ms)")
    print(
        format_table(
            [
                "job",
                "stage",
                "own step",
                "schedule",
                "after schedule",
                "optimizer",
                "CPU",
                "page faults",
            ],
            _phase_rows(results),
        )
    )
    print("\nhalving the replicas: step time after / before (paired per round)")
    print(
        format_table(
            [
                "S",
                "measured",
                "ratio",
                "IQR",
                "predicted (2M+S-1)/(M+S-1)",
                "measured/predicted",
                "predicted with the optimizer",
            ],
            _halving_rows(results),
        )
    )
    print(
        f"\npeak RSS growth per process (MiB; fresh processes, {cfg['memory_steps']} steps of "
        f"M = {max(cfg['microbatches'])} VNs; glibc's mmap threshold)"
    )
    print(
        format_table(
            [
                "S",
                "mmap threshold",
                "vflow, each stage",
                "peer, each stage",
                "unsplit worker",
                "vflow largest / unsplit",
                "target",
                "same, with torch's set-up",
            ],
            _memory_rows(results),
        )
    )
    print("\nvflow against torch.distributed.pipelining by hand (paired per round)")
    print(
        format_table(
            [
                "S",
                "R",
                "M",
                "processes",
                "vflow ms",
                "peer ms",
                "vflow/peer",
                "IQR",
                "target",
                "peer + sync ms",
                "vflow / (peer + sync)",
                "param diff",
            ],
            _peer_rows(results),
        )
    )
    reset = all(m["peak_reset"] for m in results["memory"])
    print(
        "\nnotes:\n"
        f"  model: embed Linear({IN_FEATURES}, {cfg['hidden']}), {cfg['blocks']} x "
        f"(Linear({cfg['hidden']}, {cfg['hidden']}) + GELU), head Linear({cfg['hidden']}, "
        f"{CLASSES}); AdamW; {cfg['vn_size']} samples per VN; 1F1B; one torch thread per "
        "process\n"
        "  slot: forward + backward of one microbatch through the slowest stage, timed alone "
        "on a copy of the stage between the timed rounds (every process at once); "
        "+ optimizer: plus the slowest stage's AdamW step, timed the same way\n"
        "  halving, predicted with the optimizer: ((2M+S-1) slots + optimizer) / ((M+S-1) "
        "slots + optimizer), from the same calibration: the optimizer step does not grow "
        "with M\n"
        "  step time: the slowest process's, each step after a barrier of all processes; "
        f"{cfg['rounds']} rounds after {cfg['warmup']} warm-up steps, the methods' order "
        "rotating\n"
        "  where the time goes: own step = the process's own step time; after schedule = "
        "vflow's all-reduce of the VN losses (a stage that ends its schedule early waits "
        "there for the others) and the gradients' reduction, 0 for the peer; optimizer = "
        "vflow's publishing of the gradients and the step, the peer's step and zero_grad; "
        "CPU = the process's CPU time per step, its threads included (unlike the wall "
        "times, not stretched by other processes); page faults = minor page faults per "
        "step (first touches of newly mapped memory)\n"
        "  peer: PipelineStage(stage module) + Schedule1F1B(scale_grads=True) + AdamW step + "
        "zero_grad(set_to_none=False); DDP(gradient_as_bucket_view=True) around the stage "
        "module when R >= 2\n"
        "  peer + sync: the peer with what vflow's step adds before the optimizer, one "
        "all-reduce over the grid of 2V + 2 float64 (the VN losses): every stage then "
        "waits for the last schedule to end, and the last stage's optimizer step no longer "
        "overlaps the first stage's last backwards. vflow / (peer + sync) is what remains "
        "of vflow's cost\n"
        "  param diff: largest relative difference (max |a-b| / max |b| per tensor) between "
        "vflow's and the peer's parameters after the same steps\n"
        "  memory: VmHWM after the steps less VmRSS before building the model, the "
        "high-water mark reset after that baseline, which follows one step of a tiny model "
        "of the same kinds in plain torch (torch's one-time set-up, the same in every "
        "process whatever its model; 'with torch's set-up': from before it, not judged); "
        "mmap threshold: glibc's, fixed (judged: "
        "a freed tensor goes back to the system, the peak follows the tensors alive) or "
        "glibc's default (it rises to the largest block freed, freed gradients and "
        "optimizer temporaries stay in the heap, and how much stays resident varies from "
        "run to run by tens of MiB, in every method alike)"
        + ("" if reset else " (the reset FAILED: the peaks may predate the model)")
        + "; other stages' segments are built on the meta device"
    )
    for line in results["not_run"]:
        print(f"  {line}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_output_args(parser, quick="few rounds (CI smoke test; the peer target is n/a)")
    parser.add_argument("--vn-size", type=int, default=32, help="samples per VN (default 32)")
    parser.add_argument(
        "--rounds",
        type=int,
        default=None,
        help=f"timed rounds, each one step of every method (default 60, 4 quick; the peer "
        f"target needs {MIN_ROUNDS})",
    )
    parser.add_argument(
        "--oversubscribe",
        action="store_true",
        help="run S = 4 and R = 2 on any machine, more processes than CPUs (to check the "
        "code paths; the peer target is then n/a)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=None,
        help=f"give up (and stop every process) after this many seconds in all "
        f"({TIMEOUT_S.text()})",
    )
    args = parser.parse_args(argv)
    for name in ("vn_size", "rounds", "timeout"):
        value = getattr(args, name)
        if value is not None and value <= 0:
            raise SystemExit(f"--{name.replace('_', '-')} must be > 0, got {value}")
    quick = args.quick
    cfg = Config(
        hidden=HIDDEN,
        blocks=BLOCKS,
        vn_size=args.vn_size,
        microbatches=MICROBATCHES,
        warmup=2 if quick else 3,
        rounds=args.rounds or (4 if quick else 60),
        calibration_per_round=2 if quick else 3,
        memory_steps=3,
        collective_timeout_s=60.0 if quick else 120.0,
        timeout_s=TIMEOUT_S.of(args, "timeout"),
    )
    cpus = usable_cpus()
    runs = runs_for(cpus, oversubscribe=args.oversubscribe)
    session = open_process_session(
        args,
        "vflow benchmark: PipelineExecutor against the bubble formula, the halving, memory "
        "per stage, and torch.distributed.pipelining by hand",
        threads=1,
        backend="gloo",
        threads_per_rank=1,
    )
    print(f"{cpus} usable CPUs; config: {json.dumps(asdict(cfg))}", flush=True)
    for line in runs.not_run:
        print(line)
    results: dict[str, Any] = {
        "config": asdict(cfg),
        "cpus": cpus,
        "not_run": list(runs.not_run),
        "memory": [],
        "timing": [],
    }
    deadline = time.monotonic() + cfg.timeout_s
    try:
        for s in runs.stages:
            for threshold in (MMAP_THRESHOLD, None):
                print(
                    f"memory: S = {s}, mmap threshold {_malloc_label(threshold)}: {2 * s + 1} "
                    "processes (vflow's stages, the peer's, the unsplit worker) ...",
                    flush=True,
                )
                processes = measure_memory(cfg, s, threshold, deadline)
                results["memory"].append(summarise_memory(s, processes, threshold))
        for s in runs.stages:
            spawns = [(1, one_replica_jobs(cfg.microbatches))]
            if s in runs.two_replicas:
                spawns.append((2, two_replica_jobs(cfg.microbatches, s)))
                results["not_run"] += peer_not_run(cfg.microbatches, s)
            for replicas, jobs in spawns:
                print(
                    f"timing: S = {s}, {replicas * s} processes: "
                    f"{', '.join(j.name for j in jobs)} ...",
                    flush=True,
                )
                per_rank = measure_timing(cfg, s, replicas, jobs, deadline)
                results["timing"].append(summarise_timing(per_rank, s, replicas, jobs))
    except (RankError, TimeoutError) as e:
        raise SystemExit(f"benchmark failed: {e}") from None
    print_results(results)
    records = [{"benchmark": "pipeline", **results}, *headline_records(results)]
    return session.finish(records)


if __name__ == "__main__":
    sys.exit(main())
