"""Synthetic traces in the shape of VirtualFlow's cluster experiment.

No public trace is reachable from these machines (Philly, Helios and Alibaba's need a
download), so the study draws its jobs the way VirtualFlow's workload did (reference:
../shared/reference, part B): Poisson arrivals (12 jobs an hour on 8 devices), a demand
of 1 to 8 devices, a priority of 1, 5 or 10. What VirtualFlow drew from 48 real model
configurations is drawn here from distributions, every parameter in ``Shape`` and
printed beside the results:

* a job's run time alone on its demand is log-uniform in [``run_min_s``, ``run_max_s``]
  (5 to 40 minutes): with these, the priority baseline's median average JCT and makespan
  over 11 seeds (3824 s, 13361 s) come near VirtualFlow's logged priority run (4005 s,
  11929 s);
* its scaling is Amdahl's: ``step_s(w) = t1 x (serial + (1 - serial) / w)``, with the
  serial fraction uniform in [``serial_min``, ``serial_max``] and ``t1`` uniform in
  [``step_min_s``, ``step_max_s``]; ``step_s`` is given at 1, 2, 4, ... up to the slots;
* its V is ``vn_per_slot`` x slots' worth of VNs, at least its demand: its hyperparameters
  were tuned for the whole host, and it may use the whole host when it is free;
* ``time_scale`` divides every duration (arrival gaps, run times) and leaves the step
  counts' shape alone, so that a real run of 20 jobs fits in minutes.
"""

from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass, replace
from typing import Any

from vflow.cluster.trace import JobSpec, Trace

__all__ = ["VIRTUALFLOW", "Shape", "generate"]


@dataclass(frozen=True)
class Shape:
    """The generator's parameters (module docstring)."""

    jobs: int = 20
    slots: int = 8
    arrivals_per_hour: float = 12.0
    demands: tuple[int, ...] = (1, 2, 4, 8)
    priorities: tuple[float, ...] = (1.0, 5.0, 10.0)
    run_min_s: float = 300.0
    run_max_s: float = 2400.0
    serial_min: float = 0.02
    serial_max: float = 0.2
    step_min_s: float = 0.5
    step_max_s: float = 2.0
    vn_per_slot: int = 1
    time_scale: float = 1.0

    def __post_init__(self) -> None:
        whole = {"jobs": self.jobs, "slots": self.slots, "vn_per_slot": self.vn_per_slot}
        for name, value in whole.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a whole number >= 1, got {value!r}")
        positive = {
            "arrivals_per_hour": self.arrivals_per_hour,
            "run_min_s": self.run_min_s,
            "step_min_s": self.step_min_s,
            "time_scale": self.time_scale,
        }
        for name, value in positive.items():
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a number > 0, got {value!r}")
        if not self.run_min_s <= self.run_max_s or not self.step_min_s <= self.step_max_s:
            raise ValueError("run_min_s <= run_max_s and step_min_s <= step_max_s are required")
        if not 0 <= self.serial_min <= self.serial_max < 1:
            raise ValueError("0 <= serial_min <= serial_max < 1 is required")
        if not self.demands or any(not 1 <= d <= self.slots for d in self.demands):
            raise ValueError(f"demands must be in 1..slots ({self.slots}), got {self.demands}")
        if not self.priorities or any(not p > 0 for p in self.priorities):
            raise ValueError(f"priorities must be > 0, got {self.priorities}")

    def scaled(self, **changes: Any) -> Shape:
        return replace(self, **changes)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


VIRTUALFLOW = Shape()


def generate(shape: Shape, seed: int) -> Trace:
    """A trace of ``shape.jobs`` jobs drawn with ``seed`` (module docstring)."""
    rng = random.Random(seed)
    counts = [1 << k for k in range(shape.slots.bit_length()) if 1 << k <= shape.slots]
    if counts[-1] != shape.slots:
        counts.append(shape.slots)
    jobs = []
    arrival = 0.0
    for index in range(shape.jobs):
        if index:
            arrival += rng.expovariate(shape.arrivals_per_hour / 3600.0) / shape.time_scale
        demand = rng.choice(shape.demands)
        priority = rng.choice(shape.priorities)
        serial = rng.uniform(shape.serial_min, shape.serial_max)
        t1 = rng.uniform(shape.step_min_s, shape.step_max_s)
        run_s = math.exp(rng.uniform(math.log(shape.run_min_s), math.log(shape.run_max_s)))
        step_s = {w: t1 * (serial + (1 - serial) / w) for w in counts}
        at_demand = t1 * (serial + (1 - serial) / demand)
        steps = max(1, round(run_s / shape.time_scale / at_demand))
        virtual_nodes = max(demand, shape.vn_per_slot * shape.slots)
        jobs.append(
            JobSpec(
                f"j{index + 1:0{len(str(shape.jobs))}d}",
                round(arrival, 3),
                demand,
                priority,
                virtual_nodes,
                steps,
                step_s,
            )
        )
    return Trace(shape.slots, tuple(jobs))
