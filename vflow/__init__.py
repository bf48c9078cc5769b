"""vflow: virtual node processing for PyTorch.

A global batch of B samples is split into V virtual nodes (VNs); B and V are chosen
by the user and do not depend on the hardware. A plan maps the VNs onto the workers
of a process group; each worker runs its VNs one after another, accumulating
gradients in fused flat buffers, then all workers reduce and step once.
"""

from vflow import elastic, emulation, ops, planner
from vflow._extension import _C
from vflow._version import __version__
from vflow.amp import LossScaler
from vflow.auto_plan import AutoPlan, PlanChange
from vflow.batching import split_sizes
from vflow.checkpoint import load, save
from vflow.data import VNBatchSampler
from vflow.distributed import CollectiveError
from vflow.executor import Executor
from vflow.plan import Plan, VNSlice
from vflow.planner import Planner
from vflow.prefetch import VNTransform
from vflow.profile import StepProfile, VNProfile, WorkerProfile
from vflow.results import PhaseTimings, StepResult

__all__ = [
    "_C",
    "AutoPlan",
    "CollectiveError",
    "Executor",
    "LossScaler",
    "PhaseTimings",
    "Plan",
    "PlanChange",
    "Planner",
    "StepProfile",
    "StepResult",
    "VNBatchSampler",
    "VNProfile",
    "VNSlice",
    "VNTransform",
    "WorkerProfile",
    "__version__",
    "elastic",
    "emulation",
    "load",
    "ops",
    "planner",
    "save",
    "split_sizes",
]
