"""Dynamic loss scaling for float16 training, updated once per global step."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ScalerSettings:
    """A LossScaler's policy (not its state): what workers must agree on."""

    init_scale: float
    growth_factor: float
    backoff_factor: float
    growth_interval: int


class LossScaler:
    """Multiplies each VN's loss by ``scale`` so float16 gradients do not underflow.

    After a step whose gradients held inf/NaN the step is skipped and the scale shrinks
    by ``backoff_factor``; after ``growth_interval`` finite steps in a row it grows by
    ``growth_factor``. The policy is GradScaler's, applied to the global step rather
    than to each backward, so the number of VNs never changes the scale's trajectory.
    """

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
    ) -> None:
        if not (math.isfinite(init_scale) and init_scale > 0):
            raise ValueError(f"init_scale must be a finite positive number, got {init_scale}")
        if not growth_factor > 1:
            raise ValueError(f"growth_factor must be > 1, got {growth_factor}")
        if not 0 < backoff_factor < 1:
            raise ValueError(f"backoff_factor must be in (0, 1), got {backoff_factor}")
        if isinstance(growth_interval, bool) or not isinstance(growth_interval, int):
            raise TypeError(f"growth_interval must be an int, got {type(growth_interval).__name__}")
        if growth_interval < 1:
            raise ValueError(f"growth_interval must be >= 1, got {growth_interval}")
        self.init_scale = float(init_scale)
        self.scale = float(init_scale)
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.good_steps = 0

    def settings(self) -> ScalerSettings:
        return ScalerSettings(
            self.init_scale,
            float(self.growth_factor),
            float(self.backoff_factor),
            self.growth_interval,
        )

    def update(self, found_nonfinite: bool) -> None:
        if found_nonfinite:
            self.scale *= self.backoff_factor
            self.good_steps = 0
            return
        self.good_steps += 1
        if self.good_steps == self.growth_interval:
            self.scale *= self.growth_factor
            self.good_steps = 0

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "good_steps": self.good_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = float(state["scale"])
        self.good_steps = int(state["good_steps"])
