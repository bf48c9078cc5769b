"""``python -m vflow bench``: kernel-throughput microbenchmarks of the installed vflow,
and the reporting every benchmark shares.

``kernels`` measures, ``records`` holds the self-describing headline record format and
the one place their ratios and verdicts are computed, ``summary`` prints and stores the
result, and ``table`` is the one plain-text table formatter (the demo's tables too).
The suite runner of a source checkout (``benchmarks/run.py``) uses the same records
and summary for the scripts of benchmarks/, and those scripts time their methods and
describe the machine with ``kernels``' helpers.

May import: nothing of vflow's rooms; only the top level (the extension, the ops, the
version), so that it measures the installed kernels without the runtime.
"""

from vflow.bench.cli import main

__all__ = ["main"]
