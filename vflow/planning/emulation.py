"""Emulated slower devices, for heterogeneous runs on identical hardware.

``SlowDown(loss_fn, factor)`` makes the worker that uses it ``factor`` times slower in
compute: after each VN's forward it waits ``factor - 1`` times what the forward took,
and before its backward ``factor - 1`` times what the backward will take. So the
emulated device is slower in proportion to the real work, whatever the VN size, as a
slower GPU would be.

Note [The backward's wait comes first]
A slower device's backward ends late, and with it the gradient hooks that launch the
last VN's reductions: they are exposed after its compute. A wait after the backward
would let those reductions run during it, so a worker emulated slow would hide a
reduction that a slow device exposes, and the even plan (where that worker finishes
last) would look cheaper than it is. So most of the backward's wait is paid when the
backward starts (a hook on the loss), before any gradient hook runs. Its length is not
known yet: the wait before it is for the shortest of the last BACKWARD_WINDOW backwards,
and the rest, measured by a callback queued on the autograd engine when the backward
ends, is waited then. A lower estimate rather than the last backward's time: a backward
slowed by the operating system would make the next estimate too long, and the time
waited too many would be taken off the next VNs' waits, which then look as fast as an
unslowed worker's; the planner, which reads VN times, would see the speeds wrong.

A sleep also lasts longer than asked (the timer's slack and the wake-up, ~0.1 ms here),
which on VNs of a millisecond would make the device markedly slower than ``factor``: the
time slept beyond what was owed is taken off the next waits as well. Over a run the
waits add up to what was asked.

What it does not show: memory limits, the contention of the real and the emulated work
(on shared cores a sleeping worker leaves its core to the others), and the spread of a
slower backward's bucket launches (they all come after the wait, the last one about when a
slower device's would). Every table that uses it says "emulated".
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

LossFn = Callable[[torch.nn.Module, Any], Any]

# Note [The backward's wait comes first]: the backwards whose shortest sets the next
# backward's wait before it.
BACKWARD_WINDOW = 5


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
        # Seconds still to wait; negative when ahead (slept too long).
        self._owed = 0.0
        # The last backwards' seconds: the next backward's wait before it is for the
        # shortest (Note [The backward's wait comes first]).
        self._backward_s: deque[float] = deque(maxlen=BACKWARD_WINDOW)

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
        forward_s = self._clock() - start
        self._wait((self._factor - 1) * forward_s)
        loss = out[0] if isinstance(out, tuple) else out
        if isinstance(loss, torch.Tensor) and loss.requires_grad:
            loss.register_hook(self._on_backward_start)
        return out

    def _on_backward_start(self, grad: torch.Tensor) -> torch.Tensor:
        # Note [The backward's wait comes first]
        ahead = (self._factor - 1) * min(self._backward_s, default=0.0)
        self._wait(ahead)
        start = self._clock()
        torch.autograd.Variable._execution_engine.queue_callback(
            lambda: self._on_backward_end(self._clock() - start, ahead)
        )
        return grad

    def _on_backward_end(self, backward_s: float, waited_ahead: float) -> None:
        self._backward_s.append(backward_s)
        self._wait((self._factor - 1) * backward_s - waited_ahead)

    def _wait(self, seconds: float) -> None:
        """Owes ``seconds`` more (less, if negative) and sleeps off what is owed, if
        anything."""
        if self._factor <= 1:
            return
        self._owed += seconds
        if self._owed <= 0:
            return
        start = self._clock()
        self._sleep(self._owed)
        self._owed -= self._clock() - start
