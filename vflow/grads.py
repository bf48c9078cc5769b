"""Flat gradient accumulation and reduction for one worker's virtual nodes.

Note [Capturing gradients]
While a VN's backward runs, every managed parameter has ``grad = None``. Autograd then
hands each fresh gradient to the parameter (a steal, no copy) and calls our
post-accumulate hook, which takes it away again and gives it to the C++ Reducer
(csrc/reducer.h). The Reducer folds waiting gradients into the flat buffer with one
fused ``acc += w * g`` call once they add up to about 1 MB (Note [Fold granularity]),
so a VN holds little more than the buffer itself, and during the worker's last VN it
starts a bucket's all-reduce as soon as the bucket is complete (Note [Overlap with
backward]). Gradients
that never arrive (an unused parameter) count as zero. After the step,
``param.grad`` is pointed at the buffer (Note [Flat buffer layout] in
csrc/grad_buffer.h).
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from vflow._extension import _C
from vflow.tree import VNStep


@dataclass
class _Group:
    """Parameters of one device and dtype sharing one flat accumulation buffer."""

    params: list[torch.nn.Parameter]
    buffer: _C.GradBuffer
    # Parameters whose dtype differs from the accumulator see their gradient through a
    # flat copy in their own dtype (optimizers require grad.dtype == param.dtype).
    mirror: torch.Tensor | None = None


def accumulation_dtype(param_dtype: torch.dtype, requested: torch.dtype) -> torch.dtype:
    return torch.float64 if param_dtype == torch.float64 else requested


class GradAccumulator:
    """Owns the flat buffers of ``params``, fills them from autograd VN by VN and, with
    a process group, sums them over the group's workers."""

    def __init__(
        self,
        params: Sequence[torch.nn.Parameter],
        accumulate_dtype: torch.dtype = torch.float32,
        bucket_cap_bytes: int = 25 * 1024 * 1024,
        first_bucket_bytes: int = 1024 * 1024,
        process_group: torch.distributed.ProcessGroup | None = None,
        timeout: datetime.timedelta = datetime.timedelta(minutes=10),
        group_description: str = "the process group",
        exact: bool = False,
        ordered: bool = False,
    ) -> None:
        by_key: dict[tuple[torch.device, torch.dtype], list[torch.nn.Parameter]] = {}
        for p in params:
            by_key.setdefault((p.device, p.dtype), []).append(p)
        in_slot_order = [list(reversed(members)) for members in by_key.values()]
        acc_dtypes = [accumulation_dtype(dtype, accumulate_dtype) for _, dtype in by_key]
        self.reducer = _C.Reducer(
            in_slot_order,
            acc_dtypes,
            first_bucket_bytes=first_bucket_bytes,
            bucket_cap_bytes=bucket_cap_bytes,
            process_group=process_group,
            timeout_seconds=timeout.total_seconds(),
            description=group_description,
            exact=exact,
            ordered=ordered,
        )
        self.groups: list[_Group] = []
        for members, buffer in zip(in_slot_order, self.reducer.buffers, strict=True):
            group = _Group(members, buffer)
            if members[0].dtype != buffer.data.dtype:
                group.mirror = torch.zeros_like(buffer.data, dtype=members[0].dtype)
            self.groups.append(group)
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []
        self._capturing = False
        for g, group in enumerate(self.groups):
            for slot, p in enumerate(group.params):
                hook = self._make_hook(self.reducer.bucket_of(g, slot), slot)
                self._hooks.append(p.register_post_accumulate_grad_hook(hook))

    def _make_hook(self, bucket: int, slot: int) -> Callable[[torch.Tensor], None]:
        add_grad = self.reducer.add_grad

        def hook(param: torch.Tensor) -> None:
            if not self._capturing:
                return  # a backward the user runs outside vflow keeps normal semantics
            grad = param.grad
            param.grad = None
            if grad is not None:
                add_grad(bucket, slot, grad)

        return hook

    def begin_step(self, step: int) -> None:
        """Detaches ``param.grad`` so backward writes fresh gradients; see
        Note [First fold overwrites] (csrc/reducer.h) for why the buffers need no
        zeroing here. ``step`` is named in collective errors."""
        self.reducer.begin_step(step)
        for group in self.groups:
            for p in group.params:
                p.grad = None

    def set_tree(self, cover_counts: Sequence[int], combine_merges: Sequence[int]) -> None:
        """Ordered mode: the tree schedule of the following steps (vflow.tree)."""
        self.reducer.set_tree(list(cover_counts), list(combine_merges))

    def backward(
        self, loss: torch.Tensor, weight: float, last: bool, tree_step: VNStep | None = None
    ) -> None:
        """Runs ``loss.backward()`` and adds ``weight`` x its gradients to the buffers.
        With ``last`` (this worker's last VN of the step) the buckets' all-reduces start
        while backward runs. In ordered mode ``tree_step`` says where the gradients go
        on the stack of Note [Ordered sum]."""
        if tree_step is None:
            self.reducer.begin_vn(weight, last)
        else:
            self.reducer.begin_vn(weight, last, tree_step.level, tree_step.merges)
        self._capturing = True
        try:
            loss.backward()
        except BaseException:
            self.reducer.abort_vn()
            raise
        finally:
            self._capturing = False
        self.reducer.end_vn()

    def start_stats(self, stats: torch.Tensor) -> None:
        """Starts an all-reduce (SUM) of a copy of ``stats`` ahead of the step's
        gradient buckets."""
        self.reducer.start_stats(stats)

    def wait_stats(self) -> torch.Tensor:
        """The sums over the workers of the ``stats`` given to ``start_stats``."""
        return self.reducer.wait_stats()

    def finish(self, factor: float, check_nonfinite: bool) -> torch.Tensor | None:
        """Waits for the all-reduces and scales every buffer by ``factor`` in one pass.

        With ``check_nonfinite`` returns a 0-dim float32 flag set to 1 if any scaled
        gradient is inf/NaN (reading it is the caller's only synchronisation).
        """
        if not check_nonfinite:
            self.reducer.finalize(factor, [])
            return None
        flags: dict[torch.device, torch.Tensor] = {}
        for group in self.groups:
            device = group.buffer.data.device
            if device not in flags:
                flags[device] = torch.zeros((), dtype=torch.float32, device=device)
        self.reducer.finalize(factor, [flags[g.buffer.data.device] for g in self.groups])
        found = [flag.to("cpu", non_blocking=False) for flag in flags.values()]
        return torch.stack(found).amax()

    @property
    def last_wait_seconds(self) -> float:
        return self.reducer.last_wait_seconds

    def publish(self) -> None:
        """Points every ``param.grad`` at its accumulated gradient."""
        for group in self.groups:
            if group.mirror is None:
                views = group.buffer.views()
            else:
                group.mirror.copy_(group.buffer.data)
                views = group.buffer.views_of(group.mirror)
            for p, view in zip(group.params, views, strict=True):
                p.grad = view

    def clear(self) -> None:
        """After a failed or skipped step: no gradient is exposed and no collective of
        the step is still writing to the buffers."""
        self.reducer.discard()
        for group in self.groups:
            for p in group.params:
                p.grad = None

    def close(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
