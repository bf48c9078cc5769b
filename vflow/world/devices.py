"""Which GPU a worker uses (Note [A worker's GPU]).

Note [A worker's GPU]
NCCL binds a rank to the current CUDA device when its first communicator is made, and
refuses two ranks of a group on one GPU, so each worker must set its device before any
group exists. Who says which GPU is the launcher:
* torchrun: every process of a node sees all of the node's GPUs and gets ``LOCAL_RANK``
  (0 .. processes per node - 1): it uses GPU ``LOCAL_RANK``;
* Slurm: a task gets ``SLURM_LOCALID``, its index on the node, and
  ``CUDA_VISIBLE_DEVICES`` for its GRES. Tasks that share the node's GPUs (``srun
  --ntasks-per-node=4 --gres=gpu:4``) see them all: it uses GPU ``SLURM_LOCALID``. A
  task bound GPUs of its own (``sbatch --gres=gpu:1``, one job per worker, as
  ``vflow.cluster``'s slurm launcher asks; ``--gpus-per-task``) sees only those: when
  its index is past them, it uses the first;
* neither: the first visible GPU (one worker per machine, or ``CUDA_VISIBLE_DEVICES``
  set by hand).
``LOCAL_RANK`` wins over ``SLURM_LOCALID`` (torchrun started by srun: one task per node,
its processes told apart by torchrun). An index with no GPU of its own is an error, not
a wrap-around: two workers on one GPU would fail later, in NCCL, with less to say.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch

__all__ = ["LOCAL_INDEX_VARIABLES", "local_gpu"]

LOCAL_INDEX_VARIABLES = ("LOCAL_RANK", "SLURM_LOCALID")


def local_gpu(environ: Mapping[str, str] | None = None, visible: int | None = None) -> int:
    """Note [A worker's GPU]: the index, among the GPUs this process sees, of the one
    this worker uses. ``environ`` defaults to ``os.environ``, ``visible`` to
    ``torch.cuda.device_count()``. Raises RuntimeError when no GPU is visible and
    ValueError when the launcher's index names no GPU of this worker's own."""
    env = os.environ if environ is None else environ
    count = torch.cuda.device_count() if visible is None else visible
    narrowed = env.get("CUDA_VISIBLE_DEVICES")
    seen = f"CUDA_VISIBLE_DEVICES={narrowed!r}" if narrowed is not None else "all of them"
    if count < 1:
        raise RuntimeError(f"no GPU is visible to this process ({seen})")
    for name in LOCAL_INDEX_VARIABLES:
        value = env.get(name, "")
        if value == "":
            continue
        try:
            index = int(value)
        except ValueError:
            raise ValueError(f"{name} must be an int >= 0, got {value!r}") from None
        if index < 0:
            raise ValueError(f"{name} must be an int >= 0, got {value!r}")
        if index < count:
            return index
        if name == "SLURM_LOCALID" and narrowed is not None:
            return 0  # Slurm bound this task its own GPUs: the first of them
        raise ValueError(
            f"{name}={index} names no GPU of this worker's own: {count} visible ({seen}); "
            "start at most one worker per GPU on each machine, or give each its GPU with "
            "CUDA_VISIBLE_DEVICES"
        )
    return 0
