"""vflow.planning.planner: optimal plans against brute force on random models, memory caps, edge
cases, and fits of a + b n from profiles."""

from __future__ import annotations

import itertools
import random

import pytest

from vflow.mapping.batching import split_sizes
from vflow.mapping.plan import Plan
from vflow.planning import planner
from vflow.planning.planner import (
    WorkerModel,
    fit,
    models_from_profiles,
    plan_counts,
    plan_sizes,
    predict,
)
from vflow.planning.profile import StepProfile, VNProfile, WorkerProfile


def _compositions(total: int, parts: int):
    for cuts in itertools.combinations(range(1, total), parts - 1):
        bounds = (0, *cuts, total)
        yield [bounds[k + 1] - bounds[k] for k in range(parts)]


def _random_models(rng: random.Random, workers: int, caps: bool = False) -> list[WorkerModel]:
    return [
        WorkerModel(
            rng.choice([0.0, rng.uniform(0, 0.01)]),
            rng.uniform(0.001, 0.01),
            rng.choice([None, rng.randint(2, 8)]) if caps else None,
        )
        for _ in range(workers)
    ]


def _brute_counts(models: list[WorkerModel], v: int, b: int) -> float:
    return min(predict(Plan(counts=c), models, b).step_s for c in _compositions(v, len(models)))


@pytest.mark.parametrize("seed", range(30))
def test_counts_plans_are_optimal_against_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    workers = rng.randint(1, 6)
    v = rng.randint(workers, 24 if workers <= 4 else 14)
    b = rng.randint(v, 4 * v)
    models = _random_models(rng, workers, caps=seed % 3 == 0)
    want = _brute_counts(models, v, b)
    if want == float("inf"):
        with pytest.raises(ValueError, match="no plan fits the memory caps"):
            plan_counts(models, v, b)
        return
    got = plan_counts(models, v, b, fixed_s=0.25)
    assert got.plan.virtual_nodes == v and got.plan.num_workers == workers
    assert got.step_s == pytest.approx(want + 0.25, rel=1e-12)
    assert got == plan_counts(models, v, b, fixed_s=0.25)  # the same on every call (rank)


def _brute_sizes(models: list[WorkerModel], v: int, b: int) -> float:
    best = float("inf")
    for counts in _compositions(v, len(models)):
        for samples in _compositions(b, len(models)):
            if any(s < c for s, c in zip(samples, counts, strict=True)):
                continue
            plan = Plan(sizes=[split_sizes(s, c) for s, c in zip(samples, counts, strict=True)])
            best = min(best, predict(plan, models, b).step_s)
    return best


@pytest.mark.parametrize("seed", range(20))
def test_sizes_plans_are_optimal_against_brute_force(seed: int) -> None:
    rng = random.Random(1000 + seed)
    workers = rng.randint(1, 3)
    v = rng.randint(workers, 5)
    b = rng.randint(v, 14)
    models = _random_models(rng, workers, caps=seed % 4 == 0)
    want = _brute_sizes(models, v, b)
    if want == float("inf"):
        with pytest.raises(ValueError, match="no plan fits the memory caps"):
            plan_sizes(models, v, b)
        return
    got = plan_sizes(models, v, b)
    assert got.plan.batch_size == b and got.plan.virtual_nodes == v
    assert got.step_s <= want * (1 + 1e-6)


def test_a_two_to_one_pair_gets_two_thirds_of_the_vns() -> None:
    fast, slow = WorkerModel(0.0, 1.0), WorkerModel(0.0, 2.0)
    got = plan_counts([fast, slow], 12, 120)
    assert got.plan.counts == (8, 4)
    even = predict(Plan.even(12, 2), [fast, slow], 120)
    assert even.step_s / got.step_s == pytest.approx(1.5)
    sizes = plan_sizes([fast, slow], 2, 120)  # V = W: only sizes plans can balance
    assert sizes.plan.sizes == ((80,), (40,))


def test_one_worker_and_v_equal_w() -> None:
    assert plan_counts([WorkerModel(0.1, 0.01)], 7, 70).plan == Plan(counts=[7])
    models = [WorkerModel(0.0, 0.01), WorkerModel(0.0, 0.05), WorkerModel(0.0, 0.02)]
    assert plan_counts(models, 3, 30).plan == Plan(counts=[1, 1, 1])


def test_memory_caps_are_respected_and_too_small_caps_are_a_clear_error() -> None:
    fast_small = WorkerModel(0.0, 0.001, max_vn_size=4)
    slow = WorkerModel(0.0, 0.01)
    # VN sizes are 5,5,4,4,4,4 (B=26, V=6): the capped worker may only take VNs of 4,
    # which are at the end of the batch, so it cannot be worker 0.
    with pytest.raises(ValueError, match="no plan fits the memory caps"):
        plan_counts([fast_small, WorkerModel(0.0, 0.01, max_vn_size=3)], 6, 26)
    got = plan_counts([slow, fast_small], 6, 26)
    assert got.plan.counts == (2, 4)
    sizes = plan_sizes([fast_small, slow], 6, 26)
    assert all(n <= 4 for n in sizes.plan.sizes[0])


