"""Heterogeneous workers: the even plan against plan="auto" and against the limit, on
Gloo ranks of which some are emulated slower (vflow.planning.emulation.SlowDown).

    python benchmarks/heterogeneous.py [--quick] [--json PATH]

Scenarios (all EMULATED heterogeneity on identical cores; what emulation does and does
not show: vflow/planning/emulation.py):

* 2 workers at speeds 2:1 and 3 workers at 3:2:1: step throughput (samples/s) of the
  even plan, of the automatic plan once it has planned, and the limit. Each rank holds
  three replicas of the model, each with a SlowDown of its own (a shared one would carry
  its sleep surplus from one run into the other): an even executor and an auto executor,
  stepped alternately on the same batches, and a calibration replica.

  The limit (headline) is a perfect split of the batch at calibrated speeds plus the
  per-step work that no plan removes; none of it comes from the auto run it judges:
  - speeds: calibration bursts, one after each timed pair of even and auto steps, so
    that a busy machine slows them as it slows the timed steps. In a burst every
    worker runs steps of CALIBRATION_VNS VNs of the benchmark's VN size on a third
    replica, on a process group of its own (the same vflow code path per VN: hooks,
    folds into the accumulating buffers, deterministic mode's tree; no collective with
    the others), for the same wall time, all at once (all busy, as under a balanced
    plan).
    A worker's rate is the VN size over its median VN time (forward + backward);
  - the per-step work: from the even run's profiles, the non-compute time of the worker
    that finishes last (the exposed reduction, the optimizer, the step's bookkeeping;
    the others' includes waiting for it).
  limit step time = B / (sum of the calibrated rates) + that overhead. At 2:1 with
  little overhead it is 1.5x the even plan.

  Two more limits, for comparison only: at the speeds the workers had in the auto run
  itself (anything that slows the workers under the auto plan lowers that one too, so
  it cannot judge the plan) and at those of the even run (where the fast workers idle
  and, on shared cores, run faster than under any balanced plan).

  A second table per scenario accounts for the auto run's step, per worker (medians
  over the timed steps, from the profiles every rank gathers): its VNs against the
  ideal split at the calibrated speeds, compute, waiting (exposed communication,
  including waiting for slower workers), optimizer, other (the rest of the step), and
  the wait that whole VNs alone imply at the calibrated speeds.
* a straggler: 2 equal workers, one slows 2x at step ``--straggle-at``: the steps until
  the automatic plan changes, and the throughput before and after.

Targets (from the issue): at 2:1 auto >= 1.4x even and >= 95 % of the limit; at 3:2:1
auto >= 90 % of the limit (or the account says where the time goes); re-planned within
5 steps. Medians over the timed steps; all in one run.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
from _common import add_output_args, format_table, median, open_process_session, usable_cpus

import vflow
from vflow.bench import records as bench_records
from vflow.planning.emulation import SlowDown
from vflow.world.launch import run_ranks

TARGET_GAIN_2_1 = 1.4
# Of the independent limit, per scenario: at 3:2:1 whole VNs of a 24-VN batch cannot
# follow speeds that drift on shared cores as closely as at 2:1.
TARGET_OF_LIMIT = {"2:1": 0.95, "3:2:1": 0.90}
TARGET_REPLAN_STEPS = 5
# Calibration steps run before the timed ones and are not used: the first steps of a
# fresh replica pay for allocations and SlowDown has not yet settled its surplus.
CALIBRATION_WARMUP_STEPS = 2
# VNs per calibration step: several, so that a VN pays what it pays inside a step (the
# fold into buffers that already hold other VNs' gradients, the ordered tree's merges);
# the first VN of a step only overwrites.
CALIBRATION_VNS = 8


@dataclass(frozen=True)
class Config:
    hidden: int
    layers: int
    virtual_nodes: int
    batch_size: int
    timed_steps: int
    straggle_at: int
    straggle_steps: int
    calibration_burst_s: float  # wall time of one calibration burst, all workers at once
    rank_timeout_s: float  # each multi-rank run, before its ranks are stopped


def _model(cfg: Config) -> torch.nn.Module:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = [torch.nn.Linear(64, cfg.hidden), torch.nn.Tanh()]
    for _ in range(cfg.layers - 1):
        layers += [torch.nn.Linear(cfg.hidden, cfg.hidden), torch.nn.Tanh()]
    layers.append(torch.nn.Linear(cfg.hidden, 10))
    return torch.nn.Sequential(*layers)


def _loss(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return torch.nn.functional.cross_entropy(model(x), y)


def _batch(cfg: Config, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    return (
        torch.randn(cfg.batch_size, 64, generator=gen),
        torch.randint(0, 10, (cfg.batch_size,), generator=gen),
    )


def _executor(cfg: Config, loss_fn: Any, plan: Any) -> vflow.Executor:
    model = _model(cfg)
    return vflow.Executor(
        model,
        torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
        loss_fn,
        cfg.virtual_nodes,
        plan=plan,
        deterministic=True,
        timeout=120,
    )


def _speeds_rank(rank: int, world_size: int, cfg: Config, factors: list[float]) -> dict:
    """The even and the automatic plan side by side: two executors (two replicas of the
    model), stepped alternately, so that a busy machine slows both alike; and after
    each pair a burst of the calibration of the limit's speeds."""
    even = _executor(cfg, SlowDown(_loss, factors[rank]), None)
    auto = _executor(cfg, SlowDown(_loss, factors[rank]), "auto")
    step = 0
    while not auto.plan_history and step < 20:
        even.step(_batch(cfg, step))
        auto.step(_batch(cfg, step))
        step += 1
    planned_at = auto.plan_history[0].step if auto.plan_history else None
    calibration = _Calibration(cfg, SlowDown(_loss, factors[rank]), rank, world_size)
    even_times, auto_times = [], []
    measured: dict[str, list[dict[str, Any]]] = {"even": [], "auto": []}
    account_rows: list[list[dict[str, float]]] = []
    for k in range(step, step + cfg.timed_steps + 1):  # the first under the plan: warm-up
        even_result = even.step(_batch(cfg, k))
        auto_result = auto.step(_batch(cfg, k))
        calibration.burst(timed=k > step)
        if k == step:
            continue
        even_times.append(even_result.timings.total)
        auto_times.append(auto_result.timings.total)
        for name, ex in (("even", even), ("auto", auto)):
            if ex.last_profile is not None:
                measured[name].append(_rates(ex.last_profile))
        if auto.last_profile is not None:
            account_rows.append(_account_row(auto.last_profile))

    def medians(name: str) -> dict[str, Any]:
        rows = measured[name]
        if not rows:
            return {"rates": None, "overhead_s": None}
        return {
            "rates": [median([r["rates"][w] for r in rows]) for w in range(world_size)],
            "overhead_s": median([r["overhead_s"] for r in rows]),
        }

    return {
        "even_times_s": even_times,
        "auto_times_s": auto_times,
        "auto_plan": list(auto.plan.counts),
        "planned_at": planned_at,
        "even_run": medians("even"),
        "auto_run": medians("auto"),
        "auto_account": [
            {key: median([row[w][key] for row in account_rows]) for key in account_rows[0][w]}
            for w in range(world_size)
        ]
        if account_rows
        else None,
        "calibration": calibration.result(),
        "history": [
            (c.step, c.reason, list(c.new.counts), c.predicted_old_s, c.predicted_new_s)
            for c in auto.plan_history
        ],
        "decisions": [f"step {d.step}: {d.describe()}" for d in auto.plan_decisions],
    }


