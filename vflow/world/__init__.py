"""The worker set as the step sees it: a process group with this worker's rank and the
collectives vflow runs outside the gradient reduction (``group.World``), the protocol by
which a set of workers agrees and hands its state to newcomers (``membership``),
``launch.run_ranks``, which starts N local Gloo ranks for the demo, tests and benchmarks,
``store.host_store``, through which vflow hosts every c10d store, on exactly the
address asked, and ``store.connect_store``, its clients of a store that may go silent,
``network``: the interface through which a worker reaches the store, and probes
between workers, and ``devices``: which GPU a worker uses. How the worker set changes
while a job runs is vflow.elastic's business, one floor up.

May import: vflow.mapping and the extension (vflow._extension).
"""

from vflow.world.group import CollectiveError, World
from vflow.world.membership import RefusedNewcomers

__all__ = ["CollectiveError", "RefusedNewcomers", "World"]
