"""A pipelined job's training state as one grid-independent dict, and its files.

Note [A state for every grid]
Each stage holds part of the model and its own optimizer, so the state of the job is
assembled from replica 0's stages: the model's state dict under the names of the
unsplit model (``"3.fc.weight"``), the optimizer state keyed by those parameter names
instead of the per-optimizer indices ``torch.optim`` uses, each parameter group with
its hyperparameters and the names it holds, plus the step counts, the seed and stage
0's registered objects (alike on every stage; Note [Registered state]).
Nothing in it depends on the grid: a process of any grid with the same V and segments
takes the entries of its own stage (``stage_state``), whatever cut and replica count
wrote it, and so does ``stages=1`` on one process. The stages' parts travel as raw
tensor bytes (Note [Sending the training state], vflow/world/membership.py), so the
gathered state holds the same bits as the stages.

Gathered (``PipelineExecutor.full_state_dict``), the state costs every process the
memory of the whole model: ``state_dict`` is a stage's own entries in the same layout,
and checkpoints do not gather it. ``vflow.pipeline.save`` writes each stage's part
(``stage_part``) from the processes that hold it, under these names flattened into keys
no two stages share,
and ``vflow.pipeline.load`` reads back a state of this layout holding only the loading
process's stage, which ``stage_state`` takes as it takes a whole one (Note
[Checkpoints per stage], vflow/pipeline/checkpoint.py).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from vflow.runtime import training_state
from vflow.runtime.registered_state import RegisteredState
from vflow.world import membership

if TYPE_CHECKING:
    from vflow.world.group import World

FORMAT = "vflow.pipeline"
VERSION = 1


def parameter_names(stage_module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The names of the optimizer's parameters in its state-dict index order."""
    names = {id(p): name for name, p in stage_module.named_parameters()}
    return [names[id(p)] for group in optimizer.param_groups for p in group["params"]]


