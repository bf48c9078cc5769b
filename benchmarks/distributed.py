"""vflow's Executor against PyTorch DDP + no_sync on 2 Gloo ranks on localhost.

Both methods train their own copy of one MLP (same initial weights, same
``SGD(lr=0.01, momentum=0.9)``) on the same global batch of B samples split into V
virtual nodes (VNs); each of the 2 ranks runs the VNs ``vflow.Plan.even(V, 2)`` gives
it, one after another.

* vflow: ``Executor(model, opt, loss_fn, V)`` on the default group. During a rank's last
  VN's backward the C++ Reducer starts each gradient bucket's async all-reduce as soon
  as the bucket is complete.
* DDP: ``DistributedDataParallel(model, gradient_as_bucket_view=True, bucket_cap_mb=25)``;
  each rank runs its VN slices as microbatches, all but the last under ``no_sync()``,
  each loss scaled by ``n_i / B * world_size`` (DDP averages over ranks, so the result is
  the global-batch gradient), then ``opt.step()`` and
  ``opt.zero_grad(set_to_none=False)`` — faster here than ``set_to_none=True``, whose
  fresh gradient tensors land in newly mapped pages every step (``--ddp-zero-grad``).
  DDP all-reduces its buckets during the last microbatch's backward.

Timing: after warm-up steps, each repetition runs one step of each method, alternating
which goes first (A B B A ...), then one standalone all-reduce. Every timed step starts
right after a barrier; a step's time is the slowest rank's (host wall clock), so the
two methods face the same drift and ``ratio`` is the median over repetitions of
vflow / DDP on the same batch.

Overlap, per method (medians over repetitions):

* standalone all-reduce: the gradient's bytes all-reduced in vflow's bucket layout
  (``Reducer.bucket_ranges()``: async all-reduces of the same slices of a scratch copy
  of the flat buffer, then wait) with no compute running. DDP's buckets hold the same
  bytes (vflow only adds 64-byte alignment padding).
* vflow exposed = ``StepResult.timings.reduce_wait``, the host time spent waiting for
  bucket all-reduces after backward returned. hidden = 1 - exposed / standalone.
* DDP exposed = (forward+backward time of the synchronising microbatch) - (that of a
  no_sync microbatch): DDP waits for its all-reduces at the end of the synchronising
  backward, so its extra time is the comm that backward did not hide, plus DDP's bucket
  copies and any slowdown of the compute by the communication thread.
  hidden = 1 - exposed / standalone.

Both fractions are clipped to [0, 1]. They are not quite the same measure: vflow's
excludes any slowdown of its last VN's backward (the communication thread competes for
the same cores); the breakdown table shows it as "last - other".

The breakdown table splits each method's step into its phases and counts minor page
faults per step: on CPU, gradients that land in freshly mapped memory cost a page
fault per 4 KiB page, which can rival the arithmetic.

Correctness: after the timed steps both methods have taken the same number of steps on
the same batches from the same parameters; the largest relative parameter difference
(max |a - b| / max |b| per tensor, maximum over tensors) is printed. It is 0 when the
VN weights n_i / B are powers of two (the defaults): both methods then compute the
same float32 sums. Otherwise expect ~1e-6 (rounding of differently scaled sums).

Run ``python benchmarks/distributed.py --help`` for options.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import faulthandler
import json
import multiprocessing as mp
import os
import resource
import socket
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _common import (
    apply_threads,
    environment,
    finish_run,
    fmt_ms,
    format_table,
    iqr,
    median,
    print_header,
    usable_cpus,
)
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import vflow

WORLD_SIZE = 2
HOST = "127.0.0.1"
CLASSES = 10
TARGET_RATIO = 1.0  # vflow step time / DDP step time, printed (not asserted)
# How long a terminated rank gets to exit before it is killed outright.
GRACE_S = 5.0

Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class Config:
    hidden: int
    layers: int
    virtual_nodes: int
    batch_size: int
    warmup: int
    reps: int
    threads: int
    ddp_set_to_none: bool
    collective_timeout_s: float


def mlp(hidden: int, layers: int) -> nn.Module:
    blocks: list[nn.Module] = []
    for _ in range(layers):
        blocks += [nn.Linear(hidden, hidden), nn.ReLU()]
    return nn.Sequential(*blocks, nn.Linear(hidden, CLASSES))


def minor_faults() -> int:
    # First touches of freshly mapped memory; each costs microseconds, so a step that
    # gets its gradients in newly mapped pages pays for every page of them.
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def make_optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.01, momentum=0.9)


@dataclass
class RankSeries:
    """One rank's measurements, one entry per timed repetition."""

    vflow_step: list[float] = field(default_factory=list)
    vflow_other_vn: list[float] = field(default_factory=list)  # median of the non-last VNs
    vflow_last_vn: list[float] = field(default_factory=list)
    vflow_reduce: list[float] = field(default_factory=list)
    vflow_reduce_wait: list[float] = field(default_factory=list)
    vflow_optimizer: list[float] = field(default_factory=list)
    ddp_step: list[float] = field(default_factory=list)
    ddp_other_mb: list[float] = field(default_factory=list)  # median of the no_sync ones
    ddp_last_mb: list[float] = field(default_factory=list)
    ddp_optimizer: list[float] = field(default_factory=list)
    allreduce: list[float] = field(default_factory=list)
    vflow_faults: list[float] = field(default_factory=list)
    ddp_faults: list[float] = field(default_factory=list)


