"""Peak memory of a step falls as V grows: activations are held for one VN at a time."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.support import REPO_ROOT

# Runs one step in a fresh process and reports how far the step raised the process's
# peak resident set above what it held before the step (model, data, buffers).
_SCRIPT = textwrap.dedent(
    """
    import json, resource, sys, torch, vflow
    # One thread: allocations from several OpenMP threads land in different malloc
    # arenas, and how much of that memory is reused varies with machine load.
    torch.set_num_threads(1)
    torch.manual_seed(0)
    v = int(sys.argv[1])
    width, depth, b = 1024, 8, 4096
    layers = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(width, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(b, width), torch.randint(0, 10, (b,))
    loss_fn = lambda m, batch: torch.nn.functional.cross_entropy(m(batch[0]), batch[1])
    ex = vflow.Executor(model, opt, loss_fn, virtual_nodes=v)
    page = resource.getpagesize()
    with open("/proc/self/statm") as f:
        before = int(f.read().split()[1]) * page
    ex.step((x, y))
    # VmHWM, not getrusage's ru_maxrss: Linux folds the parent's resident size at fork
    # into ru_maxrss across exec, so a large test runner would mask the step's peak.
    with open("/proc/self/status") as f:
        hwm_kb = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
    peak = hwm_kb * 1024
    print(json.dumps({"v": v, "step_peak_mb": (peak - before) / 2**20}))
    """
)


def _step_peak_mb(v: int) -> float:
    out = subprocess.run(
        [sys.executable, "-c", _SCRIPT, str(v)],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
        cwd=REPO_ROOT,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])["step_peak_mb"]


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="needs Linux /proc")
def test_step_peak_memory_falls_with_virtual_nodes():
    peaks = {v: _step_peak_mb(v) for v in (1, 2, 8)}
    # Activations of one VN at V=1 are ~256 MB (8 layers x 2 saved tensors x 16 MB).
    assert peaks[1] > peaks[2] > peaks[8], peaks
    assert peaks[1] - peaks[8] > 150, peaks
