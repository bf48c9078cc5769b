"""Phase timing that never synchronises the device while a step runs."""

from __future__ import annotations

import itertools
import time
from typing import Any

import torch


class PhaseClock:
    """Phase boundaries: host timestamps on CPU, events on the current CUDA stream.

    ``mark()`` records a boundary; ``intervals()`` returns the seconds between
    consecutive marks (on CUDA it waits for the last event, the only sync).
    """

    def __init__(self, device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        self._marks: list[Any] = []

    def mark(self) -> None:
        if self._cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._marks.append(event)
        else:
            self._marks.append(time.perf_counter())

    def intervals(self) -> list[float]:
        if self._cuda:
            self._marks[-1].synchronize()
            return [a.elapsed_time(b) / 1e3 for a, b in itertools.pairwise(self._marks)]
        return [b - a for a, b in itertools.pairwise(self._marks)]