class Bench:
    """Both methods on this rank, with their models, optimizers and batches."""

    def __init__(self, cfg: Config, rank: int) -> None:
        self.cfg = cfg
        self.rank = rank
        torch.manual_seed(0)
        initial = mlp(cfg.hidden, cfg.layers)
        self.model_v = copy.deepcopy(initial)
        self.model_d = copy.deepcopy(initial)
        self.params = sum(p.numel() for p in initial.parameters())
        self._vn_starts: list[float] = []
        self.ex = vflow.Executor(
            self.model_v,
            make_optimizer(self.model_v.parameters()),
            self._vflow_loss,
            virtual_nodes=cfg.virtual_nodes,
            seed=0,
            timeout=cfg.collective_timeout_s,
        )
        self.ddp = DistributedDataParallel(
            self.model_d, gradient_as_bucket_view=True, bucket_cap_mb=25
        )
        self.opt_d = make_optimizer(self.ddp.parameters())
        self.slices = self.ex.plan.worker_slices(rank, cfg.batch_size)

        # Every rank draws the same global batches; vflow slices its VNs out of the
        # whole batch and DDP gets the same slices.
        gen = torch.Generator().manual_seed(1234)
        self.batches: list[Batch] = [
            (
                torch.randn(cfg.batch_size, cfg.hidden, generator=gen),
                torch.randint(0, CLASSES, (cfg.batch_size,), generator=gen),
            )
            for _ in range(cfg.warmup + cfg.reps)
        ]

        # A scratch copy, so that the standalone all-reduces neither change the
        # gradients nor sum the same values up to overflow rep after rep.
        scratch = [torch.zeros_like(g.buffer.data) for g in self.ex._grads.groups]
        ranges = self.ex._grads.reducer.bucket_ranges()
        self.bucket_slices = [scratch[r.buffer].narrow(0, r.offset, r.numel) for r in ranges]
        self.bucket_mb = [s.numel() * s.element_size() / 2**20 for s in self.bucket_slices]

    def _vflow_loss(self, model: nn.Module, vn_batch: Batch) -> torch.Tensor:
        # The executor calls loss_fn at the start of each VN: these timestamps split
        # its forward+backward phase into VNs.
        self._vn_starts.append(time.perf_counter())
        x, y = vn_batch
        return F.cross_entropy(model(x), y)

    def vflow_step(self, batch: Batch, series: RankSeries | None) -> float:
        self._vn_starts.clear()
        faults = minor_faults()
        t0 = time.perf_counter()
        result = self.ex.step(batch)
        elapsed = time.perf_counter() - t0
        if series is not None:
            series.vflow_faults.append(minor_faults() - faults)
            t = result.timings
            fb_end = t0 + t.forward_backward
            ends = [*self._vn_starts[1:], fb_end]
            vn_times = [end - start for start, end in zip(self._vn_starts, ends, strict=True)]
            series.vflow_step.append(elapsed)
            if len(vn_times) > 1:
                series.vflow_other_vn.append(median(vn_times[:-1]))
            series.vflow_last_vn.append(vn_times[-1])
            series.vflow_reduce.append(t.reduce)
            series.vflow_reduce_wait.append(t.reduce_wait)
            series.vflow_optimizer.append(t.optimizer)
        return result.loss

    def ddp_step(self, batch: Batch, series: RankSeries | None) -> float:
        x, y = batch
        total = self.cfg.batch_size
        faults = minor_faults()
        t0 = time.perf_counter()
        mb_times = []
        loss_sum = torch.zeros(())
        for k, (_, start, size) in enumerate(self.slices):
            t_mb = time.perf_counter()
            last = k == len(self.slices) - 1
            # no_sync must cover the forward too: DDP decides at forward time whether
            # the following backward reduces.
            with contextlib.nullcontext() if last else self.ddp.no_sync():
                out = self.ddp(x[start : start + size])
                loss = F.cross_entropy(out, y[start : start + size])
                (loss * (size / total * WORLD_SIZE)).backward()
            loss_sum += loss.detach() * (size / total)
            mb_times.append(time.perf_counter() - t_mb)
        t_opt = time.perf_counter()
        self.opt_d.step()
        self.opt_d.zero_grad(set_to_none=self.cfg.ddp_set_to_none)
        # vflow's step returns the loss as a float; reading it is part of the step.
        value = loss_sum.item()
        end = time.perf_counter()
        if series is not None:
            series.ddp_faults.append(minor_faults() - faults)
            series.ddp_step.append(end - t0)
            if len(mb_times) > 1:
                series.ddp_other_mb.append(median(mb_times[:-1]))
            series.ddp_last_mb.append(mb_times[-1])
            series.ddp_optimizer.append(end - t_opt)
        return value

    def standalone_allreduce(self, series: RankSeries | None) -> None:
        t0 = time.perf_counter()
        works = [dist.all_reduce(s, async_op=True) for s in self.bucket_slices]
        for work in works:
            work.wait()
        if series is not None:
            series.allreduce.append(time.perf_counter() - t0)

    def max_param_rel_diff(self) -> float:
        worst = 0.0
        for a, b in zip(self.model_v.parameters(), self.model_d.parameters(), strict=True):
            scale = b.detach().abs().max().item()
            diff = (a.detach() - b.detach()).abs().max().item()
            worst = max(worst, diff / max(scale, 1e-30))
        return worst

    def run(self) -> RankSeries:
        cfg = self.cfg
        methods: dict[str, Callable[[Batch, RankSeries | None], float]] = {
            "vflow": self.vflow_step,
            "ddp": self.ddp_step,
        }
        for k in range(cfg.warmup):
            for fn in methods.values():
                dist.barrier()
                fn(self.batches[k], None)
            dist.barrier()
            self.standalone_allreduce(None)
        series = RankSeries()
        for rep in range(cfg.reps):
            # A B then B A: each method runs first equally often, so a warm-cache or
            # post-switch penalty falls on both.
            order = ["vflow", "ddp"] if rep % 2 == 0 else ["ddp", "vflow"]
            for name in order:
                # Both ranks start the step together, so neither method's time contains
                # the other rank finishing its previous work.
                dist.barrier()
                methods[name](self.batches[cfg.warmup + rep], series)
            dist.barrier()
            self.standalone_allreduce(series)
        return series


