"""Choosing a plan: what each worker's VNs cost and which mapping is fastest.

``profile`` holds the per-VN timings a step measures (the planner's input); ``planner``
fits a cost per worker and solves for the best counts or sizes plan; ``auto_plan`` is
``Executor(plan="auto")``'s online loop (plan after warm-up, re-plan on drift);
``emulation`` makes a worker slower on purpose, for benchmarks and tests.

May import: vflow.mapping.
"""

from vflow.planning.auto_plan import AutoPlan, PlanChange, PlanDecision
from vflow.planning.emulation import SlowDown
from vflow.planning.planner import Planner, WorkerModel
from vflow.planning.profile import StepProfile, VNProfile, WorkerProfile

__all__ = [
    "AutoPlan",
    "PlanChange",
    "PlanDecision",
    "Planner",
    "SlowDown",
    "StepProfile",
    "VNProfile",
    "WorkerModel",
    "WorkerProfile",
]
