"""examples/train_pipeline.py as a user starts it: the same flags under torchrun with 4
processes (2 stages x 2 replicas), 2 processes (2 stages x 1 replica: half the
devices), 2 processes with 1 stage (2 replicas, no pipeline) and plainly on one process
with 1 stage give bitwise the same ``--out`` with ``--deterministic``, and within 1e-6
(relative 2-norm per tensor) without it. Every run is a subprocess with a bounded wait."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.support import REPO_ROOT

pytest.importorskip("sklearn", reason="the example trains on scikit-learn's digits")
if not (dist.is_available() and dist.is_gloo_available()):
    pytest.skip("needs torch.distributed with Gloo", allow_module_level=True)

pytestmark = pytest.mark.slow

SCRIPT = REPO_ROOT / "examples" / "train_pipeline.py"
TORCHRUN = (sys.executable, "-m", "torch.distributed.run", "--standalone")
# Small enough for CI's 2 cores with 4 processes, big enough to train: 4 blocks.
FLAGS = ("--virtual-nodes", "4", "--steps", "6", "--seed", "3", "--width", "32")
RUN_TIMEOUT_S = 180.0
_LAUNCHER_VARS = frozenset(
    {"WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}
)


def _env() -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in _LAUNCHER_VARS and not k.startswith(("TORCHELASTIC_", "GROUP_", "ROLE_"))
    }
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    env.update(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", PYTHONUNBUFFERED="1")
    return env


def _train(tmp_path: Path, name: str, launcher: tuple[str, ...], *flags: str) -> dict:
    out = tmp_path / f"{name}.pt"
    log = tmp_path / f"{name}.log"
    with log.open("wb") as sink:
        proc = subprocess.Popen(
            [*launcher, str(SCRIPT), *FLAGS, *flags, "--out", str(out)],
            cwd=tmp_path,
            env=_env(),
            stdout=sink,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            proc.wait(timeout=RUN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # torchrun's ranks have sessions of their own
            proc.wait()
            pytest.fail(f"{name} still running after {RUN_TIMEOUT_S:g} s:\n{log.read_text()}")
    assert proc.returncode == 0, f"{name} exited with {proc.returncode}:\n{log.read_text()}"
    state = torch.load(out, weights_only=True)
    assert state["step"] == 6, name
    return state["model"]


def test_the_issue_flags_are_the_scripts() -> None:
    text = subprocess.run(
        [sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, env=_env()
    ).stdout
    for flag in ("--stages", "--virtual-nodes", "--steps", "--seed", "--deterministic", "--out"):
        assert flag in text, flag


def test_every_grid_writes_the_same_model_with_deterministic(tmp_path: Path) -> None:
    runs = {
        "4 processes, 2 stages": ((*TORCHRUN, "--nproc-per-node=4"), "2"),
        "2 processes, 2 stages": ((*TORCHRUN, "--nproc-per-node=2"), "2"),
        "2 processes, 1 stage": ((*TORCHRUN, "--nproc-per-node=2"), "1"),
        "1 process": ((sys.executable,), "1"),
    }
    models = {
        name: _train(tmp_path, f"run{i}", launcher, "--stages", stages, "--deterministic")
        for i, (name, (launcher, stages)) in enumerate(runs.items())
    }
    (_, reference), *others = models.items()
    assert len(reference) > 10  # embed, 4 blocks, head: every tensor of the unsplit model
    for name, model in others:
        assert list(model) == list(reference), name
        for key in reference:
            assert torch.equal(model[key], reference[key]), f"{name}: {key} differs"


def test_without_deterministic_the_grids_agree_to_1e_6(tmp_path: Path) -> None:
    default = _train(tmp_path, "default", (*TORCHRUN, "--nproc-per-node=4"), "--stages", "2")
    alone = _train(tmp_path, "default-alone", (sys.executable,), "--stages", "1")
    for key in alone:
        a, b = default[key].double(), alone[key].double()
        error = float((a - b).norm() / max(float(b.norm()), 1e-30))
        assert error <= 1e-6, f"{key} differs by {error:.2e} without --deterministic"
