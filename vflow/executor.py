"""``vflow.Executor``: runs a global batch as V virtual nodes (VNs) on this worker.

A step splits the global batch into V contiguous VN slices (vflow.batching), runs
forward and backward VN by VN while the fused kernels fold each VN's gradients into
flat float32 buffers (vflow.grads), normalises once for the whole global batch, and
steps the optimizer once. See docs/design.md for the semantics this guarantees.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from vflow import rng
from vflow.amp import LossScaler
from vflow.batching import Batch, batch_size, concat_outputs, slice_batch, split_sizes
from vflow.grads import GradAccumulator
from vflow.module_buffers import BUFFER_RULES, BufferRule
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


class VNSlice(NamedTuple):
    vn: int
    start: int
    size: int


@dataclass(frozen=True)
class PhaseTimings:
    """Seconds spent in each phase of one step (wall clock on the host; on CUDA
    measured with events on the current stream)."""

    forward_backward: float
    reduce: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.forward_backward + self.reduce + self.optimizer


@dataclass(frozen=True)
class StepResult:
    """What one global step did.

    loss: the global batch's loss — the size-weighted mean of the VN mean losses, or
      sum(loss_sum) / sum(num_items) for ``(loss_sum, num_items)`` losses.
    num_items: samples in the batch for mean losses, else the total num_items.
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


