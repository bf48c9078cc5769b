"""The data follows the plan (Note [Data follows the plan], vflow/data/sampler.py): the
README's "Many workers" loop run as written on Gloo ranks, and the same loop with a
``set_plan`` in the middle of an epoch or a DataLoader that draws ahead, with every
served sample recorded so that the tests can check that each sample of each global
batch was used exactly once.

A model whose step is mostly compute (about 3 ms per VN of 8 samples on one thread,
little to reduce), so that the automatic planner sees the emulated 2x slower rank
(``SlowDown``) through any noise of a loaded machine and re-plans within a few steps.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import re
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import vflow
from vflow.mapping.plan import Plan
from vflow.planning.emulation import SlowDown
from vflow.world.launch import HOST, current_store

V, B, SAMPLES, FEATURES, CLASSES = 8, 64, 64 * 16, 16, 4
SEED = 3
README = Path(__file__).resolve().parents[2] / "README.md"


class DeepNet(torch.nn.Module):
    """One 512-wide layer applied 8 times: compute-heavy for its parameter count."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(SEED)
        self.inp = torch.nn.Linear(FEATURES, 512)
        self.mid = torch.nn.Linear(512, 512)
        self.out = torch.nn.Linear(512, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        for _ in range(8):
            h = torch.tanh(self.mid(h))
        return self.out(h)


def loss_fn(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(model(batch[0]), batch[1])


class RecordingData(torch.utils.data.Dataset):
    """(x, y, index) samples; records every index it serves, in order (in this process:
    with DataLoader workers, read the indices from the batches instead)."""

    def __init__(self) -> None:
        gen = torch.Generator().manual_seed(SEED + 1)
        self.x = torch.randn(SAMPLES, FEATURES, generator=gen)
        self.y = torch.randint(0, CLASSES, (SAMPLES,), generator=gen)
        self.served: list[int] = []

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        self.served.append(int(index))
        return self.x[index], self.y[index], int(index)


def readme_snippet() -> str:
    """The python block of the README's "Many workers" section, as written."""
    text = README.read_text(encoding="utf-8")
    section = text.split("### Many workers", 1)[1].split("\n### ", 1)[0]
    blocks = re.findall(r"^```python\n(.*?)^```", section, re.MULTILINE | re.DOTALL)
    assert len(blocks) == 1, "the README's Many workers section has one python block"
    return blocks[0]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


def _model_and_optimizer() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = DeepNet()
    return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def readme_rank(rank: int, world_size: int, snippet: str, slow_factor: float) -> dict[str, Any]:
    """A ``run_ranks`` function: runs ``snippet`` (the README loop) with the names it
    assumes; rank 1 is ``slow_factor`` times slower. The snippet initialises its own
    process group from the environment, as under torchrun."""
    dist.destroy_process_group()  # run_ranks' group: the snippet makes its own
    store = current_store()
    if rank == 0:
        store.set("readme/port", str(_free_port()))
    port = store.get("readme/port").decode()
    os.environ.update(
        MASTER_ADDR=HOST, MASTER_PORT=port, RANK=str(rank), WORLD_SIZE=str(world_size)
    )
    model, optimizer = _model_and_optimizer()
    dataset = RecordingData()
    names: dict[str, Any] = {
        "torch": torch,
        "vflow": vflow,
        "model": model,
        "optimizer": optimizer,
        "loss_fn": SlowDown(loss_fn, slow_factor) if rank == 1 else loss_fn,
        "dataset": dataset,
        "epochs": 2,
    }
    exec(compile(snippet, "README.md, Many workers", "exec"), names)
    ex = names["ex"]
    result = {
        "params": [p.detach().clone() for p in model.parameters()],
        "history": [(c.step, c.new.counts) for c in ex.plan_history],
        "served": dataset.served,
        "steps": ex.step_count,
    }
    ex.close()
    return result


def served_by_step(rank: int, world_size: int, result: dict[str, Any]) -> dict[int, list[int]]:
    """Splits the indices a rank served in order into its steps' local batches, using
    the plan each step ran under (the even plan, then ``plan_history``)."""
    changes = dict(result["history"])
    plan = Plan.even(V, world_size)
    served, out = result["served"], {}
    at = 0
    for step in range(result["steps"]):
        if step in changes:
            plan = Plan(counts=list(changes[step]))
        lo, hi = plan.worker_range(rank, B)
        out[step] = served[at : at + hi - lo]
        at += hi - lo
    assert at == len(served), f"rank {rank} served {len(served) - at} samples beyond its steps"
    return out


def assert_each_sample_once(parts_by_step: list[dict[int, list[int]]], steps: int) -> None:
    """Step k's parts over all ranks are exactly global batch k, each sample once."""
    reference = vflow.VNBatchSampler(SAMPLES, B, Plan.even(V, 1), 0, seed=0)
    for step in range(steps):
        seen = [i for parts in parts_by_step for i in parts.get(step, [])]
        want = reference.step_indices(step)[0]
        assert sorted(seen) == sorted(want), f"step {step}: not its global batch exactly once"
        assert len(seen) == len(set(seen)) == B


# ---- the same loop, with a set_plan or a DataLoader that draws ahead ---------------------


@contextlib.contextmanager
def _may_start_workers() -> Iterator[None]:
    """run_ranks starts its ranks daemonic (they die with the test), and a daemonic
    process may not start children: lifts that for the DataLoader's workers, which end
    with their iterator and watch their parent (torch's worker watchdog) if it dies."""
    config = multiprocessing.current_process()._config  # type: ignore[attr-defined]
    daemon = config.get("daemon")
    config["daemon"] = False
    try:
        yield
    finally:
        config["daemon"] = daemon


def loop_rank(rank: int, world_size: int, scenario: dict[str, Any]) -> dict[str, Any]:
    """The README loop written out, with the scenario's options: ``plan`` ("auto" or
    None), ``deterministic``, ``num_workers`` of the DataLoader, ``slow`` (rank 1's
    factor), ``set_plan`` ((step, counts): called when step_count reaches step, on
    several ranks only). Returns each step's plan and local indices."""
    model, optimizer = _model_and_optimizer()
    slow = scenario.get("slow", 1.0)
    ex = vflow.Executor(
        model,
        optimizer,
        SlowDown(loss_fn, slow) if rank == 1 and slow > 1 else loss_fn,
        virtual_nodes=V,
        plan=scenario.get("plan") if world_size > 1 else None,
        deterministic=scenario.get("deterministic", False),
    )
    dataset = RecordingData()
    sampler = vflow.VNBatchSampler(len(dataset), B, executor=ex, seed=0)
    set_at, counts = scenario.get("set_plan") or (None, None)
    steps: dict[int, tuple[tuple[int, ...], list[int]]] = {}
    waited: dict[str, int] = {}
    workers = scenario.get("num_workers", 0)
    # Persistent workers start once, not every epoch (a second each on a loaded machine);
    # every epoch's iterator still calls iter(sampler).
    loader = torch.utils.data.DataLoader(
        dataset, batch_sampler=sampler, num_workers=workers, persistent_workers=workers > 0
    )
    for epoch in range(2):
        sampler.set_epoch(epoch)
        with _may_start_workers():
            batches = iter(loader)
        for local in batches:
            steps[ex.step_count] = (ex.plan.counts, local[2].tolist())
            ex.step(local, global_batch_size=B)
            if world_size > 1 and ex.step_count == set_at:
                new = Plan(counts=counts)
                ex.set_plan(new)
                first = next(k for k in range(ex.step_count, 10**6) if ex.plan_for_step(k) == new)
                waited = {"called": ex.step_count, "first": first}
    result = {
        "params": [p.detach().clone() for p in model.parameters()],
        "history": [(c.step, c.new.counts) for c in ex.plan_history],
        "steps": steps,
        "set_plan": waited,
    }
    ex.close()
    return result


def scenarios_rank(
    rank: int, world_size: int, scenarios: dict[str, dict[str, Any]]
) -> dict[str, Any]:
    return {name: loop_rank(rank, world_size, scenario) for name, scenario in scenarios.items()}
