"""Exact accumulation kernels (csrc/exact.h) against a float64 reference.

The property that matters is order independence: however the contributions are split
between "workers" and ordered within one, the unpacked sum has the same bits. The
reference here packs and sums the way the Reducer does (MAX of the top bins, int64
SUM of the packed limbs), with torch's integer ops standing in for the all-reduce.
"""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch

from tests.support.cuda_marks import devices, requires_cuda
from tests.support.reducers import make_reducer
from vflow import ops

SIZES = [0, 1, 97, 1025]


class Accumulator:
    """One worker's exact accumulators for n elements."""

    def __init__(self, n: int, device: str = "cpu") -> None:
        # Garbage rather than zeros: the first fold of a step must not read them.
        self.top = torch.full((n,), 5, dtype=torch.int8, device=device)
        self.limbs = torch.full((3, n), 12345, dtype=torch.int32, device=device)
        self.fresh = True

    def add(self, grad: torch.Tensor, weight: float) -> None:
        ops.exact_accumulate_(
            self.top, self.limbs[0], self.limbs[1], self.limbs[2], grad, weight, self.fresh
        )
        self.fresh = False


def reduce(workers: list[Accumulator]) -> torch.Tensor:
    n = workers[0].top.numel()
    global_top = torch.stack([w.top for w in workers]).amax(0)
    total = torch.zeros(n, dtype=torch.int64)
    for w in workers:
        wire = torch.empty(n, dtype=torch.int64)
        ops.exact_pack_(w.top, global_top, w.limbs[0], w.limbs[1], w.limbs[2], wire)
        total += wire
    out = torch.empty(n)
    ops.exact_unpack_(global_top, total, out)
    return out


def exact_sum(grads: list[torch.Tensor], weights: list[float], split: list[int]) -> torch.Tensor:
    """Sum of weights[i] * grads[i] with contributions split over len(split) workers."""
    workers = []
    index = 0
    for count in split:
        worker = Accumulator(grads[0].numel())
        for _ in range(count):
            worker.add(grads[index], weights[index])
            index += 1
        workers.append(worker)
    return reduce(workers)


def wide_range(n: int, generator: torch.Generator, spread: int = 40) -> torch.Tensor:
    """Random signs and magnitudes over 2^-spread .. 2^spread."""
    exponents = torch.randint(-spread, spread + 1, (n,), generator=generator).float()
    return torch.randn(n, generator=generator) * torch.exp2(exponents)


def splits_of(v: int, rng: random.Random) -> list[list[int]]:
    out = [[v], [1] * v]
    for _ in range(3):
        cuts = sorted(rng.sample(range(1, v), k=min(v - 1, rng.randint(1, 4))))
        bounds = [0, *cuts, v]
        out.append([b - a for a, b in itertools.pairwise(bounds)])
    return out


@pytest.mark.parametrize("n", SIZES)
def test_same_bits_for_every_split_and_order(n: int) -> None:
    generator = torch.Generator().manual_seed(n)
    rng = random.Random(n)
    v = 12
    grads = [wide_range(n, generator) for _ in range(v)]
    weights = [rng.choice([1.0, 1 / 12, 0.3, 1e-3]) for _ in range(v)]
    expected = exact_sum(grads, weights, [v])
    for split in splits_of(v, rng):
        order = list(range(v))
        rng.shuffle(order)
        got = exact_sum([grads[i] for i in order], [weights[i] for i in order], split)
        assert torch.equal(got, expected), f"split {split}, order {order}"


@pytest.mark.parametrize("n", SIZES[1:])
def test_error_is_one_float32_rounding_of_the_float64_sum(n: int) -> None:
    """Truncation loses < 2^-32 of the largest contribution per term; the rest is the
    final rounding to float32. The float32 loop is shown for comparison."""
    generator = torch.Generator().manual_seed(1000 + n)
    v = 64
    grads = [wide_range(n, generator, spread=20) for _ in range(v)]
    weights = [1.0 / v] * v
    got = exact_sum(grads, weights, [16, 48]).double()
    terms = torch.stack([g.double() * w for g, w in zip(grads, weights, strict=True)])
    reference = torch.tensor(
        [math.fsum(column) for column in terms.T.tolist()], dtype=torch.float64
    )
    naive = torch.zeros(n)
    for g, w in zip(grads, weights, strict=True):
        naive += g * w
    largest = terms.abs().amax(0)
    half_ulp = reference.abs() * 2.0**-24 + 2.0**-150
    bound = half_ulp + v * largest * 2.0**-32
    error = (got - reference).abs()
    assert (error <= bound).all(), f"max excess {(error - bound).max().item():g}"
    assert error.norm() <= (naive.double() - reference).abs().norm()


