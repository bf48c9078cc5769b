"""Virtual nodes and where they run: the vocabulary every other room speaks.

A global batch of B samples splits into V contiguous VN slices (``batching``); a
``Plan`` says which VNs each worker runs (``plan``); VN i at step s draws from random
streams seeded by (seed, s, i) alone (``rng``). None of it depends on the hardware, which
is what makes results independent of the mapping.

May import: nothing of vflow (this is the bottom room).
"""

from vflow.mapping.batching import Batch, batch_size, concat_outputs, slice_batch, split_sizes
from vflow.mapping.plan import Plan, VNSlice
from vflow.mapping.rng import vn_seed

__all__ = [
    "Batch",
    "Plan",
    "VNSlice",
    "batch_size",
    "concat_outputs",
    "slice_batch",
    "split_sizes",
    "vn_seed",
]
