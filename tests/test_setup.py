"""setup.py's build decisions: CUDA from the toolchain, with a validated override."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def _setup(env_value: str | None) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop("VFLOW_CUDA", None)
    if env_value is not None:
        env["VFLOW_CUDA"] = env_value
    return subprocess.run(
        [sys.executable, "setup.py", "--name"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.skipif(torch.version.cuda is not None, reason="checks the CPU-only torch build")
def test_auto_decision_is_printed_and_off_without_cuda_torch():
    out = _setup(None)
    assert out.returncode == 0, out.stderr
    assert "vflow: CUDA kernels OFF (auto: torch.version.cuda=None" in out.stdout


def test_override_off_is_honoured():
    out = _setup("0")
    assert out.returncode == 0, out.stderr
    assert "vflow: CUDA kernels OFF (disabled by VFLOW_CUDA=0)" in out.stdout


@pytest.mark.skipif(torch.version.cuda is not None, reason="checks the CPU-only torch build")
def test_forcing_cuda_without_toolchain_fails_clearly():
    out = _setup("1")
    assert out.returncode != 0
    assert "VFLOW_CUDA=1 but no CUDA toolchain is usable" in out.stderr


def test_bad_override_value_is_rejected():
    out = _setup("maybe")
    assert out.returncode != 0
    assert "VFLOW_CUDA must be auto, 0 or 1, got 'maybe'" in out.stderr


def test_version_has_one_source():
    """setup.py reads vflow/_version.py as text, the package imports it: one version."""
    import vflow

    out = subprocess.run(
        [sys.executable, "setup.py", "--version"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == vflow.__version__
    assert f'__version__ = "{vflow.__version__}"' in (ROOT / "vflow" / "_version.py").read_text()
