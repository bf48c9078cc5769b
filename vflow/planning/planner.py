"""``vflow.Planner``: a plan from the workers' measured speeds.

Note [The planner's model]
Each worker w runs its VNs one after another, so its compute time under a plan is the
sum over its VNs of ``a_w + b_w * n`` (n: the VN's samples): ``a_w`` is the fixed cost
of a VN on that worker (the Python loop, kernel launches, the fold into the buffers)
and ``b_w`` its cost per sample. The step ends when the slowest worker is done and has
done the part of a step that is not VN compute: the reduction its last backward did not
hide, the optimizer step and the step's own bookkeeping. That fixed part is about the
same under every plan (the bytes reduced and the optimizer's work do not depend on the
plan), so the predicted step time is ``max_w compute_w(plan) + fixed``, and minimising
it means minimising the largest compute time. ``fixed_step_s`` measures it as the
non-compute time of the worker that finishes last (the smallest ``step - compute`` of
any worker: the others' also holds their wait for it), median over the profiles.

The fixed part does not change which plan is best, but it sets how much a better plan
gains relative to the whole step: with a 2 ms step of which 1 ms is fixed, halving the
slowest compute gains 1.33x, not 2x. ``vflow.planning.auto_plan`` weighs that gain
against the step time's measurement noise (``step_noise_s``) before changing plans.

``a_w`` and ``b_w`` are fitted by least squares to the median forward + backward
seconds at each VN size that worker ran in the profiled steps (Note [Profiles],
vflow/planning/profile.py); medians, because a VN that the operating system preempted says
nothing about the worker's speed. Profiles only show the sizes a worker ran: under a
counts plan every VN has nearly the same size, so the fit degenerates to a cost per VN
at that size, which is all a counts plan needs. A worker that ran no VN yet has no model, and the
planner refuses to plan.

Two kinds of plan:

* **counts** (equal VN sizes, ``split_sizes(B, V)``): the only kind that keeps every VN
  the same under every plan, hence the only kind allowed in deterministic mode (same
  bits as homogeneous training). Exact optimum by dynamic programming over the
  contiguous runs of VNs: O(W V^2).
* **sizes** (VirtualFlow's uneven VN sizes, finer balance when V is small): each worker
  gets c_w VNs of as-even-as-possible sizes summing to s_w samples. For a step time T
  a worker can take at most ``floor((T - c a_w) / b_w)`` samples with c VNs, so T is
  feasible when some choice of the c_w (summing to V) lets the workers take B samples
  together, which a knapsack over the counts decides in O(W V^2); T is then found by
  bisection, to a relative 1e-9.

Memory: ``max_vn_size[w]`` caps the samples of one VN on worker w (only one VN's
activations are live at a time, so memory bounds the VN size, not the count).

Every rank computes the plan from the same profiles (the statistics all-reduce gives
every rank the same numbers) with the same arithmetic, and ties are broken by a fixed
order, so all ranks reach the same plan without
an agreement round.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from vflow.mapping.batching import split_sizes
from vflow.mapping.plan import Plan
from vflow.planning.profile import StepProfile

_INF = math.inf


@dataclass(frozen=True)
class WorkerModel:
    """Predicted seconds of one VN of ``n`` samples on a worker: ``per_vn_s +
    per_sample_s * n``; ``max_vn_size`` caps a VN's samples there (None: no cap)."""

    per_vn_s: float
    per_sample_s: float
    max_vn_size: int | None = None

    def seconds(self, vns: int, samples: int) -> float:
        return vns * self.per_vn_s + samples * self.per_sample_s


@dataclass(frozen=True)
class Prediction:
    """A plan and the step time the model predicts for it."""

    plan: Plan
    step_s: float  # max over workers of compute, plus the step's fixed part
    worker_s: tuple[float, ...]  # each worker's predicted compute


