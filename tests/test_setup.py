"""setup.py's build decisions: CUDA from the toolchain, with a validated override."""

import os
import runpy
import subprocess
import sys
import types
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


def _setup_functions() -> dict:
    return runpy.run_path(str(ROOT / "setup.py"), run_name="vflow_setup")


NVCC_13_0 = """nvcc: NVIDIA (R) Cuda compiler driver
Copyright (c) 2005-2025 NVIDIA Corporation
Built on Wed_Aug_20_01:58:59_PM_PDT_2025
Cuda compilation tools, release 13.0, V13.0.88
Build cuda_13.0.r13.0/compiler.36424714_0
"""


def test_the_releases_are_read_from_nvcc_and_the_runtime_header() -> None:
    setup = _setup_functions()
    assert setup["nvcc_release"](NVCC_13_0) == (13, 0)
    assert setup["nvcc_release"]("nvcc: command of another kind") is None
    header = "/* ... */\n#define CUDART_VERSION  13020\n#include <cuda_device_runtime_api.h>\n"
    assert setup["cudart_release"](header) == (13, 2)
    assert setup["cudart_release"]("#define CUDART_VERSION 12090\n") == (12, 9)
    assert setup["cudart_release"]("#define CUDA_VERSION 13020\n") is None


WAYS_OUT = (
    "Ways out:\n"
    "  * a CPU-only build (no CUDA kernels): VFLOW_CUDA=0 pip install --no-build-isolation .\n"
)


def test_nvcc_older_than_the_wheel_headers_is_refused_naming_both_and_the_ways_out() -> None:
    """torch 2.15.0+cu132 brings CUDA 13.2 headers, which setup.py puts first; nvcc 13.0
    would fail on CCCL's check minutes into the build (issue 34)."""
    mismatch = _setup_functions()["cuda_mismatch"]
    message = mismatch((13, 0), "13.2", "2.15.0+cu132", (13, 2), "/env/nvidia/cu13/include")
    assert message.startswith(
        "vflow: nvcc is CUDA 13.0 but the CUDA headers this build puts first on the include "
        "path are CUDA 13.2 (/env/nvidia/cu13/include, from the nvidia wheels of torch "
        "2.15.0+cu132, built with CUDA 13.2)"
    )
    assert '"CUDA compiler and CUDA toolkit headers are incompatible"' in message
    assert WAYS_OUT in message
    assert "  * a CUDA 13.2 toolkit: CUDA_HOME=/path/to/cuda-13.2 (its bin/nvcc)\n" in message
    assert message.endswith(
        "  * a torch built for nvcc's CUDA 13.0 (torch.version.cuda == '13.0'), then build again"
    )


def test_nvcc_newer_than_the_wheel_headers_is_refused_too() -> None:
    """CCCL asks for nvcc's major.minor to equal the headers', in both directions."""
    mismatch = _setup_functions()["cuda_mismatch"]
    message = mismatch((13, 2), "13.0", "2.14.1+cu130", (13, 0), "/env/nvidia/cu13/include")
    assert message.startswith("vflow: nvcc is CUDA 13.2 but the CUDA headers this build puts")
    assert "  * a CUDA 13.0 toolkit: CUDA_HOME=/path/to/cuda-13.0 (its bin/nvcc)\n" in message


def test_nvcc_of_another_major_than_torch_is_refused() -> None:
    mismatch = _setup_functions()["cuda_mismatch"]
    message = mismatch((12, 8), "13.2", "2.15.0+cu132", None, None)
    assert message.startswith(
        "vflow: nvcc is CUDA 12.8 but torch 2.15.0+cu132 was built with CUDA 13.2: a CUDA "
        "extension needs both of one major release.\n"
    )
    assert WAYS_OUT in message
    assert "  * a CUDA 13.2 toolkit: CUDA_HOME=/path/to/cuda-13.2 (its bin/nvcc)\n" in message


def test_combinations_that_build_are_let_through() -> None:
    mismatch = _setup_functions()["cuda_mismatch"]
    # .ci/cuda_check.sh's: torch 2.14.1's wheels are CUDA 13.0 (cuda-toolkit==13.0.3 in
    # its metadata), nvcc 13.0.
    assert mismatch((13, 0), "13.0", "2.14.1+cu130", (13, 0), "/env/nvidia/cu13/include") is None
    # nvcc's own headers, torch of the same major: cpp_extension only warns.
    assert mismatch((13, 0), "13.2", "2.15.0+cu132", None, None) is None
    assert mismatch((13, 2), "13.0", "2.14.1+cu130", None, None) is None


def _fake_toolkit(root: Path, nvcc_output: str) -> Path:
    bin_dir = root / "bin"
    bin_dir.mkdir(parents=True)
    nvcc = bin_dir / "nvcc"
    nvcc.write_text(f"#!/bin/sh\ncat <<'END'\n{nvcc_output}END\n")
    nvcc.chmod(0o755)
    return root


def test_the_check_runs_nvcc_and_reads_the_first_runtime_header(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The wiring of the check, without a CUDA torch or a real toolkit: the nvcc of
    CUDA_HOME is asked its release, and the first include folder holding
    cuda_runtime_api.h gives the headers'."""
    check = _setup_functions()["_check_cuda_toolchain"]
    cuda_torch = types.SimpleNamespace(
        __version__="2.15.0+cu132", version=types.SimpleNamespace(cuda="13.2")
    )
    monkeypatch.setitem(check.__globals__, "torch", cuda_torch)
    monkeypatch.setitem(
        check.__globals__, "CUDA_HOME", str(_fake_toolkit(tmp_path / "cuda", NVCC_13_0))
    )
    no_runtime = tmp_path / "nvidia" / "cudnn" / "include"
    wheel = tmp_path / "nvidia" / "cu13" / "include"
    for folder in (no_runtime, wheel):
        folder.mkdir(parents=True)
    (wheel / "cuda_runtime_api.h").write_text("#define CUDART_VERSION  13020\n")
    with pytest.raises(SystemExit, match=r"^vflow: nvcc is CUDA 13\.0 but .* are CUDA 13\.2 \("):
        check([str(no_runtime), str(wheel)])
    check([str(no_runtime)])  # nvcc's own headers
    (wheel / "cuda_runtime_api.h").write_text("#define CUDART_VERSION  13000\n")
    check([str(no_runtime), str(wheel)])
    (wheel / "cuda_runtime_api.h").write_text("/* a header of another layout */\n")
    capsys.readouterr()
    check([str(no_runtime), str(wheel)])
    assert capsys.readouterr().out.endswith(
        f"torch CUDA 13.2, headers of no release CUDART_VERSION names, in {wheel}\n"
    )
