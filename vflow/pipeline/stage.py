"""A torch.distributed.pipelining stage that tells vflow which VN it runs.

Note [Capturing a stage's gradients]
The schedules (GPipe, 1F1B) call ``forward_one_chunk`` and ``backward_one_chunk`` once
per microbatch, microbatch i being the replica's i-th VN. ``VNStage`` wraps both:
before a forward it selects the VN's random streams (Note [Segment streams]); around
a backward it opens the gradient store's capture for that VN (Note [Capturing
gradients], csrc/grad_store.h), so each VN's gradients are folded into the stage's
flat buffers on their own, in VN order — what makes the ordered sum of deterministic
mode reachable here — and the last VN's backward starts the buckets' reductions
across the stage's replicas. ``scale_grads`` is off: vflow normalises once, for the
whole global batch.

Dynamic shape inference (the first step of a schedule) runs the stage's modules once
on placeholder tensors, outside any VN. ``_compute_outputs``, its only call into the
modules, keeps their buffers (BatchNorm statistics) as they were, and the loss it
computes on the last stage is not one of the step's. Forwards run under the step's
autocast (Note [Mixed precision on a grid], vflow/pipeline/executor.py); backwards run
outside it, as autocast wants.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Protocol

import torch
from torch.distributed.pipelining import PipelineStage

from vflow.runtime.step_run import profiled


class StageListener(Protocol):
    """What a stage reports to the step that drives it (vflow.pipeline.executor)."""

    def forward_begins(self, microbatch: int) -> None: ...

    def forward_ends(self, microbatch: int) -> None: ...

    def backward(self, microbatch: int) -> contextlib.AbstractContextManager[None]: ...

    def autocast(self) -> contextlib.AbstractContextManager[Any]: ...

    def stage_inputs(self, microbatch: int, args: tuple[Any, ...]) -> tuple[Any, ...]: ...


class VNStage(PipelineStage):
    """A ``PipelineStage`` reporting to ``listener`` (Note [Capturing a stage's
    gradients])."""

    def __init__(
        self,
        submodule: torch.nn.Module,
        stage_index: int,
        num_stages: int,
        device: torch.device,
        group: torch.distributed.ProcessGroup,
        listener: StageListener,
    ) -> None:
        super().__init__(submodule, stage_index, num_stages, device, group=group)
        self._listener = listener

    def forward_one_chunk(
        self,
        fwd_chunk_id: int,
        args: tuple[Any, ...],
        kwargs: dict[str, Any] | None = None,
        save_forward_output: bool = True,
    ) -> Any:
        self._listener.forward_begins(fwd_chunk_id)
        if self.is_first:  # Note [Feeding the first stage], vflow/pipeline/executor.py
            args = self._listener.stage_inputs(fwd_chunk_id, args)
        with (
            profiled("vflow::forward", torch.autograd._profiler_enabled()),
            self._listener.autocast(),
        ):
            output = super().forward_one_chunk(fwd_chunk_id, args, kwargs, save_forward_output)
        self._listener.forward_ends(fwd_chunk_id)
        return output

    def backward_one_chunk(
        self,
        bwd_chunk_id: int,
        loss: Any = None,
        full_backward: bool = True,
        last_backward: bool = False,
    ) -> None:
        if not self.has_backward:  # a forward-only schedule (inference): nothing to capture
            return super().backward_one_chunk(bwd_chunk_id, loss, full_backward, last_backward)
        with (
            self._listener.backward(bwd_chunk_id),
            profiled("vflow::backward", torch.autograd._profiler_enabled()),
        ):
            super().backward_one_chunk(bwd_chunk_id, loss, full_backward, last_backward)

    def _compute_outputs(self, *args: torch.Tensor, module: torch.nn.Module, **kwargs: Any) -> Any:
        # Under the step's autocast, so that the shapes and dtypes inferred are those the
        # microbatches send (a bf16 activation travels as bf16).
        with _buffers_kept(module), self._listener.autocast():
            return super()._compute_outputs(*args, module=module, **kwargs)


@contextlib.contextmanager
def _buffers_kept(module: torch.nn.Module) -> Iterator[None]:
    saved = [(b, b.detach().clone()) for b in module.buffers()]
    try:
        yield
    finally:
        # Through .data: shape inference's backward comes later and must not see a
        # tracked in-place write to what the forward saved.
        for buffer, value in saved:
            buffer.data.copy_(value)