def fit(samples: Sequence[tuple[int, float]], max_vn_size: int | None = None) -> WorkerModel:
    """Least-squares ``a + b n`` through the median seconds at each VN size n (weighted
    by how many VNs had that size), both kept >= 0. Medians, because one VN that the
    operating system preempted must not move a worker's speed. With one size only, the
    fit is the median cost per sample at that size (a = 0)."""
    if not samples:
        raise ValueError("fit needs at least one (size, seconds) pair")
    by_size: dict[int, list[float]] = {}
    for n, t in samples:
        by_size.setdefault(n, []).append(t)
    points = [(n, statistics.median(ts), len(ts)) for n, ts in sorted(by_size.items())]
    count = sum(k for _, _, k in points)
    mean_n = sum(n * k for n, _, k in points) / count
    mean_t = sum(t * k for _, t, k in points) / count
    var_n = sum(k * (n - mean_n) ** 2 for n, _, k in points)
    if var_n > 0:
        slope = sum(k * (n - mean_n) * (t - mean_t) for n, t, k in points) / var_n
        intercept = mean_t - slope * mean_n
        if slope > 0 and intercept >= 0:
            return WorkerModel(intercept, slope, max_vn_size)
    return WorkerModel(0.0, max(mean_t, 1e-12) / max(mean_n, 1.0), max_vn_size)


def models_from_profiles(
    profiles: Sequence[StepProfile], max_vn_size: Sequence[int | None] | None = None
) -> list[WorkerModel]:
    """One model per worker from the VNs of ``profiles`` (all of the same workers)."""
    if not profiles:
        raise ValueError("profiles must hold at least one StepProfile")
    workers = len(profiles[0].workers)
    caps = list(max_vn_size) if max_vn_size is not None else [None] * workers
    if len(caps) != workers:
        raise ValueError(f"max_vn_size must have one entry per worker ({workers}), got {caps}")
    points: list[list[tuple[int, float]]] = [[] for _ in range(workers)]
    for profile in profiles:
        if len(profile.workers) != workers:
            raise ValueError("profiles must all come from the same number of workers")
        for rank, worker in enumerate(profile.workers):
            points[rank] += [(vn.size, vn.forward_s + vn.backward_s) for vn in worker.vns]
    missing = [rank for rank, p in enumerate(points) if not p]
    if missing:
        raise ValueError(f"worker(s) {missing} ran no VN in the profiles: nothing to fit")
    return [fit(p, cap) for p, cap in zip(points, caps, strict=True)]


def fixed_step_s(profiles: Sequence[StepProfile]) -> float:
    """The part of a step that no plan removes (Note [The planner's model]): the
    non-compute time of the worker that finishes last — its exposed reduction, optimizer
    step and bookkeeping — i.e. the smallest ``step_s - compute_s`` of any worker, median
    over ``profiles`` (0 without profiles)."""
    values = [max(0.0, min(w.step_s - w.compute_s for w in p.workers)) for p in profiles]
    return statistics.median(values) if values else 0.0


def step_noise_s(profiles: Sequence[StepProfile]) -> float:
    """The measurement noise of the step time over ``profiles`` (in step order): a robust
    standard deviation from the differences of consecutive step times (the longest
    worker's), ``1.4826 * median |T_k - T_(k-1)| / sqrt(2)``. Differences, so that a
    slow drift of the step time (the first steps of a process warming up) is not taken
    for noise; a median, so that one step that the operating system preempted does not
    widen it. 0 with fewer than two profiles."""
    times = [max(w.step_s for w in p.workers) for p in profiles if p.workers]
    if len(times) < 2:
        return 0.0
    jumps = [abs(later - earlier) for earlier, later in itertools.pairwise(times)]
    return 1.4826 * statistics.median(jumps) / math.sqrt(2)


def predict(
    plan: Plan, models: Sequence[WorkerModel], batch_size: int, fixed_s: float = 0.0
) -> Prediction:
    """The model's step time for ``plan``."""
    _check_models(models, plan.num_workers)
    sizes = plan.vn_sizes(batch_size)
    per_worker = []
    for w, model in enumerate(models):
        mine = [sizes[vn] for vn in plan.vns(w)]
        if model.max_vn_size is not None and max(mine) > model.max_vn_size:
            per_worker.append(_INF)
        else:
            per_worker.append(model.seconds(len(mine), sum(mine)))
    return Prediction(plan, max(per_worker) + fixed_s, tuple(per_worker))


