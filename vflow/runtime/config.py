"""``ExecutorConfig``: every setting of an Executor, validated once, frozen.

Note [Agreement]
Workers that differ in a setting that changes the gradient or the collectives they
issue would silently diverge or hang, so every member of a worker set checks that the
others hold the same values (vflow.world.membership). What is checked is derived from the
fields themselves: each field marked ``agreed`` is one column of the check, shown by
its own name when ranks differ. A new field is therefore checked as soon as it is
declared; nothing keeps a second list of settings in sync by hand.
"""

from __future__ import annotations

import dataclasses
import datetime
from dataclasses import dataclass, field
from typing import Literal

import torch

from vflow.mapping._checks import require_int
from vflow.runtime.amp import LossScaler, ScalerSettings
from vflow.runtime.module_buffers import BUFFER_RULES
from vflow.world.group import to_timedelta

AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
Deterministic = Literal[False, "ordered", "exact"]


# Field metadata: whether all workers of a worker set must hold the same value.
_AGREED = {"agreed": True}
_LOCAL = {"agreed": False}


@dataclass(frozen=True)
class ExecutorConfig:
    """The settings of an Executor (see its docstring for their meaning), with the
    defaults resolved: ``loss_scaling`` is the scaler's settings or None,
    ``skip_nonfinite`` a bool, ``deterministic`` False, "ordered" or "exact"."""

    virtual_nodes: int = field(metadata=_AGREED)
    seed: int = field(metadata=_AGREED)
    amp: str | None = field(metadata=_AGREED)
    accumulate_dtype: torch.dtype = field(metadata=_AGREED)
    loss_scaling: ScalerSettings | None = field(metadata=_AGREED)
    skip_nonfinite: bool = field(metadata=_AGREED)
    buffer_rule: str = field(metadata=_AGREED)
    max_grad_norm: float | None = field(metadata=_AGREED)
    bucket_cap_bytes: int = field(metadata=_AGREED)
    first_bucket_bytes: int = field(metadata=_AGREED)
    deterministic: Deterministic = field(metadata=_AGREED)
    broadcast_parameters: bool = field(metadata=_AGREED)
    timeout: datetime.timedelta = field(metadata=_LOCAL)
    prefetch: bool = field(metadata=_LOCAL)

    @property
    def amp_dtype(self) -> torch.dtype | None:
        return None if self.amp is None else AMP_DTYPES[self.amp]

    def agreed_fields(self) -> list[tuple[str, str]]:
        """(name, value as text) of every setting all workers must share."""
        return [
            (f.name, repr(getattr(self, f.name)))
            for f in dataclasses.fields(self)
            if f.metadata.get("agreed")
        ]

    def with_seed(self, seed: int) -> ExecutorConfig:
        return dataclasses.replace(self, seed=require_int("seed", seed, 0))

    @classmethod
    def from_arguments(
        cls,
        *,
        virtual_nodes: object,
        seed: object,
        amp: object,
        accumulate_dtype: object,
        loss_scale: object,
        skip_nonfinite: object,
        buffer_rule: object,
        max_grad_norm: object,
        bucket_cap_mb: object,
        first_bucket_mb: object,
        broadcast_parameters: object,
        deterministic: object,
        prefetch: object,
        timeout: object,
        has_fp16_params: bool,
    ) -> ExecutorConfig:
        """Validates the Executor's arguments (TypeError/ValueError naming the
        argument) and resolves their defaults."""
        v = require_int("virtual_nodes", virtual_nodes, 1)
        seed = require_int("seed", seed, 0)
        if not isinstance(prefetch, bool):
            raise TypeError(f"prefetch must be a bool, got {type(prefetch).__name__}")
        if amp is not None and amp not in AMP_DTYPES:
            raise ValueError(f"amp must be None, 'bf16' or 'fp16', got {amp!r}")
        if accumulate_dtype not in (torch.float32, torch.float64):
            raise ValueError(
                f"accumulate_dtype must be torch.float32 or torch.float64, got {accumulate_dtype}"
            )
        if buffer_rule not in BUFFER_RULES:
            raise ValueError(f"buffer_rule must be one of {BUFFER_RULES}, got {buffer_rule!r}")
        if max_grad_norm is not None and not (
            isinstance(max_grad_norm, (int, float))
            and not isinstance(max_grad_norm, bool)
            and max_grad_norm > 0
        ):
            raise ValueError(
                f"max_grad_norm must be a positive number or None, got {max_grad_norm}"
            )
        for name, value in (("bucket_cap_mb", bucket_cap_mb), ("first_bucket_mb", first_bucket_mb)):
            if isinstance(value, bool) or not (isinstance(value, (int, float)) and value > 0):
                raise ValueError(f"{name} must be a positive number, got {value}")
        if not isinstance(broadcast_parameters, bool):
            raise TypeError(
                f"broadcast_parameters must be a bool, got {type(broadcast_parameters).__name__}"
            )
        if not (loss_scale is None or isinstance(loss_scale, (bool, LossScaler))):
            raise TypeError(
                f"loss_scale must be None, a bool or a vflow.LossScaler, got "
                f"{type(loss_scale).__name__}"
            )
        if skip_nonfinite is not None and not isinstance(skip_nonfinite, bool):
            raise TypeError(
                f"skip_nonfinite must be a bool or None, got {type(skip_nonfinite).__name__}"
            )
        kind = resolve_deterministic(deterministic)
        if isinstance(loss_scale, LossScaler):
            scaling: ScalerSettings | None = loss_scale.settings()
        elif loss_scale or (loss_scale is None and (amp == "fp16" or has_fp16_params)):
            scaling = LossScaler().settings()
        else:
            scaling = None
        return cls(
            virtual_nodes=v,
            seed=seed,
            amp=amp,  # type: ignore[arg-type]
            accumulate_dtype=accumulate_dtype,  # type: ignore[arg-type]
            loss_scaling=scaling,
            skip_nonfinite=scaling is not None if skip_nonfinite is None else skip_nonfinite,
            buffer_rule=buffer_rule,  # type: ignore[arg-type]
            max_grad_norm=None if max_grad_norm is None else float(max_grad_norm),  # type: ignore[arg-type]
            bucket_cap_bytes=max(1, int(bucket_cap_mb * 1024 * 1024)),  # type: ignore[operator]
            first_bucket_bytes=max(1, int(first_bucket_mb * 1024 * 1024)),  # type: ignore[operator]
            deterministic=kind,
            broadcast_parameters=broadcast_parameters,
            timeout=to_timedelta(timeout),
            prefetch=prefetch,
        )


def resolve_deterministic(value: object) -> Deterministic:
    """``deterministic`` as stored: False, "ordered" (what True means) or "exact"."""
    if not isinstance(value, (bool, str)):
        raise TypeError(
            f'deterministic must be a bool, "ordered" or "exact", got {type(value).__name__}'
        )
    if value is True:
        return "ordered"
    if value not in (False, "ordered", "exact"):
        raise ValueError(f'deterministic must be False, True, "ordered" or "exact", got {value!r}')
    return value  # type: ignore[return-value]
