"""What each fault of a cluster costs an elastic job: the faults of
tests/elastic/test_faults.py played on three hosts made of network namespaces
(tests/support/hosts.py, root and Linux), for vflow (README.md's "Several machines"
worker line, examples/train_elastic.py, deterministic) and, for a silent host and a
restarted store, for torchrun's c10d rendezvous on the same three hosts
(benchmarks/_torchrun_baseline.py's agents and DDP workers, which resume from a
checkpoint written every K steps), in the same run.

    python benchmarks/faults.py [--runs N] [--quick] [--only a,d] [--json PATH]

For each fault and system, the median of ``--runs`` runs of:

- detection: from the fault to the survivors' first word of it (vflow: the warning a
  worker logs; torchrun: the first process of the new worker group starting);
- back: from the fault to the first step the job commits again without the lost
  worker (for faults that lose none: the longest time between two steps of a
  worker across the fault);
- recomputed: steps committed before the fault and computed again after it
  (torchrun: the steps since its checkpoint); lost: steps no worker set committed;
- bitwise: whether the job's final model and optimizer state equal the one-worker
  run's, bit for bit (vflow only: torchrun's DDP job is not deterministic);
- what else happened (a stale worker's return, a second copy of the job).

Both systems get the same collective timeout (``--timeout``, 4 s) and torchrun the
tuned rendezvous of benchmarks/elastic.py (keep-alive 1 s x 3, last call 1 s).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import _torchrun_baseline as trb
import torch
from _common import REPO_ROOT, open_process_session

sys.path.insert(0, str(REPO_ROOT))  # tests/support: the hosts and the README's lines

from tests.support import hosts
from tests.support.several_hosts import (
    HostJob,
    assert_bitwise_equal,
    flag,
    hosts_job,
    play_partition,
    play_silent_host,
    play_silent_store,
    play_skew,
    play_slow_link,
    play_stopped_host,
    play_store_restart,
    readme_lines,
    readme_subnet,
    reference,
    state_over_a_slow_link,
)

FAULTS = {
    "a": "a host goes silent (link down)",
    "b": "two hosts partitioned from each other",
    "c": "the store silent, then its host",
    "d": "the store restarted",
    "e": "a clock 30 s ahead",
    "f": "a host stopped (SIGSTOP) past the timeout",
    "g": "a 100 Mbit/s link",
}
TORCHRUN_FAULTS = ("a", "d")
STEPS = int(flag(readme_lines()[1], "--steps"))  # the README line's, for its reference
BIG_STATE_MB = 48


@dataclasses.dataclass
class Outcome:
    """One run of one fault."""

    detection_s: float | None = None
    back_s: float | None = None
    recomputed: int | None = None
    lost: int | None = None
    bitwise: bool | None = None
    note: str = ""


def _recomputed_and_lost(job: HostJob, steps: int) -> tuple[int, int]:
    """Steps two worker sets committed (a set logs a step once per worker: more lines
    than the set's size, or two sizes), and steps nobody committed."""
    by_step = job.sets_per_step()
    twice = sum(len(set(s)) > 1 or len(s) > max(s) for s in by_step.values())
    return twice, len(set(range(steps)) - set(by_step))


def _finish(job: HostJob, alone: dict[str, Any], names: Sequence[str]) -> Outcome:
    codes = job.wait(list(names), timeout=240)
    bitwise = False
    if all(code == 0 for code in codes.values()):
        try:
            assert_bitwise_equal(job.result(), alone)
            bitwise = True
        except (AssertionError, FileNotFoundError):
            bitwise = False
    recomputed, lost = _recomputed_and_lost(job, STEPS)
    return Outcome(recomputed=recomputed, lost=lost, bitwise=bitwise)


def _drops(job: HostJob, names: Sequence[str]) -> int:
    return sum(e["reason"] == "crash" for n in names for e in job.events(n))


def vflow_a(machines: hosts.Hosts, job: HostJob, flags: dict[str, str], alone: Any) -> Outcome:
    marks = play_silent_host(machines, job, flags)
    out = _finish(job, alone, "abc")
    seen = job.logged_at("a", "during step")
    out.detection_s = None if seen is None else seen - marks["down"]
    out.back_s = marks["a"] - marks["down"]
    out.note = f"c back {marks['rejoined'] - marks['up']:.1f} s after its link"
    return out


def vflow_b(machines: hosts.Hosts, job: HostJob, flags: dict[str, str], alone: Any) -> Outcome:
    marks = play_partition(machines, job, flags)
    out = _finish(job, alone, "abc")
    seen = job.logged_at("a", "during step")
    out.detection_s = None if seen is None else seen - marks["cut"]
    out.back_s = marks["a"] - marks["cut"]
    kept = [n for n in "bc" if any(s["t"] > marks["a"] for s in job.steps(n))]
    out.note = f"one set goes on (a+{'+'.join(kept)})"
    return out


def vflow_c(machines: hosts.Hosts, job: HostJob, flags: dict[str, str], alone: Any) -> Outcome:
    marks = play_silent_store(machines, job, flags, float(flags["timeout"]))
    gap = job.longest_gap("b", marks["silent"])
    seen = job.logged_at("b", "during step")
    saved = [torch.load(job.folder / f"{n}.pt", weights_only=True) for n in "bc"]
    lost = sum(
        job.steps(n)[-1]["step"] + 1 - state["executor"]["step_count"]
        for n, state in zip("bc", saved, strict=True)
    )
    return Outcome(
        detection_s=None if seen is None else seen - marks["down"],
        recomputed=0,
        lost=lost,
        note=f"trains on without the store (longest step gap {gap:.2f} s); host lost: b and "
        f"c stop with their checkpoints {marks['ended'] - marks['down']:.1f} s later",
    )


def vflow_d(machines: hosts.Hosts, job: HostJob, flags: dict[str, str], alone: Any) -> Outcome:
    marks = play_store_restart(machines, job, flags)
    out = _finish(job, alone, ["a", "b", "c", "late"])
    out.detection_s = marks["registered"] - marks["restarted"]
    out.back_s = job.longest_gap("a", marks["killed"] - 1.0)
    out.note = (
        f"re-registered {out.detection_s:.2f} s after the restart; a worker started then "
        f"joined at step {job.steps('late')[0]['step']} (not 0)"
    )
    return out


def vflow_e(machines: hosts.Hosts, job: HostJob, flags: dict[str, str], alone: Any) -> Outcome:
    play_skew(machines, job, flags)
    out = _finish(job, alone, "abc")
    out.back_s = job.longest_gap("a")
    out.note = f"{_drops(job, 'abc')} drops in {STEPS} steps"
    return out


def vflow_f(machines: hosts.Hosts, job: HostJob, flags: dict[str, str], alone: Any) -> Outcome:
    marks = play_stopped_host(machines, job, flags)
    out = _finish(job, alone, "abc")
    seen = job.logged_at("a", "during step")
    out.detection_s = None if seen is None else seen - marks["stopped"]
    out.back_s = job.longest_gap("a")
    out.note = "the others' longest stall; c joins again"
    return out


def vflow_g(machines: hosts.Hosts, job: HostJob, flags: dict[str, str], alone: Any) -> Outcome:
    play_slow_link(machines, job, flags)
    out = _finish(job, alone, "abc")
    joined = job.events("c")[0]["seconds"]
    out.back_s = job.longest_gap("a")
    # The digits CNN's state is 0.8 MB; a larger one shows the transfer's own speed.
    big = state_over_a_slow_link(BIG_STATE_MB, 2.0, "100mbit")
    rate = BIG_STATE_MB * 2**20 * 8 / 100e6
    out.note = (
        f"c's join {joined:.2f} s, {_drops(job, 'abc')} drops; {BIG_STATE_MB} MB of state "
        f"with a 2 s timeout: {big['seconds']:.2f} s (at the link's rate: {rate:.2f} s)"
    )
    return out


VFLOW: dict[str, Callable[..., Outcome]] = {
    "a": vflow_a,
    "b": vflow_b,
    "c": vflow_c,
    "d": vflow_d,
    "e": vflow_e,
    "f": vflow_f,
    "g": vflow_g,
}


def run_vflow(fault: str, folder: Path, timeout_s: float, alone: Any) -> Outcome:
    flags = {"sleep": "0.03", "timeout": f"{timeout_s:g}"}
    with hosts_job(folder) as (machines, job):
        return VFLOW[fault](machines, job, flags, alone)


# ---- torchrun on the same hosts -----------------------------------------------------


class HostsChain(trb._Chain):
    """torchrun's agents on namespace hosts: node a on host a (with the store), b on b,
    c on c, and later ones on b; a silent host (``link-down``) and a restart of the
    store (``store-restart``: killed, started again at its port) as events."""

    kinds = (*trb.KINDS, "link-down", "store-restart")
    interface = "eth0"

    def __init__(
        self, events: Sequence[trb.Event], s: trb.Settings, run_dir: Path, machines: hosts.Hosts
    ) -> None:
        super().__init__(events, s, run_dir)
        self.machines = machines
        self.restarted_at: float | None = None
        self.failed_at: float | None = None

    def poll(self) -> None:
        try:
            super().poll()
        except trb._Abort:
            if self.failed_at is None:
                self.failed_at = time.time()
            raise

    def result(self, wall_s: float, error: str | None, log_dir: str | None) -> trb.RunResult:
        result = super().result(wall_s, error, log_dir)
        result.extra.update(restarted_at=self.restarted_at, failed_at=self.failed_at)
        return result

    def host(self, name: str) -> str:
        return name if name in self.machines.names else "b"

    def store_address(self) -> str:
        return self.machines.address("a")

    def address(self, name: str) -> str:
        return self.machines.address(self.host(name))

    def launch(self, name: str, argv: list[str]) -> list[str]:
        return self.machines.command("a" if name == "store" else self.host(name), argv)

    def size_after(self, kind: str, size: int) -> int:
        if kind == "link-down":
            return size - 1
        if kind == "store-restart":
            return size
        return super().size_after(kind, size)

    def fire(self, event: trb.Event, size: int) -> tuple[str, float, int]:
        if event.kind == "link-down":
            agent = self.target(event)
            t = time.time()
            self.machines.link_down(self.host(agent.name))
            agent.gone = True
            return agent.name, t, size - 1
        if event.kind == "store-restart":
            assert self.store is not None
            port = self.port
            t = time.time()
            self.store.kill()
            self.store.wait(timeout=30)
            self.start_store(port)
            self.restarted_at = t
            return "store", t, size
        return super().fire(event, size)

    def completions_after(self, t: float, size: int) -> list[tuple[int, float]]:
        # After a restart of the store the group that was training is the one to watch:
        # torchrun starts no new one unless its agents notice.
        if self.fired and self.fired[-1].event.kind == "store-restart" and self.fired[-1].t == t:
            return [
                (step, done)
                for g in self.logs.groups()
                if g.world == size
                for step, done in g.completions().items()
                if done > t
            ]
        return super().completions_after(t, size)


def run_torchrun(fault: str, timeout_s: float, machines_subnet: str) -> trb.RunResult:
    profile = dataclasses.replace(trb.TUNED, name="tuned", pg_timeout_s=timeout_s)
    settings = trb.Settings(
        profile=profile,
        workers=3,
        steps=STEPS,
        checkpoint_every=10,
        hidden=256,
        layers=4,
        batch_size=64,
        timeout_s=300.0,
        event_timeout_s=90.0,
        max_workers=4,
    )
    if fault == "a":
        events = [trb.Event("link-down", 40, "c")]
    else:
        events = [trb.Event("store-restart", 40), trb.Event("grow", 80)]
    with hosts.Hosts(3, subnet=machines_subnet) as machines:
        return trb.run_chain(events, settings, lambda e, s, d: HostsChain(e, s, d, machines))


def torchrun_outcome(fault: str, result: trb.RunResult) -> Outcome:
    if result.error and not result.events:
        return Outcome(note=f"failed: {result.error}")
    event = result.events[-1]
    out = Outcome(
        detection_s=event.phases_s.get("exec"),
        back_s=event.recovery_s,
        recomputed=event.recomputed_steps,
        lost=len(result.missing_steps),
        bitwise=None,
    )
    if fault == "d":
        restart = result.events[0]
        if len(result.events) < 2:
            # The agents did not survive the restart: the job stopped.
            failed, restarted = result.extra.get("failed_at"), result.extra.get("restarted_at")
            last = restart.progress_at_event
            every = result.settings["checkpoint_every"]
            error = result.error or ""
            why = next(
                (w for w in ("RendezvousConnectionError", "DistNetworkError") if w in error),
                error.strip().splitlines()[-1][:80] if error.strip() else "no error",
            )
            out = Outcome(
                detection_s=None if failed is None or restarted is None else failed - restarted,
                lost=(last + 1) - (last + 1) // every * every,
                note=f"an agent exits and the job stops ({why}); the steps since the last "
                "checkpoint are lost to a restart by hand",
            )
            return out
        late = "joined by a restart of every worker" if event.recovered else "never joined"
        after = "recovered" if restart.recovered else "no new group"
        out.note = f"after the restart: {after}; the late worker: {late}"
    if result.error:
        out.note = (out.note + "; " if out.note else "") + f"error: {result.error}"
    return out


# ---- the table ----------------------------------------------------------------------


def _median(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def summarise(system: str, fault: str, runs: Sequence[Outcome]) -> dict[str, Any]:
    bitwise = [r.bitwise for r in runs if r.bitwise is not None]
    return {
        "system": system,
        "fault": fault,
        "what": FAULTS[fault],
        "runs": len(runs),
        "detection_s": _median([r.detection_s for r in runs]),
        "back_s": _median([r.back_s for r in runs]),
        "detection_s_all": [r.detection_s for r in runs],
        "back_s_all": [r.back_s for r in runs],
        "recomputed": _median([r.recomputed for r in runs]),
        "lost": _median([r.lost for r in runs]),
        "bitwise": all(bitwise) if bitwise else None,
        "notes": [r.note for r in runs],
    }


def _s(value: float | None, every: Sequence[float | None] = ()) -> str:
    """A median, with the runs' range when there are several."""
    if value is None:
        return "-"
    present = [v for v in every if v is not None]
    if len(present) < 2:
        return f"{value:.2f}"
    return f"{value:.2f} ({min(present):.2f}-{max(present):.2f})"


def print_table(rows: Sequence[dict[str, Any]]) -> None:
    print()
    header = ("fault", "system", "detection s", "back s", "recomputed", "lost", "bitwise", "note")
    print(" | ".join(header))
    print(" | ".join("---" for _ in header))
    for r in rows:
        bitwise = "-" if r["bitwise"] is None else ("yes" if r["bitwise"] else "NO")
        cells = (
            f"{r['fault']}. {r['what']}",
            r["system"],
            _s(r["detection_s"], r["detection_s_all"]),
            _s(r["back_s"], r["back_s_all"]),
            "-" if r["recomputed"] is None else f"{r['recomputed']:g}",
            "-" if r["lost"] is None else f"{r['lost']:g}",
            bitwise,
            r["notes"][0] if r["notes"] else "",
        )
        print(" | ".join(cells))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3, help="runs per fault and system (median)")
    parser.add_argument("--quick", action="store_true", help="one run each")
    parser.add_argument("--only", default=",".join(FAULTS), help="faults to run, e.g. a,d")
    parser.add_argument("--timeout", type=float, default=4.0, help="collective timeout, s")
    parser.add_argument("--no-torchrun", action="store_true", help="vflow's rows only")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    args = parser.parse_args(argv)
    faults = [f for f in args.only.split(",") if f]
    unknown = [f for f in faults if f not in FAULTS]
    if unknown:
        parser.error(f"--only: faults are {', '.join(FAULTS)}, got {unknown}")
    if args.runs < 1:
        parser.error(f"--runs must be >= 1, got {args.runs}")
    why = hosts.cannot("nft", "tc", "faketime")
    if why is not None:
        print(f"benchmarks/faults.py: cannot make hosts here: {why}", file=sys.stderr)
        return 1
    runs = 1 if args.quick else args.runs
    session = open_process_session(
        args, "faults on three namespace hosts: vflow vs torchrun", threads=1, hosts=3
    )
    rows = []
    with tempfile.TemporaryDirectory(prefix="vflow-faults-") as tmp:
        folder = Path(tmp)
        alone = reference(folder / "alone")
        for fault in faults:
            outcomes = []
            for k in range(runs):
                outcomes.append(run_vflow(fault, folder / f"{fault}{k}", args.timeout, alone))
                print(f"vflow {fault} run {k + 1}: {outcomes[-1]}", flush=True)
            rows.append(summarise("vflow", fault, outcomes))
            if fault in TORCHRUN_FAULTS and not args.no_torchrun:
                outcomes = []
                for k in range(runs):
                    result = run_torchrun(fault, args.timeout, readme_subnet())
                    outcomes.append(torchrun_outcome(fault, result))
                    print(f"torchrun {fault} run {k + 1}: {outcomes[-1]}", flush=True)
                rows.append(summarise("torchrun", fault, outcomes))
    print_table(rows)
    return session.finish(rows)


if __name__ == "__main__":
    sys.exit(main())
