"""Worker sets of whole pipeline replicas (vflow/elastic/replicas.py, Note [Replicas as
members]): the set a choice of workers makes, read from the stages said in a real
store; the knockers offered a place; and the ElasticJob options of a pipelined job,
refused before anything starts."""

from __future__ import annotations

from typing import Any

import pytest
import torch.distributed as dist

from vflow.elastic import ElasticJob
from vflow.elastic.rendezvous import Round
from vflow.elastic.replicas import Replicas, Workers, arrange


def _round(store: dist.Store, rank: int) -> Round:
    return Round(0, rank, 6, "vflow/job/boot/round0", lambda: store)


def test_a_set_keeps_whole_replicas_in_grid_order() -> None:
    stage_of = {0: 0, 1: 1, 2: 0, 3: 1, 4: 0, 5: 1}
    assert arrange([0, 1, 2, 3, 4, 5], stage_of, 2) == [0, 1, 2, 3, 4, 5]
    # Rank 3 lost: stage 1 has two workers, so two replicas; rank 4 is left out.
    assert arrange([0, 1, 2, 4, 5], stage_of, 2) == [0, 1, 2, 5]
    # The chosen order decides who pairs with whom and who is left out.
    assert arrange([5, 4, 1, 0], stage_of, 2) == [4, 5, 0, 1]
    assert arrange([0, 2, 4], stage_of, 2) == []


def test_every_worker_reads_the_same_set_from_the_stages_said_in_the_store() -> None:
    store = dist.HashStore()
    layouts = [Replicas(3, rank % 3) for rank in range(6)]
    for rank, layout in enumerate(layouts):
        layout.announce(_round(store, rank))
    # Newcomers' stages come from the admission's decision, written by the members.
    layouts[0].tell(_round(store, 0), [-1, -2], [2, 0])
    views = [
        layout.shape(_round(store, r), [0, 1, 2, 3, 4, -1, -2]) for r, layout in enumerate(layouts)
    ]
    assert all(view == [0, 1, 2, 3, 4, -1] for view in views), views
    assert Workers().shape(_round(store, 0), [3, 1, 2]) == [3, 1, 2]


def test_knockers_are_offered_places_as_whole_replicas_oldest_first() -> None:
    layout = Replicas(2, 0)
    # Tickets' stages, oldest first (-1: not said yet).
    assert layout.choose([1, 1, 0, -1, 0, 1], room=8) == [0, 1, 2, 4]
    assert layout.choose([1, 1, 0, -1, 0, 1], room=3) == [0, 2]  # one replica's room
    assert layout.choose([1, 1, -1], room=8) == []  # a lone stage waits
    assert Workers().choose([0, 0, 0], room=2) == [0, 1]
    store = dist.HashStore()
    store.set("stage/7", "1")
    assert layout.ticket_stages(store, [7, 8]) == [1, -1]


@pytest.mark.parametrize(
    ("options", "error"),
    [
        ({"stages": 0}, "stages must be an int >= 1"),
        ({"stages": 2}, r"stage must be this worker's stage, an int in \[0, 2\)"),
        ({"stages": 2, "stage": 2}, r"stage must be this worker's stage"),
        ({"stage": 1}, "stage=1 needs stages > 1"),
        ({"stages": 2, "stage": 0, "min_workers": 1}, "min_workers must be >= stages"),
        (
            {"stages": 2, "stage": 0, "checkpoint": "state.pt"},
            "suspending a pipelined job, and saving its state when it cannot go on, are not built",
        ),
    ],
)
def test_bad_pipeline_options_are_refused_before_anything_starts(
    options: dict[str, Any], error: str
) -> None:
    with pytest.raises(ValueError, match=error):
        ElasticJob("127.0.0.1:1", "job", **options)


def test_a_pipelined_job_counts_processes_and_needs_a_replica_to_start() -> None:
    job = ElasticJob("127.0.0.1:1", "job", stages=3, stage=2)
    assert (job.stages, job.stage, job.min_workers) == (3, 2, 3)
    assert ElasticJob("127.0.0.1:1", "job").min_workers == 1
