"""Global batches and their split into virtual nodes.

A batch is a tensor or a (nested) tuple, list or dict of tensors that share dim 0,
the sample dimension. Virtual node (VN) i always receives the i-th contiguous slice
of the global batch in batch order; see docs/design.md, "Splitting the batch".
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

Batch = Any  # torch.Tensor | Sequence[Batch] | Mapping[str, Batch]


def split_sizes(batch_size: int, virtual_nodes: int) -> list[int]:
    """Sizes of the V contiguous VN slices of a batch of ``batch_size`` samples.

    Sizes differ by at most one; the first ``batch_size % virtual_nodes`` VNs get the
    extra sample, so the split is a function of (B, V) alone.
    """
    if batch_size < virtual_nodes:
        raise ValueError(
            f"batch has {batch_size} samples but virtual_nodes={virtual_nodes}: every virtual "
            "node needs at least one sample (B >= V)"
        )
    base, extra = divmod(batch_size, virtual_nodes)
    return [base + 1 if i < extra else base for i in range(virtual_nodes)]


def _leaves(batch: Batch, path: str) -> list[tuple[str, torch.Tensor]]:
    if isinstance(batch, torch.Tensor):
        return [(path, batch)]
    if isinstance(batch, Mapping):
        out = []
        for key, value in batch.items():
            out += _leaves(value, f"{path}[{key!r}]")
        return out
    if isinstance(batch, (tuple, list)):
        out = []
        for index, value in enumerate(batch):
            out += _leaves(value, f"{path}[{index}]")
        return out
    raise TypeError(
        f"{path} is a {type(batch).__name__}; a batch must be a Tensor or a tuple/list/dict "
        "of Tensors sharing dim 0"
    )


def tensor_bytes(batch: Batch) -> int:
    """The bytes of every tensor in ``batch``."""
    return sum(t.numel() * t.element_size() for _, t in _leaves(batch, "batch"))


def _common_size(batch: Batch) -> int | None:
    """The dim-0 size every leaf of ``batch`` shares, or None when the batch is not a
    valid one (then ``batch_size`` walks it again to say why). Checked once per step:
    no leaf paths are built on this path."""
    if type(batch) is torch.Tensor:
        return int(batch.shape[0]) if batch.dim() > 0 else None
    if not isinstance(batch, (tuple, list, Mapping)):
        return None
    children = batch.values() if isinstance(batch, Mapping) else batch
    size = None
    for child in children:
        child_size = _common_size(child)
        if child_size is None or (size is not None and child_size != size):
            return None
        size = child_size
    return size


def batch_size(batch: Batch, name: str = "batch") -> int:
    """Number of samples in ``batch``; validates its structure.

    Raises TypeError for non-tensor leaves and ValueError for an empty structure, a
    0-dim leaf, or leaves whose dim-0 sizes differ.
    """
    size = _common_size(batch)
    if size is not None:
        return size
    leaves = _leaves(batch, name)
    if not leaves:
        raise ValueError(f"{name} holds no tensors")
    first_path, first = leaves[0]
    for path, tensor in leaves:
        if tensor.dim() == 0:
            raise ValueError(f"{path} is a 0-dim tensor; batch members need a sample dim 0")
        if tensor.shape[0] != first.shape[0]:
            raise ValueError(
                f"{path} has {tensor.shape[0]} samples in dim 0 but {first_path} has "
                f"{first.shape[0]}; all batch members must share dim 0"
            )
    return int(first.shape[0])


def map_batch(batch: Batch, fn: Callable[[torch.Tensor], torch.Tensor]) -> Batch:
    """Applies ``fn`` to every tensor leaf, keeping the structure (and its types)."""
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    # Plain tuples and lists first, by exact type: this runs for every VN of every step,
    # and the Mapping check below is an ABC lookup.
    kind = type(batch)
    if kind is tuple or kind is list:
        return kind([fn(v) if isinstance(v, torch.Tensor) else map_batch(v, fn) for v in batch])
    if isinstance(batch, Mapping):
        return type(batch)((k, map_batch(v, fn)) for k, v in batch.items())
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
        return type(batch)(*(map_batch(v, fn) for v in batch))
    return type(batch)(map_batch(v, fn) for v in batch)


def slice_batch(batch: Batch, start: int, stop: int) -> Batch:
    """Samples [start, stop) of every leaf; views, no copies."""
    return map_batch(batch, operator.itemgetter(slice(start, stop)))


def concat_outputs(outputs: Sequence[Batch], name: str = "output") -> Batch:
    """Concatenates per-VN outputs along dim 0, leaf by leaf, in VN order."""
    first = outputs[0]
    if isinstance(first, torch.Tensor):
        if first.dim() == 0:
            raise ValueError(
                f"{name} is a 0-dim tensor; infer concatenates outputs along the sample dim 0"
            )
        return torch.cat(list(outputs), dim=0)
    if isinstance(first, Mapping):
        return type(first)(
            (k, concat_outputs([o[k] for o in outputs], f"{name}[{k!r}]")) for k in first
        )
    if isinstance(first, (tuple, list)):
        parts = [concat_outputs([o[i] for o in outputs], f"{name}[{i}]") for i in range(len(first))]
        if isinstance(first, tuple) and hasattr(first, "_fields"):
            return type(first)(*parts)
        return type(first)(parts)
    raise TypeError(f"{name} is a {type(first).__name__}; infer can only concatenate tensors")