class _Calibration:
    """This worker's samples per second of compute while every worker computes, for the
    limit (module docstring): steps of CALIBRATION_VNS VNs of a replica of its own, on
    a process group of its own, in bursts of ``cfg.calibration_burst_s`` that every
    worker runs at the same time (right after a step they all ended together). A fixed
    time rather than a
    fixed count keeps all workers busy until the end of a burst, as under a balanced
    plan; a fast worker that finished early would leave the slow ones the cores to
    themselves and flatter their speed."""

    def __init__(self, cfg: Config, slow: SlowDown, rank: int, world_size: int) -> None:
        # new_group is a collective of the default group: every rank creates every group.
        solo = [dist.new_group([r]) for r in range(world_size)][rank]
        self._cfg = cfg
        self._vn_size = cfg.batch_size // cfg.virtual_nodes
        x, y = _batch(cfg, 10**6)  # a batch no timed step uses
        samples = self._vn_size * CALIBRATION_VNS
        self._batch = (x[:samples], y[:samples])
        model = _model(cfg)
        self._executor = vflow.Executor(
            model,
            torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
            slow,
            CALIBRATION_VNS,
            process_group=solo,
            deterministic=True,
            timeout=120,
        )
        self._vn_s: list[float] = []
        for _ in range(CALIBRATION_WARMUP_STEPS):
            self._executor.step(self._batch)

    def burst(self, timed: bool) -> None:
        end = time.perf_counter() + self._cfg.calibration_burst_s
        while True:
            vns = self._executor.step(self._batch).profile.vns
            if timed:
                self._vn_s += [vn.forward_s + vn.backward_s for vn in vns]
            if time.perf_counter() >= end:
                return

    def result(self) -> dict[str, Any]:
        vn_s = median(self._vn_s)
        return {"rate": self._vn_size / vn_s, "vn_s": vn_s, "vns": len(self._vn_s)}


