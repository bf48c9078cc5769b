"""The loss protocol: what ``loss_fn(model, vn_batch)`` may return and how a step's
loss and gradient are normalised from it (docs/design.md, "Loss normalisation").

A VN's ``loss_fn`` returns its **mean** loss (a scalar tensor), which the step weights
by ``n_i / B``, or ``(loss_sum, num_items)``, which is added as it is and divided by
the global batch's total ``num_items`` once every worker's VNs have run. Every VN of
every worker must return the same kind.
"""

from __future__ import annotations

import math
from typing import Any, Literal, NamedTuple

import torch

LossKind = Literal["mean", "sum"]


class VNLoss(NamedTuple):
    """One VN's parsed ``loss_fn`` result."""

    loss: torch.Tensor  # 0-dim, requires grad
    items: torch.Tensor | float  # num_items for "sum" losses, 0.0 for "mean" ones
    kind: LossKind


def parse(out: Any, vn: int) -> VNLoss:
    """Validates what ``loss_fn`` returned for virtual node ``vn``."""
    if (
        type(out) is torch.Tensor
        and out.dim() == 0
        and out.requires_grad
        and out.is_floating_point()
    ):
        return VNLoss(out, 0.0, "mean")  # the common case, checked in as few steps
    where = f"loss_fn (virtual node {vn})"
    if isinstance(out, torch.Tensor):
        loss, items, kind = out, 0.0, "mean"
    elif isinstance(out, tuple) and len(out) == 2:
        loss, items = out
        kind = "sum"
        if not isinstance(loss, torch.Tensor):
            raise TypeError(
                f"{where} returned (loss_sum, num_items) with loss_sum a "
                f"{type(loss).__name__}; expected a scalar tensor"
            )
        if isinstance(items, bool) or not isinstance(items, (int, float, torch.Tensor)):
            raise TypeError(
                f"{where} returned num_items of type {type(items).__name__}; expected an int, "
                "a float or a scalar tensor"
            )
        if isinstance(items, torch.Tensor):
            if items.numel() != 1 or items.dtype == torch.bool or items.is_complex():
                raise TypeError(
                    f"{where} returned num_items as a tensor of shape {tuple(items.shape)} "
                    f"and dtype {items.dtype}; expected a real scalar"
                )
            items = items.detach().reshape(())
        elif not math.isfinite(items) or items < 0:
            raise ValueError(f"{where} returned num_items={items}; expected a count >= 0")
        else:
            items = float(items)
    else:
        raise TypeError(
            f"{where} returned a {type(out).__name__}; expected a scalar loss tensor (the "
            "mean over the VN's samples) or a tuple (loss_sum, num_items)"
        )
    if loss.numel() != 1:
        raise ValueError(f"{where} returned a loss of shape {tuple(loss.shape)}; expected a scalar")
    if not loss.is_floating_point():
        raise TypeError(f"{where} returned a loss of dtype {loss.dtype}; expected floating point")
    if not loss.requires_grad:
        raise ValueError(
            f"{where} returned a loss that does not require grad; it must be computed from "
            "the model's trainable parameters"
        )
    return VNLoss(loss.reshape(()), items, kind)


def check_same_kind(kind: LossKind, first: LossKind, vn: int, first_vn: int) -> None:
    if kind != first:
        raise TypeError(
            f"loss_fn returned a {kind} loss for virtual node {vn} but a {first} loss for "
            f"virtual node {first_vn}; every VN must return the same kind"
        )


def check_worker_kinds(sum_workers: float, world_size: int) -> None:
    """Every worker's VNs must return the same kind (decided from the reduced stats, so
    every worker raises at the same point)."""
    if sum_workers not in (0, world_size):
        raise TypeError(
            f"loss_fn returned (loss_sum, num_items) losses on {sum_workers:g} of "
            f"{world_size} workers and mean losses on the others; every worker must "
            "return the same kind"
        )


def raise_bad_items(vns: list[int], items: list[torch.Tensor | float], bad_items: float) -> None:
    """Names this worker's first VN with an invalid num_items, else the count of such
    VNs on the other workers (every worker raises at the same point)."""
    for vn, value in zip(vns, items, strict=True):
        number = float(value)
        if not math.isfinite(number) or number < 0:
            raise ValueError(
                f"loss_fn (virtual node {vn}) returned num_items={number}; expected a count >= 0"
            )
    raise ValueError(
        f"loss_fn returned a num_items that is negative or not finite on "
        f"{bad_items:g} virtual node(s) of other workers; expected counts >= 0"
    )


def check_item_total(total: float) -> None:
    if not math.isfinite(total) or total <= 0:
        raise ValueError(
            f"loss_fn returned num_items summing to {total} over the global batch; the "
            "summed loss is divided by this total, so it must be finite and > 0 (and every "
            "VN's num_items a count >= 0)"
        )
