"""The main job's heterogeneous row: 2 workers at speeds 2:1, the second one
*emulated* at half speed (vflow.planning.SlowDown), once with the even plan and once
with ``plan="auto"``, which profiles the workers and moves VNs to the faster one. The
two runs train side by side, their steps interleaved (vflow.demo.mappings.run_together),
so that the load of a shared machine meets both alike. Their parameters must equal the
first run's bitwise like every other mapping's; ``table`` gives their steady throughput
side by side with the bounds for whole VNs."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

import vflow
from vflow.bench import records
from vflow.bench.table import format_table
from vflow.demo.mappings import Outcome, Run
from vflow.planning import planner

# Worker w's compute is SLOWDOWN[w] times slower (emulated).
SLOWDOWN = (1.0, 2.0)


def runs(virtual_nodes: int, batch_size: int) -> list[Run]:
    """The two runs: the even plan, then plan="auto" starting from it."""
    even = vflow.Plan.even(virtual_nodes, len(SLOWDOWN)).counts
    return [
        Run(f"vflow, {len(SLOWDOWN)} workers at speeds {speeds_label()} (emulated), {kind}",
            len(SLOWDOWN), batch_size, even, SLOWDOWN, kind == 'plan="auto"')
        for kind in ("even plan", 'plan="auto"')
    ]  # fmt: skip


def speeds_label() -> str:
    """SLOWDOWN as relative speeds, e.g. "2:1"."""
    slowest = max(SLOWDOWN)
    return ":".join(f"{slowest / f:g}" for f in SLOWDOWN)


def steady_start(outcomes: Sequence[Outcome]) -> int:
    """The first steady step: the one after the first step under the automatic plan's
    last change (that one pays for the change), or after the first step of all."""
    last = max((c["step"] for o in outcomes for c in o.plan_changes), default=0)
    return last + 1


def steady_step_seconds(outcome: Outcome, start: int) -> float:
    """The median step time from step ``start`` on."""
    times = outcome.step_seconds[start:]
    return float(np.median(times)) if times else math.nan


def gain_over(even: Outcome, other: Outcome, start: int) -> float:
    """How many times faster ``other`` is than the even run from step ``start`` on: the
    median of the per-step ratios, inverted. The two runs' steps interleave (step k of
    one, then step k of the other), so a step's ratio cancels the load both met; the
    benchmark (benchmarks/heterogeneous.py) pairs its runs the same way."""
    other_s, even_s = other.step_seconds[start:], even.step_seconds[start:]
    return 1 / records.paired_ratio(other_s, even_s) if other_s else math.nan


def _unit_models(slowdown: Sequence[float]) -> list[planner.WorkerModel]:
    """Worker w takes ``slowdown[w]`` units per VN, whatever its size."""
    return [planner.WorkerModel(per_vn_s=f, per_sample_s=0.0) for f in slowdown]


def _even_step_units(virtual_nodes: int, slowdown: Sequence[float]) -> float:
    even = vflow.Plan.even(virtual_nodes, len(slowdown))
    return planner.predict(even, _unit_models(slowdown), virtual_nodes).step_s


def best_whole_vn_gain(virtual_nodes: int, slowdown: Sequence[float]) -> float:
    """Step time of the even plan over that of the best counts plan (vflow.planning.planner) when
    compute alone counts and worker w takes ``slowdown[w]`` units per VN: what moving
    whole, equal VNs can gain at these speeds."""
    best = planner.plan_counts(_unit_models(slowdown), virtual_nodes, virtual_nodes)
    return _even_step_units(virtual_nodes, slowdown) / best.step_s


def compute_bound_gain(virtual_nodes: int, slowdown: Sequence[float]) -> float:
    """The same for a perfect split of the compute (the sum of the workers' speeds)."""
    return _even_step_units(virtual_nodes, slowdown) * sum(1 / f for f in slowdown) / virtual_nodes


def _plan_path(outcome: Outcome) -> str:
    path = str(list(outcome.run.counts or ()))
    for change in outcome.plan_changes:
        path += f" -({change['step']})-> {change['counts']}"
    return path


def changes_after_warmup(outcome: Outcome) -> int:
    """Plan changes other than the first plan from the warm-up's profiles."""
    return sum(1 for change in outcome.plan_changes if change["reason"] != "profiled")


def _decisions_line(outcome: Outcome) -> str:
    if not outcome.plan_changes and outcome.plan_decisions:
        return (
            f'plan="auto" stayed on the even plan ({outcome.plan_decisions[-1]}): the gain '
            "the model predicts is not larger than the step time's noise"
        )
    return 'plan="auto" decisions: ' + ("; ".join(outcome.plan_decisions) or "none")


def table(outcomes: list[Outcome], virtual_nodes: int) -> str:
    """The heterogeneous runs side by side: plans, steady throughput, gain over even,
    the automatic planner's decisions, and the bounds at the speeds set and at the
    speeds measured in the even run."""
    even = next(o for o in outcomes if not o.run.auto_plan)
    start = steady_start(outcomes)
    headers = ["run", "ms per VN by worker", "steady step ms", "samples/s", "vs even plan",
               "max |param diff| vs first", "plans", "changes after warm-up"]  # fmt: skip
    rows = []
    for o in outcomes:
        step_s = steady_step_seconds(o, start)
        rows.append([
            o.run.name, " / ".join(f"{1e3 * t:.2f}" for t in o.vn_seconds),
            f"{1e3 * step_s:.1f}", f"{o.run.global_batch / step_s:.0f}",
            f"{gain_over(even, o, start):.2f}x",
            f"{o.max_param_diff:.2e}" if o.max_param_diff else "0", _plan_path(o),
            str(changes_after_warmup(o)) if o.run.auto_plan else "-",
        ])  # fmt: skip
    lines = [
        "heterogeneous workers, EMULATED (vflow.planning.SlowDown: worker w waits to run "
        f"{list(SLOWDOWN)} times slower); steady = from step {start} on, after the "
        "automatic plan's last change; vs even plan = median of the per-step ratios (the "
        "two runs' steps interleave)",
        format_table(headers, rows),
        *(_decisions_line(o) for o in outcomes if o.run.auto_plan),
        f"bounds over the even plan, compute only (communication and the optimizer do not "
        f"shrink): speeds {speeds_label()} as set: "
        f"{compute_bound_gain(virtual_nodes, SLOWDOWN):.2f}x, "
        f"{best_whole_vn_gain(virtual_nodes, SLOWDOWN):.2f}x with V={virtual_nodes} whole VNs",
    ]
    measured = even.vn_seconds
    if measured and all(t > 0 for t in measured):
        fastest = min(measured)
        ratio = [t / fastest for t in measured]
        label = ":".join(f"{max(ratio) / r:.2f}" for r in ratio)
        lines[-1] += (
            f"; speeds {label} as measured in the even run: "
            f"{compute_bound_gain(virtual_nodes, ratio):.2f}x, "
            f"{best_whole_vn_gain(virtual_nodes, ratio):.2f}x with whole VNs"
        )
    return "\n".join(lines)
