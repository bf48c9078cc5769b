"""The process grid of a pipelined job: replicas x stages.

Note [The grid]
Process p of a grid of R replicas and S stages (p in the grid's own rank order) holds
stage ``p % S`` of replica ``p // S``: the S processes of a replica are consecutive, as
in a (replica, stage) DeviceMesh. Each process belongs to two subgroups besides the
grid: its replica's *stage group* (S processes in stage order; the pipeline's sends
and receives) and its stage's *replica group* (R processes in replica order; the
reduction of that stage's gradients, the joining of a newcomer's stage). With S = 1
there is no stage group, with R = 1 no replica group.

torch.distributed.pipelining addresses its peers by their global ranks, so the
subgroups are made with ``new_group`` (vflow.world.group), a collective of the whole default group:
every process of the job builds every grid, including one it is not part of
(``member`` is then False), in the same order. ``ProcessGrid.of`` does that.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch.distributed as dist

from vflow.world.group import new_group


@dataclass(frozen=True)
class ProcessGrid:
    """One grid as this process sees it (Note [The grid])."""

    replicas: int
    stages: int
    member: bool
    replica: int  # -1 when not a member
    stage: int  # -1 when not a member
    group: dist.ProcessGroup | None  # the whole grid; None: this process alone
    stage_group: dist.ProcessGroup | None  # this replica's stages (None when S = 1)
    replica_group: dist.ProcessGroup | None  # this stage's replicas (None when R = 1)

    @property
    def rank(self) -> int:
        return self.replica * self.stages + self.stage

    @property
    def size(self) -> int:
        return self.replicas * self.stages

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.stages - 1

    @property
    def is_detached(self) -> bool:
        """Whether this process holds a stage of a pipeline but has no grid to run it on
        (``ProcessGrid.detached``)."""
        return self.stages > 1 and self.stage_group is None

    @classmethod
    def alone(cls) -> ProcessGrid:
        """This process alone: one replica of one stage, no process group."""
        return cls(1, 1, True, 0, 0, None, None, None)

    @classmethod
    def detached(cls, stages: int, stage: int) -> ProcessGrid:
        """Stage ``stage`` of ``stages`` held by this process before it has a grid:
        enough to build its executor, not to train (Note [Building a stage ahead],
        vflow/pipeline/executor.py). An elastic job builds a worker's executor on it
        before the worker joins a grid (vflow.elastic)."""
        for name, value in (("stages", stages), ("stage", stage)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, got {type(value).__name__}")
        if stages < 2:
            raise ValueError(f"stages must be >= 2 for a detached stage, got {stages}")
        if not 0 <= stage < stages:
            raise ValueError(f"stage must be in [0, {stages}), got {stage}")
        return cls(1, stages, True, 0, stage, None, None, None)

    @classmethod
    def of(
        cls,
        stages: int,
        ranks: list[int] | None = None,
        *,
        timeout: datetime.timedelta | float | None = None,
    ) -> ProcessGrid:
        """The grid of the default group's processes ``ranks`` (default: all) with
        ``stages`` stages. A collective of the whole default group: every process calls
        it with the same arguments, in the same order as every other ``new_group``."""
        if not dist.is_initialized():
            if ranks not in (None, [0]):
                raise ValueError(
                    f"ranks={ranks!r} needs torch.distributed to be initialised; without it "
                    "the grid is this process alone"
                )
            if stages != 1:
                raise ValueError(
                    f"stages={stages} needs {stages} processes: initialise torch.distributed "
                    "(torchrun) with a multiple of stages processes"
                )
            return cls.alone()
        world = dist.get_world_size()
        ranks = list(range(world)) if ranks is None else list(ranks)
        if not ranks or len(set(ranks)) != len(ranks) or not all(0 <= r < world for r in ranks):
            raise ValueError(
                f"ranks must be distinct ranks of the default group [0, {world}), got {ranks!r}"
            )
        if ranks != sorted(ranks):
            # dist.new_group orders a group's members by rank: a grid position must match.
            raise ValueError(f"ranks must be in increasing order, got {ranks!r}")
        if isinstance(stages, bool) or not isinstance(stages, int) or stages < 1:
            raise ValueError(f"stages must be an int >= 1, got {stages!r}")
        if len(ranks) % stages:
            raise ValueError(
                f"stages={stages} does not divide the grid's {len(ranks)} processes: a grid is "
                "replicas x stages processes"
            )
        if isinstance(timeout, (int, float)):
            timeout = datetime.timedelta(seconds=timeout)
        replicas = len(ranks) // stages
        me = dist.get_rank()
        group = _group(ranks, timeout)
        stage_groups = [
            _group(ranks[r * stages : (r + 1) * stages], timeout) if stages > 1 else None
            for r in range(replicas)
        ]
        replica_groups = [
            _group(ranks[s::stages], timeout) if replicas > 1 else None for s in range(stages)
        ]
        if me not in ranks:
            return cls(replicas, stages, False, -1, -1, None, None, None)
        position = ranks.index(me)
        replica, stage = divmod(position, stages)
        return cls(
            replicas,
            stages,
            True,
            replica,
            stage,
            group,
            stage_groups[replica],
            replica_groups[stage],
        )


def _group(ranks: list[int], timeout: datetime.timedelta | None) -> dist.ProcessGroup:
    # A group of its own even for the whole default group: its timeout bounds the
    # pipeline's sends and receives, which wait on the group's.
    return new_group(ranks, timeout)