def plan_counts(
    models: Sequence[WorkerModel],
    virtual_nodes: int,
    batch_size: int,
    fixed_s: float = 0.0,
    min_vns: int = 1,
) -> Prediction:
    """The counts plan with the smallest predicted step time (exact) among those that
    give every worker at least ``min_vns`` VNs (a pipeline replica running 1F1B needs as
    many as it has stages)."""
    workers = _check_problem(models, virtual_nodes, batch_size)
    if isinstance(min_vns, bool) or not isinstance(min_vns, int) or min_vns < 1:
        raise ValueError(f"min_vns must be an int >= 1, got {min_vns!r}")
    if workers * min_vns > virtual_nodes:
        raise ValueError(
            f"{workers} workers with at least min_vns={min_vns} VNs each need more than "
            f"virtual_nodes={virtual_nodes}"
        )
    sizes = split_sizes(batch_size, virtual_nodes)
    prefix = [0]
    for n in sizes:
        prefix.append(prefix[-1] + n)
    # best[w][j]: the smallest max compute of workers 0..w-1 running VNs 0..j-1.
    best = [[_INF] * (virtual_nodes + 1) for _ in range(workers + 1)]
    choice = [[0] * (virtual_nodes + 1) for _ in range(workers + 1)]
    best[0][0] = 0.0
    for w in range(1, workers + 1):
        model = models[w - 1]
        cap = model.max_vn_size
        for j in range(w * min_vns, virtual_nodes - (workers - w) * min_vns + 1):
            for i in range((w - 1) * min_vns, j - min_vns + 1):  # worker w-1 runs VNs i..j-1
                if best[w - 1][i] == _INF:
                    continue
                if cap is not None and sizes[i] > cap:  # sizes fall along the batch
                    continue
                cost = max(best[w - 1][i], model.seconds(j - i, prefix[j] - prefix[i]))
                if cost < best[w][j]:
                    best[w][j], choice[w][j] = cost, i
    if best[workers][virtual_nodes] == _INF:
        raise ValueError(_no_plan(models, max(sizes)))
    counts = []
    j = virtual_nodes
    for w in range(workers, 0, -1):
        i = choice[w][j]
        counts.append(j - i)
        j = i
    return predict(Plan(counts=counts[::-1]), models, batch_size, fixed_s)


def plan_sizes(
    models: Sequence[WorkerModel], virtual_nodes: int, batch_size: int, fixed_s: float = 0.0
) -> Prediction:
    """The sizes plan (uneven VN sizes) with the smallest predicted step time, to a
    relative 1e-9 in the step time."""
    _check_problem(models, virtual_nodes, batch_size)
    if all(m.per_sample_s <= 0 for m in models):
        return plan_counts(models, virtual_nodes, batch_size, fixed_s)
    # Any feasible plan bounds T from above; the counts optimum usually is one.
    try:
        high = plan_counts(models, virtual_nodes, batch_size).step_s
    except ValueError:
        high = _INF
    if high == _INF:
        high = max(m.seconds(virtual_nodes, batch_size) for m in models) * 2 + 1.0
    if _assign(models, virtual_nodes, batch_size, high) is None:
        raise ValueError(_no_plan(models, math.ceil(batch_size / virtual_nodes)))
    low = 0.0
    while high - low > 1e-9 * high:
        middle = (low + high) / 2
        if _assign(models, virtual_nodes, batch_size, middle) is None:
            low = middle
        else:
            high = middle
    assignment = _assign(models, virtual_nodes, batch_size, high)
    assert assignment is not None
    counts, capacity = assignment
    samples = _take(models, counts, capacity, batch_size)
    plan = Plan(sizes=[split_sizes(s, c) for s, c in zip(samples, counts, strict=True)])
    return predict(plan, models, batch_size, fixed_s)


def _assign(
    models: Sequence[WorkerModel], virtual_nodes: int, batch_size: int, limit: float
) -> tuple[list[int], list[int]] | None:
    """VN counts (summing to V) under which the workers can take ``batch_size`` samples
    within ``limit`` seconds each, with each worker's most samples; None if none can."""
    workers = len(models)
    # capacity[w][c]: most samples worker w takes with c VNs within the limit (-1: none).
    capacity = []
    for model in models:
        row = [-1] * (virtual_nodes + 1)
        for c in range(1, virtual_nodes - workers + 2):
            room = limit - c * model.per_vn_s
            # The slack absorbs rounding: a plan predicted at exactly the limit fits it.
            most = (
                math.floor(room / model.per_sample_s + 1e-9)
                if model.per_sample_s > 0
                else batch_size
            )
            if model.max_vn_size is not None:
                most = min(most, c * model.max_vn_size)
            row[c] = min(most, batch_size) if most >= c else -1
        capacity.append(row)
    # total[w][k]: most samples of workers 0..w-1 with k VNs in all.
    total = [[-1] * (virtual_nodes + 1) for _ in range(workers + 1)]
    pick = [[0] * (virtual_nodes + 1) for _ in range(workers + 1)]
    total[0][0] = 0
    for w in range(1, workers + 1):
        for k in range(w, virtual_nodes - (workers - w) + 1):
            for c in range(1, k - (w - 1) + 1):
                before, mine = total[w - 1][k - c], capacity[w - 1][c]
                if before < 0 or mine < 0:
                    continue
                if before + mine > total[w][k]:
                    total[w][k], pick[w][k] = before + mine, c
    if total[workers][virtual_nodes] < batch_size:
        return None
    counts = []
    k = virtual_nodes
    for w in range(workers, 0, -1):
        c = pick[w][k]
        counts.append(c)
        k -= c
    counts.reverse()
    return counts, [capacity[w][c] for w, c in enumerate(counts)]


