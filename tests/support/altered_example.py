"""examples/train_elastic.py with one thing changed, as a user's edited copy of it would
be, to start against a job of the unchanged example:

    python tests/support/altered_example.py wider-model -- EXAMPLE ARGS...
    python tests/support/altered_example.py slow-load=SECONDS -- EXAMPLE ARGS...

``wider-model``: the example's model gets one more layer (another model shape);
``slow-load=S``: loading the training state the members send takes S seconds more (a
slow machine). The example itself runs unchanged (``runpy``), from its own path.
"""

from __future__ import annotations

import runpy
import sys
import time
from pathlib import Path

import torch

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_elastic.py"


def _wider_model() -> None:
    import vflow.demo

    make_model = vflow.demo.make_model

    def wider(seed: int) -> torch.nn.Module:
        model = make_model(seed)
        model.append(torch.nn.Linear(10, 10))
        return model

    vflow.demo.make_model = wider  # the example imports it by name when it starts


def _slow_load(seconds: float) -> None:
    from vflow.world import membership

    deserialize = membership.deserialize

    def slowly(data: bytes) -> object:
        time.sleep(seconds)
        return deserialize(data)

    membership.deserialize = slowly  # type: ignore[assignment]


def main(argv: list[str]) -> None:
    if len(argv) < 2 or argv[1] != "--":
        raise SystemExit(__doc__)
    change, example_args = argv[0], argv[2:]
    if change == "wider-model":
        _wider_model()
    elif change.startswith("slow-load="):
        _slow_load(float(change.removeprefix("slow-load=")))
    else:
        raise SystemExit(f"unknown change {change!r}\n{__doc__}")
    sys.argv = [str(EXAMPLE), *example_args]
    runpy.run_path(str(EXAMPLE), run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
