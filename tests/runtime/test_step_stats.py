"""The step statistics' wire layout (vflow/runtime/step_stats.py): what a worker encodes, summed
over workers, decodes to totals added in VN order and to every worker's profile."""

from __future__ import annotations

import pytest
import torch

from vflow.planning.profile import VNProfile, WorkerProfile
from vflow.runtime.step_stats import StatsLayout, local_totals

V, W = 5, 2


def _profile(rank: int, vns: list[int]) -> WorkerProfile:
    entries = tuple(VNProfile(vn, 3 + vn, 0.001 * (vn + 1), 0.002 * (vn + 1)) for vn in vns)
    return WorkerProfile(rank, 7, entries, 0.5 + rank, 0.25, 0.125, 1.5 + rank)


def _encode(
    layout: StatsLayout,
    vns: list[int],
    kind: str,
    rank: int,
    profile: bool,
    signal: int = 0,
    lead: int = 0,
):
    losses = [torch.tensor(1.0 / (vn + 3), requires_grad=True) * 1.0 for vn in vns]
    weights = [0.1 * (vn + 1) for vn in vns]
    items: list[torch.Tensor | float] = [float(10 + vn) for vn in vns]
    previous = _profile(rank, vns) if profile else None
    return layout.encode(
        vns, losses, weights, kind, items, previous, rank, signal, lead, torch.device("cpu")
    )


def test_sums_over_workers_decode_to_vn_order_totals_and_profiles() -> None:
    layout = StatsLayout(V, W)
    assert layout.numel == 6 * V + 10 * W
    a = _encode(layout, [0, 1, 2], "sum", 0, True, signal=0, lead=3)
    b = _encode(layout, [3, 4], "sum", 1, True, signal=5, lead=0)
    stats = layout.decode(a + b)
    want_loss = 0.0
    for vn in range(V):
        want_loss += torch.tensor(1.0 / (vn + 3)).double().item() * (0.1 * (vn + 1))
    assert stats.loss_total == want_loss  # VN order, float64, bit for bit
    assert stats.items_total == sum(10.0 + vn for vn in range(V))
    assert stats.sum_workers == 2 and stats.bad_items == 0
    assert stats.profile is not None and stats.profile.step == 7
    assert stats.profile.workers == (_profile(0, [0, 1, 2]), _profile(1, [3, 4]))
    assert stats.signals == (0, 5)  # each worker's word in its own slot, by rank
    assert stats.leads == (3, 0)  # each worker's data lead in its own slot, by rank


def test_no_profile_until_every_worker_sent_one() -> None:
    layout = StatsLayout(V, W)
    stats = layout.decode(
        _encode(layout, [0, 1, 2], "mean", 0, True) + _encode(layout, [3, 4], "mean", 1, False)
    )
    assert stats.profile is None and stats.sum_workers == 0


def test_invalid_item_counts_are_counted_on_the_device() -> None:
    layout = StatsLayout(2, 1)
    losses = [torch.tensor(1.0, requires_grad=True) * 1.0 for _ in range(2)]
    items = [torch.tensor(-1.0), torch.tensor(float("nan"))]
    stats = layout.decode(
        layout.encode([0, 1], losses, [1.0, 1.0], "sum", items, None, 0, 0, 0, torch.device("cpu"))
    )
    assert stats.bad_items == 2


@pytest.mark.parametrize("v", [1, 3, 5, 9])  # read one by one up to 4 VNs, stacked beyond
def test_single_worker_totals_equal_the_statistics_path(v: int) -> None:
    layout = StatsLayout(v, 1)
    losses = [torch.tensor(0.3 * (vn + 1)) for vn in range(v)]
    weights = [(vn % 3 + 1) / 7 for vn in range(v)]
    via_stats = layout.decode(
        layout.encode(
            list(range(v)), losses, weights, "mean", [0.0] * v, None, 0, 0, 0, torch.device("cpu")
        )
    )
    loss_total, items_total, bad = local_totals(losses, weights, None)
    assert (loss_total, items_total, bad) == (via_stats.loss_total, 0.0, 0.0)
