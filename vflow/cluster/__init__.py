"""Elastic cluster scheduling: many vflow jobs sharing a cluster's slots, resized by a
policy while they run (the paper's job-completion-time study).

``trace`` reads the jobs (TRACE.json) and ``workload`` draws them in the shape of
VirtualFlow's workload; ``policies`` holds the policies, pure functions from the slots
and the active jobs to an allocation; ``simulator`` plays a trace under a policy in
discrete events; ``runner`` plays it for real, as elastic vflow jobs on local emulated
slots; ``cli`` is ``python -m vflow cluster``.

May import: vflow.mapping, vflow.planning, vflow.data, vflow.world, vflow.runtime and
vflow.elastic.
"""

from vflow.cluster.policies import POLICIES, JobState, Policy, get_policy
from vflow.cluster.simulator import MEASURED, Costs, simulate
from vflow.cluster.trace import JobSpec, Trace, TraceError, load_trace, parse_trace
from vflow.cluster.workload import VIRTUALFLOW, Shape, generate

__all__ = [
    "MEASURED",
    "POLICIES",
    "VIRTUALFLOW",
    "Costs",
    "JobSpec",
    "JobState",
    "Policy",
    "Shape",
    "Trace",
    "TraceError",
    "generate",
    "get_policy",
    "load_trace",
    "parse_trace",
    "simulate",
]
