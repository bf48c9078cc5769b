"""ExecutorConfig: validated once, frozen, and the settings ranks must agree on derived
from its fields (Note [Agreement])."""

from __future__ import annotations

import dataclasses
import datetime

import pytest
import torch

import vflow
from vflow.runtime.config import ExecutorConfig


def _arguments(**overrides: object) -> dict[str, object]:
    args: dict[str, object] = {
        "virtual_nodes": 4,
        "seed": 0,
        "amp": None,
        "accumulate_dtype": torch.float32,
        "loss_scale": None,
        "skip_nonfinite": None,
        "buffer_rule": "vn0",
        "max_grad_norm": None,
        "bucket_cap_mb": 25.0,
        "first_bucket_mb": 1.0,
        "broadcast_parameters": True,
        "deterministic": False,
        "prefetch": True,
        "timeout": 600.0,
        "has_fp16_params": False,
    }
    args.update(overrides)
    return args


def test_every_agreed_field_is_checked_and_local_ones_are_not() -> None:
    config = ExecutorConfig.from_arguments(**_arguments())
    agreed = dict(config.agreed_fields())
    fields = {f.name for f in dataclasses.fields(config)}
    assert set(agreed) == fields - {"timeout", "prefetch"}
    assert agreed["seed"] == "0" and agreed["deterministic"] == "False"


def test_loss_scaler_settings_are_part_of_the_agreement() -> None:
    a = ExecutorConfig.from_arguments(**_arguments(loss_scale=vflow.LossScaler(init_scale=8.0)))
    b = ExecutorConfig.from_arguments(**_arguments(loss_scale=vflow.LossScaler(init_scale=16.0)))
    assert dict(a.agreed_fields())["loss_scaling"] != dict(b.agreed_fields())["loss_scaling"]
    # A scaler's state (its current scale) is training state, not a setting.
    scaler = vflow.LossScaler(init_scale=8.0)
    scaler.update(True)
    c = ExecutorConfig.from_arguments(**_arguments(loss_scale=scaler))
    assert c.agreed_fields() == a.agreed_fields()


def test_defaults_are_resolved() -> None:
    config = ExecutorConfig.from_arguments(**_arguments(amp="fp16", deterministic=True))
    assert config.loss_scaling is not None and config.skip_nonfinite is True
    assert config.deterministic == "ordered" and config.amp_dtype == torch.float16
    assert config.timeout == datetime.timedelta(seconds=600)
    assert config.bucket_cap_bytes == 25 * 1024 * 1024
    fp16_params = ExecutorConfig.from_arguments(**_arguments(has_fp16_params=True))
    assert fp16_params.loss_scaling is not None
    off = ExecutorConfig.from_arguments(**_arguments(amp="fp16", loss_scale=False))
    assert off.loss_scaling is None and off.skip_nonfinite is False


@pytest.mark.parametrize(
    ("overrides", "error", "message"),
    [
        ({"skip_nonfinite": 1}, TypeError, "skip_nonfinite must be a bool or None"),
        ({"prefetch": "yes"}, TypeError, "prefetch must be a bool"),
        ({"deterministic": "bitwise"}, ValueError, "deterministic must be False, True"),
        ({"deterministic": 1.0}, TypeError, "deterministic must be a bool"),
        ({"timeout": 0}, ValueError, "timeout must be > 0"),
        ({"first_bucket_mb": 0}, ValueError, "first_bucket_mb must be a positive number"),
    ],
)
def test_bad_settings_name_the_argument(overrides, error, message) -> None:
    with pytest.raises(error, match=message):
        ExecutorConfig.from_arguments(**_arguments(**overrides))


def test_the_config_is_frozen_and_a_new_seed_makes_a_new_one() -> None:
    config = ExecutorConfig.from_arguments(**_arguments())
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.seed = 3  # type: ignore[misc]
    assert config.with_seed(3).seed == 3 and config.seed == 0
    with pytest.raises(ValueError, match="seed must be >= 0"):
        config.with_seed(-1)
