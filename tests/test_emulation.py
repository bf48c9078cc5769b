"""vflow.emulation.SlowDown: waits in proportion to the real forward and backward times."""

from __future__ import annotations

import pytest
import torch

from vflow.emulation import SlowDown


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        self.now += 1.0  # every reading is one second after the previous one
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)


def test_waits_factor_minus_one_times_forward_and_backward() -> None:
    clock = FakeClock()
    model = torch.nn.Linear(3, 1)
    slow = SlowDown(lambda m, b: m(b).sum(), 3.0, clock=clock, sleep=clock.sleep)
    loss = slow(model, torch.ones(2, 3))
    assert clock.slept == [2.0]  # forward read as 1 s: waits 2 s
    loss.backward()
    assert clock.slept == [2.0, 2.0]  # backward read as 1 s, waited at its end
    assert model.weight.grad is not None


def test_factor_one_never_waits_and_bad_factors_are_named() -> None:
    clock = FakeClock()
    slow = SlowDown(lambda m, b: (m(b).sum(), 2), 1.0, clock=clock, sleep=clock.sleep)
    loss, items = slow(torch.nn.Linear(3, 1), torch.ones(2, 3))
    loss.backward()
    assert clock.slept == [] and items == 2
    with pytest.raises(ValueError, match="factor must be a number >= 1"):
        slow.factor = 0.5
    with pytest.raises(TypeError, match="loss_fn must be callable"):
        SlowDown(None, 2.0)  # type: ignore[arg-type]
