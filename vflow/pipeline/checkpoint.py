"""The job's training state in a file: ``vflow.pipeline.save`` writes what
``PipelineExecutor.state_dict`` gathers (Note [A state for every grid]), and
``vflow.pipeline.load`` loads it into any grid's executors."""

from __future__ import annotations

import os

import torch

from vflow.pipeline.executor import PipelineExecutor
from vflow.runtime.checkpoint import write_atomically
from vflow.world.group import World


def save(path: str | os.PathLike[str], ex: PipelineExecutor) -> None:
    """Writes the job's state to ``path`` from the grid's first process, atomically
    (a crash leaves the old file or the new one). A collective of the grid: it returns
    on every process once the file is written, and raises on every process if it
    could not be."""
    state = ex.state_dict()
    path = os.fspath(path)
    failure: BaseException | None = None
    if ex.grid.rank == 0:
        try:
            write_atomically(path, state)
        except Exception as e:  # told to the others below, then raised here
            failure = e
    written = World(ex.grid.group, ex.config.timeout).gather_ints(
        [int(failure is None)], f"gather of whether {path} was written", ex.step_count
    )
    if failure is not None:
        raise failure
    if not written[0][0]:
        raise OSError(f"the grid's first process could not write {path} (its error says why)")


def load(path: str | os.PathLike[str], ex: PipelineExecutor) -> None:
    """Loads the state in ``path`` (from ``save`` on any grid) into ``ex``'s stage;
    every process of the grid calls it."""
    state = torch.load(os.fspath(path), map_location="cpu", weights_only=True)
    ex.load_state_dict(state)
