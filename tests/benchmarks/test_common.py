"""benchmarks/_common.py: the command-line pieces and the benchmark MLP that the scripts
share (distributed.py and elastic.py parse the same sizes; accumulate.py, elastic.py and
step.py count or build the same model)."""

from __future__ import annotations

import argparse
import os

import pytest

from tests.support.benchmark_scripts import load_script

common = load_script("_common")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    common.add_output_args(parser, quick="short")
    common.add_process_args(parser, per="rank", timeout_s=common.Default(full=600.0, quick=120.0))
    common.add_mlp_args(parser)
    parser.add_argument("--virtual-nodes", type=int, default=4)
    return parser


@pytest.mark.parametrize(("hidden", "layers"), [(16, 1), (64, 3)])
def test_the_mlp_counts_the_parameters_it_builds(hidden: int, layers: int) -> None:
    mlp = common.Mlp(hidden, layers)
    assert mlp.params == sum(p.numel() for p in mlp.build().parameters())
    assert mlp.name == f"mlp {layers}x{hidden}"


def test_sizes_and_timeout_default_by_run_and_yield_to_the_options() -> None:
    timeout = common.Default(full=600.0, quick=120.0)
    full = _parser().parse_args([])
    assert common.mlp_of(full) == (common.Mlp(1024, 12), 128) and common.FULL_MLP.layers == 12
    assert timeout.of(full, "timeout") == 600.0 and full.threads == 1
    quick = _parser().parse_args(["--quick"])
    assert common.mlp_of(quick) == (common.Mlp(512, 4), 64)
    assert timeout.of(quick, "timeout") == 120.0
    asked = _parser().parse_args(
        ["--quick", "--hidden", "16", "--batch-size", "8", "--timeout", "5"]
    )
    assert common.mlp_of(asked) == (common.Mlp(16, 4), 8)
    assert timeout.of(asked, "timeout") == 5.0


@pytest.mark.parametrize(
    ("argv", "problem"),
    [
        ([], None),
        (["--layers", "0"], "--layers must be >= 1, got 0"),
        (["--threads", "0"], "--threads must be >= 1, got 0"),
        (["--virtual-nodes", "1"], "--virtual-nodes must be >= 2 (one VN per rank at least)"),
        (["--quick", "--virtual-nodes", "65"], "--batch-size 64 < --virtual-nodes 65"),
    ],
)
def test_size_problems_name_the_option(argv: list[str], problem: str | None) -> None:
    args = _parser().parse_args(argv)
    found = common.size_problem(
        args, processes=2, per="rank", positive=("threads", "batch_size", "hidden", "layers")
    )
    assert found == problem


def test_peak_memory_from_proc_status() -> None:
    text = "Name:\tpython\nVmPeak:\t  900 kB\nVmHWM:\t  300 kB\nVmRSS:\t  200 kB\nThreads:\t4\n"
    status = common.parse_status(text)
    assert status == {"VmHWM": 300 * 1024, "VmRSS": 200 * 1024}
    with pytest.raises(ValueError):
        common.parse_status("VmRSS:\t 1 kB\n")
    if os.path.exists("/proc/self/status"):
        mine = common.memory_status()
        assert 0 < mine["VmRSS"] <= mine["VmHWM"]


def test_the_mmap_threshold_is_set_for_the_processes_started_inside_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(common.MALLOC_ENV, "999")
    with common.malloc_env(65536):
        assert os.environ[common.MALLOC_ENV] == "65536"
    assert os.environ[common.MALLOC_ENV] == "999"
    with common.malloc_env(None):  # glibc's default: nothing set
        assert common.MALLOC_ENV not in os.environ
    assert os.environ[common.MALLOC_ENV] == "999"
    monkeypatch.delenv(common.MALLOC_ENV)
    with common.malloc_env(65536):
        pass
    assert common.MALLOC_ENV not in os.environ
