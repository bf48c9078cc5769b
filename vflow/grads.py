"""Flat gradient accumulation for one worker's virtual nodes.

Note [Capturing gradients]
While a VN's backward runs, every managed parameter has ``grad = None``. Autograd then
hands each fresh gradient to the parameter (a steal, no copy) and calls our
post-accumulate hook, which takes it away again and queues it in its bucket. When all
gradients of a bucket have arrived the bucket is folded into the flat buffer with one
fused ``acc += w * g`` call and the gradients are freed, so a VN never holds more than
one bucket of gradients beyond the buffer itself. Gradients that never arrive (an
unused parameter) count as zero. After the last VN, ``param.grad`` is pointed at the
buffer (see Note [Flat buffer layout] in csrc/grad_buffer.h).

Buckets are contiguous slot ranges of one buffer, laid out in reverse registration
order (the order backward usually produces gradients), so a bucket is also a
contiguous slice of the flat tensor — the unit a collective can reduce later.

Note [First fold overwrites]
Buffers are not zeroed at the start of a step. A bucket's first fold of the step,
when every one of its gradients arrived, writes ``acc = w * g`` instead of adding
(the kernel does not read the accumulator), which saves a zeroing pass and a read
stream. A first fold with some gradients missing zeroes the bucket's range first,
and a bucket that received nothing during the whole step is zeroed in ``finish``.
Overwriting gives the same bits as adding to zero, so results do not depend on it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from vflow._extension import _C


@dataclass
class _Bucket:
    group: _Group
    slots: list[int]  # consecutive slot indices, i.e. one contiguous range of the buffer
    pending_slots: list[int] = field(default_factory=list)
    pending_grads: list[torch.Tensor] = field(default_factory=list)
    # True until the bucket's first fold of the step. See Note [First fold overwrites].
    fresh: bool = True


@dataclass
class _Group:
    """Parameters of one device and dtype sharing one flat accumulation buffer."""

    params: list[torch.nn.Parameter]
    buffer: _C.GradBuffer
    # Parameters whose dtype differs from the accumulator see their gradient through a
    # flat copy in their own dtype (optimizers require grad.dtype == param.dtype).
    mirror: torch.Tensor | None = None
    buckets: list[_Bucket] = field(default_factory=list)


def accumulation_dtype(param_dtype: torch.dtype, requested: torch.dtype) -> torch.dtype:
    return torch.float64 if param_dtype == torch.float64 else requested


class GradAccumulator:
    """Owns the flat buffers of ``params`` and fills them from autograd, VN by VN."""

    def __init__(
        self,
        params: Sequence[torch.nn.Parameter],
        accumulate_dtype: torch.dtype = torch.float32,
        bucket_cap_bytes: int = 25 * 1024 * 1024,
    ) -> None:
        by_key: dict[tuple[torch.device, torch.dtype], list[torch.nn.Parameter]] = {}
        for p in params:
            by_key.setdefault((p.device, p.dtype), []).append(p)
        self.groups: list[_Group] = []
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []
        self._capturing = False
        self._weight = 1.0
        for (_, dtype), members in by_key.items():
            ordered = list(reversed(members))
            acc_dtype = accumulation_dtype(dtype, accumulate_dtype)
            group = _Group(ordered, _C.GradBuffer(ordered, acc_dtype))
            if dtype != acc_dtype:
                group.mirror = torch.zeros_like(group.buffer.data, dtype=dtype)
            group.buckets = self._make_buckets(group, bucket_cap_bytes)
            self.groups.append(group)
        for group in self.groups:
            for bucket in group.buckets:
                for slot in bucket.slots:
                    hook = self._make_hook(bucket, slot)
                    self._hooks.append(group.params[slot].register_post_accumulate_grad_hook(hook))

    @staticmethod
    def _make_buckets(group: _Group, cap_bytes: int) -> list[_Bucket]:
        element_size = group.buffer.data.element_size()
        buckets: list[_Bucket] = []
        current: list[int] = []
        size = 0
        for slot, numel in enumerate(group.buffer.numels):
            if current and size + numel * element_size > cap_bytes:
                buckets.append(_Bucket(group, current))
                current, size = [], 0
            current.append(slot)
            size += numel * element_size
        buckets.append(_Bucket(group, current))
        return buckets

    def _make_hook(self, bucket: _Bucket, slot: int) -> Callable[[torch.Tensor], None]:
        def hook(param: torch.Tensor) -> None:
            if not self._capturing:
                return  # a backward the user runs outside vflow keeps normal semantics
            grad = param.grad
            param.grad = None
            if grad is None:
                return
            bucket.pending_slots.append(slot)
            bucket.pending_grads.append(grad)
            if len(bucket.pending_slots) == len(bucket.slots):
                self._flush(bucket)

        return hook

    def _flush(self, bucket: _Bucket) -> None:
        if bucket.pending_slots:
            buffer = bucket.group.buffer
            complete = len(bucket.pending_slots) == len(bucket.slots)
            if bucket.fresh and not complete:
                buffer.zero_slots_(bucket.slots[0], bucket.slots[-1])
            buffer.accumulate_(
                bucket.pending_slots, bucket.pending_grads, self._weight, bucket.fresh and complete
            )
            bucket.fresh = False
        self._drop_pending(bucket)

    @staticmethod
    def _drop_pending(bucket: _Bucket) -> None:
        bucket.pending_slots = []
        bucket.pending_grads = []

    def _buckets(self):
        for group in self.groups:
            yield from group.buckets

    def begin_step(self) -> None:
        """Detaches ``param.grad`` so backward writes fresh gradients; see
        Note [First fold overwrites] for why the buffers need no zeroing here."""
        for group in self.groups:
            for bucket in group.buckets:
                bucket.fresh = True
            for p in group.params:
                p.grad = None

    def backward(self, loss: torch.Tensor, weight: float) -> None:
        """Runs ``loss.backward()`` and adds ``weight`` x its gradients to the buffers."""
        self._weight = weight
        self._capturing = True
        try:
            loss.backward()
            for bucket in self._buckets():
                self._flush(bucket)
        finally:
            self._capturing = False
            for bucket in self._buckets():
                self._drop_pending(bucket)

    def finish(self, factor: float, check_nonfinite: bool) -> torch.Tensor | None:
        """Scales every buffer by ``factor`` in one pass each.

        With ``check_nonfinite`` returns a 0-dim float32 flag per device, set to 1 if any
        scaled gradient is inf/NaN (reading it is the caller's only synchronisation).
        """
        for bucket in self._buckets():
            if bucket.fresh:  # no gradient reached it in any VN: all zero
                bucket.group.buffer.zero_slots_(bucket.slots[0], bucket.slots[-1])
                bucket.fresh = False
        if not check_nonfinite:
            for group in self.groups:
                group.buffer.scale_(factor)
            return None
        flags: dict[torch.device, torch.Tensor] = {}
        for group in self.groups:
            device = group.buffer.data.device
            if device not in flags:
                flags[device] = torch.zeros((), dtype=torch.float32, device=device)
            group.buffer.scale_check_(factor, flags[device])
        found = [flag.to("cpu", non_blocking=False) for flag in flags.values()]
        return torch.stack(found).amax()

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
        """After a failed or skipped step: no gradient is exposed."""
        for group in self.groups:
            for p in group.params:
                p.grad = None

    def close(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
