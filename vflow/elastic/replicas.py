"""Worker sets made of whole pipeline replicas (Note [Replicas as members]).

The state machine (vflow/elastic/job.py), the admission of newcomers
(vflow/elastic/admission.py) and the survivors' agreement (vflow/elastic/agreement.py)
ask a ``Layout`` which of the workers they chose form the set, and in which order; the
plain one (``Workers``) keeps them all as they are. This module uses only the round's
store (vflow/elastic/rendezvous.py), none of them.

Note [Replicas as members]
A pipelined job's workers are processes, each holding one stage of S for its whole
life: it builds only that stage's segments (Note [Building a stage ahead],
vflow/pipeline/executor.py). A worker set is a grid of R whole replicas: S processes
each, one per stage, in grid order (replica by replica, stages in order: Note [The
grid], vflow/pipeline/grid.py), which is the order of ``WorkerSet.ranks`` and of the
set's default group. Whenever the protocols choose the workers of a set (a round, the
survivors of a crash, the workers left after a leave, members and newcomers after a
knock), ``Replicas.shape`` keeps R = the fewest workers of any stage, the first R of
each stage in the chosen order; the others are left out: they knock (a survivor whose
replica lost a stage, LeftOut) and come back once a worker of each missing stage
knocks too. Every member shapes alike, from the chosen ranks and each rank's stage,
which every worker writes under ``vflow/stage/<rank>`` in its round's store when it
enters the round; the members write the newcomers' stages from the admission's
decision, before any of them reads them.

Newcomers come in whole replicas too: a knocker writes its stage beside its ticket
(``stage/<ticket>`` in the job's store), and the members offer places to as many
replicas as the waiting tickets make, the oldest tickets of each stage
(``Replicas.choose``); a ticket older than the newest offered and not offered is told
to knock again (it keeps its place in spirit, not its number). A lone process of a
stage waits and sets no WAITING bit: the members are not disturbed until a replica can
form (``Replicas.waiting``).
"""

from __future__ import annotations

from typing import Protocol

import torch.distributed as dist

from vflow.elastic.rendezvous import Round

__all__ = ["Layout", "Replicas", "Workers"]

_STAGE = "vflow/stage/"


class Layout(Protocol):
    """How the workers a protocol chose form a worker set (Note [Replicas as members])."""

    @property
    def stages(self) -> int: ...

    def announce(self, rnd: Round) -> None:
        """Says this worker's stage in ``rnd``, which it just entered."""

    def shape(self, rnd: Round, ranks: list[int]) -> list[int]:
        """The worker set ``ranks`` form, in its order (the others are left out)."""

    def tell(self, rnd: Round, ranks: list[int], stages: list[int]) -> None:
        """Records the stages of newcomers ``ranks`` of ``rnd`` (from the decision)."""

    def ticket_stages(self, job: dist.Store, tickets: list[int]) -> list[int]:
        """The stage each knocker of ``tickets`` holds (-1: not said yet)."""

    def choose(self, stages: list[int], room: int) -> list[int]:
        """The indices of the knockers (their ``stages``, oldest first) to offer a place
        to, at most ``room`` workers."""


class Workers:
    """Every worker is a member of its own: the sets are the workers chosen, as they
    are (``vflow.Executor``)."""

    stages = 1

    def announce(self, rnd: Round) -> None:
        pass

    def shape(self, rnd: Round, ranks: list[int]) -> list[int]:
        return list(ranks)

    def tell(self, rnd: Round, ranks: list[int], stages: list[int]) -> None:
        pass

    def ticket_stages(self, job: dist.Store, tickets: list[int]) -> list[int]:
        return [0] * len(tickets)

    def choose(self, stages: list[int], room: int) -> list[int]:
        return list(range(min(len(stages), max(room, 0))))


class Replicas:
    """Note [Replicas as members]: sets of whole replicas of ``stages`` stages; this
    worker holds ``stage``."""

    def __init__(self, stages: int, stage: int) -> None:
        self.stages = stages
        self.stage = stage

    def announce(self, rnd: Round) -> None:
        rnd.store.set(f"{_STAGE}{rnd.rank}", str(self.stage))

    def tell(self, rnd: Round, ranks: list[int], stages: list[int]) -> None:
        if ranks:
            rnd.store.multi_set([f"{_STAGE}{r}" for r in ranks], [str(s) for s in stages])

    def shape(self, rnd: Round, ranks: list[int]) -> list[int]:
        if not ranks:
            return []
        # Every rank of a set said its stage when it entered the round, or the members
        # did for it (``tell``) before the set formed; multi_get waits for a key not
        # there yet, up to the store's timeout.
        values = rnd.store.multi_get([f"{_STAGE}{r}" for r in ranks])
        stage_of = {r: int(v) for r, v in zip(ranks, values, strict=True)}
        return arrange(ranks, stage_of, self.stages)

    def ticket_stages(self, job: dist.Store, tickets: list[int]) -> list[int]:
        keys = [f"stage/{t}" for t in tickets]
        return [int(job.get(k)) if job.check([k]) else -1 for k in keys]

    def choose(self, stages: list[int], room: int) -> list[int]:
        by_stage: list[list[int]] = [[] for _ in range(self.stages)]
        for index, stage in enumerate(stages):
            if 0 <= stage < self.stages:
                by_stage[stage].append(index)
        replicas = min(min(len(b) for b in by_stage), max(room, 0) // self.stages)
        return sorted(i for b in by_stage for i in b[:replicas])


def arrange(ranks: list[int], stage_of: dict[int, int], stages: int) -> list[int]:
    """Note [Replicas as members]: the whole replicas ``ranks`` make (``stage_of``: each
    one's stage), the first of each stage in ``ranks``' order first, in grid order."""
    by_stage: list[list[int]] = [[] for _ in range(stages)]
    for r in ranks:
        by_stage[stage_of[r]].append(r)
    replicas = min(len(b) for b in by_stage)
    return [by_stage[s][k] for k in range(replicas) for s in range(stages)]
