"""Helpers shared by the tests, in one place: model and data factories (``models``),
reference seeds (``seeds``), reducers built by hand (``reducers``), the CUDA markers
(``cuda_marks``), the rendezvous store as a process (``rendezvous``), the addresses a
process listens on (``sockets``), the elastic test worker (``elastic_worker``, also run
as a script), the elastic example with one thing changed (``altered_example``, a
script) and a loader for the scripts of benchmarks/ (``benchmark_scripts``).
Multi-rank tests start their ranks with vflow.world.launch.run_ranks."""

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
