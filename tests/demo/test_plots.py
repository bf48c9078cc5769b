"""The main job's figures (vflow/demo/plots.py): what a reader sees in them."""

from __future__ import annotations

from pathlib import Path

import matplotlib.colors
import numpy as np
import pytest

from vflow.demo import plots
from vflow.demo.mappings import Outcome, Run


def _outcome(name: str, counts: tuple[int, ...] | None, workers: int = 2) -> Outcome:
    run = Run(name, workers, 64, counts)
    outcome = Outcome(run, losses=[2.0, 1.0, 0.5], steps_per_epoch=3)
    outcome.param_diff_per_step = [0.0, 0.0, 0.0] if counts else [0.0, 1e-3, 1e-2]
    return outcome


def _luminance(color: object) -> float:
    r, g, b = matplotlib.colors.to_rgb(color)
    return 0.2126 * r + 0.7152 * g + 0.0722 * b


def test_every_run_of_the_main_job_stands_out_in_the_legend() -> None:
    # The main job's runs: 4 mappings and the 2 heterogeneous ones (plan="auto" is the
    # sixth vflow run, whose line used to be 0.2 points wide), then 2 baselines.
    outcomes = [_outcome(f"vflow {i}", (4, 4)) for i in range(6)]
    outcomes += [_outcome(f"baseline {i}", None) for i in range(2)]
    fig = plots.loss_curves_figure(outcomes, "title")
    try:
        legend = fig.axes[0].get_legend()
        lines = legend.get_lines()
        assert [t.get_text() for t in legend.get_texts()] == [o.run.name for o in outcomes]
        for line in lines:
            assert line.get_linewidth() >= 1.2, line.get_label()
            assert line.get_alpha() in (None, 0.8)
        for line in lines[:6]:  # the blues
            assert _luminance(line.get_color()) < 0.5, (line.get_label(), line.get_color())
        vflow_styles = {(line.get_color(), line.get_linewidth()) for line in lines[:6]}
        assert len(vflow_styles) == 6  # identical curves: each must be told apart
    finally:
        plots._pyplot().close(fig)


def _events(steps: list[int]) -> list[dict[str, object]]:
    reasons = ["start", "grow", "grow", "crash", "grow", "finish"]
    labels = ["start: a → 1", "+b → 2", "+c → 3", "b killed → 2", "+d → 3", "done → 3"]
    return [
        {"step": s, "reason": r, "label": label}
        for s, r, label in zip(steps, reasons, labels, strict=True)
    ]


@pytest.mark.parametrize("steps", [22, 66])
def test_the_elastic_figures_event_labels_do_not_overlap(steps: int) -> None:
    # The demo's changes come one or two steps apart at the start of the job.
    events = _events([0, 2, 4, 5, 7, steps])
    losses = list(np.linspace(2.3, 0.2, steps))
    workers = [1, 1, 2, 2, 3, 2, 2, *([3] * (steps - 7))]
    fig = plots.elastic_figure(events, losses, losses, workers, "title")
    try:
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        texts = [t for t in fig.axes[0].texts if t.get_text() in {e["label"] for e in events}]
        assert len(texts) == len(events)
        boxes = [t.get_window_extent(renderer) for t in texts]
        for i, a in enumerate(boxes):
            for b in boxes[i + 1 :]:
                assert not a.overlaps(b), (texts[boxes.index(a)].get_text(), a, b)
        # No change's dashed line runs through another change's label.
        strip = fig.axes[0]
        for collection in strip.collections:
            for segment in collection.get_segments():
                (x, y0), (_, y1) = strip.transData.transform(segment)
                low, high = sorted((y0, y1))
                for text, box in zip(texts, boxes, strict=True):
                    crosses = box.x0 + 1 < x < box.x1 - 1 and low < box.y1 and box.y0 < high
                    assert not crosses, (text.get_text(), x)
        figure_box = fig.bbox
        for text, box in zip(texts, boxes, strict=True):
            assert figure_box.x0 <= box.x0 and box.x1 <= figure_box.x1, text.get_text()
    finally:
        plots._pyplot().close(fig)


def test_the_figures_are_written_as_png(tmp_path: Path) -> None:
    plots.loss_curves([_outcome("vflow", (4, 4)), _outcome("b", None)], tmp_path / "a.png", "t")
    events = _events([0, 2, 4, 5, 7, 12])
    plots.elastic(tmp_path / "b.png", events, [1.0] * 12, [1.0] * 12, [1] * 12, "t")
    for name in ("a.png", "b.png"):
        assert (tmp_path / name).read_bytes().startswith(b"\x89PNG")