def stage_part(
    stage_module: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    stage: int,
    registered: RegisteredState,
    loss_scaler: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One stage's model and optimizer state, keyed by parameter names, its
    registered objects' states and its loss scaler's (alike on every stage: one
    verdict per step for the whole grid)."""
    names = parameter_names(stage_module, optimizer)
    saved = optimizer.state_dict()
    return {
        "stage": stage,
        "model": stage_module.state_dict(),
        "optimizer_state": {names[i]: value for i, value in saved["state"].items()},
        "param_groups": [
            {
                **{k: v for k, v in group.items() if k != "params"},
                "params": [names[i] for i in group["params"]],
            }
            for group in saved["param_groups"]
        ],
        "registered": registered.state_dict(),
        "loss_scaler": loss_scaler,
    }


def gather(world: World, mine: dict[str, Any] | None, stages: int) -> list[dict[str, Any]]:
    """Every stage's part, from replica 0's processes (grid ranks 0..S-1), on every
    process of the grid; ``mine`` is this process's part on replica 0, else None."""
    if not world.distributed:
        assert mine is not None
        return [mine]
    parts = []
    for stage in range(stages):
        if world.rank == stage:
            assert mine is not None
            data, header = membership.pack_state(mine, world.device)
            sizes = torch.tensor([data.numel(), header], dtype=torch.int64)
        else:
            sizes = torch.zeros(2, dtype=torch.int64)
        world.broadcast_from(stage, [sizes], f"broadcast of stage {stage}'s state size", None)
        if world.rank != stage:
            data = torch.empty(int(sizes[0]), dtype=torch.uint8, device=world.device)
        world.broadcast_own(stage, data, f"broadcast of stage {stage}'s state")
        part = membership.unpack_state(data, int(sizes[1]))
        parts.append(membership.map_tensors(part, lambda t: t.clone()))
    return parts


def assemble(
    parts: list[dict[str, Any]],
    *,
    virtual_nodes: int,
    seed: int,
    step_count: int,
    skipped_steps: int,
    deterministic: bool,
    optimizer_class: type,
    written_by: dict[str, Any],
) -> dict[str, Any]:
    """The whole job's state (Note [A state for every grid]) from the stages' parts."""
    model: OrderedDict[str, Any] = OrderedDict()
    optimizer_state: dict[str, Any] = {}
    groups: list[dict[str, Any]] = []
    for part in sorted(parts, key=lambda p: p["stage"]):
        model.update(part["model"])
        optimizer_state.update(part["optimizer_state"])
        groups.extend(part["param_groups"])
    return {
        "format": FORMAT,
        "version": VERSION,
        "virtual_nodes": virtual_nodes,
        "seed": seed,
        "step_count": step_count,
        "skipped_steps": skipped_steps,
        "deterministic": deterministic,
        "model": model,
        "optimizer": {"state": optimizer_state, "param_groups": groups},
        "optimizer_class": f"{optimizer_class.__module__}.{optimizer_class.__qualname__}",
        # The registered objects are alike on every stage (PipelineExecutor.register_state):
        # stage 0's stand for all, whatever cut loads them.
        "registered": min(parts, key=lambda p: p["stage"])["registered"],
        "loss_scaler": min(parts, key=lambda p: p["stage"]).get("loss_scaler"),
        "written_by": written_by,
    }


def stage_state(
    state: Any,
    stage_module: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    template: dict[str, Any],
    segment_names: list[str],
) -> dict[str, Any]:
    """This stage's entries of ``state`` in the executor-state layout of
    vflow.runtime.training_state (``template``: this stage's current one), which then
    validates and loads them all or nothing. Entries of no segment of the model
    (``segment_names``) are refused: the state is another model's."""
    if not isinstance(state, Mapping):
        raise TypeError(
            "state must be a dict from PipelineExecutor.full_state_dict() or state_dict(), "
            f"got {type(state).__name__}"
        )
    if state.get("format") != FORMAT:
        raise ValueError(
            f"not a vflow pipeline state: state['format'] is {state.get('format')!r}, "
            f"expected {FORMAT!r} (from PipelineExecutor.full_state_dict() or state_dict())"
        )
    if state.get("version") != VERSION:
        raise ValueError(
            f"state['version'] is {state.get('version')!r}; this vflow reads {VERSION}"
        )
    missing = [key for key in training_state.COMMON_KEYS if key not in state]
    if missing:
        raise ValueError(f"pipeline state lacks the key(s) {missing}")
    saved_model = state["model"]
    saved_optimizer = state["optimizer"]
    if not isinstance(saved_model, Mapping):
        raise TypeError(f"state['model'] must be a dict, got {type(saved_model).__name__}")
    if not isinstance(saved_optimizer, Mapping) or not {"state", "param_groups"} <= set(
        saved_optimizer
    ):
        raise TypeError("state['optimizer'] must be a dict with 'state' and 'param_groups'")
    wanted = stage_module.state_dict()
    segments = set(segment_names)
    foreign = [key for key in saved_model if str(key).split(".", 1)[0] not in segments]
    if foreign:
        raise ValueError(
            f"state['model'] has entries of no segment of this model, {foreign[:8]}: the "
            f"checkpoint must come from the same model (segments {segment_names})"
        )
    absent = [key for key in wanted if key not in saved_model]
    if absent:
        raise ValueError(
            f"state['model'] lacks this stage's entries {absent[:8]}: the checkpoint must come "
            "from the same model (the same segments under the same names)"
        )
    names = parameter_names(stage_module, optimizer)
    group_of: dict[str, dict[str, Any]] = {}
    for group in saved_optimizer["param_groups"]:
        for name in group.get("params", []):
            group_of[name] = group
    param_groups = []
    index = 0
    for g, live in enumerate(optimizer.param_groups):
        mine = names[index : index + len(live["params"])]
        saved_groups = [group_of.get(name) for name in mine]
        if any(group is None for group in saved_groups):
            lost = [n for n, group in zip(mine, saved_groups, strict=True) if group is None]
            raise ValueError(
                f"state['optimizer'] has no parameter group holding {lost[:8]}: the optimizer "
                "state must come from the same model"
            )
        hyper = [{k: v for k, v in group.items() if k != "params"} for group in saved_groups]  # type: ignore[union-attr]
        if any(h != hyper[0] for h in hyper):
            raise ValueError(
                f"the parameters of this stage's optimizer group {g} were in groups with "
                "different hyperparameters when the state was written; the groups must match"
            )
        param_groups.append({**hyper[0], "params": list(range(index, index + len(mine)))})
        index += len(mine)
    per_param = saved_optimizer["state"]
    optimizer_state = {i: per_param[name] for i, name in enumerate(names) if name in per_param}
    return {
        **template,
        "virtual_nodes": state["virtual_nodes"],
        "seed": state["seed"],
        "step_count": state["step_count"],
        "skipped_steps": state["skipped_steps"],
        "deterministic": state["deterministic"],
        "model": OrderedDict((key, saved_model[key]) for key in wanted),
        "optimizer": {"state": optimizer_state, "param_groups": param_groups},
        "optimizer_class": state["optimizer_class"],
        "registered": state.get("registered", {}),
        "loss_scaler": state.get("loss_scaler"),
    }
