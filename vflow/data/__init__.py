"""Feeding VNs their samples: each worker loads only its VNs' samples
(``VNBatchSampler``), and the next VN's batch is sliced, transformed and copied to the
device while the current VN computes (``vn_batches`` driven by ``prefetch``); a
DataLoader's worker processes load ahead for a job whose workers change
(``StepLoader``).

May import: vflow.mapping.
"""

from vflow.data.prefetch import VNTransform
from vflow.data.sampler import PlanFollower, VNBatchSampler
from vflow.data.step_loader import StepLoader

__all__ = ["PlanFollower", "StepLoader", "VNBatchSampler", "VNTransform"]
