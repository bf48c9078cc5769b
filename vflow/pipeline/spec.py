"""``vflow.Pipeline``: how a model is cut into stages and which schedule runs them.

Note [Segments and stages]
A pipelined model is a ``torch.nn.Sequential`` whose children are its *segments*: the
finest cut there is, each taking the previous one's output. A segment may take and
return several tensors (hidden states and an attention mask): a segment that returns a
tuple passes its elements as the next segment's positional arguments, and the first
segment takes the step's inputs (a tensor, or a tuple of them) the same way
(``Segments``, the chain every stage runs, in one process as across processes). A
stage is a run of consecutive segments; ``split`` names the children where
stages 1, 2, ... begin (``SplitPoint.BEGINNING`` in torch.distributed.pipelining's
terms), or, when None, the segments are dealt out as evenly as their count allows. A
segment is also the unit of randomness (Note [Segment streams]): cutting the model
elsewhere moves segments between processes but never changes what they draw.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

SCHEDULES = {"GPipe": ScheduleGPipe, "1F1B": Schedule1F1B}


@dataclass(frozen=True)
class Pipeline:
    """A pipeline of ``stages`` stages run by ``schedule`` ("1F1B" or "GPipe", on
    torch.distributed.pipelining's schedules), cut before the children named in
    ``split`` (``stages - 1`` names, in model order; None: an even cut)."""

    stages: int
    schedule: str = "1F1B"
    split: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stages, bool) or not isinstance(self.stages, int) or self.stages < 1:
            raise ValueError(f"stages must be an int >= 1, got {self.stages!r}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {sorted(SCHEDULES)}, got {self.schedule!r}")
        if self.split is not None:
            split = self.split
            if isinstance(split, str) or not isinstance(split, Sequence):
                raise TypeError(
                    f"split must be a sequence of child names or None, got {type(split).__name__}"
                )
            if not all(isinstance(name, str) for name in split):
                raise TypeError(f"split must hold child names (str), got {list(split)!r}")
            if len(split) != self.stages - 1:
                raise ValueError(
                    f"split must name stages - 1 = {self.stages - 1} children (where stages "
                    f"1..{self.stages - 1} begin), got {len(split)}: {list(split)!r}"
                )
            object.__setattr__(self, "split", tuple(split))

    def cut(self, names: Sequence[str]) -> list[list[str]]:
        """The names of each stage's segments, for a model whose children are
        ``names``: a process that builds only its own segments (the others on the meta
        device, so that the whole model never exists in one process) reads its own here."""
        return [list(names[first:stop]) for first, stop in stage_bounds(names, self)]

    @property
    def min_microbatches(self) -> int:
        """The fewest microbatches (VNs) a replica may run: 1F1B needs one per stage."""
        return self.stages if self.schedule == "1F1B" else 1

    def check_microbatches(self, counts: Sequence[int]) -> None:
        if min(counts) < self.min_microbatches:
            raise ValueError(
                f'schedule="1F1B" needs at least stages={self.stages} VNs (microbatches) per '
                f"replica; the plan gives {list(counts)}. Give each replica more VNs, or use "
                'schedule="GPipe"'
            )


class Segments(torch.nn.Sequential):
    """Consecutive segments run as one chain (Note [Segments and stages]): a tuple
    between two segments is the next one's positional arguments. With one tensor
    between every two, exactly ``torch.nn.Sequential``."""

    def forward(self, *args: Any) -> Any:
        out: Any = args
        for module in self:
            out = module(*out) if isinstance(out, tuple) else module(out)
        return out


def segments(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The model's segments (Note [Segments and stages])."""
    if not isinstance(model, torch.nn.Sequential):
        raise TypeError(
            f"model must be a torch.nn.Sequential whose children are the segments a "
            f"pipeline may be cut between, got {type(model).__name__}"
        )
    children = list(model.named_children())
    if not children:
        raise ValueError("model is an empty torch.nn.Sequential: there is nothing to cut")
    return children


def stage_bounds(names: Sequence[str], pipeline: Pipeline) -> list[tuple[int, int]]:
    """[first, stop) segment indices of every stage."""
    count, stages = len(names), pipeline.stages
    if stages > count:
        raise ValueError(
            f"stages={stages} exceeds the model's {count} segments (children of the "
            "Sequential): every stage needs at least one"
        )
    if pipeline.split is None:
        base, extra = divmod(count, stages)
        sizes = [base + 1 if s < extra else base for s in range(stages)]
        starts = [sum(sizes[:s]) for s in range(stages)]
    else:
        position = {name: i for i, name in enumerate(names)}
        starts = [0]
        for k, name in enumerate(pipeline.split):
            if name not in position:
                raise ValueError(
                    f"split[{k}]={name!r} is not a child of model; its children are {list(names)}"
                )
            if position[name] <= starts[-1]:
                after = "the first child" if k == 0 else f"split[{k - 1}]={pipeline.split[k - 1]!r}"
                raise ValueError(
                    f"split[{k}]={name!r} does not come after {after}: the cuts must be in "
                    "model order and leave every stage at least one segment"
                )
            starts.append(position[name])
    return [(start, stop) for start, stop in zip(starts, [*starts[1:], count], strict=True)]