def _account_row(profile: vflow.StepProfile) -> list[dict[str, float]]:
    """Where each worker's step went: compute, waiting (exposed communication, which
    holds the wait for slower workers), optimizer and the rest of the step."""
    return [
        {
            "vns": float(len(w.vns)),
            "samples": float(w.samples),
            "compute_s": w.compute_s,
            "waiting_s": w.exposed_comm_s,
            "optimizer_s": w.optimizer_s,
            "other_s": w.step_s - w.compute_s - w.exposed_comm_s - w.optimizer_s,
            "step_s": w.step_s,
        }
        for w in profile.workers
    ]


def _rates(profile: vflow.StepProfile) -> dict[str, Any]:
    """Each worker's samples per second of compute, and the part of a step that is not
    compute and that no plan removes: the non-compute time of the worker that finishes
    last (the others' includes waiting for it), i.e. the exposed reduction, the
    optimizer and the step's own bookkeeping."""
    rates = [w.samples / w.compute_s for w in profile.workers]
    return {"rates": rates, "overhead_s": vflow.planner.fixed_step_s([profile])}


def _straggler_rank(rank: int, world_size: int, cfg: Config) -> dict:
    slow = SlowDown(_loss, 1.0)
    auto = _executor(cfg, slow, "auto")
    times = []
    for step in range(cfg.straggle_at + cfg.straggle_steps):
        if rank == 1 and step == cfg.straggle_at:
            slow.factor = 2.0
        times.append(auto.step(_batch(cfg, step)).timings.total)
    return {
        "times_s": times,
        "history": [(c.step, c.reason, list(c.new.counts)) for c in auto.plan_history],
    }


def speeds(cfg: Config, factors: list[float]) -> dict[str, Any]:
    results = [
        r.value
        for r in run_ranks(
            len(factors),
            _speeds_rank,
            cfg,
            factors,
            timeout=cfg.rank_timeout_s,
            collective_timeout=120,
        )
    ]
    return summarize_speeds(cfg.batch_size, factors, _with_calibration(results))


