"""torch.compile under vflow.Executor (docs/guide.md, "torch.compile").

A model compiled by inductor trains under the Executor, dropout included: inductor
draws the seeds of its random kernels from torch's default generator, which vflow
seeds for every VN (Note [VN randomness], vflow/mapping/rng.py), so a compiled
model's dropout masks are fixed by (seed, step, VN) as eager ones are. They are other
masks than eager's, drawn by other kernels; the training is bitwise identical across
mappings in deterministic mode all the same: 1, 2 and 3 Gloo processes, even and
uneven plans, and VNs of two sizes (22 samples in 6 VNs).

Compiling is slow on a small CPU machine, so one spawn of 3 processes trains every
mapping (on groups of its first 1, 2 and 3 ranks), and all processes share one
inductor cache (tests/support/compiled.py).
"""

from __future__ import annotations

import math
import re

import pytest
import torch
import torch.distributed as dist

import vflow
from tests.support.compiled import (
    batches,
    differing,
    dropout_mlp,
    mean_ce,
    shared_inductor_cache,
    snapshot,
)
from vflow.world.launch import run_ranks

pytestmark = pytest.mark.slow

V = 6
STEPS = 3

# world size -> {mapping name: VN counts per worker}
MAPPINGS: dict[int, dict[str, list[int]]] = {
    1: {"1 process": [6]},
    2: {"2 processes [3,3]": [3, 3], "2 processes [4,2]": [4, 2]},
    3: {"3 processes [2,2,2]": [2, 2, 2]},
}
# case -> global batch size
CASES: dict[str, int] = {"VNs of one size": 24, "VNs of two sizes": 22}


def train(counts: list[int], size: int, compiled: bool, group: object) -> dict:
    """STEPS deterministic steps of the dropout MLP."""
    model = dropout_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    driven = torch.compile(model) if compiled else model
    with vflow.Executor(
        driven,
        optimizer,
        mean_ce,
        V,
        seed=3,
        plan=vflow.Plan(counts=counts),
        deterministic=True,
        process_group=group,
        timeout=120,
    ) as ex:
        losses = [ex.step(batch).loss for batch in batches(STEPS, size)]
    return {"losses": losses, "state": snapshot(model, optimizer)}


def dropout_outputs(seeds: list[int]) -> list[torch.Tensor]:
    """The compiled model's output on one input, training mode, after seeding torch's
    default generator with each of ``seeds``: what vflow does before every VN."""
    compiled = torch.compile(dropout_mlp())
    x = torch.ones(4, 6)
    outputs = []
    for seed in seeds:
        torch.manual_seed(seed)
        outputs.append(compiled(x).detach())
    return outputs


def _run_mappings(rank: int, world_size: int) -> dict:
    """Every mapping of MAPPINGS on the ranks it needs, world size 1 first: the others
    wait for it so that they find its graphs compiled."""
    groups = {n: dist.new_group(list(range(n))) for n in sorted(MAPPINGS)}
    out = {}
    for n in sorted(MAPPINGS):
        if rank < n:
            for name, counts in MAPPINGS[n].items():
                for case, size in CASES.items():
                    out[(name, case)] = train(counts, size, True, groups[n])
        if n == 1 and rank == 0:
            out["eager"] = train([6], 24, False, groups[1])
            out["outputs"] = dropout_outputs([7, 7, 8])
            # Traced afresh under the flag (its compiled code is cached on disk).
            torch._dynamo.reset()
            with torch._dynamo.config.patch(compiled_autograd=True):
                out["compiled_autograd flag"] = train([6], 24, True, groups[1])
        dist.barrier()
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    with shared_inductor_cache(tmp_path_factory):
        return [r.value for r in run_ranks(max(MAPPINGS), _run_mappings, timeout=400)]


@pytest.fixture(scope="module")
def reference(results: list[dict]) -> dict:
    return results[0]


def test_a_compiled_model_with_dropout_trains(reference: dict) -> None:
    got = reference[("1 process", "VNs of one size")]
    assert all(math.isfinite(x) for x in got["losses"])
    start = {f"param {k}": v for k, v in dropout_mlp().named_parameters()}
    assert not [k for k, v in start.items() if torch.equal(got["state"][k], v)]


def test_compiled_dropout_draws_from_the_default_generator_vflow_seeds(reference: dict) -> None:
    first, again, other = reference["outputs"]
    assert torch.equal(first, again)
    assert not torch.equal(first, other)


def test_compiled_dropout_draws_other_masks_than_eager(reference: dict) -> None:
    compiled = reference[("1 process", "VNs of one size")]["losses"]
    assert compiled[0] != reference["eager"]["losses"][0]


@pytest.mark.parametrize("world_size", [2, 3])
def test_every_mapping_is_bitwise_identical_to_one_process(
    world_size: int, results: list[dict], reference: dict
) -> None:
    for name in MAPPINGS[world_size]:
        for case in CASES:
            want = reference[("1 process", case)]
            for rank in range(world_size):
                got = results[rank][(name, case)]
                where = f"{name}, {case}, rank {rank}"
                assert got["losses"] == want["losses"], f"{where}: losses differ"
                assert not differing(got["state"], want["state"]), f"{where}: state differs"


def test_the_compiled_autograd_flag_alone_changes_nothing(reference: dict) -> None:
    got, want = reference["compiled_autograd flag"], reference[("1 process", "VNs of one size")]
    assert got["losses"] == want["losses"]
    assert not differing(got["state"], want["state"])


def test_compiled_autograd_is_refused_before_anything_changes() -> None:
    from torch._dynamo import compiled_autograd

    model = dropout_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    (batch,) = batches(1, 24)
    with vflow.Executor(model, optimizer, mean_ce, V, seed=3, deterministic=True) as ex:
        before = snapshot(model, optimizer)
        with compiled_autograd._enable(torch.compile):
            with pytest.raises(
                RuntimeError,
                match=re.escape(
                    "vflow.Executor.step: torch's compiled autograd is enabled, and vflow "
                    "does not support it"
                ),
            ):
                ex.step(batch)
        assert ex.step_count == 0
        assert not differing(snapshot(model, optimizer), before)
        assert all(p.grad is None for p in model.parameters())
        loss = ex.step(batch).loss
    fresh = dropout_mlp()
    fresh_optimizer = torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9)
    with vflow.Executor(fresh, fresh_optimizer, mean_ce, V, seed=3, deterministic=True) as ex:
        assert ex.step(batch).loss == loss
    assert not differing(snapshot(model, optimizer), snapshot(fresh, fresh_optimizer))
