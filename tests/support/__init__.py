"""Helpers shared by the tests, in one place: model and data factories (``models``),
reference seeds (``seeds``), reducers built by hand (``reducers``), the CUDA markers
(``cuda_marks``), the rendezvous store as a process (``rendezvous``), the addresses a
process listens on (``sockets``), the elastic test worker (``elastic_worker``, also run
as a script), the elastic example with one thing changed (``altered_example``, a
script), a loader for the scripts of benchmarks/ (``benchmark_scripts``), hosts made of
network namespaces with the faults of a cluster's network (``hosts``) and the README's
several-machine lines on them, with the faults played on them (``several_hosts``, also
used by benchmarks/faults.py). Multi-rank tests start their ranks with
vflow.world.launch.run_ranks."""

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
