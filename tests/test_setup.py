"""setup.py's build decisions: CUDA from the toolchain, with a validated override."""

import os
import runpy
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


def _fake_environment(root: Path, torch_version: str | None) -> Path:
    site = root / "site-packages"
    site.mkdir(parents=True)
    if torch_version is not None:
        info = site / f"torch-{torch_version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(
            f"Metadata-Version: 2.1\nName: torch\nVersion: {torch_version}\n"
        )
    return site


def test_an_isolated_build_refuses_to_replace_the_environments_torch(tmp_path: Path) -> None:
    """``pip install .`` builds against pyproject's pinned CPU torch in an isolated
    environment; in an environment with another torch (here a CUDA build) that would
    replace it, so the build stops and says to use --no-build-isolation."""
    check = runpy.run_path(str(ROOT / "setup.py"), run_name="vflow_setup")["check_build_torch"]
    isolated = str(tmp_path / "pip-build-env" / "overlay" / "torch" / "__init__.py")
    site = _fake_environment(tmp_path / "cuda-env", "2.14.1+cu130")
    with pytest.raises(SystemExit) as info:
        check(isolated, "2.13.0+cpu", [site])
    message = str(info.value)
    assert "this environment has torch 2.14.1+cu130" in message
    assert "against torch 2.13.0+cpu" in message
    assert "pip install --no-build-isolation ." in message
    # The same torch as the environment's, no torch there, or the environment's own
    # torch (--no-build-isolation, make): nothing to replace.
    check(isolated, "2.14.1+cu130", [site])
    check(isolated, "2.13.0+cpu", [_fake_environment(tmp_path / "empty-env", None)])
    check(str(site / "torch" / "__init__.py"), "2.14.1+cu130", [site])
