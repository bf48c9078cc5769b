"""examples/train_digits.py end to end: the same job on 1, 2 and 3 processes (even and
uneven plans) must exit cleanly and produce the same parameters.

The script runs in subprocesses, as a user would start it: plainly, and under
``python -m torch.distributed.run --standalone`` (torchrun without relying on PATH).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("sklearn", reason="the example trains on scikit-learn's digits")
if not (dist.is_available() and dist.is_gloo_available()):
    pytest.skip("needs torch.distributed with Gloo", allow_module_level=True)

pytestmark = pytest.mark.slow

_SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "train_digits.py"
# Generous for a loaded CI machine, but bounded: a hung rank fails the test instead of
# the suite. The script's own --timeout is shorter, so a rank whose peer died exits by
# itself with vflow's error before the test kills it.
_RUN_TIMEOUT_S = 150.0
_COLLECTIVE_TIMEOUT_S = "60"
_STOP_GRACE_S = 45.0
_TRAIN_ARGS = ("--epochs", "1", "--timeout", _COLLECTIVE_TIMEOUT_S)
_TORCHRUN = (sys.executable, "-m", "torch.distributed.run", "--standalone")
_LAUNCHER_VARS = frozenset(
    {"WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}
)
_ACCURACY = re.compile(r"^final test accuracy (\d+\.\d+) after \d+ steps$", re.MULTILINE)


def _env() -> dict[str, str]:
    # Inherited launcher variables (pytest itself started by torchrun, say) would make
    # the plain run try to join a process group.
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in _LAUNCHER_VARS and not k.startswith(("TORCHELASTIC_", "GROUP_", "ROLE_"))
    }
    # One thread per process: several ranks share a small machine's cores. No GPU: the
    # runs are compared with each other, and NCCL wants one GPU per rank.
    env.update(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", PYTHONUNBUFFERED="1")
    return env


def _stop(proc: subprocess.Popen[bytes]) -> None:
    # torchrun starts every rank in a session of its own, so killing the launcher's
    # process group would orphan the ranks. On SIGTERM torchrun stops its ranks itself
    # (and SIGKILLs them after 30 s); the SIGKILL here is for a launcher that hangs.
    proc.terminate()
    try:
        proc.wait(timeout=_STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _run(launcher: tuple[str, ...], log_dir: Path, name: str, *args: str) -> str:
    """Runs the script to completion and returns its stdout; fails on a non-zero exit
    or after _RUN_TIMEOUT_S, stopping every process it started."""
    cmd = [*launcher, str(_SCRIPT), *_TRAIN_ARGS, *args]
    out_path, err_path = log_dir / f"{name}.out", log_dir / f"{name}.err"
    # Files, not pipes: a rank outliving its launcher would hold a pipe open and block
    # the read. The launcher gets a session of its own so that killpg hits nothing else.
    with out_path.open("wb") as out, err_path.open("wb") as err:
        proc = subprocess.Popen(
            cmd, cwd=log_dir, env=_env(), stdout=out, stderr=err, start_new_session=True
        )
        try:
            proc.wait(timeout=_RUN_TIMEOUT_S)
            timed_out = False
        except subprocess.TimeoutExpired:
            timed_out = True
            _stop(proc)
        except BaseException:  # Ctrl-C: the launcher's own session would not get it
            _stop(proc)
            raise
    stdout, stderr = out_path.read_text(), err_path.read_text()
    if timed_out:
        pytest.fail(f"{cmd} still running after {_RUN_TIMEOUT_S:g} s\n{stdout}\n{stderr}")
    assert proc.returncode == 0, f"{cmd} exited with {proc.returncode}\n{stdout}\n{stderr}"
    return stdout


def test_same_parameters_on_any_number_of_processes(tmp_path: Path) -> None:
    runs = {
        "1 process": ((sys.executable,), ()),
        "2 processes, even plan": ((*_TORCHRUN, "--nproc_per_node=2"), ()),
        "3 processes, plan 1,1,6": ((*_TORCHRUN, "--nproc_per_node=3"), ("--plan", "1,1,6")),
    }
    states: dict[str, dict[str, torch.Tensor]] = {}
    accuracies: dict[str, float] = {}
    for i, (name, (launcher, extra)) in enumerate(runs.items()):
        path = tmp_path / f"run{i}.pt"
        out = _run(launcher, tmp_path, f"run{i}", "--save", str(path), *extra)
        # Only rank 0 reports, so each line appears once whatever the number of ranks.
        found = _ACCURACY.findall(out)
        assert len(found) == 1, f"{name}: expected one final accuracy line in\n{out}"
        assert out.count("epoch 1/1") == 1, f"{name}: expected one epoch line in\n{out}"
        accuracies[name] = float(found[0])
        states[name] = torch.load(path, weights_only=True)

    (ref_name, ref), *others = states.items()
    for name, state in others:
        assert state.keys() == ref.keys()
        for key in ref:
            torch.testing.assert_close(
                state[key],
                ref[key],
                rtol=1e-5,
                atol=1e-6,
                msg=lambda m, key=key, name=name: f"{key}: {name} vs {ref_name}: {m}",
            )
    # Chance is 0.1; one epoch gets well above it.
    assert accuracies[ref_name] > 0.3, accuracies
    # Parameters agree to float32 rounding, so at most a borderline test sample or two
    # may change its predicted class.
    for name, acc in accuracies.items():
        assert acc == pytest.approx(accuracies[ref_name], abs=0.01), (name, accuracies)
