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
from collections.abc import Callable
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


# The processes a run takes, and its launcher: torchrun, or plainly one process.
LAUNCHERS = {
    4: (*TORCHRUN, "--nproc-per-node=4"),
    2: (*TORCHRUN, "--nproc-per-node=2"),
    1: (sys.executable,),
}
Trained = Callable[..., dict]


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Trained:
    """``trained(processes, stages, *flags)``: the model a run writes, each run once per
    module (the tests share the one-process reference)."""
    directory = tmp_path_factory.mktemp("runs")
    models: dict[tuple, dict] = {}

    def run(processes: int, stages: int, *flags: str) -> dict:
        key = (processes, stages, *flags)
        if key not in models:
            models[key] = _train(
                directory,
                f"run{len(models)}",
                LAUNCHERS[processes],
                "--stages",
                str(stages),
                *flags,
            )
        return models[key]

    return run


def test_the_issue_flags_are_the_scripts() -> None:
    text = subprocess.run(
        [sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, env=_env()
    ).stdout
    for flag in ("--stages", "--virtual-nodes", "--steps", "--seed", "--deterministic", "--out"):
        assert flag in text, flag


# (processes, stages) of the issue's grids: one process, 2 stages, 2 x 2.
GRIDS = ((1, 1), (2, 2), (4, 2))


def _assert_bitwise(models: dict[str, dict], what: str) -> None:
    (_, reference), *others = models.items()
    assert len(reference) > 10, what  # embed, the blocks, head: every tensor of the model
    for name, model in others:
        assert list(model) == list(reference), f"{what}: {name}"
        for key in reference:
            assert torch.equal(model[key], reference[key]), f"{what}: {name}: {key} differs"


def test_every_grid_writes_the_same_model_with_deterministic(trained: Trained) -> None:
    grids = (*GRIDS, (2, 1))  # and 2 replicas without a pipeline
    models = {f"{n} processes, {s} stages": trained(n, s, "--deterministic") for n, s in grids}
    _assert_bitwise(models, "--deterministic")


def test_without_deterministic_the_grids_agree_to_1e_6(trained: Trained) -> None:
    default, alone = trained(4, 2), trained(1, 1)
    for key in alone:
        a, b = default[key].double(), alone[key].double()
        error = float((a - b).norm() / max(float(b.norm()), 1e-30))
        assert error <= 1e-6, f"{key} differs by {error:.2e} without --deterministic"


@pytest.mark.parametrize("flags", [("--max-grad-norm", "0.5"), ("--amp", "bf16")])
def test_clipping_and_amp_keep_every_grid_bitwise(trained: Trained, flags: tuple[str, str]) -> None:
    """The issue's acceptance: with ``--deterministic``, ``--out`` is bitwise the same on
    one process, on 2 stages and on 2 x 2, and differs from the run without the flag
    (so the flag did something)."""
    models = {
        f"{n} processes, {s} stages": trained(n, s, "--deterministic", *flags) for n, s in GRIDS
    }
    _assert_bitwise(models, " ".join(flags))
    plain, flagged = trained(1, 1, "--deterministic"), models["1 processes, 1 stages"]
    assert any(not torch.equal(flagged[key], plain[key]) for key in plain), flags


def test_the_transformer_passing_a_mask_between_stages_is_bitwise_on_two_stages(
    trained: Trained,
) -> None:
    """Segments that pass two tensors (hidden states and an attention mask) on: 2
    stages on 2 processes train the model one process trains, to the bit."""
    flags = ("--model", "transformer", "--blocks", "2", "--deterministic")
    alone = trained(1, 1, *flags)
    assert any(".attention." in key for key in alone)
    _assert_bitwise({"1 process": alone, "2 stages": trained(2, 2, *flags)}, "transformer")
