"""Emulated slower devices, for heterogeneous runs on identical hardware.

``SlowDown(loss_fn, factor)`` makes the worker that uses it ``factor`` times slower in
compute: after each VN's forward it waits ``factor - 1`` times what the forward took,
and each VN's backward waits ``factor - 1`` times what the backward takes. So the
emulated device is slower in proportion to the real work, whatever the VN size, as a
slower GPU would be.

Note [Waiting before the gradients]
A slower device has its gradients later, and so starts reducing them later. The
backward's wait is therefore paid at its start, before any gradient exists (a hook on
the loss runs first in the backward): ``factor - 1`` times the previous VN's backward
time, the best estimate there is; when the backward ends (a callback queued on the
autograd engine) the difference to ``factor - 1`` times its actual time is settled. So
the hooks that launch the reduction of a VN's buckets run after the emulated delay, as
on a slow device, and the last VN's reduction is exposed on the emulated worker too.
(With the wait at the end of the backward instead, the reduction of the last VN ran
during the wait, which made the slow worker's step look shorter than a slow device's.)

A sleep lasts longer than asked (the timer's slack and the wake-up, ~0.1 ms here), which
on VNs of a millisecond would make the device markedly slower than ``factor``; the
surplus is measured and taken off the next wait, so the waits add up to what was asked.

What it does not show: a slower device's communication itself, memory limits, or
contention between the real and the emulated work. Every table that uses it says
"emulated".
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

LossFn = Callable[[torch.nn.Module, Any], Any]


class SlowDown:
    """``loss_fn`` on a device ``factor`` times slower (``factor`` >= 1); see the
    module docstring. ``factor`` may be changed between steps (a straggler)."""

    def __init__(
        self,
        loss_fn: LossFn,
        factor: float,
        *,
        clock: Callable[[], float] = time.perf_counter,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
        self.loss_fn = loss_fn
        self.factor = factor
        self._clock = clock
        self._sleep = sleep
        # Seconds waited beyond what was asked so far (> 0: the next waits are shorter).
        self._surplus = 0.0
        # The last backward's own time: what the next backward waits for at its start.
        self._last_backward_s = 0.0

    @property
    def factor(self) -> float:
        return self._factor

    @factor.setter
    def factor(self, value: float) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 1:
            raise ValueError(f"factor must be a number >= 1, got {value!r}")
        self._factor = float(value)

    def __call__(self, model: torch.nn.Module, batch: Any) -> Any:
        start = self._clock()
        out = self.loss_fn(model, batch)
        self._pay((self._factor - 1) * (self._clock() - start))
        loss = out[0] if isinstance(out, tuple) else out
        if isinstance(loss, torch.Tensor) and loss.requires_grad:
            loss.register_hook(self._on_backward_start)
        return out

    def _on_backward_start(self, grad: torch.Tensor) -> torch.Tensor:
        # Note [Waiting before the gradients]: paid before any gradient hook runs.
        ahead = (self._factor - 1) * self._last_backward_s
        self._pay(ahead)
        start = self._clock()
        torch.autograd.Variable._execution_engine.queue_callback(
            lambda: self._settle_backward(self._clock() - start, ahead)
        )
        return grad

    def _settle_backward(self, seconds: float, paid: float) -> None:
        self._last_backward_s = seconds
        self._pay((self._factor - 1) * seconds - paid)

    def _pay(self, seconds: float) -> None:
        """Waits ``seconds`` less the surplus of earlier waits; a negative amount (paid
        ahead too much) adds to the surplus."""
        if self._factor <= 1:
            return
        owed = seconds - self._surplus
        if owed <= 0:
            self._surplus = -owed
            return
        start = self._clock()
        self._sleep(owed)
        self._surplus = max(0.0, self._clock() - start - owed)
