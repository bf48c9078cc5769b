"""The step: ``Executor`` and the machinery it orchestrates.

One step runs this worker's VNs one after another (``step_run``), folds their gradients
into flat buffers through C++ hooks (``grad_store``), reduces them across workers with a
strategy (``reduction``, ``tree``), exchanges the step's statistics (``step_stats``,
``losses``) and steps the optimizer once. Around it: settings (``config``), BatchNorm
buffers (``module_buffers``), loss scaling (``amp``), inference, results, the training
state and its checkpoints (``training_state``, ``checkpoint``).

May import: vflow.mapping, vflow.planning, vflow.data, vflow.world, the extension and
the ops. Never the elastic room above it: an elastic job drives an executor, not the
reverse.
"""

from vflow.runtime.amp import LossScaler
from vflow.runtime.checkpoint import load, save, save_local
from vflow.runtime.executor import Executor
from vflow.runtime.results import PhaseTimings, StepResult

__all__ = [
    "Executor",
    "LossScaler",
    "PhaseTimings",
    "StepResult",
    "load",
    "save",
    "save_local",
]
