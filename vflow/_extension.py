"""Loads the compiled extension ``vflow._C`` with an actionable error when it cannot."""

from __future__ import annotations

import importlib
from types import ModuleType

import torch


def _public(version: str) -> str:
    return version.split("+")[0]


def load() -> ModuleType:
    try:
        module = importlib.import_module("vflow._C")
    except ImportError as exc:
        raise ImportError(
            "vflow's compiled extension vflow._C could not be imported "
            f"({exc}). Build it against the installed torch {torch.__version__} with "
            "`pip install --no-build-isolation .` from the vflow source folder."
        ) from exc
    built = module.torch_version
    if _public(built) != _public(torch.__version__):
        raise ImportError(
            f"vflow._C was built against torch {built} but torch {torch.__version__} is "
            "installed; rebuild with `pip install --no-build-isolation .`."
        )
    return module


_C = load()
