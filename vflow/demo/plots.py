"""The main job's figures: the mappings' loss curves and parameter differences
(``loss_curves.png``), and the elastic job's loss curve with its changes of the worker
set (``elastic.png``). Each figure is built by a function that returns it, so that
tests can read what it shows, and saved by one that closes it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from vflow.demo.mappings import Outcome

# Every vflow run ends bitwise identical, so their curves lie on top of each other:
# each gets its own dash pattern, in blues dark enough to read in the legend.
_VFLOW_STYLES = [
    {"linestyle": "-", "color": "#08306b", "linewidth": 2.6},
    {"linestyle": (0, (6, 2)), "color": "#1f77b4", "linewidth": 2.2},
    {"linestyle": (0, (1, 1.5)), "color": "#08519c", "linewidth": 2.2},
    {"linestyle": (0, (5, 2, 1, 2)), "color": "#2171b5", "linewidth": 1.8},
    {"linestyle": (0, (3, 3)), "color": "#3a6fb0", "linewidth": 1.6},
    {"linestyle": (0, (8, 2, 1, 2, 1, 2)), "color": "#0b4f8a", "linewidth": 1.4},
]
_BASELINE_COLORS = ["tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown"]
_EVENT_COLORS = {
    "start": "tab:green",
    "grow": "tab:green",
    "crash": "tab:red",
    "leave": "tab:orange",
}


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Figure, path: Path) -> None:
    fig.savefig(path, dpi=120)
    _pyplot().close(fig)


def loss_curves_figure(outcomes: Sequence[Outcome], title: str) -> Figure:
    """Loss per epoch of every run, and below it each run's largest parameter
    difference to the first run after the same samples."""
    plt = _pyplot()
    fig, (loss_ax, diff_ax) = plt.subplots(
        2, 1, figsize=(8, 7.5), sharex=True, gridspec_kw={"height_ratios": [3, 2]}
    )
    vflow_index = baseline_index = 0
    for outcome in outcomes:
        epochs = [(k + 1) / outcome.steps_per_epoch for k in range(len(outcome.losses))]
        diffs = [(e, d) for e, d in zip(epochs, outcome.param_diff_per_step) if d is not None]
        if outcome.run.counts is not None:
            style: dict[str, Any] = _VFLOW_STYLES[vflow_index % len(_VFLOW_STYLES)]
            vflow_index += 1
        else:
            color = _BASELINE_COLORS[baseline_index % len(_BASELINE_COLORS)]
            style = {"color": color, "alpha": 0.8, "linewidth": 1.2}
            baseline_index += 1
        loss_ax.plot(epochs, outcome.losses, label=outcome.run.name, **style)
        if diffs and outcome is not outcomes[0]:
            diff_ax.plot(*zip(*diffs), label=outcome.run.name, **style)
    loss_ax.set_ylabel("training loss (global batch)")
    loss_ax.set_yscale("log")
    loss_ax.set_title(title, fontsize=10)
    loss_ax.legend(fontsize=8, handlelength=4)
    diff_ax.set_xlabel("epoch")
    diff_ax.set_ylabel("max |param − first run's|", fontsize=9)
    # Linear near 0, logarithmic above: exact zeros stay on the axis while differences
    # from 1e-6 to 1 stay apart.
    diff_ax.set_yscale("symlog", linthresh=1e-6)
    # A little below 0, so that the vflow lines at exactly 0 are not hidden by the axis.
    diff_ax.set_ylim(bottom=-3e-7)
    diff_ax.set_title(
        f"largest parameter difference to the first run ({outcomes[0].run.name}) after the "
        "same samples",
        fontsize=9,
    )
    if vflow_index > 1:
        diff_ax.annotate(
            "every vflow mapping: exactly 0 at every step",
            xy=(0.01, 0.1),
            xycoords="axes fraction",
            color=_VFLOW_STYLES[0]["color"],
            fontsize=9,
        )
    diff_ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def loss_curves(outcomes: Sequence[Outcome], path: Path, title: str) -> None:
    _save(loss_curves_figure(outcomes, title), path)


def elastic_figure(
    events: Sequence[Mapping[str, Any]],
    losses: Sequence[float],
    reference_losses: Sequence[float],
    workers_per_step: Sequence[int],
    title: str,
) -> Figure:
    """The elastic job's loss per step beside the fixed-hardware run's, its worker
    count per step, and each change of the worker set (``events``: "step", "reason",
    "label") as a dashed line. The changes' labels sit in a strip above the curves, one
    row each, their lines running down from them: changes a step or two apart (the first
    ones always are) stay legible."""
    plt = _pyplot()
    fig, (events_ax, loss_ax, workers_ax) = plt.subplots(
        3,
        1,
        figsize=(8, 6.5 + 0.12 * len(events)),
        sharex=True,
        gridspec_kw={"height_ratios": [0.25 * max(1, len(events)), 3, 1]},
    )
    steps = list(range(len(losses)))
    loss_ax.plot(
        steps, reference_losses, color="tab:gray", linewidth=3, alpha=0.5,
        label="fixed hardware: 1 process",
    )  # fmt: skip
    loss_ax.plot(
        steps, losses, color="tab:blue", marker=".", linewidth=1,
        label="elastic: 1 → 3 workers, one killed, one joins",
    )  # fmt: skip
    events_ax.set_ylim(len(events), 0)
    events_ax.axis("off")
    events_ax.set_title(title, fontsize=10)
    middle = (len(losses) - 1) / 2
    for index, event in enumerate(events):
        # Between the last step of the old worker set and the first of the new one.
        x = event["step"] - 0.5
        color = _EVENT_COLORS.get(event["reason"], "tab:gray")
        for ax in (loss_ax, workers_ax):
            ax.axvline(x, color=color, linestyle="--", linewidth=1)
        # In the strip, from the label's row down: no line crosses a label of its left.
        events_ax.vlines(x, index + 0.5, len(events), color=color, linestyle="--", linewidth=1)
        left = x <= middle
        events_ax.annotate(
            event["label"],
            xy=(x, index + 0.5),
            xytext=(3 if left else -3, 0),
            textcoords="offset points",
            ha="left" if left else "right",
            va="center",
            fontsize=8,
            color=color,
        )
    loss_ax.set_ylabel("training loss (global batch)")
    loss_ax.legend(fontsize=8, loc="lower left")
    workers_ax.step(steps, workers_per_step, where="mid", color="tab:blue")
    most = max(workers_per_step, default=1)
    workers_ax.set_ylim(0, most + 0.5)
    workers_ax.set_yticks(range(most + 1))
    workers_ax.set_ylabel("workers")
    workers_ax.set_xlabel("step")
    workers_ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def elastic(
    path: Path,
    events: Sequence[Mapping[str, Any]],
    losses: Sequence[float],
    reference_losses: Sequence[float],
    workers_per_step: Sequence[int],
    title: str,
) -> None:
    _save(elastic_figure(events, losses, reference_losses, workers_per_step, title), path)