def _with_calibration(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Rank 0's result, with every rank's calibration (each rank measured only its own)."""
    return {
        **results[0],
        "calibration": {
            key: [r["calibration"][key] for r in results] for key in ("rate", "vn_s", "vns")
        },
    }


def summarize_speeds(b: int, factors: list[float], first: dict[str, Any]) -> dict[str, Any]:
    """Throughputs, limits, ratios and the account of the auto run's step, from rank 0's
    result of ``_speeds_rank`` with every rank's calibration (``_with_calibration``).

    The headline limit reads only the calibration and the even run: nothing of the auto
    run that it judges."""
    even_s = median(first["even_times_s"])
    auto_s = median(first["auto_times_s"])

    def limit(rates: list[float] | None, overhead_s: float | None) -> float | None:
        if rates is None or overhead_s is None:
            return None
        return b / sum(rates) + overhead_s

    calibrated = first["calibration"]["rate"]
    even_overhead_s = first["even_run"]["overhead_s"]
    limit_s = limit(calibrated, even_overhead_s)
    auto_speeds_limit_s = limit(first["auto_run"]["rates"], first["auto_run"]["overhead_s"])
    even_speeds_limit_s = limit(first["even_run"]["rates"], even_overhead_s)

    def per_s(seconds: float | None) -> float | None:
        return None if seconds is None else b / seconds

    def of(seconds: float | None) -> float | None:
        return None if seconds is None else seconds / auto_s

    summary = {
        "factors": factors,
        "even_samples_per_s": b / even_s,
        "auto_samples_per_s": b / auto_s,
        "limit_s": limit_s,
        "limit_samples_per_s": per_s(limit_s),
        "limit_source": "calibrated rates + even run's non-compute time of the last worker",
        "calibrated_rates": calibrated,
        "calibration": first["calibration"],
        "overhead_s": even_overhead_s,
        "auto_run_rates": first["auto_run"]["rates"],
        "even_run_rates": first["even_run"]["rates"],
        "auto_speeds_limit_s": auto_speeds_limit_s,
        "auto_speeds_limit_samples_per_s": per_s(auto_speeds_limit_s),
        "even_speeds_limit_s": even_speeds_limit_s,
        "even_speeds_limit_samples_per_s": per_s(even_speeds_limit_s),
        "auto_over_even": even_s / auto_s,
        "auto_over_limit": of(limit_s),
        "auto_over_auto_speeds_limit": of(auto_speeds_limit_s),
        "auto_over_even_speeds_limit": of(even_speeds_limit_s),
        "auto_plan": first["auto_plan"],
        "planned_at": first["planned_at"],
        "account": account(first["auto_account"], calibrated),
        "history": first["history"],
        "decisions": first["decisions"],
        "even_times_s": first["even_times_s"],
        "auto_times_s": first["auto_times_s"],
    }
    summary["gap_to_limit"] = gap_to_limit(b, summary)
    return summary


def account(
    workers: list[dict[str, float]] | None, calibrated: list[float]
) -> list[dict[str, float]] | None:
    """Per worker of the auto run, its medians, plus what the calibrated speeds say of
    its share: the ideal number of VNs (a perfect split, in VNs of the benchmark's
    size) and the wait that its whole VNs alone imply (the slowest worker's compute at
    the calibrated speeds less its own); waiting beyond that is exposed reduction,
    noise, or speeds that moved away from the calibration."""
    if not workers:
        return None
    vns_total = sum(w["vns"] for w in workers)
    predicted = [w["samples"] / rate for w, rate in zip(workers, calibrated, strict=True)]
    return [
        {
            **w,
            "ideal_vns": vns_total * rate / sum(calibrated),
            "predicted_compute_s": own,
            "split_wait_s": max(predicted) - own,
        }
        for w, rate, own in zip(workers, calibrated, predicted, strict=True)
    ]


def straggler(cfg: Config) -> dict[str, Any]:
    results = [
        r.value
        for r in run_ranks(
            2, _straggler_rank, cfg, timeout=cfg.rank_timeout_s, collective_timeout=120
        )
    ]
    first = results[0]
    replans = [h for h in first["history"] if h[0] > cfg.straggle_at]
    replanned_at = replans[0][0] if replans else None
    times = first["times_s"]
    before = times[max(1, cfg.straggle_at - 5) : cfg.straggle_at]
    after = times[replanned_at + 1 :] if replanned_at is not None else []
    b = cfg.batch_size
    return {
        "straggle_at": cfg.straggle_at,
        "replanned_at": replanned_at,
        "steps_to_replan": None if replanned_at is None else replanned_at - cfg.straggle_at,
        "before_samples_per_s": b / median(before),
        "slowed_samples_per_s": b / median(times[cfg.straggle_at : replanned_at or len(times)]),
        "after_samples_per_s": b / median(after) if after else None,
        "history": first["history"],
    }


def _verdict(ok: bool | None) -> str:
    return "n/a" if ok is None else ("met" if ok else "MISSED")


def _speeds_label(rates: list[float] | None) -> str:
    return "n/a" if not rates else ":".join(f"{x / min(rates):.2f}" for x in rates)


def _per_s(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.0f}"


def _share(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.0%}"


# The account's times, in the order of its table's columns.
_ACCOUNT_TIMES = ("compute_s", "waiting_s", "optimizer_s", "other_s", "step_s", "split_wait_s")


def _ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds * 1e3:.1f}"


def _targets(name: str, r: dict[str, Any]) -> str:
    """The verdicts of one scenario: gain over even (2:1 only) / share of the limit."""
    of_limit = r["auto_over_limit"]
    limit_ok = None if of_limit is None else of_limit >= TARGET_OF_LIMIT[name]
    gain = _verdict(r["auto_over_even"] >= TARGET_GAIN_2_1) if name == "2:1" else "-"
    return f"{gain} / {_verdict(limit_ok)}"


def gap_to_limit(b: int, r: dict[str, Any]) -> dict[str, float] | None:
    """Where the auto run's step exceeds the limit, from the worker whose compute ends
    last (medians of the account; the parts add up to the gap up to the difference
    between medians):

    * whole_vns_s: its compute at the calibrated speeds under the plan, less the
      perfect split's (what whole VNs cost);
    * slower_than_calibrated_s: its measured compute less that (it computed more slowly
      inside the step than in the calibration: communication threads and the other
      workers on the same cores);
    * non_compute_s: its step less its compute, less the even run's non-compute time
      that the limit counts."""
    rows, limit_s = r["account"], r["limit_s"]
    if not rows or limit_s is None:
        return None
    last = max(rows, key=lambda row: row["compute_s"])
    perfect_s = b / sum(r["calibrated_rates"])
    return {
        "gap_s": median(r["auto_times_s"]) - limit_s,
        "whole_vns_s": last["predicted_compute_s"] - perfect_s,
        "slower_than_calibrated_s": last["compute_s"] - last["predicted_compute_s"],
        "non_compute_s": last["step_s"] - last["compute_s"] - r["overhead_s"],
    }


def account_note(name: str, b: int, r: dict[str, Any]) -> str | None:
    """One line on where the auto run's step exceeds the limit (``gap_to_limit``)."""
    gap = gap_to_limit(b, r)
    if gap is None:
        return None
    rows = r["account"]
    ideal = ":".join(f"{x['ideal_vns']:.1f}" for x in rows)
    plan = ":".join(str(int(x["vns"])) for x in rows)
    return (
        f"{name}: the auto step is {_ms(gap['gap_s'])} ms over the limit: whole VNs "
        f"({plan}, ideal {ideal} at the calibrated speeds) {_ms(gap['whole_vns_s'])} ms, "
        f"compute slower than calibrated {_ms(gap['slower_than_calibrated_s'])} ms, "
        f"non-compute time beyond the even run's {_ms(gap['non_compute_s'])} ms "
        "(the worker whose compute ends last)"
    )


def print_results(results: dict[str, Any]) -> None:
    rows = []
    for name, r in results["speeds"].items():
        rows.append(
            [
                f"{name} (emulated)",
                _speeds_label(r["calibrated_rates"]),
                f"{r['even_samples_per_s']:.0f}",
                f"{r['auto_samples_per_s']:.0f}",
                _per_s(r["limit_samples_per_s"]),
                f"{r['auto_over_even']:.2f}x",
                _share(r["auto_over_limit"]),
                str(r["auto_plan"]),
                _targets(name, r),
                _speeds_label(r["auto_run_rates"]),
                _per_s(r["auto_speeds_limit_samples_per_s"]),
                _share(r["auto_over_auto_speeds_limit"]),
                _speeds_label(r["even_run_rates"]),
                _per_s(r["even_speeds_limit_samples_per_s"]),
                _share(r["auto_over_even_speeds_limit"]),
            ]
        )
    print(
        format_table(
            [
                "workers",
                "speeds (calibrated)",
                "even s/s",
                "auto s/s",
                "limit s/s",
                "auto/even",
                "auto/limit",
                "auto plan",
                "targets (2:1 >=1.4x / >=95%; 3:2:1 >=90%)",
                "auto run: speeds",
                "limit s/s",
                "auto/that",
                "even run: speeds",
                "limit s/s",
                "auto/that",
            ],
            rows,
        )
    )
    notes = []
    for name, r in results["speeds"].items():
        if not r["account"]:
            continue
        print()
        print(
            format_table(
                [
                    f"{name} auto run, worker",
                    "factor",
                    "VNs (ideal)",
                    "compute ms",
                    "waiting ms",
                    "optimizer ms",
                    "other ms",
                    "step ms",
                    "split wait ms",
                ],
                [
                    [
                        str(w),
                        f"{r['factors'][w]:g}",
                        f"{row['vns']:.0f} ({row['ideal_vns']:.1f})",
                        *(_ms(row[key]) for key in _ACCOUNT_TIMES),
                    ]
                    for w, row in enumerate(r["account"])
                ],
            )
        )
        notes.append(account_note(name, results["config"]["batch_size"], r))
        notes.append(f'{name}: plan="auto" decisions: ' + "; ".join(r["decisions"]))
    s = results["straggler"]
    steps = s["steps_to_replan"]
    print()
    print(
        format_table(
            ["straggler (emulated, 1 of 2 slows 2x)", "value"],
            [
                ["slows at step", str(s["straggle_at"])],
                ["first step under the new plan", str(s["replanned_at"])],
                [
                    "steps until re-planned",
                    f"{steps} (target <= {TARGET_REPLAN_STEPS}: "
                    f"{_verdict(None if steps is None else steps <= TARGET_REPLAN_STEPS)})",
                ],
                ["samples/s before", f"{s['before_samples_per_s']:.0f}"],
                ["samples/s slowed, old plan", f"{s['slowed_samples_per_s']:.0f}"],
                [
                    "samples/s after re-planning",
                    "n/a"
                    if s["after_samples_per_s"] is None
                    else f"{s['after_samples_per_s']:.0f}",
                ],
            ],
        )
    )
    print(
        "\nsamples/s: global batch / median step time (rank 0's step, which ends with every "
        "rank's).\nlimit (judges the auto plan): a perfect split of the batch at the "
        "calibrated speeds (bursts after each timed pair of steps: every worker runs "
        f"steps of {CALIBRATION_VNS} VNs of the benchmark's size on a group of its own, "
        "all at once, for the same time) plus the "
        "step's non-compute time from the even run (that of the worker that finishes "
        "last). Nothing in it comes from the auto run. For comparison only: the same "
        "split at the speeds of the auto run itself (anything that slows the workers "
        "under the auto plan lowers it too) and at those of the even run (where the fast "
        "workers idle part of the step, and on these shared cores a worker runs faster "
        "when the others idle).\n"
        "Per-worker tables: medians over the timed steps of the auto run. waiting: "
        "exposed communication, including the wait for slower workers; other: the step "
        "less compute, waiting and optimizer; VNs (ideal): the plan's VNs and a perfect "
        "split at the calibrated speeds; split wait: the wait that the whole-VN split "
        "alone implies at the calibrated speeds.\n"
        + "".join(f"{n}\n" for n in notes if n)
        + "All heterogeneity here is EMULATED: SlowDown waits in proportion to the real "
        "compute (vflow/planning/emulation.py)."
    )


# ---- headline records for the suite's summary (vflow/bench/records.py) ----


# --quick times 4 steps of a small model, whose step is mostly the per-step work that no
# plan shrinks: a smoke run, not a measurement of the targets.
_FULL_RUN: dict[str, Any] = {
    "requires": {"min_samples": 10},
    "why": "the targets are judged on 10 or more timed steps of the default model",
}


def headline_records(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Per scenario, auto against even (paired: stepped alternately; target at 2:1) and
    auto against the independent limit (calibrated speeds and the even run's overhead)."""
    m = bench_records.measurement
    out = []
    for name, r in results["speeds"].items():
        scenario = name.replace(":", "-")
        out.append(
            bench_records.headline(
                "heterogeneous",
                f"heterogeneous/{scenario}/auto-vs-even",
                f"{name} emulated: auto / even plan step time",
                vflow=m(r["auto_times_s"], label='plan="auto"'),
                baseline=m(r["even_times_s"], label="even plan"),
                paired=True,
                target=(
                    bench_records.target("<=", 1 / TARGET_GAIN_2_1, **_FULL_RUN)
                    if name == "2:1"
                    else None
                ),
            )
        )
        if r["limit_s"] is not None:
            out.append(
                bench_records.headline(
                    "heterogeneous",
                    f"heterogeneous/{scenario}/auto-vs-limit",
                    f"{name} emulated: auto / limit step time",
                    vflow=m(r["auto_times_s"], label='plan="auto"'),
                    limit=m(
                        [r["limit_s"]],
                        label="sum of the workers' calibrated throughputs",
                        note="independent of the auto run it judges: each worker's compute "
                        "rate from calibration bursts between the timed steps (steps of "
                        "8 VNs on a group of its own, all workers busy at once), split "
                        "perfectly, plus the non-compute time of the even run's last worker",
                    ),
                    compare="vflow/limit",
                    target=bench_records.target("<=", 1 / TARGET_OF_LIMIT[name], **_FULL_RUN),
                )
            )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_output_args(parser, quick="small model, few steps (CI smoke)")
    parser.add_argument(
        "--virtual-nodes",
        type=int,
        default=24,
        help="V (default 24: whole VNs can match the emulated workers' measured speeds, "
        "which on shared cores are not exactly 2:1, to within a few percent)",
    )
    parser.add_argument("--straggle-at", type=int, default=20)
    args = parser.parse_args(argv)
    if args.virtual_nodes < 3:
        raise SystemExit(
            f"--virtual-nodes must be >= 3 (one VN per worker), got {args.virtual_nodes}"
        )
    quick = args.quick
    cfg = Config(
        hidden=256 if quick else 768,
        layers=2 if quick else 3,
        virtual_nodes=args.virtual_nodes,
        batch_size=16 * args.virtual_nodes,
        timed_steps=4 if quick else 12,
        straggle_at=args.straggle_at,
        straggle_steps=10 if quick else 15,
        calibration_burst_s=0.01 if quick else 0.03,
        # The three runs together stay under run.py's limits (300 s quick, 1200 s full).
        rank_timeout_s=80 if quick else 350,
    )
    session = open_process_session(
        args,
        "vflow benchmark: heterogeneous workers, even vs auto plan vs limit (emulated)",
        threads=1,
        backend="gloo",
        threads_per_rank=1,
        emulated=True,
    )
    print(f"{usable_cpus()} usable CPUs; config: {json.dumps(asdict(cfg))}", flush=True)
    results = {
        "config": asdict(cfg),
        "speeds": {"2:1": speeds(cfg, [1.0, 2.0]), "3:2:1": speeds(cfg, [1.0, 1.5, 3.0])},
        "straggler": straggler(cfg),
    }
    print_results(results)
    return session.finish([{"benchmark": "heterogeneous", **results}, *headline_records(results)])


if __name__ == "__main__":
    sys.exit(main())