def test_zero_and_signed_zero_contributions() -> None:
    acc = Accumulator(4)
    acc.add(torch.tensor([0.0, -0.0, 1.0, -2.5]), 1.0)
    acc.add(torch.tensor([-0.0, 0.0, -1.0, 2.5]), 1.0)
    out = reduce([acc])
    assert torch.equal(out, torch.zeros(4))
    assert not torch.signbit(out).any()


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan], ids=["inf", "minus_inf", "nan"])
def test_nonfinite_contribution_poisons_its_element_only(bad: float) -> None:
    a, b = Accumulator(3), Accumulator(3)
    a.add(torch.tensor([1.0, bad, 3.0]), 1.0)
    b.add(torch.tensor([1.0, 2.0, 3.0]), 1.0)
    b.add(torch.tensor([1.0, 2.0, 3.0]), 1.0)
    out = reduce([a, b])
    assert out[0].item() == 3.0 and out[2].item() == 9.0
    assert math.isnan(out[1].item())


def test_contribution_beyond_float32_is_reported_as_nan() -> None:
    # weight * grad is formed in double: 4 * 2^127 = 2^129 has no float32 value.
    acc = Accumulator(2)
    acc.add(torch.tensor([2.0**127, 1.0]), 4.0)
    out = reduce([acc])
    assert math.isnan(out[0].item()) and out[1].item() == 4.0


def test_sum_beyond_float32_becomes_inf() -> None:
    big = 3.0e38
    workers = [Accumulator(2) for _ in range(2)]
    for w in workers:
        w.add(torch.tensor([big, -big]), 1.0)
    out = reduce(workers)
    assert out[0].item() == math.inf and out[1].item() == -math.inf


def test_cancellation_is_exact() -> None:
    acc = Accumulator(1)
    for value in (1e30, 1.0, -1e30):
        acc.add(torch.tensor([value]), 1.0)
    # 1.0 sits 99 bits below 1e30: more than the window keeps, so it is truncated.
    assert reduce([acc]).item() == 0.0
    acc = Accumulator(1)
    for value in (2.0**20, 1.0, -(2.0**20)):
        acc.add(torch.tensor([value]), 1.0)
    assert reduce([acc]).item() == 1.0


