"""``python -m vflow demo``: the main job end to end, and the workload the examples share.

``cli`` puts the job together: the mappings and the data-parallel baseline
(``mappings``), the heterogeneous row (``heterogeneous``), the elastic scenario
(``elastic_scenario``, whose workers run it as ``python -m``), the figures (``plots``)
and a progress bar (``progress``). ``digits`` holds the data, model and loss that the
examples import from here.

May import: vflow.mapping, vflow.planning, vflow.data, vflow.world, vflow.runtime,
vflow.elastic, vflow.pipeline, vflow.cluster, vflow.bench and the package's face (vflow); no room
imports the demo.
"""

from vflow.demo.digits import (
    accuracy,
    cross_entropy,
    epoch_order,
    load_digits_split,
    make_model,
    make_pipeline_model,
    make_transformer_model,
)

__all__ = [
    "accuracy",
    "cross_entropy",
    "epoch_order",
    "load_digits_split",
    "main",
    "make_model",
    "make_pipeline_model",
    "make_transformer_model",
]


def main(argv: list[str] | None = None) -> int:
    """``python -m vflow demo [options]``; returns the exit status."""
    # Imported on use: the elastic scenario's workers run ``python -m
    # vflow.demo.elastic_scenario``, which must not find that module imported already.
    from vflow.demo.cli import main as run_demo

    return run_demo(argv)
