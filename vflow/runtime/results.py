"""What ``Executor.step`` returns."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

from vflow.planning.profile import WorkerProfile


@dataclass(frozen=True)
class PhaseTimings:
    """Seconds spent in each phase of one step (wall clock on the host; on CUDA
    measured with events on the current stream)."""

    forward_backward: float
    reduce: float
    optimizer: float
    # Of ``reduce``: host time blocked on gradient reductions that backward did not
    # hide (0 on one worker).
    reduce_wait: float = 0.0

    @property
    def total(self) -> float:
        return self.forward_backward + self.reduce + self.optimizer


@dataclass(frozen=True)
class StepResult:
    """What one global step did.

    loss: the global batch's loss (all workers) — the size-weighted mean of the VN mean
      losses, or sum(loss_sum) / sum(num_items) for ``(loss_sum, num_items)`` losses.
    num_items: for mean losses the samples in the global batch (an int, B); for summed
      losses the total num_items of all workers (a float).
    step: index of this step (0 for the first).
    skipped: True when the optimizer step was skipped because a gradient was inf/NaN.
    loss_scale: the fp16 loss scale used for this step, or None without loss scaling.
    grad_norm: the global gradient 2-norm before clipping, when max_grad_norm is set.
    timings: the step's phases on this worker.
    profile: this worker's per-VN forward and backward times, compute and exposed
      communication (Note [Profiles] in vflow/planning/profile.py); built when first read.
    signals: every worker's signal word for this step (``Executor.signal``), by rank:
      what all workers learn at the same step, without a collective of their own.
    """

    loss: float
    num_items: int | float
    step: int
    skipped: bool
    loss_scale: float | None
    grad_norm: float | None
    timings: PhaseTimings
    make_profile: Callable[[], WorkerProfile] = field(repr=False, compare=False)
    signals: tuple[int, ...] = (0,)

    @functools.cached_property
    def profile(self) -> WorkerProfile:
        return self.make_profile()


class SignalWord:
    """A worker's signal word for its next step (``Executor.signal``,
    ``PipelineExecutor.signal``): an int in [0, 2**31), or a function returning one that
    the step calls when it sends its statistics."""

    def __init__(self) -> None:
        self._word: int | Callable[[], int] = 0

    def set(self, word: int | Callable[[], int]) -> None:
        if not callable(word):
            _check(word, "word")
        self._word = word

    def read(self) -> int:
        if not callable(self._word):
            return self._word
        word = self._word()
        _check(word, "the signal function's result")
        return word

    def reset(self) -> None:
        self._word = 0


def _check(word: object, name: str) -> None:
    if isinstance(word, bool) or not isinstance(word, int) or not 0 <= word < 2**31:
        raise ValueError(f"{name} must be an int in [0, 2**31), got {word!r}")