def test_bad_problems_are_named() -> None:
    with pytest.raises(ValueError, match="every worker needs a VN"):
        plan_counts([WorkerModel(0, 1)] * 3, 2, 10)
    with pytest.raises(ValueError, match="batch_size=3 < virtual_nodes=4"):
        plan_counts([WorkerModel(0, 1)], 4, 3)
    with pytest.raises(TypeError, match=r"models\[0\] must be"):
        plan_counts(["fast"], 4, 8)  # type: ignore[list-item]
    with pytest.raises(ValueError, match=r"models\[0\].max_vn_size must be >= 1"):
        plan_counts([WorkerModel(0, 1, max_vn_size=0)], 4, 8)


def test_fit_recovers_a_line_and_falls_back_to_a_cost_per_sample() -> None:
    model = fit([(4, 0.5 + 4 * 0.1), (8, 0.5 + 8 * 0.1), (16, 0.5 + 16 * 0.1)])
    assert model.per_vn_s == pytest.approx(0.5) and model.per_sample_s == pytest.approx(0.1)
    flat = fit([(8, 0.8), (8, 1.2)])
    assert flat.per_vn_s == 0 and flat.per_sample_s == pytest.approx(0.125)


def test_models_from_profiles_use_every_workers_vns() -> None:
    def worker(rank: int, per_sample: float, vns: list[int]) -> WorkerProfile:
        entries = tuple(VNProfile(vn, 10, 0.0, 10 * per_sample) for vn in vns)
        return WorkerProfile(rank, 3, entries, 0.0, 0.0, 0.0, 0.0)

    profile = StepProfile(3, (worker(0, 0.01, [0, 1]), worker(1, 0.02, [2, 3])))
    models = models_from_profiles([profile, profile], max_vn_size=[None, 12])
    assert [m.per_sample_s for m in models] == pytest.approx([0.01, 0.02])
    assert models[1].max_vn_size == 12
    with pytest.raises(ValueError, match=r"worker\(s\) \[1\] ran no VN"):
        models_from_profiles([StepProfile(3, (worker(0, 0.01, [0, 1, 2, 3]), worker(1, 0.02, [])))])


def _timed(step: int, step_s: list[float], compute_s: list[float]) -> StepProfile:
    workers = tuple(
        WorkerProfile(w, step, (), compute, 0.0, 0.0, total)
        for w, (total, compute) in enumerate(zip(step_s, compute_s, strict=True))
    )
    return StepProfile(step, workers)


def test_fixed_step_is_the_last_finishers_non_compute_time() -> None:
    # Worker 0 waits 5 ms for worker 1; worker 1's 2 ms are what no plan removes.
    profiles = [_timed(k, [0.012, 0.012], [0.005, 0.010]) for k in range(3)]
    assert planner.fixed_step_s(profiles) == pytest.approx(0.002)
    assert planner.fixed_step_s([]) == 0.0


def test_step_noise_ignores_a_drift_and_one_outlier() -> None:
    steady = [_timed(k, [0.010 + 0.001 * (k % 2)] * 2, [0.0] * 2) for k in range(9)]
    drifting = [_timed(k, [0.020 - 0.001 * k + 0.001 * (k % 2)] * 2, [0.0] * 2) for k in range(9)]
    outlier = [*steady[:4], _timed(4, [0.5, 0.5], [0.0, 0.0]), *steady[5:]]
    sigma = planner.step_noise_s(steady)
    assert sigma == pytest.approx(1.4826 * 0.001 / 2**0.5)
    assert planner.step_noise_s(drifting) <= 1.01 * sigma  # a drift of 1 ms/step is not noise
    assert planner.step_noise_s(outlier) == pytest.approx(sigma)
    assert planner.step_noise_s(steady[:1]) == 0.0


def test_counts_plans_can_require_a_minimum_of_vns_per_worker() -> None:
    """A pipeline replica running 1F1B needs as many VNs as it has stages: with a worker
    ten times slower, the best plan gives it the fewest VNs allowed."""
    fast, slow = WorkerModel(1.0, 0.0), WorkerModel(10.0, 0.0)
    assert plan_counts([fast, slow], 8, 64).plan == Plan(counts=[7, 1])
    assert plan_counts([fast, slow], 8, 64, min_vns=2).plan == Plan(counts=[6, 2])
    assert plan_counts([slow, fast, slow], 9, 9, min_vns=3).plan == Plan(counts=[3, 3, 3])
    with pytest.raises(ValueError, match="min_vns=3 VNs each need more than virtual_nodes=8"):
        plan_counts([fast, slow, fast], 8, 64, min_vns=3)
    with pytest.raises(ValueError, match="min_vns must be an int >= 1"):
        plan_counts([fast], 8, 64, min_vns=0)
