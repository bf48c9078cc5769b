"""Emulated slower devices, for heterogeneous runs on identical hardware.

``SlowDown(loss_fn, factor)`` makes the worker that uses it ``factor`` times slower in
compute: after each VN's forward it waits ``factor - 1`` times what the forward took,
and after its backward ``factor - 1`` times what the backward took (a callback queued on
the autograd engine runs when that backward ends). So the emulated device is slower in
proportion to the real work, whatever the VN size, as a slower GPU would be.

A sleep lasts longer than asked (the timer's slack and the wake-up, ~0.1 ms here), which
on VNs of a millisecond would make the device markedly slower than ``factor``; the
surplus is measured and taken off the next wait, so the waits add up to what was asked.

What it does not show: a slower device's communication (the reduction of the last
VN's buckets starts as early as on a fast one, since the hooks that launch it run
before the wait), memory limits, or contention between the real and the emulated
work. Every table that uses it says "emulated".
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
        self._wait(self._clock() - start)
        loss = out[0] if isinstance(out, tuple) else out
        if isinstance(loss, torch.Tensor) and loss.requires_grad:
            loss.register_hook(self._on_backward_start)
        return out

    def _on_backward_start(self, grad: torch.Tensor) -> torch.Tensor:
        start = self._clock()
        torch.autograd.Variable._execution_engine.queue_callback(
            lambda: self._wait(self._clock() - start)
        )
        return grad

    def _wait(self, seconds: float) -> None:
        if self._factor <= 1 or seconds <= 0:
            return
        owed = (self._factor - 1) * seconds - self._surplus
        if owed <= 0:
            self._surplus = -owed
            return
        start = self._clock()
        self._sleep(owed)
        self._surplus = max(0.0, self._clock() - start - owed)
