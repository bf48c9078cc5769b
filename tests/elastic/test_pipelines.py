"""Elastic pipelines as a user runs them (README.md's "### Elastic pipelines"): the
store's line, then its worker line (examples/train_pipeline.py) as one process per
stage. A replica starts the job, a second one joins (its stage 1 racing a third
process of stage 1, which waits alone), the second replica's stage 1 dies of SIGKILL
mid-step, its stage 0 pairs with the waiting process into a replica that joins again,
and one process of that replica leaves (SIGTERM): the job ends with an ``--out``
bitwise equal to the one-process run of the same flags, ``--stages 1``. The store and
every worker are subprocesses; every wait is bounded and every process is killed at
the end (Note [Replicas as members], vflow/elastic/replicas.py)."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.support import REPO_ROOT
from tests.support.elastic_lines import Workers, readme_store, reasons, worker_env
from tests.support.several_hosts import flag, readme_lines

pytest.importorskip("sklearn", reason="the example trains on scikit-learn's digits")
if not (dist.is_available() and dist.is_gloo_available()):
    pytest.skip("needs torch.distributed with Gloo", allow_module_level=True)

SCRIPT = "examples/train_pipeline.py"
# Fewer steps than the README's, at its pace: long enough for the changes below.
STEPS = "100"


def _joined(workers: Workers, names: list[str]) -> list[str]:
    """Those of ``names`` that trained in the job (they logged their start)."""
    return [name for name in names if "start" in reasons(workers.events(name))]


@pytest.mark.slow
def test_replicas_join_crash_come_back_and_leave_bitwise_as_one_process(tmp_path: Path) -> None:
    store, worker = readme_lines("### Elastic pipelines", SCRIPT)
    assert flag(worker, "--stages") == "2" and flag(worker, "--stage") == "0", worker
    out = tmp_path / "final.pt"
    with readme_store(store, tmp_path) as port:
        workers = Workers(worker, port, tmp_path)
        try:
            workers.start("a", out=str(out), steps=STEPS)
            workers.start("b", out=str(out), steps=STEPS, stage="1")
            workers.wait_for("a", "the first replica training", lambda e: "start" in reasons(e))
            for name, stage in (("c", "0"), ("d", "1"), ("e", "1")):
                workers.start(name, out=str(out), steps=STEPS, stage=stage)
            workers.wait_for(
                "a", "a replica joining", lambda e: (e[-1][1], e[-1][2]) == (4, "grow")
            )
            (joined,) = _joined(workers, ["d", "e"])
            waiting = "e" if joined == "d" else "d"
            workers.procs[joined].kill()
            assert workers.procs[joined].wait(timeout=30) == -signal.SIGKILL
            workers.wait_for("a", "the crash", lambda e: "crash" in reasons(e))
            # c, whose replica lost its stage 1, and the process that waited form one.
            workers.wait_for("a", "the replica coming back", lambda e: reasons(e)[-1] == "grow")
            assert _joined(workers, ["c", waiting]) == ["c", waiting]
            workers.procs[waiting].send_signal(signal.SIGTERM)
            codes = workers.wait(["a", "b", "c", waiting], timeout=180)
            assert codes == {"a": 0, "b": 0, "c": 0, waiting: 0}, workers.stderr("a")[-4000:]
        finally:
            workers.kill_all()

    a = workers.events("a")
    assert reasons(a) == ["start", "grow", "crash", "grow", "leave", "finish"], a
    assert [n for _, n, _ in a] == [2, 4, 2, 4, 2, 2], a
    assert workers.events("b") == a
    crashed_at = a[2][0]
    assert f"vflow elastic: redoing step {crashed_at} with 2 workers (2 lost)" in workers.stderr(
        "a"
    )
    # c sat out once its replica lost a stage, and again when its partner left; the
    # job finished without it.
    said = workers.stderr("c")
    assert "went on without this worker (its replica lost a stage;" in said, said[-4000:]
    assert "replica lost a stage to the workers leaving" in said, said[-4000:]
    assert "finished while this worker was out of its worker set" in said, said[-4000:]

    alone = tmp_path / "alone.pt"
    reference = [
        worker[0] if (REPO_ROOT / worker[0]).exists() else "python",
        SCRIPT,
        "--stages",
        "1",
        "--steps",
        STEPS,
        *(w for f in ("--virtual-nodes", "--seed") for w in (f, flag(worker, f))),
        "--deterministic",
        "--out",
        str(alone),
    ]
    done = subprocess.run(
        reference, cwd=REPO_ROOT, env=worker_env(), capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-4000:]
    got, want = torch.load(out, weights_only=True), torch.load(alone, weights_only=True)
    assert got["step"] == want["step"] == int(STEPS)
    assert got["model"].keys() == want["model"].keys()
    for name, value in want["model"].items():
        assert torch.equal(got["model"][name], value), f"{name} differs"
