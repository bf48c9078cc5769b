"""Random streams per segment.

Note [Segment streams]
A non-pipelined executor seeds the generators once per VN (Note [VN randomness],
vflow/mapping/rng.py): a VN's draws come in the order its forward makes them. Cut into
stages, that order is gone: with both stages in one process, stage 1's dropout draws
after stage 0's; on two processes it draws first, from a fresh generator. So a
pipelined model reseeds before every *segment* (Note [Segments and stages]) with
``vn_seed(seed, step, vn, SEGMENT_STREAMS + k)`` for segment k: what segment k of VN i
draws at step s is then fixed by (seed, s, i, k), whichever process runs it, in any
grid, and in the single-process reference (``stages=1``), which reseeds the same way.
These streams differ from the non-pipelined executor's, so a model trained by
``vflow.Executor`` and by a pipelined executor with the same seed draw different
dropout masks; both are deterministic. Backward passes draw nothing; a segment that
recomputes its forward (activation checkpointing) would need the same seed again,
which this does not provide.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from vflow.mapping import rng


class SegmentStreams:
    """Forward pre-hooks that reseed ``generators`` before each of ``segments`` runs,
    from the VN set by ``begin_vn``; idle (no reseeding) outside a step."""

    def __init__(
        self,
        segments: list[tuple[int, torch.nn.Module]],
        generators: list[torch.Generator],
    ) -> None:
        self._generators = generators
        self._seeds: dict[int, int] = {}
        self._active = False
        self._handles = [
            module.register_forward_pre_hook(self._hook(index)) for index, module in segments
        ]
        self._indices = [index for index, _ in segments]
        self._seed = 0
        self._step = 0

    def _hook(self, index: int) -> Callable[[torch.nn.Module, object], None]:
        def reseed(module: torch.nn.Module, args: object) -> None:
            # No VN yet: shape inference before the step's first VN (its draws are
            # thrown away with the rest of that pass).
            seed = self._seeds.get(index) if self._active else None
            if seed is not None:
                rng.seed_all(seed, self._generators)

        return reseed

    def begin_step(self, seed: int, step: int) -> None:
        self._seed, self._step, self._active = seed, step, True
        self._seeds = {}

    def begin_vn(self, vn: int) -> None:
        """The segments' seeds for VN ``vn`` of the current step."""
        streams = [rng.SEGMENT_STREAMS + index for index in self._indices]
        self._seeds = {
            index: rng.vn_seed(self._seed, self._step, vn, stream)
            for index, stream in zip(self._indices, streams, strict=True)
        }

    def end_step(self) -> None:
        self._active = False

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
