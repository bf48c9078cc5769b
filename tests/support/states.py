"""Comparing training states (dicts of tensors, lists and plain values) exactly."""

from __future__ import annotations

from typing import Any

import torch


def assert_same(got: Any, want: Any, at: str = "state") -> None:
    """Exact equality, tensors bit for bit (dtype and shape too); ``at`` names where a
    difference is."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), at
        assert got.dtype == want.dtype and got.shape == want.shape, at
        assert torch.equal(got, want), f"{at} differs"
    elif isinstance(want, dict):
        assert isinstance(got, dict) and set(got) == set(want), f"{at}: keys differ"
        for k in want:
            assert_same(got[k], want[k], f"{at}[{k!r}]")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), at
        for k, (g, w) in enumerate(zip(got, want)):
            assert_same(g, w, f"{at}[{k}]")
    else:
        assert got == want, f"{at}: {got!r} != {want!r}"
