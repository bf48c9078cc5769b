"""The worker set as the step sees it: a process group with this worker's rank and the
collectives vflow runs outside the gradient reduction (``group.World``), the protocol by
which a set of workers agrees and hands its state to newcomers (``membership``), and
``launch.run_ranks``, which starts N local Gloo ranks for the demo, tests and benchmarks.
How the worker set changes while a job runs is vflow.elastic's business, one floor up.

May import: vflow.mapping and the extension (vflow._extension).
"""

from vflow.world.group import CollectiveError, World

__all__ = ["CollectiveError", "World"]
