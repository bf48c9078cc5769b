"""The step's clock: marks points of a step without synchronising the device.

Timing never synchronises the device during a step: on the CPU the marks are host
timestamps; on CUDA they are events on the current stream, read once the step's last
event has completed (the one wait the step already has at its end). What is measured
becomes the step's profile (Note [Profiles], vflow.planning.profile).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch


class StepClock:
    """Marks points of one step: ``mark()`` returns a point (a host timestamp on the CPU,
    an event recorded on the current stream on CUDA); ``seconds(a, b)`` between two
    points, once ``finish(last)`` has run."""

    def __init__(self, device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        # A builtin on the CPU: marking is on the per-VN path.
        self.mark: Callable[[], Any] = self._record_event if self._cuda else time.perf_counter

    @staticmethod
    def _record_event() -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def finish(self, last: Any) -> None:
        """Makes every point up to ``last`` readable (on CUDA: waits for its event)."""
        if self._cuda:
            last.synchronize()

    def seconds(self, start: Any, stop: Any) -> float:
        if self._cuda:
            return start.elapsed_time(stop) / 1e3
        return stop - start
