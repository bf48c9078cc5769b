"""torch.compile under vflow.elastic.ElasticJob (docs/guide.md, "torch.compile"): a
compiled model with dropout, deterministic mode, one worker joined by a second that
compiles its model on joining; the job ends bitwise equal to the one-worker job."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support import elastic_worker
from tests.support.compiled import shared_inductor_cache
from tests.support.rendezvous import store_process

pytestmark = pytest.mark.slow

WORKER = Path(elastic_worker.__file__)
STEPS = 8
# The compiled dropout MLP in deterministic mode, with generous timeouts: a newcomer
# compiles its model in its first step, which the others wait for.
JOB = ("--compile", "--deterministic", "--seed", "3", "--timeout", "120", "--join-timeout", "120")


@pytest.fixture(scope="module")
def rendezvous(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with shared_inductor_cache(tmp_path_factory), store_process() as (proc, endpoint):
        yield endpoint
        proc.terminate()
        assert proc.wait(timeout=30) == 0


def _start(endpoint: str, job: str, tmp: Path, worker: str, *extra: str) -> subprocess.Popen:
    args = [sys.executable, str(WORKER), "--rdzv", endpoint, "--job", job, *JOB]
    args += ["--steps", str(STEPS), "--log", str(tmp / f"{worker}.log"), *extra]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    return subprocess.Popen(args, env=env, stderr=open(tmp / f"{worker}.err", "w"))


def _steps(tmp: Path, worker: str) -> list[dict[str, Any]]:
    """The worker's log lines of committed steps: not those of failed steps, nor its
    last line (the job's events)."""
    path = tmp / f"{worker}.log"
    lines = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return [line for line in lines if "loss" in line]


def _finish(procs: dict[str, subprocess.Popen], tmp: Path) -> None:
    try:
        for worker, proc in procs.items():
            code = proc.wait(timeout=300)
            assert code == 0, (tmp / f"{worker}.err").read_text()[-4000:]
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)


def test_a_compiled_model_joined_by_a_second_worker_trains_bitwise_as_one(
    rendezvous: str, tmp_path: Path
) -> None:
    alone, grown = tmp_path / "alone", tmp_path / "grown"
    alone.mkdir()
    grown.mkdir()
    pid = os.getpid()
    # First alone: it compiles the graphs the two workers then find in the cache.
    _finish(
        {"a": _start(rendezvous, f"alone{pid}", alone, "a", "--out", str(alone / "out.pt"))}, alone
    )

    # Slow steps until the second worker is in, so that it joins before the job ends.
    slow = ("--workers", "2", "--sleep", "5")
    a = _start(rendezvous, f"grown{pid}", grown, "a", "--out", str(grown / "out.pt"), *slow)
    procs = {"a": a}
    try:
        deadline = time.monotonic() + 120
        while not _steps(grown, "a"):
            assert a.poll() is None, (grown / "a.err").read_text()[-4000:]
            assert time.monotonic() < deadline, "a ran no step in 120 s"
            time.sleep(0.05)
        procs["b"] = _start(rendezvous, f"grown{pid}", grown, "b", *slow)
    finally:
        _finish(procs, grown)

    workers = [line["workers"] for line in _steps(grown, "a")]
    assert workers[0] == 1 and workers[-1] == 2, workers
    want, got = torch.load(alone / "out.pt"), torch.load(grown / "out.pt")
    assert got["step"] == want["step"] == STEPS
    assert [x["loss"] for x in _steps(grown, "a")] == [x["loss"] for x in _steps(alone, "a")]
    for name, value in want["model"].items():
        assert torch.equal(got["model"][name], value), name
    for index, state in want["optimizer"]["state"].items():
        for key, value in state.items():
            assert torch.equal(got["optimizer"]["state"][index][key], value), (index, key)
