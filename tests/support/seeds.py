"""VN seeds derived from their documented definition (Note [VN randomness] in
vflow/mapping/rng.py), independently of vflow.mapping.rng, so tests can check vflow against them."""

from __future__ import annotations

MASK64 = (1 << 64) - 1


def splitmix64(x: int) -> int:
    """The published splitmix64 output function (Steele, Lea, Flood 2014)."""
    z = (x + 0x9E3779B97F4A7C15) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def expected_seed(seed: int, step: int, vn: int, stream: int = 0) -> int:
    """splitmix64 folded over (seed, step, vn, stream), top 63 bits."""
    x = splitmix64(seed)
    for part in (step, vn, stream):
        x = splitmix64(x ^ part)
    return x >> 1
