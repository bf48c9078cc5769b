"""Per-virtual-node random streams.

Note [VN randomness]: the draws of VN i at step s come from generators seeded with
``vn_seed(seed, s, i)``, so dropout masks and other random ops depend on the VN, not
on which worker runs it or on what ran before it on that worker. The caller's own RNG
state is saved before a step and restored after it, so using vflow does not perturb
random draws the training script makes between steps.
"""

from __future__ import annotations

import torch

_MASK64 = (1 << 64) - 1

# Distinct streams so that training and inference at the same step never share draws.
TRAIN_STREAM = 0
INFER_STREAM = 1
DATA_STREAM = 2  # the generator handed to a VN's vn_transform
# Segment k of a pipelined model draws from stream SEGMENT_STREAMS + k (Note [Segment
# streams], vflow/pipeline/streams.py); far above the others so that they never meet.
SEGMENT_STREAMS = 1 << 32


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def vn_seed(seed: int, step: int, vn: int, stream: int = TRAIN_STREAM) -> int:
    """A 63-bit seed for (seed, step, vn, stream); well mixed, stable across releases."""
    return vn_seeds(seed, step, [vn], stream)[0]


def vn_seeds(seed: int, step: int, vns: list[int], stream: int = TRAIN_STREAM) -> list[int]:
    """``vn_seed`` of every VN in ``vns``, mixing (seed, step) once."""
    prefix = _splitmix64(_splitmix64(seed & _MASK64) ^ (step & _MASK64))
    return [
        _splitmix64(_splitmix64(prefix ^ (vn & _MASK64)) ^ (stream & _MASK64)) >> 1 for vn in vns
    ]


def generators(devices: list[torch.device]) -> list[torch.Generator]:
    """The CPU generator and the default generators of the given CUDA devices: what a
    VN's random draws come from."""
    indices = sorted({d.index or 0 for d in devices if d.type == "cuda"})
    return [torch.default_generator] + [torch.cuda.default_generators[i] for i in indices]


def seed_all(value: int, generators: list[torch.Generator]) -> None:
    """Seeds ``generators`` (from ``generators(devices)``).

    torch.manual_seed would also queue a lazy seeding of every CUDA device, which
    records a Python traceback each time: milliseconds per VN on a small model.
    """
    for generator in generators:
        generator.manual_seed(value)


class preserved_rng:
    """Restores ``generators``' states on exit (what torch.random.fork_rng does, without
    its per-call device bookkeeping: this runs once per step)."""

    __slots__ = ("_generators", "_states")

    def __init__(self, generators: list[torch.Generator]) -> None:
        self._generators = generators
        self._states: list[torch.Tensor] = []

    def __enter__(self) -> None:
        self._states = [g.get_state() for g in self._generators]

    def __exit__(self, *exc: object) -> None:
        for generator, state in zip(self._generators, self._states, strict=True):
            generator.set_state(state)
