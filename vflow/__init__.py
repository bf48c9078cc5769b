"""vflow: virtual node processing for PyTorch.

A global batch of B samples is split into V virtual nodes (VNs); B and V are chosen
by the user and do not depend on the hardware. A plan maps the VNs onto the workers
of a process group; each worker runs its VNs one after another, accumulating
gradients in fused flat buffers, then all workers reduce and step once.

The package is a house of rooms by concern (docs/design.md, "Structure: who owns
what"), each importing only the rooms below it:

    mapping   VNs, their split of the batch, Plan, per-VN random streams
    planning  profiles, the planner, plan="auto", emulated slow workers
    data      VNBatchSampler, VN batches and their prefetching
    world     the process group and its collectives, joining a worker set, local ranks
    runtime   Executor: the step, gradient buffers, reduction, checkpoints
    elastic   ElasticJob: workers join, leave and crash while the job runs
    pipeline  PipelineExecutor: VNs as the microbatches of pipeline replicas
    bench     python -m vflow bench, the headline records, tables
    demo      python -m vflow demo: the main job and its scenarios

This module is the package's face: the names users need, from every room.
"""

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings
from types import ModuleType

from vflow import elastic, ops, pipeline
from vflow._extension import _C
from vflow._version import __version__
from vflow.data import VNBatchSampler, VNTransform
from vflow.mapping import Plan, VNSlice, split_sizes
from vflow.pipeline import Pipeline, PipelineExecutor
from vflow.planning import (
    AutoPlan,
    PlanChange,
    PlanDecision,
    Planner,
    StepProfile,
    VNProfile,
    WorkerProfile,
    emulation,
    planner,
)
from vflow.runtime import Executor, LossScaler, PhaseTimings, StepResult, load, save
from vflow.world import CollectiveError, RefusedNewcomers

__all__ = [
    "_C",
    "AutoPlan",
    "CollectiveError",
    "Executor",
    "LossScaler",
    "PhaseTimings",
    "Pipeline",
    "PipelineExecutor",
    "Plan",
    "PlanChange",
    "PlanDecision",
    "Planner",
    "RefusedNewcomers",
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
    "pipeline",
    "planner",
    "save",
    "split_sizes",
]

# Note [Moved modules]
# Before 0.4 every module sat directly in vflow/. Code that imports an old path
# (``from vflow.plan import Plan``, ``import vflow.checkpoint``) keeps working: the
# finder below hands out the module at its new path, under the old name too, with a
# DeprecationWarning that names the new path. It is the same module object, so types,
# pickles and isinstance checks are unaffected. vflow.elastic and vflow.data are rooms
# now and export what their modules did, so they need no alias.
MOVED_MODULES = {
    "vflow._checks": "vflow.mapping._checks",
    "vflow.amp": "vflow.runtime.amp",
    "vflow.auto_plan": "vflow.planning.auto_plan",
    "vflow.batching": "vflow.mapping.batching",
    "vflow.checkpoint": "vflow.runtime.checkpoint",
    "vflow.config": "vflow.runtime.config",
    "vflow.demo_elastic": "vflow.demo.elastic_scenario",
    "vflow.distributed": "vflow.world.group",
    "vflow.emulation": "vflow.planning.emulation",
    "vflow.executor": "vflow.runtime.executor",
    "vflow.grad_store": "vflow.runtime.grad_store",
    "vflow.inference": "vflow.runtime.inference",
    "vflow.launch": "vflow.world.launch",
    "vflow.losses": "vflow.runtime.losses",
    "vflow.membership": "vflow.world.membership",
    "vflow.module_buffers": "vflow.runtime.module_buffers",
    "vflow.plan": "vflow.mapping.plan",
    "vflow.planner": "vflow.planning.planner",
    "vflow.prefetch": "vflow.data.prefetch",
    "vflow.profile": "vflow.planning.profile",
    "vflow.reduction": "vflow.runtime.reduction",
    "vflow.rendezvous": "vflow.elastic.rendezvous",
    "vflow.results": "vflow.runtime.results",
    "vflow.rng": "vflow.mapping.rng",
    "vflow.step_run": "vflow.runtime.step_run",
    "vflow.step_stats": "vflow.runtime.step_stats",
    "vflow.table": "vflow.bench.table",
    "vflow.training_state": "vflow.runtime.training_state",
    "vflow.tree": "vflow.runtime.tree",
    "vflow.vn_batches": "vflow.data.vn_batches",
}


class _MovedModuleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Resolves the old module paths of MOVED_MODULES (Note [Moved modules])."""

    def __init__(self) -> None:
        self._own_specs: dict[str, importlib.machinery.ModuleSpec | None] = {}

    def find_spec(
        self, fullname: str, path: object = None, target: object = None
    ) -> importlib.machinery.ModuleSpec | None:
        new = MOVED_MODULES.get(fullname)
        if new is None:
            return None
        warnings.warn(
            f"{fullname} moved to {new}; import it from there (or the name from vflow)",
            DeprecationWarning,
            stacklevel=2,
        )
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = importlib.import_module(MOVED_MODULES[spec.name])
        self._own_specs[spec.name] = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        # The import system has just set the alias's spec on the module: put its own back.
        assert module.__spec__ is not None
        module.__spec__ = self._own_specs.pop(module.__spec__.name)


if not any(isinstance(finder, _MovedModuleFinder) for finder in sys.meta_path):
    sys.meta_path.append(_MovedModuleFinder())
