"""``vflow.Executor``: runs a global batch as V virtual nodes (VNs) over the workers
of a process group.

A step splits the global batch into V contiguous VN slices; the plan (vflow.plan)
says which of them this worker runs. The worker runs forward and backward VN by VN
while the fused kernels fold each VN's gradients into flat float32 buffers, and
during its last VN the C++ Reducer all-reduces the buffers bucket by bucket
(vflow.grads, csrc/reducer.h). The gradient is normalised once for the whole global
batch and every worker steps its optimizer once on the same gradient. See
docs/design.md for the semantics this guarantees.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import logging
import math
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

import torch

from vflow import checkpoint, distributed, rng, tree
from vflow._checks import require_int
from vflow._extension import _C
from vflow.amp import LossScaler
from vflow.batching import Batch, batch_size, concat_outputs, map_batch, slice_batch
from vflow.grads import GradAccumulator
from vflow.module_buffers import BUFFER_RULES, BufferRule
from vflow.plan import Plan, VNSlice
from vflow.prefetch import Prefetcher, VNTransform
from vflow.timing import PhaseClock

LossFn = Callable[[torch.nn.Module, Batch], Any]
ForwardFn = Callable[[torch.nn.Module, Batch], Any]

_AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
_log = logging.getLogger("vflow")

# model -> the live Executor driving it. Two executors on one model would both capture
# its gradients. Kept outside the model so that the model stays deep-copyable/picklable.
_OWNERS: weakref.WeakKeyDictionary[torch.nn.Module, weakref.ref[Executor]] = (
    weakref.WeakKeyDictionary()
)


@dataclass(frozen=True)
class PhaseTimings:
    """Seconds spent in each phase of one step (wall clock on the host; on CUDA
    measured with events on the current stream)."""

    forward_backward: float
    reduce: float
    optimizer: float
    # Of ``reduce``: host time blocked on gradient all-reduces that backward did not
    # hide (0 on one worker).
    reduce_wait: float = 0.0

    @property
    def total(self) -> float:
        return self.forward_backward + self.reduce + self.optimizer


@dataclass(frozen=True)
class StepResult:
    """What one global step did.

    loss: the global batch's loss (all workers) — the size-weighted mean of the VN mean
      losses, or sum(loss_sum) / sum(num_items) for ``(loss_sum, num_items)`` losses.
    num_items: samples in the global batch for mean losses, else the total num_items.
    step: index of this step (0 for the first).
    skipped: True when the optimizer step was skipped because a gradient was inf/NaN.
    loss_scale: the fp16 loss scale used for this step, or None without loss scaling.
    grad_norm: the global gradient 2-norm before clipping, when max_grad_norm is set.
    """

    loss: float
    num_items: float
    step: int
    skipped: bool
    loss_scale: float | None
    grad_norm: float | None
    timings: PhaseTimings


def _default_forward(model: torch.nn.Module, batch: Batch) -> Any:
    if isinstance(batch, torch.Tensor):
        return model(batch)
    if isinstance(batch, dict):
        return model(**batch)
    return model(*batch)


class Executor:
    """Runs training steps and inference over ``virtual_nodes`` VNs on this worker.

    Args:
        model: the module to train. Its trainable parameters must be leaf tensors.
        optimizer: a torch.optim.Optimizer over (a subset of) the model's parameters.
        loss_fn: ``loss_fn(model, vn_batch)`` returning the VN's mean loss (a scalar
            tensor) or ``(loss_sum, num_items)``; see docs/design.md, "Loss normalisation".
        virtual_nodes: V, the number of VNs the global batch is split into.
        seed: seeds the per-VN random generators, see Note [VN randomness].
        amp: None, "bf16" or "fp16": run loss_fn under autocast in that dtype.
        accumulate_dtype: accumulator dtype for gradients of non-float64 parameters
            (torch.float32 or torch.float64). float64 parameters always use float64.
        loss_scale: fp16 loss scaling. None (default) enables it when amp="fp16" or a
            trainable parameter is float16; True/False force it; a LossScaler
            instance configures it.
        skip_nonfinite: skip the optimizer step when a gradient is inf/NaN (reported
            in StepResult.skipped). Defaults to True when loss scaling is on.
        buffer_rule: how module buffers are updated, "vn0" or "mean"; see
            Note [Buffer rule].
        max_grad_norm: if set, clip the global gradient 2-norm to this value before
            the optimizer step (torch.nn.utils.clip_grad_norm_ semantics).
        plan: which VNs each worker of the process group runs (vflow.Plan); defaults
            to ``Plan.even(virtual_nodes, world_size)``. Replace it with ``set_plan``.
        process_group: the torch.distributed group whose workers share the step;
            defaults to the default group when torch.distributed is initialised, else
            this process alone. Every rank must construct its Executor with the same
            arguments (checked: plan and model layout).
        timeout: bound on every wait for a collective (seconds or a timedelta). When a
            worker dies or hangs, the others raise vflow.CollectiveError naming the
            step and the group within this time.
        bucket_cap_mb: gradients are folded and all-reduced in buckets of at most this
            many MB (see Note [Buckets] in csrc/reducer.h).
        first_bucket_mb: cap of the first bucket, kept small so that the first
            all-reduce starts early in backward.
        broadcast_parameters: with a process group, copy rank 0's parameters and
            buffers to every rank at construction (as DDP does), so replicas start equal.
        deterministic: make training bitwise identical for a given V and seed whatever
            the number of workers and the plan; the loss and module buffers are then
            reduced VN by VN in VN order, and a gradient sum that is inf/NaN skips the
            step with ``skip_nonfinite`` or else raises FloatingPointError. How the
            gradients are summed: ``True`` or ``"ordered"`` adds them in float in one
            fixed binary tree over the VN indices (Note [Ordered sum] in
            csrc/reducer.h; about the cost of the default path); ``"exact"`` sums them
            exactly in integers (Note [Exact accumulation] in csrc/exact.h; more
            accurate, about twice the communication, float32 accumulation and
            non-float64 parameters only). See docs/reproducibility.md for the
            conditions and the cost. Stored normalised: False, "ordered" or "exact".
        prefetch: prepare the next VN's batch in a background thread while the current
            VN computes (Note [Prefetch] in vflow/prefetch.py): slicing, the
            deterministic-mode copy, ``vn_transform`` and, for a model on a GPU and a
            batch on the CPU, the copy to the GPU on a side stream. Results are the same
            with and without it.
        vn_transform: ``fn(vn_batch, generator) -> vn_batch`` applied to every VN's
            batch before ``loss_fn`` (decoding, augmentation, collation). It runs in the
            prefetch thread, so it must not use torch's global random generator: draw
            from ``generator``, a CPU generator seeded from (seed, step, VN) — the same
            draws for a VN under every plan. It must keep the number of samples and not
            modify its input in place (outside deterministic mode that input is a view
            of the caller's batch). ``infer`` does not apply it.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_fn: LossFn,
        virtual_nodes: int,
        seed: int = 0,
        *,
        amp: str | None = None,
        accumulate_dtype: torch.dtype = torch.float32,
        loss_scale: bool | LossScaler | None = None,
        skip_nonfinite: bool | None = None,
        buffer_rule: str = "vn0",
        max_grad_norm: float | None = None,
        plan: Plan | None = None,
        process_group: torch.distributed.ProcessGroup | None = None,
        timeout: float | datetime.timedelta = 600.0,
        bucket_cap_mb: float = 25.0,
        first_bucket_mb: float = 1.0,
        broadcast_parameters: bool = True,
        deterministic: bool | str = False,
        prefetch: bool = True,
        vn_transform: VNTransform | None = None,
    ) -> None:
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
            )
        if not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
        self.virtual_nodes = require_int("virtual_nodes", virtual_nodes, 1)
        self.seed = require_int("seed", seed, 0)
        if not isinstance(prefetch, bool):
            raise TypeError(f"prefetch must be a bool, got {type(prefetch).__name__}")
        if vn_transform is not None and not callable(vn_transform):
            raise TypeError(
                f"vn_transform must be callable or None, got {type(vn_transform).__name__}"
            )
        if amp is not None and amp not in _AMP_DTYPES:
            raise ValueError(f"amp must be None, 'bf16' or 'fp16', got {amp!r}")
        if accumulate_dtype not in (torch.float32, torch.float64):
            raise ValueError(
                f"accumulate_dtype must be torch.float32 or torch.float64, got {accumulate_dtype}"
            )
        if buffer_rule not in BUFFER_RULES:
            raise ValueError(f"buffer_rule must be one of {BUFFER_RULES}, got {buffer_rule!r}")
        if max_grad_norm is not None and not (
            isinstance(max_grad_norm, (int, float))
            and not isinstance(max_grad_norm, bool)
            and max_grad_norm > 0
        ):
            raise ValueError(
                f"max_grad_norm must be a positive number or None, got {max_grad_norm}"
            )
        for name, value in (("bucket_cap_mb", bucket_cap_mb), ("first_bucket_mb", first_bucket_mb)):
            if isinstance(value, bool) or not (isinstance(value, (int, float)) and value > 0):
                raise ValueError(f"{name} must be a positive number, got {value}")
        timeout = distributed.to_timedelta(timeout)
        group = distributed.resolve_group(process_group)
        world_size = 1 if group is None else group.size()
        if plan is None:
            plan = distributed.default_plan(self.virtual_nodes, world_size)
        plan = distributed.check_plan(plan, self.virtual_nodes, world_size)
        if not isinstance(broadcast_parameters, bool):
            raise TypeError(
                f"broadcast_parameters must be a bool, got {type(broadcast_parameters).__name__}"
            )
        if not (loss_scale is None or isinstance(loss_scale, (bool, LossScaler))):
            raise TypeError(
                f"loss_scale must be None, a bool or a vflow.LossScaler, got "
                f"{type(loss_scale).__name__}"
            )
        params = self._trainable_params(model, optimizer)
        if not isinstance(deterministic, (bool, str)):
            raise TypeError(
                f'deterministic must be a bool, "ordered" or "exact", got '
                f"{type(deterministic).__name__}"
            )
        if deterministic is True:
            deterministic = "ordered"
        if deterministic not in (False, "ordered", "exact"):
            raise ValueError(
                f'deterministic must be False, True, "ordered" or "exact", got {deterministic!r}'
            )
        if deterministic:
            self._check_deterministic_support(params, accumulate_dtype, deterministic)
        owner = _OWNERS.get(model)
        if owner is not None and owner() is not None:
            raise ValueError(
                "model is already driven by another live vflow.Executor; call its close() first"
            )
        bucket_cap_bytes = max(1, int(bucket_cap_mb * 1024 * 1024))
        first_bucket_bytes = max(1, int(first_bucket_mb * 1024 * 1024))
        self._collectives = None if group is None else distributed.Collectives(group, timeout)
        if self._collectives is not None:
            layout = repr(
                (
                    [(tuple(p.shape), str(p.dtype)) for p in params],
                    [(name, tuple(b.shape), str(b.dtype)) for name, b in model.named_buffers()],
                )
            )
            # Settings that change the gradient or the collectives issued: ranks that
            # differ in any of them would diverge or hang.
            settings = repr(
                (
                    self.seed,
                    amp,
                    str(accumulate_dtype),
                    buffer_rule,
                    max_grad_norm,
                    bucket_cap_bytes,
                    first_bucket_bytes,
                    loss_scale if isinstance(loss_scale, (bool, type(None))) else "scaler",
                    skip_nonfinite,
                    deterministic,
                    broadcast_parameters,
                )
            )
            self._collectives.check_agreement(
                [
                    ("plan", repr(plan), repr(plan)),
                    ("model layout", layout, "this rank's parameter and buffer shapes/dtypes"),
                    (
                        "settings",
                        settings,
                        f"(seed, amp, accumulate_dtype, buffer_rule, max_grad_norm, bucket "
                        f"caps, loss_scale, skip_nonfinite, deterministic, "
                        f"broadcast_parameters) = {settings}",
                    ),
                ]
            )
            if broadcast_parameters:
                self._collectives.broadcast_from_first(
                    [*params, *model.buffers()], "broadcast of rank 0's parameters", None
                )

        self.model = model
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.amp = amp
        self.max_grad_norm = None if max_grad_norm is None else float(max_grad_norm)
        has_fp16_params = any(p.dtype == torch.float16 for p in params)
        if isinstance(loss_scale, LossScaler):
            self.scaler: LossScaler | None = loss_scale
        elif loss_scale or (loss_scale is None and (amp == "fp16" or has_fp16_params)):
            self.scaler = LossScaler()
        else:
            self.scaler = None
        self.skip_nonfinite = self.scaler is not None if skip_nonfinite is None else skip_nonfinite
        self.deterministic: Literal[False, "ordered", "exact"] = deterministic
        self._tree: tuple[Plan, tree.TreeSchedule] | None = None
        self.step_count = 0
        self.skipped_steps = 0
        self._device = params[0].device
        self._devices = sorted({p.device for p in params}, key=str)
        self._buffers = BufferRule(
            model, buffer_rule, self.virtual_nodes if deterministic else None
        )
        self._plan = plan
        self.process_group = group
        self.rank = 0 if group is None else group.rank()
        self.world_size = world_size
        self._prefetcher = Prefetcher(self._device, prefetch)
        self.vn_transform = vn_transform
        self._grads = GradAccumulator(
            params,
            accumulate_dtype,
            bucket_cap_bytes=bucket_cap_bytes,
            first_bucket_bytes=first_bucket_bytes,
            process_group=group,
            timeout=timeout,
            group_description="this process" if group is None else distributed.describe(group),
            exact=deterministic == "exact",
            ordered=deterministic == "ordered",
        )
        _OWNERS[model] = weakref.ref(self)

    @property
    def plan(self) -> Plan:
        return self._plan

    def set_plan(self, plan: Plan) -> None:
        """Runs the following steps with ``plan`` (same V, one entry per rank).

        With a process group this is a collective: every rank must call it between the
        same two steps with the same plan (checked; on a mismatch every rank raises and
        keeps its old plan).
        """
        self._check_open()
        plan = distributed.check_plan(plan, self.virtual_nodes, self.world_size)
        if self._collectives is not None:
            self._collectives.check_agreement([("plan", repr(plan), repr(plan))])
        self._plan = plan

    def _check_deterministic_support(
        self, params: list[torch.nn.Parameter], accumulate_dtype: torch.dtype, kind: str
    ) -> None:
        if any(p.is_cuda for p in params) and not torch.are_deterministic_algorithms_enabled():
            _log.warning(
                "vflow: deterministic=True on CUDA also needs deterministic kernels in the "
                "model: call torch.use_deterministic_algorithms(True) (see "
                "docs/reproducibility.md)"
            )
        if kind != "exact":
            return
        if accumulate_dtype != torch.float32:
            raise ValueError(
                f'deterministic="exact" sums gradients exactly and converts them to float32 once; '
                f"accumulate_dtype must be torch.float32, got {accumulate_dtype}"
            )
        wide = [tuple(p.shape) for p in params if p.dtype == torch.float64]
        if wide:
            raise ValueError(
                f'deterministic="exact" supports float32, bfloat16 and float16 parameters; '
                f"{len(wide)} trainable parameter(s) are float64 (first shape {wide[0]})"
            )
        if self.virtual_nodes > _C.EXACT_MAX_TERMS:
            raise ValueError(
                f'deterministic="exact" supports at most {_C.EXACT_MAX_TERMS} virtual nodes (the '
                f"exact sums would overflow beyond), got virtual_nodes={self.virtual_nodes}"
            )

    @staticmethod
    def _trainable_params(
        model: torch.nn.Module, optimizer: torch.optim.Optimizer
    ) -> list[torch.nn.Parameter]:
        owned = {id(p) for p in model.parameters()}
        for g, group in enumerate(optimizer.param_groups):
            for k, p in enumerate(group["params"]):
                if id(p) not in owned:
                    raise ValueError(
                        f"optimizer param_groups[{g}]['params'][{k}] (shape {tuple(p.shape)}) is "
                        "not a parameter of model; the optimizer may only hold model parameters"
                    )
        params = []
        for name, p in model.named_parameters():
            if not p.requires_grad:
                continue
            if not p.is_leaf:
                raise ValueError(
                    f"model parameter {name!r} is not a leaf tensor (it was computed from "
                    "other tensors); vflow accumulates gradients of leaf parameters only"
                )
            if not p.is_floating_point():
                raise ValueError(f"model parameter {name!r} is {p.dtype}; expected floating point")
            params.append(p)
        for name, module in model.named_modules():
            if isinstance(module, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and module.sparse:
                raise ValueError(
                    f"module {name!r} produces sparse gradients (sparse=True); vflow's "
                    "accumulation buffers are dense"
                )
        if not params:
            raise ValueError("model has no trainable parameters (requires_grad=True)")
        return params

    def _local_slices(
        self, batch: Batch, global_batch_size: int | None
    ) -> tuple[list[VNSlice], int]:
        """This worker's VNs as slices of ``batch``, and the global batch size B.

        ``batch`` is the global batch, or with ``global_batch_size`` only this worker's
        samples of it (its VNs' slices, concatenated in VN order).
        """
        total = batch_size(batch)
        if global_batch_size is None:
            return self._plan.worker_slices(self.rank, total), total
        require_int("global_batch_size", global_batch_size, 1)
        start, stop = self._plan.worker_range(self.rank, global_batch_size)
        if total != stop - start:
            raise ValueError(
                f"batch has {total} samples but worker {self.rank}'s share of a global batch of "
                f"global_batch_size={global_batch_size} under {self._plan} is {stop - start} "
                f"(samples [{start}, {stop})); pass this worker's samples only, or the whole "
                "global batch without global_batch_size"
            )
        slices = self._plan.worker_slices(self.rank, global_batch_size)
        return [VNSlice(vn, begin - start, size) for vn, begin, size in slices], global_batch_size

    # ---- training -------------------------------------------------------------

    def step(self, batch: Batch, *, global_batch_size: int | None = None) -> StepResult:
        """Runs one global step.

        ``batch`` is either the whole global batch (B samples; every rank passes the same
        one and runs its VNs' slices of it), or — with ``global_batch_size=B`` — only
        this worker's samples: its VNs' slices of the global batch concatenated in VN
        order, as vflow.data.VNBatchSampler yields them.

        On any error before the optimizer step (bad input, an exception in loss_fn or
        backward) the model's parameters and buffers, the optimizer, the loss scaler and
        the step count are left as they were, and ``param.grad`` is None. An exception
        raised by ``optimizer.step()`` itself propagates with the module buffers restored.
        """
        self._check_open()
        slices, total = self._local_slices(batch, global_batch_size)
        clock = PhaseClock(self._device)
        clock.mark()
        self._buffers.begin_step()
        try:
            with rng.preserved_rng(self._devices):
                loss, num_items, found, grad_norm = self._forward_backward_reduce(
                    batch, slices, total, clock
                )
                if self._collectives is not None and self._buffers.has_buffers:
                    self._buffers.reduce(self._collectives, self.virtual_nodes, self.step_count)
            skipped = bool(found) if found is not None else False
            if skipped:
                self._grads.clear()
                self.skipped_steps += 1
                _log.warning(
                    "vflow step %d: inf/NaN in the gradients, optimizer step skipped%s",
                    self.step_count,
                    "" if self.scaler is None else f" (loss scale {self.scaler.scale:g})",
                )
            else:
                self._grads.publish()
                self.optimizer.step()
        except BaseException:
            self._buffers.abort()
            self._grads.clear()
            raise
        self._buffers.commit()
        scale = None if self.scaler is None else self.scaler.scale
        if self.scaler is not None:
            self.scaler.update(skipped)
        clock.mark()
        fb, reduce, opt = clock.intervals()
        result = StepResult(
            loss=loss,
            num_items=num_items,
            step=self.step_count,
            skipped=skipped,
            loss_scale=scale,
            grad_norm=grad_norm,
            timings=PhaseTimings(fb, reduce, opt, self._grads.last_wait_seconds),
        )
        self.step_count += 1
        return result

    def _forward_backward_reduce(
        self, batch: Batch, slices: list[VNSlice], total: int, clock: PhaseClock
    ) -> tuple[float, float, torch.Tensor | None, float | None]:
        vn_steps = self._tree_schedule().vn_steps if self.deterministic == "ordered" else None
        self._grads.begin_step(self.step_count)
        scale = 1.0 if self.scaler is None else self.scaler.scale
        jobs = [
            functools.partial(self._vn_batch, batch, start, size, vn) for vn, start, size in slices
        ]
        # Plain slicing is a few views: not worth a thread hand-off.
        background = (
            bool(self.deterministic)
            or self.vn_transform is not None
            or self._prefetcher.needs_transfer(batch)
        )
        vn_batches = self._prefetcher.batches(jobs, background)
        with contextlib.closing(vn_batches):
            return self._run_vns(slices, total, vn_batches, vn_steps, scale, clock)

    def _run_vns(
        self,
        slices: list[VNSlice],
        total: int,
        vn_batches: Iterator[Batch],
        vn_steps: tuple[tree.VNStep, ...] | None,
        scale: float,
        clock: PhaseClock,
    ) -> tuple[float, float, torch.Tensor | None, float | None]:
        kind: str | None = None
        loss_parts: list[tuple[int, torch.Tensor]] = []
        item_parts: list[torch.Tensor] = []
        for position, ((vn, _, size), vn_batch) in enumerate(zip(slices, vn_batches, strict=True)):
            last = position == len(slices) - 1
            rng.seed_all(rng.vn_seed(self.seed, self.step_count, vn), self._devices)
            with self._autocast():
                out = self.loss_fn(self.model, vn_batch)
            loss, items, this_kind = self._parse_loss(out, vn)
            if kind is not None and this_kind != kind:
                raise TypeError(
                    f"loss_fn returned a {this_kind} loss for virtual node {vn} but a {kind} "
                    f"loss for virtual node {slices[0].vn}; every VN must return the same kind"
                )
            kind = this_kind
            # Mean losses are weighted by VN size / B here; summed losses are added as
            # they are and divided by the global item count once all VNs have run.
            weight = size / total if kind == "mean" else 1.0
            loss_parts.append((vn, loss.detach().double() * weight))
            if kind == "sum":
                item_parts.append(torch.as_tensor(items, dtype=torch.float64).to(self._device))
            if last:
                stats = self._local_stats(loss_parts, item_parts, kind)
                self._grads.start_stats(stats)
            self._grads.backward(
                loss.float() * scale if scale != 1.0 else loss,
                weight,
                last,
                None if vn_steps is None else vn_steps[position],
            )
            self._buffers.end_vn(vn)
        clock.mark()
        loss_total, items_total, sum_kind_workers, bad_items = self._global_stats(
            self._grads.wait_stats()
        )
        if sum_kind_workers not in (0, self.world_size):
            raise TypeError(
                f"loss_fn returned (loss_sum, num_items) losses on {sum_kind_workers:g} of "
                f"{self.world_size} workers and mean losses on the others; every worker must "
                "return the same kind"
            )
        if bad_items:
            self._raise_bad_items(slices, item_parts, bad_items)
        factor = 1.0 / scale
        if kind == "mean":
            num_items = float(total)
            loss_value = loss_total
        else:
            self._check_items(items_total)
            num_items = items_total
            factor /= num_items
            loss_value = loss_total / num_items
        found = self._grads.finish(factor, self.skip_nonfinite or self.deterministic)
        if self.deterministic and not self.skip_nonfinite and bool(found):
            raise FloatingPointError(
                f"vflow step {self.step_count}: a gradient of the global batch is inf or NaN, "
                "or its sum does not fit float32 (deterministic mode never hands such a sum "
                "to the optimizer); nothing was changed. Pass skip_nonfinite=True to skip "
                "such steps instead"
            )
        grad_norm = None
        if self.max_grad_norm is not None and not (found is not None and bool(found)):
            grad_norm = self._clip()
        clock.mark()
        return loss_value, num_items, found, grad_norm

    def _tree_schedule(self) -> tree.TreeSchedule:
        """This worker's schedule of Note [Ordered sum] for the current plan, handed to
        the reducer when the plan changed."""
        if self._tree is None or self._tree[0] != self._plan:
            ranges = [
                (self._plan.vns(w).start, self._plan.vns(w).stop) for w in range(self.world_size)
            ]
            schedule = tree.schedule(ranges, self.rank, self.virtual_nodes)
            self._grads.set_tree(schedule.cover_counts, schedule.combine_merges)
            self._tree = (self._plan, schedule)
        return self._tree[1]

    def _vn_batch(self, batch: Batch, start: int, size: int, vn: int) -> Batch:
        """VN ``vn``'s batch, ready for loss_fn except for the move to the GPU; runs in
        the prefetch thread (Note [Prefetch])."""
        vn_batch = slice_batch(batch, start, start + size)
        if self.deterministic:
            # A VN's slice starts at a different offset (and alignment) under different
            # plans; some CPU kernels' summation order depends on the alignment of their
            # input, so every VN gets a fresh, equally aligned copy.
            vn_batch = map_batch(vn_batch, lambda t: t.clone(memory_format=torch.contiguous_format))
        if self.vn_transform is not None:
            generator = torch.Generator().manual_seed(
                rng.vn_seed(self.seed, self.step_count, vn, rng.DATA_STREAM)
            )
            vn_batch = self.vn_transform(vn_batch, generator)
            got = batch_size(vn_batch)
            if got != size:
                # The VN's loss weight and the step's item count come from its size.
                raise ValueError(
                    f"vn_transform returned a batch of {got} samples for virtual node {vn}, "
                    f"which has {size}; it must keep the number of samples"
                )
        return vn_batch

    def _local_stats(
        self,
        loss_parts: list[tuple[int, torch.Tensor]],
        item_parts: list[torch.Tensor],
        kind: str,
    ) -> torch.Tensor:
        """This worker's part of the step's statistics, to be summed over the workers:
        [V weighted VN losses | V VN item counts | 1 if summed losses | VNs with an
        invalid item count], float64 on the communication device.

        Every VN's values sit in their own slot, zero on the workers that did not run
        it, so the sum over workers only ever adds zeros to a value: exact in any
        order. The totals are then formed in VN order (``_global_stats``), which makes
        the reported loss independent of the plan too.
        """
        device = self._device if self._collectives is None else self._collectives.device
        v = self.virtual_nodes
        vns = torch.tensor([vn for vn, _ in loss_parts], device=self._device)
        stats = torch.zeros(2 * v + 2, dtype=torch.float64, device=self._device)
        stats[vns] = torch.stack([loss for _, loss in loss_parts]).to(self._device)
        if item_parts:
            items = torch.stack(item_parts).to(self._device)
            stats[v + vns] = items
            # Counted on the device, so that bad counts are seen by every worker
            # without a host synchronisation before the last backward.
            stats[2 * v + 1] = ((items < 0) | ~torch.isfinite(items)).sum().double()
        stats[2 * v] = 1.0 if kind == "sum" else 0.0
        return stats.to(device)

    def _global_stats(self, stats: torch.Tensor) -> tuple[float, float, float, float]:
        """(loss total, item total, workers with summed losses, invalid item counts)
        from the all-reduced statistics, each total added in VN order."""
        values = stats.tolist()
        v = self.virtual_nodes
        loss_total = 0.0
        items_total = 0.0
        for vn in range(v):
            loss_total += values[vn]
            items_total += values[v + vn]
        return loss_total, items_total, values[2 * v], values[2 * v + 1]

    @staticmethod
    def _raise_bad_items(
        slices: list[VNSlice], item_parts: list[torch.Tensor], bad_items: float
    ) -> None:
        """Names this worker's first VN with an invalid num_items, else the count of
        such VNs on the other workers (every worker raises at the same point)."""
        for (vn, _, _), items in zip(slices, item_parts, strict=True):
            value = float(items)
            if not math.isfinite(value) or value < 0:
                raise ValueError(
                    f"loss_fn (virtual node {vn}) returned num_items={value}; expected a count >= 0"
                )
        raise ValueError(
            f"loss_fn returned a num_items that is negative or not finite on "
            f"{bad_items:g} virtual node(s) of other workers; expected counts >= 0"
        )

    @staticmethod
    def _check_items(total: float) -> None:
        if not math.isfinite(total) or total <= 0:
            raise ValueError(
                f"loss_fn returned num_items summing to {total} over the global batch; the "
                "summed loss is divided by this total, so it must be finite and > 0 (and every "
                "VN's num_items a count >= 0)"
            )

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.amp is None:
            return contextlib.nullcontext()
        return torch.autocast(self._device.type, dtype=_AMP_DTYPES[self.amp])

    @staticmethod
    def _parse_loss(out: Any, vn: int) -> tuple[torch.Tensor, torch.Tensor | float, str]:
        where = f"loss_fn (virtual node {vn})"
        if isinstance(out, torch.Tensor):
            loss, items, kind = out, 0.0, "mean"
        elif isinstance(out, tuple) and len(out) == 2:
            loss, items = out
            kind = "sum"
            if not isinstance(loss, torch.Tensor):
                raise TypeError(
                    f"{where} returned (loss_sum, num_items) with loss_sum a "
                    f"{type(loss).__name__}; expected a scalar tensor"
                )
            if isinstance(items, bool) or not isinstance(items, (int, float, torch.Tensor)):
                raise TypeError(
                    f"{where} returned num_items of type {type(items).__name__}; expected an int, "
                    "a float or a scalar tensor"
                )
            if isinstance(items, torch.Tensor):
                if items.numel() != 1 or items.dtype == torch.bool or items.is_complex():
                    raise TypeError(
                        f"{where} returned num_items as a tensor of shape {tuple(items.shape)} "
                        f"and dtype {items.dtype}; expected a real scalar"
                    )
                items = items.detach().reshape(())
            elif not math.isfinite(items) or items < 0:
                raise ValueError(f"{where} returned num_items={items}; expected a count >= 0")
        else:
            raise TypeError(
                f"{where} returned a {type(out).__name__}; expected a scalar loss tensor (the "
                "mean over the VN's samples) or a tuple (loss_sum, num_items)"
            )
        if loss.numel() != 1:
            raise ValueError(
                f"{where} returned a loss of shape {tuple(loss.shape)}; expected a scalar"
            )
        if not loss.is_floating_point():
            raise TypeError(
                f"{where} returned a loss of dtype {loss.dtype}; expected floating point"
            )
        if not loss.requires_grad:
            raise ValueError(
                f"{where} returned a loss that does not require grad; it must be computed from "
                "the model's trainable parameters"
            )
        return loss.reshape(()), items, kind

    def _clip(self) -> float:
        norms = [torch.linalg.vector_norm(g.buffer.data) for g in self._grads.groups]
        total = torch.linalg.vector_norm(torch.stack([n.to(self._device) for n in norms]))
        norm = float(total)
        coef = self.max_grad_norm / (norm + 1e-6)
        if coef < 1.0:
            for group in self._grads.groups:
                group.buffer.scale_(coef)
        return norm

    # ---- inference --------------------------------------------------------------

    @torch.no_grad()
    def infer(
        self,
        batch: Batch,
        forward_fn: ForwardFn | None = None,
        *,
        global_batch_size: int | None = None,
        gather: bool = True,
    ) -> Any:
        """Runs the forward VN by VN under no_grad; returns outputs in batch order.

        ``batch`` is the global batch, or this worker's samples of it with
        ``global_batch_size`` (as in ``step``). Each worker runs only its own VNs; with
        a process group and ``gather`` (default) the outputs of all workers are gathered
        so that every rank returns the outputs of the whole global batch, as a single
        process would. ``gather=False`` returns this worker's outputs only.

        ``forward_fn(model, vn_batch)`` defaults to ``model(x)`` for a tensor,
        ``model(*batch)`` for a tuple/list and ``model(**batch)`` for a dict. Outputs
        (tensors or tuples/lists/dicts of them) are concatenated along dim 0. The
        model's mode is left as the caller set it (call ``model.eval()`` for
        inference-mode BatchNorm and dropout).
        """
        self._check_open()
        if not isinstance(gather, bool):
            raise TypeError(f"gather must be a bool, got {type(gather).__name__}")
        slices, total = self._local_slices(batch, global_batch_size)
        forward = _default_forward if forward_fn is None else forward_fn
        outputs = []
        with rng.preserved_rng(self._devices):
            for vn, start, size in slices:
                rng.seed_all(
                    rng.vn_seed(self.seed, self.step_count, vn, rng.INFER_STREAM), self._devices
                )
                with self._autocast():
                    outputs.append(forward(self.model, slice_batch(batch, start, start + size)))
        local = concat_outputs(outputs)
        if self._collectives is None or not gather:
            return local
        counts = [stop - start for start, stop in self._worker_ranges(total)]
        return map_batch(local, lambda t: self._collectives.gather_rows(t, counts, self.step_count))

    def _worker_ranges(self, total: int) -> list[tuple[int, int]]:
        return [self._plan.worker_range(w, total) for w in range(self.world_size)]

    # ---- checkpoints ----------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume training bit for bit on any number of workers:
        model, optimizer, step counts, seed and loss scaler (see vflow.checkpoint)."""
        self._check_open()
        return checkpoint.executor_state_dict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores ``state`` from ``state_dict()``, written with any plan and any
        number of workers for the same V. Raises before changing anything when
        ``state`` does not fit this executor (see vflow.checkpoint)."""
        self._check_open()
        checkpoint.load_executor_state_dict(self, state)

    # ---- lifecycle ----------------------------------------------------------------

    def _check_open(self) -> None:
        if self._grads is None:
            raise RuntimeError("this Executor is closed")

    def close(self) -> None:
        """Removes vflow's hooks from the model; gradients stay where they are."""
        grads = getattr(self, "_grads", None)
        if grads is None:
            return
        grads.close()
        self._grads = None
        self._prefetcher.close()
        owner = _OWNERS.get(self.model)
        if owner is not None and owner() is self:
            del _OWNERS[self.model]

    def __enter__(self) -> Executor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()
