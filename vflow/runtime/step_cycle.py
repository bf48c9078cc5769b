"""The life cycle of a training step, one implementation for every executor.

Note [A step's life cycle]
``vflow.Executor`` runs its VNs one after another; ``vflow.PipelineExecutor`` runs them
as the microbatches of a pipeline schedule. What surrounds the VNs is the same, and is
written here once, so that a change to it (or a feature of it) holds for both:

1. module buffers open the step (Note [Buffer rule], vflow/runtime/module_buffers.py);
2. ``compute``, the executor's own part, under the step's profiler range, with the
   callers' random generators preserved: the VNs, the reduction of the gradients and of
   the step's statistics, the global normalisation and the inf/NaN verdict, which it
   leaves in ``work.skipped``;
3. a skipped step drops its gradients (and logs it); otherwise ``param.grad`` is
   published (unless ``compute`` did, to clip it), ``work.before_optimizer`` runs (the
   pre-step hooks and clipping of Note [Before the optimizer step]) and the optimizer
   steps, then ``work.after_optimizer`` (what the executor let run past the step: the
   pipeline's last stage reads its losses there);
4. on any error up to there the buffers are rolled back and no gradient stays exposed,
   so the parameters, buffers and optimizer are as before the step; otherwise the
   buffers commit and the loss scaler moves with the step's verdict, the same on
   every worker since the verdict is.

The step count, the clock and the result stay with the executor: they are what its
callers read.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from vflow.mapping import rng
from vflow.runtime.step_run import profiled

if TYPE_CHECKING:
    from vflow.runtime.amp import LossScaler
    from vflow.runtime.grad_store import GradStore
    from vflow.runtime.module_buffers import BufferRule

_log = logging.getLogger("vflow")


class StepWork(Protocol):
    """An executor's step as the cycle sees it."""

    skipped: bool  # the verdict ``compute`` reached: inf/NaN, no optimizer step
    published: bool  # ``compute`` already pointed ``param.grad`` at the buffers

    def before_optimizer(self) -> None: ...

    def after_optimizer(self) -> None: ...


@dataclass(frozen=True)
class StepParts:
    """What the cycle changes or restores, handed over by the executor each step."""

    grads: GradStore
    optimizer: torch.optim.Optimizer
    scaler: LossScaler | None
    module_buffers: BufferRule | None  # None when the model has no buffers to manage
    generators: list[torch.Generator]
    step: int
    range_name: str  # the step's profiler range


def run_step(parts: StepParts, work: StepWork, compute: Callable[[], None]) -> float | None:
    """Note [A step's life cycle]; returns the loss scale the step ran with (None
    without loss scaling). Raises what ``compute`` or the optimizer raised, with the
    step undone."""
    buffers = parts.module_buffers
    scaler = parts.scaler
    scale = None if scaler is None else scaler.scale
    profiling = torch.autograd._profiler_enabled()
    if buffers is not None:
        buffers.begin_step()
    try:
        with profiled(parts.range_name, profiling), rng.preserved_rng(parts.generators):
            compute()
        if work.skipped:
            parts.grads.clear()
            _log.warning(
                "vflow step %d: inf/NaN in the gradients, optimizer step skipped%s",
                parts.step,
                "" if scale is None else f" (loss scale {scale:g})",
            )
        else:
            if not work.published:
                parts.grads.publish()
            work.before_optimizer()
            with profiled("vflow::optimizer", profiling):
                parts.optimizer.step()
            work.after_optimizer()
    except BaseException:
        if buffers is not None:
            buffers.abort()
        parts.grads.clear()
        raise
    if buffers is not None:
        buffers.commit()
    if scaler is not None:
        scaler.update(work.skipped)
    return scale