def _per_step(
    values: Sequence[Sequence[float]], how: Callable[[Sequence[float]], float]
) -> list[float]:
    """Combines the ranks' series step by step (``values[rank][step]``)."""
    return [how(list(step)) for step in zip(*values, strict=True)]


def _hidden(exposed: float | None, standalone: float) -> float | None:
    if exposed is None or standalone <= 0:
        return None
    return min(1.0, max(0.0, 1.0 - exposed / standalone))


def summarise(cfg: Config, bench: Bench, ranks: list[RankSeries], diff: float) -> dict[str, Any]:
    """One record from every rank's series: step times are the slowest rank's, phase
    times the mean over ranks, each then taken as a median over repetitions."""

    def slowest(name: str) -> list[float]:
        return _per_step([getattr(r, name) for r in ranks], max)

    def mean(name: str) -> list[float]:
        return _per_step([getattr(r, name) for r in ranks], statistics.fmean)

    def med(values: list[float]) -> float | None:
        return median(values) if values else None

    v_step, d_step = slowest("vflow_step"), slowest("ddp_step")
    allreduce = slowest("allreduce")
    ratios = [a / b for a, b in zip(v_step, d_step, strict=True)]
    standalone = median(allreduce)

    v_other, v_last = med(mean("vflow_other_vn")), med(mean("vflow_last_vn"))
    d_other, d_last = med(mean("ddp_other_mb")), med(mean("ddp_last_mb"))
    v_wait = med(mean("vflow_reduce_wait"))
    d_exposed = None if d_other is None or d_last is None else d_last - d_other
    phases = {
        "vflow": {
            "other_vn_fwd_bwd": v_other,
            "last_vn_fwd_bwd": v_last,
            "reduce": med(mean("vflow_reduce")),
            "reduce_wait": v_wait,
            "optimizer": med(mean("vflow_optimizer")),
            "page_faults": med(mean("vflow_faults")),
        },
        "ddp": {
            "other_mb_fwd_bwd": d_other,
            "last_mb_fwd_bwd": d_last,
            "optimizer": med(mean("ddp_optimizer")),
            "page_faults": med(mean("ddp_faults")),
        },
    }
    return {
        "benchmark": "distributed",
        "backend": "gloo",
        "world_size": WORLD_SIZE,
        "model": f"mlp {cfg.layers}x{cfg.hidden}",
        "params": bench.params,
        "virtual_nodes": cfg.virtual_nodes,
        "global_batch": cfg.batch_size,
        "vn_sizes": [s.size for s in bench.ex.plan.slices(cfg.batch_size)],
        "plan": repr(bench.ex.plan),
        "optimizer": "SGD(lr=0.01, momentum=0.9)",
        "ddp_zero_grad_set_to_none": cfg.ddp_set_to_none,
        "threads_per_rank": cfg.threads,
        "warmup_steps": cfg.warmup,
        "measured_steps": cfg.reps,
        "buckets_mb": bench.bucket_mb,
        "vflow_median_s": median(v_step),
        "ddp_median_s": median(d_step),
        "vflow_iqr_s": iqr(v_step),
        "ddp_iqr_s": iqr(d_step),
        "ratio": median(ratios),
        "ratio_iqr": iqr(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "ratio_of_medians": median(v_step) / median(d_step),
        "allreduce_standalone_s": standalone,
        "allreduce_standalone_iqr_s": iqr(allreduce),
        "vflow_exposed_s": v_wait,
        "ddp_exposed_s": d_exposed,
        "vflow_hidden": _hidden(v_wait, standalone),
        "ddp_hidden": _hidden(d_exposed, standalone),
        "phases_s": phases,
        "max_param_rel_diff": diff,
        "vflow_times_s": v_step,
        "ddp_times_s": d_step,
        "allreduce_times_s": allreduce,
    }


def _ms_range(values: Sequence[float]) -> str:
    return f"{fmt_ms(min(values))}-{fmt_ms(max(values))}"


def _pct(fraction: float | None) -> str:
    return "n/a" if fraction is None else f"{100 * fraction:.0f}%"


def _diff(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


def print_results(r: dict[str, Any]) -> None:
    v_times, d_times = r["vflow_times_s"], r["ddp_times_s"]
    standalone = fmt_ms(r["allreduce_standalone_s"])
    ok = r["ratio"] <= TARGET_RATIO
    print(
        f"\n{r['model']} ({r['params'] / 1e6:.1f} M params, "
        f"{sum(r['buckets_mb']):.1f} MB of fp32 gradient in {len(r['buckets_mb'])} "
        f"buckets), V={r['virtual_nodes']}, B={r['global_batch']}, {r['plan']}, "
        f"{r['measured_steps']} measured steps per method"
    )
    print(
        "step = slowest rank's host time, median (min-max); ratio = median over "
        "repetitions of vflow / DDP on the same batch (min-max)"
    )
    print(
        format_table(
            [
                "method",
                "step ms",
                "min-max ms",
                "ratio vs DDP",
                "all-reduce alone ms",
                "exposed ms",
                "hidden",
            ],
            [
                [
                    "vflow",
                    fmt_ms(r["vflow_median_s"]),
                    _ms_range(v_times),
                    f"{r['ratio']:.3f} ({r['ratio_min']:.2f}-{r['ratio_max']:.2f})",
                    standalone,
                    fmt_ms(r["vflow_exposed_s"]),
                    _pct(r["vflow_hidden"]),
                ],
                [
                    "DDP + no_sync",
                    fmt_ms(r["ddp_median_s"]),
                    _ms_range(d_times),
                    "1.000",
                    standalone,
                    fmt_ms(r["ddp_exposed_s"]),
                    _pct(r["ddp_hidden"]),
                ],
            ],
        )
    )
    print(
        f"target ratio <= {TARGET_RATIO}: {'met' if ok else 'MISSED'} "
        f"(ratio of medians {r['ratio_of_medians']:.3f}, "
        f"ratio IQR {r['ratio_iqr']:.3f})"
    )

    vp, dp = r["phases_s"]["vflow"], r["phases_s"]["ddp"]
    print(
        "\nwhere the time goes (ms, per rank, mean over ranks then median over steps; "
        "'other' = a microbatch/VN before the last one)"
    )
    print(
        format_table(
            [
                "method",
                "other fwd+bwd",
                "last fwd+bwd",
                "last - other",
                "after bwd",
                "optimizer",
                "page faults",
            ],
            [
                [
                    "vflow",
                    fmt_ms(vp["other_vn_fwd_bwd"]),
                    fmt_ms(vp["last_vn_fwd_bwd"]),
                    fmt_ms(_diff(vp["last_vn_fwd_bwd"], vp["other_vn_fwd_bwd"])),
                    f"{fmt_ms(vp['reduce'])} (wait {fmt_ms(vp['reduce_wait'])})",
                    fmt_ms(vp["optimizer"]),
                    f"{vp['page_faults']:.0f}",
                ],
                [
                    "DDP + no_sync",
                    fmt_ms(dp["other_mb_fwd_bwd"]),
                    fmt_ms(dp["last_mb_fwd_bwd"]),
                    fmt_ms(_diff(dp["last_mb_fwd_bwd"], dp["other_mb_fwd_bwd"])),
                    "in last bwd",
                    fmt_ms(dp["optimizer"]),
                    f"{dp['page_faults']:.0f}",
                ],
            ],
        )
    )
    zero = "set_to_none=True" if r["ddp_zero_grad_set_to_none"] else "set_to_none=False"
    print(
        "\nnotes:\n"
        f"  all-reduce alone = the gradient's buckets all-reduced with nothing else "
        f"running (median over {r['measured_steps']} reps)\n"
        "  vflow exposed = StepResult.timings.reduce_wait (waiting for bucket all-reduces "
        "after backward);\n"
        "    its 'last - other' shows how much the overlapped all-reduces slow the last "
        "VN's backward\n"
        "  DDP exposed = last (synchronising) microbatch fwd+bwd - a no_sync one; DDP "
        "waits for its buckets inside that backward\n"
        "  hidden = 1 - exposed / all-reduce alone, clipped to [0, 1]\n"
        "  page faults = minor page faults per step (first touches of newly mapped memory, "
        "each costing microseconds)\n"
        f"  DDP: gradient_as_bucket_view=True, bucket_cap_mb=25, zero_grad({zero}); "
        "optimizer = step + zero_grad + reading the loss\n"
        "  vflow optimizer = optimizer.step and the step's bookkeeping; vflow's loss is "
        "the global one (an extra small all-reduce), DDP's the local one"
    )
    print(
        f"\ncorrectness: max relative parameter difference vflow vs DDP after "
        f"{r['warmup_steps'] + r['measured_steps']} steps: {r['max_param_rel_diff']:.1e}"
    )


def _use_loopback() -> None:
    # Keep Gloo on loopback: by default it binds to the address the hostname resolves
    # to, which may be an external interface that a sandbox blocks.
    if "GLOO_SOCKET_IFNAME" not in os.environ:
        loopback = next((name for _, name in socket.if_nameindex() if name.startswith("lo")), None)
        if loopback is not None:
            os.environ["GLOO_SOCKET_IFNAME"] = loopback


def rank_main(rank: int, port: int, cfg: Config, out_path: str, give_up_at: float) -> None:
    """One rank: joins the group, runs both methods, and on rank 0 prints the results
    and writes the record to ``out_path`` for the parent."""
    torch.set_num_threads(cfg.threads)
    # A rank still running shortly before the parent gives up (at wall-clock time
    # give_up_at) leaves its Python stacks on stderr, so a hang shows where it was stuck.
    faulthandler.dump_traceback_later(max(0.1, give_up_at - GRACE_S - time.time()))
    _use_loopback()
    timeout = timedelta(seconds=cfg.collective_timeout_s)
    try:
        store = dist.TCPStore(HOST, port, is_master=False, timeout=timeout)
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=WORLD_SIZE, timeout=timeout
        )
        try:
            bench = Bench(cfg, rank)
            if rank == 0:
                print(
                    f"measuring {cfg.reps} reps after {cfg.warmup} warm-up step(s) ...",
                    flush=True,
                )
            series = bench.run()
            gathered: list[Any] = [None] * WORLD_SIZE
            dist.all_gather_object(gathered, series)
            diff = bench.max_param_rel_diff()
            bench.ex.close()
            if rank == 0:
                record = summarise(cfg, bench, gathered, diff)
                print_results(record)
                Path(out_path).write_text(json.dumps(record), encoding="utf-8")
        finally:
            dist.destroy_process_group()
    except BaseException:
        print(f"rank {rank} failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        sys.exit(1)
    finally:
        faulthandler.cancel_dump_traceback_later()


def run_ranks(cfg: Config, timeout_s: float) -> dict[str, Any]:
    """Spawns the ranks and waits for them, never longer than ``timeout_s``."""
    ctx = mp.get_context("spawn")  # forking a process with torch's threads can deadlock
    # The parent is not a rank: port 0 lets the OS pick a free port, and it must not
    # wait for workers; the ranks' rendezvous does the waiting.
    store = dist.TCPStore(
        HOST, 0, None, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout_s)
    )
    with tempfile.TemporaryDirectory(prefix="vflow-bench-") as tmp:
        out_path = Path(tmp) / "record.json"
        procs = [
            ctx.Process(
                target=rank_main,
                args=(
                    rank,
                    store.port,
                    cfg,
                    str(out_path),
                    time.time() + timeout_s,
                ),
                name=f"vflow-bench-rank-{rank}",
                daemon=True,  # die with the parent if it is interrupted
            )
            for rank in range(WORLD_SIZE)
        ]
        try:
            for p in procs:
                p.start()
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline:
                alive = [p for p in procs if p.is_alive()]
                # A failed rank leaves the other one blocked in a collective: stop now.
                if not alive or any(p.exitcode not in (None, 0) for p in procs):
                    break
                alive[0].join(0.2)
            failed = {rank: p.exitcode for rank, p in enumerate(procs) if p.exitcode}
            hung = [rank for rank, p in enumerate(procs) if p.is_alive()]
        finally:
            _stop(procs)
        if failed:
            raise SystemExit(f"benchmark failed: rank exit codes {failed} (see stderr)")
        if hung:
            raise SystemExit(
                f"ranks {hung} still running after {timeout_s:g} s, killed (their Python "
                "stacks are on stderr)"
            )
        record = json.loads(out_path.read_text(encoding="utf-8"))
    del store  # only now: the ranks used it until they ended
    return record


def _stop(procs: list[Any]) -> None:
    # A benchmark rank has nothing worth a graceful shutdown: kill it outright.
    for p in procs:
        if p.is_alive():
            p.kill()
    for p in procs:
        if p.pid is not None:  # None when start() failed
            p.join()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="small model and few repetitions (CI smoke test)"
    )
    parser.add_argument(
        "--json", type=Path, default=None, metavar="PATH", help="write the results to PATH"
    )
    parser.add_argument(
        "--threads", type=int, default=1, help="torch intra-op threads per rank (default 1)"
    )
    parser.add_argument(
        "--reps", type=int, default=None, help="timed steps per method (default 40, 6 quick)"
    )
    parser.add_argument(
        "--virtual-nodes", type=int, default=4, help="V, split over the 2 ranks (default 4)"
    )
    parser.add_argument(
        "--batch-size", type=int, default=None, help="global batch B (default 128, 64 quick)"
    )
    parser.add_argument(
        "--hidden", type=int, default=None, help="MLP width (default 1024, 512 quick)"
    )
    parser.add_argument(
        "--layers",
        type=int,
        default=None,
        help="hidden Linear layers (default 12, ~12.6 M params; 4 quick)",
    )
    parser.add_argument(
        "--ddp-zero-grad",
        choices=["none", "zeros"],
        default="zeros",
        help="DDP's optimizer.zero_grad: set_to_none=False ('zeros', default: the faster "
        "here, see benchmarks/README.md) or True ('none')",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=None,
        help="give up (and kill the ranks) after this many seconds (default 600, 120 quick)",
    )
    args = parser.parse_args(argv)
    for name in ("threads", "reps", "batch_size", "hidden", "layers"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if args.virtual_nodes < WORLD_SIZE:
        raise SystemExit(f"--virtual-nodes must be >= {WORLD_SIZE} (one VN per rank at least)")
    quick = args.quick
    cfg = Config(
        hidden=args.hidden or (512 if quick else 1024),
        layers=args.layers or (4 if quick else 12),
        virtual_nodes=args.virtual_nodes,
        batch_size=args.batch_size or (64 if quick else 128),
        # DDP rebuilds its buckets in the second iteration's forward: keep it out.
        warmup=2 if quick else 3,
        reps=args.reps or (6 if quick else 40),
        threads=args.threads,
        ddp_set_to_none=args.ddp_zero_grad == "none",
        collective_timeout_s=60.0,
    )
    if cfg.batch_size < cfg.virtual_nodes:
        raise SystemExit(f"--batch-size {cfg.batch_size} < --virtual-nodes {cfg.virtual_nodes}")
    timeout_s = args.timeout or (120.0 if quick else 600.0)

    # The header's thread count is then the per-rank one.
    apply_threads(cfg.threads)
    env = environment(torch.device("cpu"))
    env |= {"ranks": WORLD_SIZE, "backend": "gloo", "threads_per_rank": cfg.threads}
    print_header("vflow benchmark: Executor vs DDP + no_sync, 2 Gloo ranks on localhost", env)
    total_threads = WORLD_SIZE * cfg.threads
    print(
        f"{WORLD_SIZE} ranks x {cfg.threads} torch thread(s) (+ one Gloo thread each while "
        f"communicating) on {usable_cpus()} usable CPUs"
    )
    busy = env["busy_cpus_at_start"]
    if busy is not None and busy + total_threads > usable_cpus() + 0.25:
        print(
            f"WARNING: {total_threads} rank threads + {busy:.2f} CPUs used by others exceed "
            f"{usable_cpus()} CPUs: expect descheduled threads and noisy times"
        )
    print(
        f"config: {json.dumps(asdict(cfg))}\noptimizer SGD(lr=0.01, momentum=0.9) for both methods",
        flush=True,
    )
    record = run_ranks(cfg, timeout_s)
    return finish_run(args.json, [record], env)


if __name__ == "__main__":
    sys.exit(main())
