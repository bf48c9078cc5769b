"""vflow.planning.emulation.SlowDown: waits in proportion to the real forward and backward times."""

from __future__ import annotations

import pytest
import torch

from vflow.planning.emulation import SlowDown


class FakeClock:
    """Time moves only when the test or a sleep moves it; each sleep overshoots by
    ``overshoot`` seconds, as a real timer does."""

    def __init__(self, overshoot: float = 0.0) -> None:
        self.now = 0.0
        self.overshoot = overshoot
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds + self.overshoot


def _timed_model(clock: FakeClock, forward_s: float, backward_s: float) -> torch.nn.Module:
    """A Linear layer whose forward and backward move ``clock`` by the given seconds."""
    model = torch.nn.Linear(3, 1)

    def forward_hook(module: torch.nn.Module, args: object, out: torch.Tensor) -> None:
        clock.now += forward_s
        out.register_hook(lambda grad: setattr(clock, "now", clock.now + backward_s))

    model.register_forward_hook(forward_hook)
    return model


def test_waits_factor_minus_one_times_forward_and_backward() -> None:
    clock = FakeClock()
    model = _timed_model(clock, forward_s=1.0, backward_s=0.5)
    slow = SlowDown(lambda m, b: m(b).sum(), 3.0, clock=clock, sleep=clock.sleep)
    loss = slow(model, torch.ones(2, 3))
    assert clock.slept == [2.0]  # forward took 1 s: waits 2 s
    loss.backward()
    # No backward measured yet: nothing waited before it, 2 x 0.5 s after it.
    assert clock.slept == [2.0, 1.0]
    assert model.weight.grad is not None
    slow(model, torch.ones(2, 3)).backward()
    # From the second VN on, the backward's wait comes before it, and it was enough.
    assert clock.slept == [2.0, 1.0, 2.0, 1.0]
    assert clock.now == pytest.approx(2 * 3.0 * (1.0 + 0.5))


def test_the_backward_waits_before_its_gradient_hooks() -> None:
    """Note [The backward's wait comes first]: the hooks that launch a slow device's
    reductions run after its wait, as they would after a slow backward."""
    clock = FakeClock()
    model = _timed_model(clock, forward_s=1.0, backward_s=1.0)
    hook_times: list[float] = []
    model.weight.register_post_accumulate_grad_hook(lambda p: hook_times.append(clock.now))
    slow = SlowDown(lambda m, b: m(b).sum(), 2.0, clock=clock, sleep=clock.sleep)
    for _ in range(2):
        slow(model, torch.ones(2, 3)).backward()
    # VN 1 (no backward measured yet): forward 1 s, wait 1 s, backward 1 s (hooks at
    # 3 s), wait 1 s. VN 2: forward, wait, 1 s before the backward, hooks at 8 s: the
    # end of a 2 s backward, as on a device 2x slower.
    assert clock.slept == [1.0, 1.0, 1.0, 1.0]
    assert hook_times == [3.0, 8.0]
    assert clock.now == 8.0  # 2 VNs of 2 s at factor 2


def test_a_backward_the_system_slowed_does_not_speed_up_the_next_vns() -> None:
    """The wait before a backward is for the shortest of the last ones: one long
    backward (a preempted process) is paid after it, not taken as the next estimate,
    so no later VN skips its wait and looks as fast as an unslowed worker's."""
    clock = FakeClock()
    model = torch.nn.Linear(3, 1)
    backward_s = iter([1.0, 1.0, 5.0, 1.0, 1.0])

    def forward_hook(module: torch.nn.Module, args: object, out: torch.Tensor) -> None:
        clock.now += 1.0
        seconds = next(backward_s)
        out.register_hook(lambda grad: setattr(clock, "now", clock.now + seconds))

    model.register_forward_hook(forward_hook)
    slow = SlowDown(lambda m, b: m(b).sum(), 2.0, clock=clock, sleep=clock.sleep)
    vn_s = []
    for _ in range(5):
        start = clock.now
        slow(model, torch.ones(2, 3)).backward()
        vn_s.append(clock.now - start)
    assert vn_s == [4.0, 4.0, 12.0, 4.0, 4.0]  # each VN twice its work


def test_oversleeping_is_taken_off_the_next_waits() -> None:
    clock = FakeClock(overshoot=0.25)
    model = _timed_model(clock, forward_s=1.0, backward_s=2.0)
    slow = SlowDown(lambda m, b: m(b).sum(), 2.0, clock=clock, sleep=clock.sleep)
    for _ in range(3):
        slow(model, torch.ones(2, 3)).backward()
    # Each wait is owed 1 s (forward) or 2 s (backward: after it on the first VN, before
    # it on the others); the 0.25 s slept beyond it is owed less the next time.
    assert clock.slept == [1.0, 1.75, 0.75, 1.75, 0.75, 1.75]
    # Three VNs of 3 s at factor 2 take 18 s, plus only the last wait's surplus.
    assert clock.now == pytest.approx(18.0 + 0.25)


def test_a_surplus_larger_than_a_wait_skips_it() -> None:
    clock = FakeClock(overshoot=3.0)
    model = _timed_model(clock, forward_s=1.0, backward_s=2.0)
    slow = SlowDown(lambda m, b: m(b).sum(), 2.0, clock=clock, sleep=clock.sleep)
    slow(model, torch.ones(2, 3))  # 1 s asked, 4 s slept: 3 s ahead
    assert clock.slept == [1.0]
    slow(model, torch.ones(2, 3)).backward()  # 1 s owed, then 2 s: both skipped
    assert clock.slept == [1.0]
    slow(model, torch.ones(2, 3))
    assert clock.slept == [1.0, 1.0]  # the surplus is used up: waits again


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
