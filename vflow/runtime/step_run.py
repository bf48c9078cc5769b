"""One training step on this worker: its VNs one after another, then the reduction and
the global normalisation. The Executor sets it up and commits or rolls back around it.

This loop runs once per VN, so it is written for a small per-VN cost: everything that
does not change within a step is looked up once, and optional work (profiler ranges,
module buffers, loss scaling, autocast) costs nothing when it is off.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch.profiler import record_function

from vflow.mapping import rng
from vflow.mapping.batching import Batch
from vflow.mapping.plan import VNSlice
from vflow.planning.profile import VNProfile, WorkerProfile
from vflow.runtime import losses
from vflow.runtime.clock import StepClock
from vflow.runtime.grad_store import clip_grads_
from vflow.runtime.results import PhaseTimings, StepResult
from vflow.runtime.step_stats import local_totals

if TYPE_CHECKING:
    from torch import nn

    from vflow.runtime.config import Deterministic
    from vflow.runtime.grad_store import GradStore
    from vflow.runtime.module_buffers import BufferRule
    from vflow.runtime.step_stats import GlobalStats, StatsLayout
    from vflow.world.group import World


_NO_RANGE = contextlib.nullcontext()


def profiled(name: str, on: bool) -> contextlib.AbstractContextManager:
    """A ``torch.profiler`` range when ``on`` (a profiler runs); nothing otherwise, since
    the range costs several µs even without a profiler."""
    return torch.profiler.record_function(name) if on else _NO_RANGE


@dataclass(frozen=True)
class StepInputs:
    """What one step reads from its executor, handed over by value: the step's code
    never sees the Executor, which owns it (imports run one way in vflow.runtime)."""

    model: nn.Module
    loss_fn: Callable[..., Any]
    grads: GradStore
    world: World
    stats: StatsLayout
    generators: list[torch.Generator]
    module_buffers: BufferRule | None  # None when the model has no buffers to manage
    seed: int
    step: int
    signal: Callable[[], int]  # this worker's signal word, read when the stats are sent
    lead: int  # steps beyond this one whose batches this worker's sampler has drawn
    own_profile: WorkerProfile | None  # the previous step's, sent with this one
    loss_scale: float  # 1.0 without loss scaling
    skip_nonfinite: bool
    deterministic: Deterministic
    max_grad_norm: float | None
    # Calls the user's pre-step hooks; None when none is registered.
    pre_step_hooks: Callable[[], None] | None
    params: list[torch.nn.Parameter]  # trainable, whose ``param.grad`` hooks may change


# Note [Before the optimizer step]
# What runs between the reduction and ``optimizer.step()``, in this order:
# 1. ``reduce``: the global normalisation (and loss-scale unscaling) in one pass over
#    the buffers, with the non-finite check. A step whose gradient is inf/NaN stops
#    here: skipped (or FloatingPointError in deterministic mode without
#    skip_nonfinite); there is no optimizer step, so no hook runs either, and every
#    worker decides alike from the same reduced gradient.
# 2. The user's pre-step hooks (``Executor.register_pre_step_hook``), on ``param.grad``
#    as the optimizer will take it. They come after the check so that they only ever see
#    finite gradients, as ``optimizer.step()`` does.
# 3. ``max_grad_norm`` clipping, last: it bounds the gradient the optimizer takes
#    whatever a hook did (as a loop calls clip_grad_norm_ right before the step), and
#    ``StepResult.grad_norm`` is the norm of the gradient after the hooks.
# A hook that makes a gradient inf/NaN is not caught: the check ran before it.
# Without hooks, clipping runs on the buffers before ``publish`` (the bits of every
# step without hooks are those of before hooks existed). With hooks it runs on the
# published ``param.grad``: where the buffer accumulates in another dtype than the
# parameter (a float32 buffer for bfloat16 parameters), ``param.grad`` is a copy that
# the hooks changed and the buffer is not.


# Note [Told while computing]
# After a crash, the survivors reach the failed step's collectives one after another,
# over as long as a step takes, and the elastic job tells each one that its set broke
# as soon as one of them finds out (Note [A survivor blocked on survivors],
# vflow/elastic/agreement.py), which interrupts its World. A worker told while still
# in its VNs would compute the rest of them for a collective that fails at once, and
# the others' agreement waits for it (on a busy host it also takes their CPU). So
# before each VN's forward and before the step's first collective, the loop looks
# whether its World was interrupted (one atomic load while nothing was) and, if so,
# fails the step there as a failed collective would: nothing was committed, so the
# step's usual failure path restores everything. A VN's forward or backward already
# running is finished.


class StepRun:
    """The VN loop (``vns``), then ``reduce`` and ``before_optimizer``; ``result`` once
    the step is committed."""

    def __init__(
        self, inputs: StepInputs, slices: list[VNSlice], total: int, clock: StepClock
    ) -> None:
        self.inputs = inputs
        self.slices = slices
        self.total = total
        self.clock = clock
        self.scale = inputs.loss_scale
        self.kind: losses.LossKind | None = None
        self.losses: list[torch.Tensor] = []
        self.weights: list[float] = []
        self.items: list[torch.Tensor | float] = []
        self.marks: list[tuple[int, int, Any, Any, Any, Any]] = []  # vn, size, 4 points
        self.loss = math.nan
        self.num_items: int | float = 0
        self.skipped = False
        self.published = False  # param.grad is published by the step's cycle
        self.grad_norm: float | None = None
        self.stats_wait = 0.0
        self.gathered: GlobalStats | None = None  # the step's, on several workers
        self.signals: tuple[int, ...] = (0,)
        self.leads: tuple[int, ...] = (inputs.lead,)
        self.after_vns: Any = None
        self.after_reduce: Any = None
        self.profiling = torch.autograd._profiler_enabled()

    def vns(self, vn_batches: Iterator[Batch], autocast: Callable[[], Any] | None) -> None:
        inputs, clock, grads = self.inputs, self.clock, self.inputs.grads
        reducer, placement = grads.reducer, grads.reduction.placement
        loss_fn, model, profiling = inputs.loss_fn, inputs.model, self.profiling
        generators = inputs.generators
        module_buffers = inputs.module_buffers
        distributed = inputs.world.distributed
        vn_ids = [s.vn for s in self.slices]
        seeds = rng.vn_seeds(inputs.seed, inputs.step, vn_ids)
        grads.begin_step(inputs.step)
        last_position = len(self.slices) - 1
        with contextlib.closing(vn_batches):  # an error waits for the batch in flight
            for position, ((vn, _, size), vn_batch) in enumerate(
                zip(self.slices, vn_batches, strict=True)
            ):
                if distributed:  # Note [Told while computing]
                    inputs.world.check_interrupted(f"VN {vn}'s forward", inputs.step)
                for generator in generators:
                    generator.manual_seed(seeds[position])
                forward_start = clock.mark()
                with record_function("vflow::forward") if profiling else _NO_RANGE:
                    if autocast is None:
                        out = loss_fn(model, vn_batch)
                    else:
                        with autocast():
                            out = loss_fn(model, vn_batch)
                forward_end = clock.mark()
                parsed = losses.parse(out, vn)
                if self.kind is None:
                    self.kind = parsed.kind
                elif parsed.kind != self.kind:
                    losses.check_same_kind(parsed.kind, self.kind, vn, self.slices[0].vn)
                # Mean losses are weighted by VN size / B here; summed losses are added
                # as they are and divided by the global item count after the last VN.
                weight = size / self.total if self.kind == "mean" else 1.0
                self.losses.append(parsed.loss)
                self.weights.append(weight)
                self.items.append(parsed.items)
                last = position == last_position
                if last:
                    # Read as late as it can be sent, so that news arriving during the
                    # step's forward passes travels with this step, not the next.
                    signal = inputs.signal()
                    self.signals = (signal,)
                if last and distributed:
                    inputs.world.check_interrupted("the step's collectives", inputs.step)
                    reducer.start_stats(
                        inputs.stats.encode(
                            vn_ids,
                            self.losses,
                            self.weights,
                            self.kind,
                            self.items,
                            inputs.own_profile,
                            inputs.world.rank,
                            signal,
                            inputs.lead,
                            inputs.world.device,
                        ),
                        with_buckets=True,  # every value in a slot of its own (step_stats)
                    )
                loss = parsed.loss if self.scale == 1.0 else parsed.loss.float() * self.scale
                backward_start = clock.mark()
                with record_function("vflow::backward") if profiling else _NO_RANGE:
                    grads.backward(loss, weight, last, placement(position))
                self.marks.append(
                    (vn, size, forward_start, forward_end, backward_start, clock.mark())
                )
                if module_buffers is not None:
                    module_buffers.end_vn(vn)
        self.after_vns = clock.mark()

    def reduce(self) -> None:
        inputs, grads = self.inputs, self.inputs.grads
        waited = time.perf_counter()
        if inputs.world.distributed:
            stats = inputs.stats.decode(grads.reducer.wait_stats())
            loss_total, items_total = stats.loss_total, stats.items_total
            sum_workers, bad_items = stats.sum_workers, stats.bad_items
            self.gathered = stats
            self.signals = stats.signals
            self.leads = stats.leads
        else:
            loss_total, items_total, bad_items = local_totals(
                self.losses, self.weights, self.items if self.kind == "sum" else None
            )
            sum_workers = 1.0 if self.kind == "sum" else 0.0
        # Statistics that rode with bucket 0 were waited for with it: the reducer
        # counts that wait as the buckets' (Note [Statistics ride with bucket 0]).
        if not (inputs.world.distributed and grads.reducer.stats_with_buckets):
            self.stats_wait = time.perf_counter() - waited
        losses.check_worker_kinds(sum_workers, inputs.world.size)
        if bad_items:
            losses.raise_bad_items([s.vn for s in self.slices], self.items, bad_items)
        factor = 1.0 / self.scale
        if self.kind == "mean":
            self.num_items = self.total
            self.loss = loss_total
        else:
            losses.check_item_total(items_total)
            self.num_items = items_total
            factor /= items_total
            self.loss = loss_total / items_total
        found = grads.finish(factor, inputs.skip_nonfinite or bool(inputs.deterministic))
        if inputs.deterministic and not inputs.skip_nonfinite and found:
            raise FloatingPointError(
                f"vflow step {inputs.step}: a gradient of the global batch is inf or NaN, "
                "or its sum does not fit float32 (deterministic mode never hands such a sum "
                "to the optimizer); nothing was changed. Pass skip_nonfinite=True to skip "
                "such steps instead"
            )
        if inputs.max_grad_norm is not None and not found and inputs.pre_step_hooks is None:
            self.grad_norm = grads.clip_grad_norm_(inputs.max_grad_norm)
        self.skipped = found
        self.after_reduce = self.clock.mark()

    def before_optimizer(self) -> None:
        """Note [Before the optimizer step]: on a step that steps the optimizer, with
        ``param.grad`` published, the user's pre-step hooks, then ``max_grad_norm``
        clipping of ``param.grad``; both count as the reduce phase."""
        inputs = self.inputs
        if inputs.pre_step_hooks is None:
            return
        inputs.pre_step_hooks()
        if inputs.max_grad_norm is not None:
            self.grad_norm = clip_grads_([p.grad for p in inputs.params], inputs.max_grad_norm)
        self.after_reduce = self.clock.mark()

    def after_optimizer(self) -> None:
        """Nothing of this step runs past the optimizer step (Note [A step's life
        cycle], vflow/runtime/step_cycle.py)."""

    def result(self, start: int, end: int, loss_scale: float | None) -> StepResult:
        inputs, seconds = self.inputs, self.clock.seconds
        wait = inputs.grads.last_wait_seconds
        marks, rank, step = self.marks, inputs.world.rank, inputs.step
        optimizer_s = seconds(self.after_reduce, end)
        step_s = seconds(start, end)
        exposed = self.stats_wait + wait

        def profile() -> WorkerProfile:
            vns = tuple(
                VNProfile(vn, size, seconds(a, b), seconds(c, d)) for vn, size, a, b, c, d in marks
            )
            compute = sum(v.forward_s + v.backward_s for v in vns)
            return WorkerProfile(rank, step, vns, compute, exposed, optimizer_s, step_s)

        timings = PhaseTimings(
            seconds(start, self.after_vns),
            seconds(self.after_vns, self.after_reduce),
            optimizer_s,
            wait,
        )
        return StepResult(
            self.loss,
            self.num_items,
            step,
            self.skipped,
            loss_scale,
            self.grad_norm,
            timings,
            profile,
            self.signals,
        )