def test_subnormal_contributions_are_exact() -> None:
    tiny = torch.tensor([2.0**-149, 3 * 2.0**-149])
    acc = Accumulator(2)
    for _ in range(5):
        acc.add(tiny, 1.0)
    assert torch.equal(reduce([acc]), tiny * 5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_gradients_are_widened_exactly(dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(7)
    grads = [torch.randn(97, generator=generator).to(dtype) for _ in range(4)]
    got = exact_sum(grads, [0.25] * 4, [2, 2])
    reference = sum(g.double() * 0.25 for g in grads).float()
    # Inputs with 8-11 significant bits: the exact sum fits float32 without rounding.
    assert torch.equal(got, reference)


def test_kernels_reject_bad_arguments() -> None:
    acc = Accumulator(4)
    with pytest.raises(RuntimeError, match="grad has 3 elements"):
        ops.exact_accumulate_(acc.top, *acc.limbs, torch.ones(3), 1.0)
    with pytest.raises(RuntimeError, match="grad must be float32"):
        ops.exact_accumulate_(acc.top, *acc.limbs, torch.ones(4, dtype=torch.float64), 1.0)
    with pytest.raises(RuntimeError, match="l1 must have dtype"):
        ops.exact_accumulate_(
            acc.top, acc.limbs[0], acc.limbs[1].long(), acc.limbs[2], torch.ones(4), 1.0
        )
    with pytest.raises(RuntimeError, match="wire must have dtype"):
        ops.exact_pack_(acc.top, acc.top, *acc.limbs, torch.empty(4))
    with pytest.raises(RuntimeError, match="out has 3 elements"):
        ops.exact_unpack_(acc.top, torch.zeros(4, dtype=torch.int64), torch.empty(3))


@pytest.mark.parametrize("device", devices())
def test_reducer_in_exact_mode_matches_the_kernels(device: str) -> None:
    params = [torch.zeros(5, 3, device=device), torch.zeros(7, device=device)]
    reducer = make_reducer([params], [torch.float32], 1 << 20, 1 << 20, kind="exact")
    assert (
        reducer.reduction.kind == "exact" and reducer.bytes_per_step == 0
    )  # one process: nothing on the wire
    generator = torch.Generator().manual_seed(3)
    vns = [[wide_range(15, generator).view(5, 3), wide_range(7, generator)] for _ in range(3)]
    reducer.begin_step(0)
    for k, grads in enumerate(vns):
        reducer.begin_vn(1 / 3, k == 2)
        # Parameter 1 gets no gradient from VN 1: it counts as zero.
        for slot, grad in enumerate(grads):
            if not (k == 1 and slot == 1):
                reducer.add_grad(reducer.bucket_of(0, slot), slot, grad.to(device))
        reducer.end_vn()
    reducer.finalize(1.0, [])
    views = [view.cpu() for view in reducer.buffers[0].views()]
    expected_15 = exact_sum([g[0].reshape(-1) for g in vns], [1 / 3] * 3, [3])
    expected_7 = exact_sum([vns[0][1], vns[2][1]], [1 / 3, 1 / 3], [2])
    assert torch.equal(views[0].reshape(-1), expected_15)
    assert torch.equal(views[1], expected_7)


def test_reducer_rejects_exact_float64() -> None:
    with pytest.raises(RuntimeError, match="exact accumulation needs float32"):
        make_reducer([[torch.zeros(3, dtype=torch.float64)]], [torch.float64], 1, 1, kind="exact")


@pytest.mark.skipif(
    "avx2" not in ops.cpu_vector_paths(), reason="this CPU (or build) has no AVX2/FMA/F16C path"
)
@pytest.mark.parametrize("n", [1, 3, 97, 1025])
@pytest.mark.usefixtures("restore_cpu_vector_path")
def test_avx2_and_portable_paths_give_the_same_integers(n: int) -> None:
    generator = torch.Generator().manual_seed(n)
    grads = [wide_range(n, generator, spread=60) for _ in range(6)]
    grads[2][::7] = math.inf
    grads[3][1::5] = math.nan
    grads[4][::3] = 2.0**127  # with weight 3: beyond float32
    weights = [0.1, 1.0, 1 / 3, 1e-30, 3.0, 1e20]
    states = {}
    for path in ("portable", "avx2"):
        ops.set_cpu_vector_path(path)
        acc = Accumulator(n)
        for g, w in zip(grads, weights, strict=True):
            acc.add(g, w)
        states[path] = acc
    assert torch.equal(states["portable"].top, states["avx2"].top)
    assert torch.equal(states["portable"].limbs, states["avx2"].limbs)


def test_the_factor_is_applied_before_the_conversion_to_float32() -> None:
    """A raw sum beyond float32 whose normalised value fits is not an overflow."""
    big = 3.0e38
    workers = [Accumulator(1) for _ in range(2)]
    for w in workers:
        w.add(torch.tensor([big]), 1.0)
    global_top = torch.maximum(workers[0].top, workers[1].top)
    total = torch.zeros(1, dtype=torch.int64)
    for w in workers:
        wire = torch.empty(1, dtype=torch.int64)
        ops.exact_pack_(w.top, global_top, *w.limbs, wire)
        total += wire
    out = torch.empty(1)
    ops.exact_unpack_(global_top, total, out, 0.5)
    assert out.item() == torch.tensor(big).item()


@requires_cuda
@pytest.mark.parametrize("n", [1, 97, 1025, (1 << 20) + 3])
def test_cuda_kernels_give_the_cpu_integers(n: int) -> None:
    """Device and host share the per-element code (exact.h); this checks that the CUDA
    build really computes the same integers, specials and half-precision inputs
    included, so a result does not depend on where the sum was taken."""
    generator = torch.Generator().manual_seed(n)
    grads = [wide_range(n, generator, spread=60) for _ in range(7)]
    grads[2][::7] = math.inf
    grads[3][1::5] = math.nan
    grads[4][::3] = 2.0**127  # with weight 3: beyond float32
    grads[5] = grads[5].to(torch.bfloat16)
    grads[6] = grads[6].clamp(-6e4, 6e4).to(torch.float16)
    weights = [0.1, 1.0, 1 / 3, 1e-30, 3.0, 1e20, 0.7]
    host, device = Accumulator(n), Accumulator(n, "cuda")
    for g, w in zip(grads, weights, strict=True):
        host.add(g, w)
        device.add(g.cuda(), w)
    assert torch.equal(device.top.cpu(), host.top)
    assert torch.equal(device.limbs.cpu(), host.limbs)

    other = Accumulator(n)
    other.add(wide_range(n, generator, spread=60), 1.0)
    global_top = torch.maximum(host.top, other.top)
    wires = {}
    for name, acc in (("cpu", host), ("cuda", device)):
        wire = torch.empty(n, dtype=torch.int64, device=acc.top.device)
        ops.exact_pack_(acc.top, global_top.to(acc.top.device), *acc.limbs, wire)
        wires[name] = wire
    assert torch.equal(wires["cuda"].cpu(), wires["cpu"])
    outs = {}
    for name, wire in wires.items():
        out = torch.empty(n, device=wire.device)
        ops.exact_unpack_(global_top.to(wire.device), wire, out, 0.25)
        outs[name] = out.cpu()
    # Bits, not values: NaN elements must match too.
    assert torch.equal(outs["cuda"].view(torch.int32), outs["cpu"].view(torch.int32))
