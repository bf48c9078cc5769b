"""The main job's pipeline row: the digits as a residual MLP (``make_pipeline_model``)
cut into 2 pipeline stages, trained with the same B, V and seed on 2 replicas (4
processes) and on 1 replica (2 processes: half the devices, twice the VNs each), beside
the model trained without a pipeline on one process. All three must end bitwise
identical (deterministic mode). The table gives each run's median step time beside the
bubble formula's prediction, and its largest peak memory per process.

The prediction: a replica of S stages running M microbatches takes (M + S - 1) slots,
a slot being one stage's forward and backward of one VN. The slot comes from the
single-process run, independently of the pipelined runs it judges: its median VN time
(the whole model's forward and backward) over S. The prediction leaves out what a
pipeline adds (sends and receives, the reduction across replicas, the optimizer);
the 2-replica run's 4 processes share the cores of a machine with fewer than 4.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

import vflow
from vflow.bench.table import format_table
from vflow.demo.digits import load_digits_split, make_pipeline_model
from vflow.world.launch import run_ranks

STAGES = 2
LR = 1e-3  # AdamW's
GRIDS = ((1, 1), (STAGES, 2), (STAGES, 1))  # (stages, replicas); the first is the reference


@dataclass(frozen=True)
class Outcome:
    stages: int
    replicas: int
    step_seconds: float  # median over the steps after the first
    vn_seconds: float  # median forward + backward of a VN on the first process
    peak_mib: float  # the largest growth of a process's peak resident memory
    losses: list[float]
    model: dict[str, torch.Tensor]

    @property
    def name(self) -> str:
        stages = f"{self.stages} stage{'s' if self.stages > 1 else ''}"
        return f"{stages} x {self.replicas} replica{'s' if self.replicas > 1 else ''}"


def _status(field: str) -> float:
    """A /proc/self/status memory figure in MiB (0 where there is no /proc)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def _reset_peak() -> None:
    # Linux: writing 5 resets the peak resident set size (VmHWM) to the current one.
    try:
        with open("/proc/self/clear_refs", "w") as clear:
            clear.write("5")
    except OSError:
        pass


def _train(rank: int, world_size: int, stages: int, settings: dict[str, Any]) -> dict[str, Any]:
    x_train, y_train, _, _ = load_digits_split(settings["seed"])
    baseline = _status("VmRSS")
    _reset_peak()
    ex = vflow.PipelineExecutor(
        make_pipeline_model(settings["seed"]),
        lambda params: torch.optim.AdamW(params, lr=LR),
        lambda output, target: F.cross_entropy(output, target),
        settings["virtual_nodes"],
        seed=settings["seed"],
        pipeline=vflow.Pipeline(stages),
        deterministic=True,
        timeout=settings["timeout"],
    )
    sampler = vflow.VNBatchSampler(
        len(y_train), settings["batch_size"], vflow.Plan([1]), 0, seed=settings["seed"]
    )
    losses, seconds, vn_seconds = [], [], []
    for step in range(settings["steps"]):
        indices, _ = sampler.step_indices(step)
        start = time.perf_counter()
        result = ex.step(x_train[indices], y_train[indices])
        seconds.append(time.perf_counter() - start)
        losses.append(result.loss)
        vn_seconds += [v.forward_s + v.backward_s for v in result.profile.vns]
    state = ex.full_state_dict()
    ex.close()
    return {
        "losses": losses,
        "step_seconds": statistics.median(seconds[1:] or seconds),
        "vn_seconds": statistics.median(vn_seconds),
        "peak_mib": _status("VmHWM") - baseline,
        "model": state["model"] if rank == 0 else None,
    }


def _single(stages: int, settings: dict[str, Any]) -> dict[str, Any]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # like every rank: a condition of deterministic mode
    try:
        return _train(0, 1, stages, settings)
    finally:
        torch.set_num_threads(threads)


def virtual_nodes_for(batch_size: int, virtual_nodes: int) -> int:
    """The row's V: the demo's, or the largest divisor of B below it (a pipeline's
    microbatches share one shape); at least 2 per replica of 2 for 1F1B."""
    divisor = max(v for v in range(1, virtual_nodes + 1) if batch_size % v == 0)
    if divisor < 2 * STAGES:
        raise ValueError(
            f"the pipeline row needs a V >= {2 * STAGES} that divides B={batch_size} (up to "
            f"--virtual-nodes={virtual_nodes})"
        )
    return divisor


def run(settings: dict[str, Any]) -> list[Outcome]:
    """The three runs of ``settings`` (batch_size, virtual_nodes, seed, steps,
    timeout), the reference first."""
    outcomes = []
    for stages, replicas in GRIDS:
        if stages * replicas == 1:
            ranks = [_single(stages, settings)]
        else:
            ranks = [
                r.value
                for r in run_ranks(
                    stages * replicas,
                    _train,
                    stages,
                    settings,
                    timeout=settings["timeout"],
                    collective_timeout=min(settings["timeout"], 120.0),
                )
            ]
        outcomes.append(
            Outcome(
                stages,
                replicas,
                statistics.median(r["step_seconds"] for r in ranks),
                ranks[0]["vn_seconds"],
                max(r["peak_mib"] for r in ranks),
                ranks[0]["losses"],
                ranks[0]["model"],
            )
        )
    return outcomes


def identical(outcomes: list[Outcome]) -> bool:
    """Whether every run ended with the reference's parameters and losses, bit for bit."""
    reference = outcomes[0]
    return all(
        o.losses == reference.losses
        and o.model.keys() == reference.model.keys()
        and all(torch.equal(o.model[k], reference.model[k]) for k in reference.model)
        for o in outcomes[1:]
    )


def predicted_step_seconds(outcome: Outcome, reference: Outcome, virtual_nodes: int) -> float:
    """(M + S - 1) slots of the reference's VN time over S (the module docstring)."""
    microbatches = virtual_nodes // outcome.replicas
    slot = reference.vn_seconds / outcome.stages
    return (microbatches + outcome.stages - 1) * slot


def table(outcomes: list[Outcome], virtual_nodes: int) -> str:
    reference = outcomes[0]
    rows = []
    for o in outcomes:
        predicted = predicted_step_seconds(o, reference, virtual_nodes)
        rows.append(
            [
                o.name,
                str(o.stages * o.replicas),
                str(virtual_nodes // o.replicas),
                f"{1e3 * o.step_seconds:.1f}",
                f"{1e3 * predicted:.1f}",
                f"{o.peak_mib:.0f}",
                "reference" if o is reference else ("yes" if identical([reference, o]) else "NO"),
            ]
        )
    headers = ["pipeline run", "processes", "VNs per replica", "step ms (median)",
               "predicted ms", "peak MiB per process", "same bits"]  # fmt: skip
    cores = os.cpu_count() or 1
    note = (
        f"predicted: (M + S - 1) slots, a slot = the 1-process run's VN time / S; no "
        f"communication or optimizer. {cores} CPU core(s) here"
        + (": the 4-process run shares them" if cores < 4 else "")
    )
    return format_table(headers, rows) + "\n" + note
