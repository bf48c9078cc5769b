"""The demo's progress bar: steps done over all runs, on a terminal or in a log."""

from __future__ import annotations

import math
import sys
import time
from typing import Any


class ProgressBar:
    """Steps done over all runs.

    On a terminal: one line redrawn in place (at most 10 times a second) with a bar, the
    share and count of steps done, the time so far, an estimate of the time left and
    the current run. Otherwise (a log, a pipe): one line per update, an update being a
    run starting or ending, so that a log shows how far the job got.
    """

    WIDTH = 30

    def __init__(self, total: int, stream: Any = sys.stderr) -> None:
        self.total, self.stream = max(1, total), stream
        self.done = self.run_start_done = 0
        self.label = ""
        self.start = self.run_start = time.perf_counter()
        self.last_draw = -math.inf
        self.interactive = bool(getattr(stream, "isatty", lambda: False)())

    def start_run(self, label: str) -> None:
        self.label = label
        self.run_start, self.run_start_done = time.perf_counter(), self.done
        if self.interactive:
            self._draw(force=True)
        else:
            self._line(f"{label} ...")

    def update(self, run_steps: int) -> None:
        """The current run has done ``run_steps`` steps."""
        self.done = self.run_start_done + run_steps
        if self.interactive:
            self._draw(force=False)

    def end_run(self) -> None:
        seconds = time.perf_counter() - self.run_start
        if self.interactive:
            self._draw(force=True)
        else:
            self._line(f"{self.label}: {self.done - self.run_start_done} steps in {seconds:.1f} s")

    def finish(self) -> None:
        if self.interactive:
            self.stream.write("\n")
            self.stream.flush()

    def _line(self, text: str) -> None:
        elapsed = time.perf_counter() - self.start
        self.stream.write(f"[{self.done}/{self.total} steps, {elapsed:.1f} s] {text}\n")
        self.stream.flush()

    def _draw(self, *, force: bool) -> None:
        now = time.perf_counter()
        if not force and now - self.last_draw < 0.1:
            return
        self.last_draw = now
        fraction = min(1.0, self.done / self.total)
        filled = round(self.WIDTH * fraction)
        elapsed = now - self.start
        # Steps of the later runs take about as long as those so far: a rough estimate,
        # shown once there is something to go on.
        left = f"~{elapsed * (1 - fraction) / fraction:.0f} s left" if self.done else ""
        self.stream.write(
            f"\r[{'#' * filled}{'.' * (self.WIDTH - filled)}] {100 * fraction:3.0f}% "
            f"{self.done}/{self.total} steps {elapsed:5.1f} s {left:<12} {self.label:<36.36}"
        )
        self.stream.flush()
