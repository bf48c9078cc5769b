"""vflow: virtual node processing for PyTorch.

A global batch of B samples is split into V virtual nodes (VNs); B and V are chosen
by the user and do not depend on the hardware. Each worker runs its VNs one after
another, accumulating gradients in fused flat buffers, then steps once.
"""

from vflow._extension import _C
from vflow.amp import LossScaler
from vflow.batching import split_sizes
from vflow.executor import Executor, PhaseTimings, StepResult

__all__ = ["_C", "Executor", "LossScaler", "PhaseTimings", "StepResult", "split_sizes"]
__version__ = "0.1.0"
