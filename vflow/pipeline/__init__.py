"""Virtual nodes over pipeline replicas: a model cut into S stages (``Pipeline``), a
grid of replicas x stages (``ProcessGrid``, Note [The grid] in ``grid``), and the
executor that runs each replica's VNs as the microbatches of one
torch.distributed.pipelining schedule (``PipelineExecutor``, Note [VNs as
microbatches] in ``executor``), with per-segment random streams (``streams``), the
stage that reports each VN's gradients to vflow's buffers (``stage``) and a training
state that loads on any grid (``state``).

May import: vflow.mapping, vflow.planning, vflow.data, vflow.world and vflow.runtime. Never the
elastic room, which drives pipelines from above (vflow/elastic/replicas.py).
"""

from vflow.pipeline.checkpoint import load, save
from vflow.pipeline.executor import PipelineExecutor
from vflow.pipeline.grid import ProcessGrid
from vflow.pipeline.spec import Pipeline, Segments

__all__ = ["Pipeline", "PipelineExecutor", "ProcessGrid", "Segments", "load", "save"]