def _take(
    models: Sequence[WorkerModel], counts: list[int], capacity: list[int], batch_size: int
) -> list[int]:
    """Samples per worker summing to ``batch_size``, each within [count, capacity]: the
    surplus is taken back from the workers predicted to finish last."""
    samples = list(capacity)
    surplus = sum(samples) - batch_size
    while surplus > 0:
        finish = [
            models[w].seconds(counts[w], samples[w]) if samples[w] > counts[w] else -_INF
            for w in range(len(samples))
        ]
        slowest = max(range(len(samples)), key=lambda w: (finish[w], -w))
        # Take back at once what keeps this worker no faster than the next slowest.
        others = [f for w, f in enumerate(finish) if w != slowest and f > -_INF]
        step = 1
        if others and models[slowest].per_sample_s > 0:
            gap = (finish[slowest] - max(others)) / models[slowest].per_sample_s
            step = max(1, int(gap))
        step = min(step, surplus, samples[slowest] - counts[slowest])
        samples[slowest] -= step
        surplus -= step
    return samples


def _check_models(models: Sequence[WorkerModel], workers: int) -> None:
    if len(models) != workers:
        raise ValueError(f"models must have one entry per worker ({workers}), got {len(models)}")
    for w, model in enumerate(models):
        if not isinstance(model, WorkerModel):
            raise TypeError(f"models[{w}] must be a vflow.planning.WorkerModel, got {model!r}")
        if not (model.per_vn_s >= 0 and model.per_sample_s >= 0):
            raise ValueError(f"models[{w}] has a negative cost: {model}")
        if model.max_vn_size is not None and model.max_vn_size < 1:
            raise ValueError(
                f"models[{w}].max_vn_size must be >= 1 or None, got {model.max_vn_size}"
            )


def _check_problem(models: Sequence[WorkerModel], virtual_nodes: int, batch_size: int) -> int:
    for name, value in (("virtual_nodes", virtual_nodes), ("batch_size", batch_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if not models:
        raise ValueError("models must have one entry per worker, got none")
    _check_models(models, len(models))
    if len(models) > virtual_nodes:
        raise ValueError(
            f"{len(models)} workers but virtual_nodes={virtual_nodes}: every worker needs a VN"
        )
    if batch_size < virtual_nodes:
        raise ValueError(f"batch_size={batch_size} < virtual_nodes={virtual_nodes}")
    return len(models)


def _no_plan(models: Sequence[WorkerModel], vn_size: int) -> str:
    caps = [m.max_vn_size for m in models]
    return (
        f"no plan fits the memory caps: VNs need up to {vn_size} samples, the workers' "
        f"max_vn_size are {caps}; raise the caps or V"
    )


class Planner:
    """The plan for the workers of ``profiles`` (Note [The planner's model]): a pure
    function of its inputs, so every rank that holds the same profiles gets the same plan.

    ``Planner(kind="counts" | "sizes", max_vn_size=None)(profiles, batch_size)`` returns
    a Prediction (plan and predicted step time); ``profiles`` are StepProfiles of the
    same workers (``Executor.last_profile``), V is read from them.
    """

    def __init__(self, kind: str = "counts", max_vn_size: Sequence[int | None] | None = None):
        if kind not in ("counts", "sizes"):
            raise ValueError(f"kind must be 'counts' or 'sizes', got {kind!r}")
        self.kind = kind
        self.max_vn_size = None if max_vn_size is None else list(max_vn_size)

    def __call__(self, profiles: Sequence[StepProfile], batch_size: int) -> Prediction:
        models = models_from_profiles(profiles, self.max_vn_size)
        virtual_nodes = sum(len(w.vns) for w in profiles[0].workers)
        solve = plan_counts if self.kind == "counts" else plan_sizes
        return solve(models, virtual_nodes, batch_size, fixed_step_s(profiles))
