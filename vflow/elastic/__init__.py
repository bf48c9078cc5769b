"""Elastic jobs: workers join, leave and crash while the job runs, and nothing is lost
or repeated (``ElasticJob``, Note [Elastic state machine] in ``job``). Membership is
torch.distributed.elastic's rendezvous inside long-lived workers, on a store that
``python -m vflow rendezvous`` hosts (``rendezvous``).

May import: vflow.mapping, vflow.planning, vflow.data, vflow.world and vflow.runtime.
"""

from vflow.elastic.job import LEAVE, WAITING, ElasticJob, Event

__all__ = ["LEAVE", "WAITING", "ElasticJob", "Event"]
