"""``python -m vflow bench``: kernel-throughput microbenchmarks of the installed vflow.

``kernels`` measures, ``records`` holds the self-describing headline record format and
the one place their ratios and verdicts are computed, ``summary`` prints and stores the
result; the suite runner of a source checkout (``benchmarks/run.py``) uses the same
records and summary for the accumulate, step, distributed and prefetch scripts.
"""

from vflow.bench.cli import main

__all__ = ["main"]
