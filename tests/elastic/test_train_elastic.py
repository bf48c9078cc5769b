"""examples/train_elastic.py as a user runs it: one job that grows (A, then B joins),
loses B to SIGKILL and gains C ends with an ``--out`` file bitwise equal to the same
flags run alone on one worker. The store and every worker are subprocesses; every wait
is bounded and every process is killed at the end."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.support import REPO_ROOT

pytest.importorskip("sklearn", reason="the example trains on scikit-learn's digits")
if not (dist.is_available() and dist.is_gloo_available()):
    pytest.skip("needs torch.distributed with Gloo", allow_module_level=True)

SCRIPT = REPO_ROOT / "examples" / "train_elastic.py"
REQUIRED = ("--rdzv", "--job", "--steps", "--virtual-nodes", "--seed", "--deterministic", "--out")
STEPS = 200
# A sleeps this long before each step until it has seen the scenario's three changes
# (grow, crash, grow), so that B and C join long before the job's end on a loaded
# machine; the rest of the steps run at full speed.
SLEEP = "0.3"
WAIT_S = 90.0


def _env() -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    # Bitwise equality needs the same thread count in every worker and in the
    # one-worker run; no GPU: the example trains on the CPU with Gloo.
    env.update(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", PYTHONUNBUFFERED="1")
    return env


@pytest.fixture(scope="module")
def rendezvous() -> Iterator[str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "vflow", "rendezvous", "--port", "0"],
        stdout=subprocess.PIPE,
        text=True,
        env=_env(),
    )
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 60)
        assert ready, "python -m vflow rendezvous printed no address within 60 s"
        endpoint = proc.stdout.readline().strip()  # type: ignore[union-attr]
        assert endpoint.startswith("127.0.0.1:"), endpoint
        yield endpoint
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)


class Workers:
    """Processes of examples/train_elastic.py, each with a log and stderr file."""

    def __init__(self, endpoint: str, tmp: Path) -> None:
        self.endpoint, self.tmp = endpoint, tmp
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, name: str, job: str, out: Path, *extra: str) -> None:
        args = [
            sys.executable,
            str(SCRIPT),
            "--rdzv",
            self.endpoint,
            "--job",
            job,
            "--steps",
            str(STEPS),
            "--virtual-nodes",
            "8",
            "--seed",
            "0",
            "--deterministic",
            "--out",
            str(out),
            "--log",
            str(self.log(name)),
            *extra,
        ]
        with (self.tmp / f"{name}.err").open("wb") as err:
            self.procs[name] = subprocess.Popen(
                args, env=_env(), stdout=subprocess.DEVNULL, stderr=err
            )

    def log(self, name: str) -> Path:
        return self.tmp / f"{name}.log"

    def lines(self, name: str) -> list[dict[str, Any]]:
        if not self.log(name).exists():
            return []
        # The last line may be half-written while the worker runs.
        text = self.log(name).read_text()
        return [json.loads(line) for line in text.split("\n")[:-1] if line]

    def steps(self, name: str) -> list[dict[str, Any]]:
        return [line for line in self.lines(name) if "step" in line and "events" not in line]

    def end(self, name: str) -> dict[str, Any]:
        ends = [line for line in self.lines(name) if "events" in line]
        assert ends, f"{name} wrote no last line:\n{self.stderr(name)}"
        return ends[-1]

    def stderr(self, name: str) -> str:
        return (self.tmp / f"{name}.err").read_text()[-4000:]

    def wait_for(self, name: str, what: str, done: Any) -> None:
        """Polls ``done(step lines of name)`` until true, for at most WAIT_S."""
        deadline = time.monotonic() + WAIT_S
        while not done(self.steps(name)):
            if self.procs[name].poll() is not None:
                raise AssertionError(f"{name} ended before {what}:\n{self.stderr(name)}")
            if time.monotonic() > deadline:
                raise AssertionError(f"no {what} within {WAIT_S:g} s:\n{self.stderr(name)}")
            time.sleep(0.05)

    def wait(self, names: list[str], timeout: float) -> dict[str, int]:
        deadline = time.monotonic() + timeout
        return {
            name: self.procs[name].wait(timeout=max(1.0, deadline - time.monotonic()))
            for name in names
        }

    def kill_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)


def _runs(counts: list[int]) -> list[int]:
    """Worker counts with repeats collapsed: [1, 1, 2, 2, 1] -> [1, 2, 1]."""
    return [c for i, c in enumerate(counts) if i == 0 or counts[i - 1] != c]


def _alone_again(steps: list[dict[str, Any]]) -> bool:
    return _runs([x["workers"] for x in steps])[-2:] == [2, 1]


def _assert_bitwise_equal(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert got["step"] == want["step"] == STEPS
    assert got["model"].keys() == want["model"].keys()
    for key, value in want["model"].items():
        assert torch.equal(got["model"][key], value), f"model {key} differs"
    got_opt, want_opt = got["optimizer"], want["optimizer"]
    assert got_opt["param_groups"] == want_opt["param_groups"]
    assert got_opt["state"].keys() == want_opt["state"].keys()
    for index, state in want_opt["state"].items():
        assert got_opt["state"][index].keys() == state.keys()
        for key, value in state.items():
            assert torch.equal(got_opt["state"][index][key], value), f"optimizer {index} {key}"


def test_help_lists_the_required_flags() -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--help"],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    for flag in REQUIRED:
        assert flag in done.stdout, f"--help does not list {flag}"
    assert "python -m vflow rendezvous" in done.stdout


@pytest.mark.slow
def test_grow_crash_and_grow_again_end_bitwise_as_one_worker(
    rendezvous: str, tmp_path: Path
) -> None:
    workers = Workers(rendezvous, tmp_path)
    job, out, alone = f"grow{os.getpid()}", tmp_path / "out.pt", tmp_path / "alone.pt"
    try:
        # The one-worker run under another job id on the same store, meanwhile.
        workers.start("alone", f"alone{os.getpid()}", alone)
        workers.start("a", job, out, "--sleep", SLEEP, "--sleep-until-changes", "3")
        workers.wait_for("a", "2 steps of A", lambda s: len(s) >= 2)
        workers.start("b", job, out)
        workers.wait_for("b", "3 steps of B", lambda s: len(s) >= 3)
        workers.procs["b"].kill()
        assert workers.procs["b"].wait(timeout=30) == -signal.SIGKILL
        # C starts once A trains alone again, so that it joins a running job rather
        # than the recovery round.
        workers.wait_for("a", "a step of A alone after B", _alone_again)
        workers.start("c", job, out)
        codes = workers.wait(["a", "c", "alone"], timeout=120)
        assert codes == {"a": 0, "c": 0, "alone": 0}, workers.stderr("a") + workers.stderr("c")
    finally:
        workers.kill_all()

    a_steps = workers.steps("a")
    assert [x["step"] for x in a_steps] == list(range(STEPS))  # each step once on A
    assert _runs([x["workers"] for x in a_steps]) == [1, 2, 1, 2]
    assert all(x["workers"] == 2 for x in workers.steps("b") + workers.steps("c"))
    assert workers.steps("c") and workers.end("c")["step"] == STEPS
    reasons = [e["reason"] for e in workers.end("a")["events"]]
    assert reasons == ["start", "grow", "crash", "grow", "finish"], reasons
    assert _runs([x["workers"] for x in workers.steps("alone")]) == [1]
    _assert_bitwise_equal(torch.load(out, weights_only=True), torch.load(alone, weights_only=True))
