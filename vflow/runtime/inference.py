"""Inference VN by VN: each worker runs the forward of its own VNs under no_grad, and
the outputs of all workers are gathered in batch order (``Executor.infer``)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import Any

import torch

from vflow.mapping import rng
from vflow.mapping.batching import Batch, concat_outputs, map_batch, slice_batch
from vflow.mapping.plan import Plan, VNSlice
from vflow.world.group import World

ForwardFn = Callable[[torch.nn.Module, Batch], Any]

_log = logging.getLogger("vflow")


def default_forward(model: torch.nn.Module, batch: Batch) -> Any:
    if isinstance(batch, torch.Tensor):
        return model(batch)
    if isinstance(batch, dict):
        return model(**batch)
    return model(*batch)


@torch.no_grad()
def run(
    model: torch.nn.Module,
    batch: Batch,
    slices: list[VNSlice],
    forward_fn: ForwardFn | None,
    *,
    seed: int,
    step: int,
    generators: list[torch.Generator],
    autocast: Callable[[], contextlib.AbstractContextManager] | None,
) -> Any:
    """This worker's outputs for its VN ``slices`` of ``batch``, concatenated in VN
    order. VN i draws from the inference stream of (seed, step, i)."""
    forward = default_forward if forward_fn is None else forward_fn
    seeds = rng.vn_seeds(seed, step, [s.vn for s in slices], rng.INFER_STREAM)
    outputs = []
    with rng.preserved_rng(generators):
        for (_, start, size), vn_seed in zip(slices, seeds, strict=True):
            rng.seed_all(vn_seed, generators)
            with contextlib.nullcontext() if autocast is None else autocast():
                outputs.append(forward(model, slice_batch(batch, start, start + size)))
    return concat_outputs(outputs)


def gather(world: World, plan: Plan, local: Any, total: int, step: int) -> Any:
    """Every worker's outputs (``local`` here), in batch order, on every rank."""
    counts = [b - a for a, b in (plan.worker_range(w, total) for w in range(world.size))]
    return map_batch(local, lambda t: world.gather_rows(t, counts, step))


def warn_if_training(model: torch.nn.Module) -> bool:
    """Warns (returns True) when ``model`` is in training mode with BatchNorm layers that
    track running statistics: inference would then update them."""
    if not model.training:
        return False
    stateful = any(
        isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and m.track_running_stats
        for m in model.modules()
    )
    if stateful:
        _log.warning(
            "vflow: infer ran with the model in training mode, so BatchNorm updated its "
            "running statistics; call model.eval() before infer for inference"
        )
    return stateful
