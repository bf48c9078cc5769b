"""Elastic jobs: workers join, leave and crash while the job runs, and nothing is lost
or repeated (``ElasticJob``, Note [Elastic state machine] in ``job``). The state machine
drives protocols of their own modules, which never import it: newcomers let into a
running job (``admission``), the survivors' agreement after a crash (``agreement``),
the worker sets' process groups (``groups``), and what a worker says, records and
saves when it cannot go on (``reporting``). Membership is torch.distributed.elastic's
rendezvous inside long-lived workers (``rendezvous``), on a store that ``python -m
vflow rendezvous`` hosts (``server``), where the job's record says which worker set
owns it, kept across restarts by the store's journal (``record``). Worker scripts
take the job's options as command-line flags with ``add_job_arguments`` and
``job_from_args`` (``flags``). A pipelined job's worker sets are whole replicas
(``replicas``, Note [Replicas as members]).

May import: vflow.mapping, vflow.planning, vflow.data, vflow.world, vflow.runtime and
vflow.pipeline (an elastic job drives either executor).
"""

from vflow.elastic.flags import add_job_arguments, job_from_args
from vflow.elastic.job import LEAVE, SUSPEND, WAITING, ElasticJob, Event, JoinRefused

__all__ = [
    "LEAVE",
    "SUSPEND",
    "WAITING",
    "ElasticJob",
    "Event",
    "JoinRefused",
    "add_job_arguments",
    "job_from_args",
]
