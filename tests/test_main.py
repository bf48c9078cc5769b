"""``python -m vflow`` (vflow/__main__.py): commands, --version and unknown commands."""

from __future__ import annotations

import subprocess
import sys

import pytest

import vflow
from vflow.__main__ import main


def test_version_names_vflow_torch_and_the_build(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--version"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"vflow {vflow.__version__} (torch ")
    assert f"extension built against torch {vflow._C.torch_version}" in out


def test_unknown_command_is_named_with_exit_status_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["foo"]) == 2
    err = capsys.readouterr().err
    assert err.rstrip().endswith("python -m vflow: error: unknown command 'foo'")
    assert "commands:" in err


def test_no_command_prints_the_usage_with_exit_status_2(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main([]) == 2
    assert "usage: python -m vflow <command>" in capsys.readouterr().err


def test_as_a_module() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "vflow", "--version"], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"vflow {vflow.__version__} ")
