from collections.abc import Iterator
from typing import Any

import pytest
import torch

from tests.support.cuda_marks import CUDA_MISSING
from vflow import ops


@pytest.fixture
def restore_cpu_vector_path() -> Iterator[None]:
    """Puts the CPU kernels' vector path (a process-wide setting) back as it was."""
    before = ops.cpu_vector_path()
    try:
        yield
    finally:
        ops.set_cpu_vector_path(before)


@pytest.fixture(autouse=True)
def _fixed_seed():
    torch.manual_seed(1234)


# One test's budget on the 2-core CI machine: the summary names any test that ran longer,
# so that the suite stays well within `make test`'s ten minutes as it grows. The slowest
# tests start real worker processes (the README's elastic lines, the demo's elastic
# scenario, the elastic benchmark) and take 30-50 s there.
TEST_BUDGET_S = 60.0


def _skip_reason(report: pytest.TestReport) -> str:
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    return reason.removeprefix("Skipped: ")


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """CUDA skips in one line (they are expected without a GPU), every other skip
    reason with its count, and the tests over TEST_BUDGET_S."""
    by_reason: dict[str, int] = {}
    for report in terminalreporter.stats.get("skipped", []):
        reason = _skip_reason(report)
        by_reason[reason] = by_reason.get(reason, 0) + 1
    cuda = by_reason.pop(CUDA_MISSING, 0) if CUDA_MISSING else 0
    if cuda:
        terminalreporter.write_line(
            f"{cuda} CUDA tests skipped: {CUDA_MISSING} (benchmarks/gpu_check.sh runs them "
            "on a GPU machine)"
        )
    for reason, count in sorted(by_reason.items()):
        terminalreporter.write_line(f"{count} skipped: {reason}")
    slow = [
        report
        for report in terminalreporter.stats.get("passed", [])
        + terminalreporter.stats.get("failed", [])
        if report.when == "call" and report.duration > TEST_BUDGET_S
    ]
    for report in sorted(slow, key=lambda r: -r.duration):
        terminalreporter.write_line(
            f"over the {TEST_BUDGET_S:g} s budget: {report.nodeid} ({report.duration:.1f} s)"
        )