def _require_int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


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
        bucket_cap_mb: gradients are folded into the buffers in buckets of at most
            this many MB, bounding the un-folded gradients held during backward.
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
        bucket_cap_mb: float = 25.0,
    ) -> None:
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
            )
        if not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
        self.virtual_nodes = _require_int("virtual_nodes", virtual_nodes, 1)
        self.seed = _require_int("seed", seed, 0)
        if amp is not None and amp not in _AMP_DTYPES:
            raise ValueError(f"amp must be None, 'bf16' or 'fp16', got {amp!r}")
        if accumulate_dtype not in (torch.float32, torch.float64):
            raise ValueError(
                f"accumulate_dtype must be torch.float32 or torch.float64, got {accumulate_dtype}"
            )
        if buffer_rule not in BUFFER_RULES:
            raise ValueError(f"buffer_rule must be one of {BUFFER_RULES}, got {buffer_rule!r}")
        if max_grad_norm is not None and not (
            isinstance(max_grad_norm, (int, float)) and max_grad_norm > 0
        ):
            raise ValueError(
                f"max_grad_norm must be a positive number or None, got {max_grad_norm}"
            )
        if not (isinstance(bucket_cap_mb, (int, float)) and bucket_cap_mb > 0):
            raise ValueError(f"bucket_cap_mb must be a positive number, got {bucket_cap_mb}")
        if not (loss_scale is None or isinstance(loss_scale, (bool, LossScaler))):
            raise TypeError(
                f"loss_scale must be None, a bool or a vflow.LossScaler, got "
                f"{type(loss_scale).__name__}"
            )
        params = self._trainable_params(model, optimizer)
        owner = _OWNERS.get(model)
        if owner is not None and owner() is not None:
            raise ValueError(
                "model is already driven by another live vflow.Executor; call its close() first"
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
        self.step_count = 0
        self.skipped_steps = 0
        self._device = params[0].device
        self._devices = sorted({p.device for p in params}, key=str)
        self._buffers = BufferRule(model, buffer_rule)
        self._grads = GradAccumulator(
            params, accumulate_dtype, bucket_cap_bytes=int(bucket_cap_mb * 1024 * 1024)
        )
        _OWNERS[model] = weakref.ref(self)

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

    def _vn_slices(self, total: int) -> list[VNSlice]:
        """The VNs this worker runs, as (VN index, first sample, size) in run order.

        The global VN split depends on (B, V) only; which of those VNs a worker runs is
        the one place that knows about workers (all of them, in this release).
        """
        sizes = split_sizes(total, self.virtual_nodes)
        starts = itertools.accumulate(sizes[:-1], initial=0)
        return [VNSlice(i, start, size) for i, (start, size) in enumerate(zip(starts, sizes))]

    # ---- training -------------------------------------------------------------

    def step(self, batch: Batch) -> StepResult:
        """Runs one global step over ``batch`` (the whole global batch, B samples).

        On any error before the optimizer step (bad input, an exception in loss_fn or
        backward) the model's parameters and buffers, the optimizer, the loss scaler and
        the step count are left as they were, and ``param.grad`` is None. An exception
        raised by ``optimizer.step()`` itself propagates with the module buffers restored.
        """
        self._check_open()
        total = batch_size(batch)
        slices = self._vn_slices(total)
        clock = PhaseClock(self._device)
        clock.mark()
        self._buffers.begin_step()
        try:
            with rng.preserved_rng(self._devices):
                loss, num_items, found, grad_norm = self._forward_backward_reduce(
                    batch, slices, total, clock
                )
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
            timings=PhaseTimings(fb, reduce, opt),
        )
        self.step_count += 1
        return result

    def _forward_backward_reduce(
        self, batch: Batch, slices: list[VNSlice], total: int, clock: PhaseClock
    ) -> tuple[float, float, torch.Tensor | None, float | None]:
        self._grads.begin_step()
        scale = 1.0 if self.scaler is None else self.scaler.scale
        kind: str | None = None
        loss_parts: list[torch.Tensor] = []
        item_parts: list[torch.Tensor | float] = []
        for vn, start, size in slices:
            vn_batch = slice_batch(batch, start, start + size)
            rng.seed_all(rng.vn_seed(self.seed, self.step_count, vn), self._devices)
            with self._autocast():
                out = self.loss_fn(self.model, vn_batch)
            loss, items, this_kind = self._parse_loss(out, vn)
            if kind is not None and this_kind != kind:
                raise TypeError(
                    f"loss_fn returned a {this_kind} loss for virtual node {vn} but a {kind} "
                    "loss for virtual node 0; every VN must return the same kind"
                )
            kind = this_kind
            # Mean losses are weighted by VN size / B here; summed losses are added as
            # they are and divided by the global item count once all VNs have run.
            weight = size / total if kind == "mean" else 1.0
            self._grads.backward(loss.float() * scale if scale != 1.0 else loss, weight)
            self._buffers.end_vn()
            loss_parts.append(loss.detach().float() * weight)
            item_parts.append(items)
        factor = 1.0 / scale
        if kind == "mean":
            num_items = float(total)
        else:
            num_items = self._total_items(item_parts)
            factor /= num_items
        clock.mark()
        found = self._grads.finish(factor, self.skip_nonfinite)
        grad_norm = None
        if self.max_grad_norm is not None and not (found is not None and bool(found)):
            grad_norm = self._clip()
        loss_value = torch.stack(loss_parts).sum().item()
        if kind == "sum":
            loss_value /= num_items
        clock.mark()
        return loss_value, num_items, found, grad_norm

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

    @staticmethod
    def _total_items(parts: list[torch.Tensor | float]) -> float:
        values = [float(p) if isinstance(p, torch.Tensor) else p for p in parts]
        for vn, value in enumerate(values):
            if not math.isfinite(value) or value < 0:
                raise ValueError(
                    f"loss_fn (virtual node {vn}) returned num_items={value}; expected a count >= 0"
                )
        total = sum(values)
        if total <= 0:
            raise ValueError(
                f"loss_fn returned num_items summing to {total} over the global batch; the "
                "summed loss is divided by this total, so it must be > 0"
            )
        return total

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
    def infer(self, batch: Batch, forward_fn: ForwardFn | None = None) -> Any:
        """Runs the forward VN by VN under no_grad; returns outputs in batch order.

        ``forward_fn(model, vn_batch)`` defaults to ``model(x)`` for a tensor,
        ``model(*batch)`` for a tuple/list and ``model(**batch)`` for a dict. Outputs
        (tensors or tuples/lists/dicts of them) are concatenated along dim 0. The
        model's mode is left as the caller set it (call ``model.eval()`` for
        inference-mode BatchNorm and dropout).
        """
        self._check_open()
        total = batch_size(batch)
        forward = _default_forward if forward_fn is None else forward_fn
        outputs = []
        with rng.preserved_rng(self._devices):
            for vn, start, size in self._vn_slices(total):
                rng.seed_all(
                    rng.vn_seed(self.seed, self.step_count, vn, rng.INFER_STREAM), self._devices
                )
                with self._autocast():
                    outputs.append(forward(self.model, slice_batch(batch, start, start + size)))
        return concat_outputs(outputs)

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
