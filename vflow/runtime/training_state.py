"""An Executor's training state as a plan-independent dict, and restoring it: what
``Executor.state_dict`` / ``load_state_dict``, the checkpoints (vflow.runtime.checkpoint) and
the state handed to a worker joining the job (vflow.world.membership) are made of.

What it holds
  The model's state dict (parameters and buffers), the optimizer's state dict, the
  step counts (``step_count``, ``skipped_steps``), the seed, the loss scaler's state,
  the registered objects' states (``registered``, Note [Registered state] in
  vflow.runtime.registered_state) and V. That is the executor's whole training state:
  the random draws of VN i at step s come from generators seeded with
  ``vn_seed(seed, s, i)`` (Note [VN randomness] in vflow.mapping.rng), so (seed,
  step_count) *is* the complete VN random state; no generator state is needed, and
  loading replaces the executor's seed with the state's.

Plan independence
  Nothing in it depends on the plan or on the number of workers: every worker holds
  the same parameters and optimizer state after a step, and the VN random streams
  depend on the VN, not on the worker that runs it. A state written by W workers
  therefore resumes on W' workers (any plan) with the same V; V itself must match,
  since it fixes the VN slices of every global batch. ``written_by`` records the
  writer's world size and plan for information only.

Loading is all or nothing: everything is validated before anything changes (a state
that does not fit raises TypeError/ValueError naming the key), and should applying it
still fail (say, out of memory half-way), what was replaced is put back before the
error propagates.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from vflow._version import __version__
from vflow.runtime.amp import LossScaler
from vflow.runtime.registered_state import RegisteredState
from vflow.world.membership import map_tensors

FORMAT = "vflow.executor"
VERSION = 1
_SUPPORTED_VERSIONS = (1,)
# Keys that must be in an executor state of VERSION; "written_by" is informational.
# The keys a state of any executor has (a pipeline's too, vflow.pipeline.state)...
COMMON_KEYS = (
    "virtual_nodes",
    "seed",
    "step_count",
    "skipped_steps",
    "deterministic",
    "model",
    "optimizer",
    "optimizer_class",
)
# ... and an executor state of VERSION's.
_REQUIRED = (*COMMON_KEYS, "loss_scaler")
_MAX_LISTED = 8


@dataclass
class Target:
    """What a state is read from or loaded into: an Executor's model, optimizer, loss
    scaler and registered objects, for its V."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scaler: LossScaler | None
    virtual_nodes: int
    registered: RegisteredState


@dataclass(frozen=True)
class Progress:
    """The counters and seed a state carries besides the model and optimizer."""

    step_count: int
    skipped_steps: int
    seed: int


def build(
    target: Target, progress: Progress, deterministic: bool, world_size: int, plan_counts: list[int]
) -> dict[str, Any]:
    """The training state as a dict that survives ``torch.save`` /
    ``torch.load(weights_only=True)``.

    As with ``torch.nn.Module.state_dict``, the tensors are the live ones: the dict
    follows further training unless it is saved or cloned.
    """
    return {
        "format": FORMAT,
        "version": VERSION,
        "virtual_nodes": target.virtual_nodes,
        "seed": progress.seed,
        "step_count": progress.step_count,
        "skipped_steps": progress.skipped_steps,
        "deterministic": deterministic,
        "model": target.model.state_dict(),
        "optimizer": target.optimizer.state_dict(),
        "optimizer_class": _class_name(target.optimizer),
        "loss_scaler": None if target.scaler is None else target.scaler.state_dict(),
        "registered": target.registered.state_dict(),
        "written_by": {
            "world_size": world_size,
            "plan_counts": plan_counts,
            "vflow_version": __version__,
            "torch_version": str(torch.__version__),
        },
    }


def load(target: Target, state: Any, *, assign: bool = False) -> Progress:
    """Validates ``state`` (from ``build``) and applies it to ``target``; returns the
    progress it carries, for the caller to adopt.

    ``assign``: ``state``'s tensors belong to nobody else (read from a file or received
    just now), so the optimizer may adopt them instead of copies.
    """
    _validate(target, state)
    snapshot = _Snapshot.take(target)
    optimizer_state = state["optimizer"]
    if not assign:
        # Optimizer.load_state_dict keeps tensors that already have the parameter's
        # dtype and device instead of copying them; two executors would then update
        # the same momentum buffers in place.
        optimizer_state = {**optimizer_state, "state": clone_tree(optimizer_state["state"])}
    try:
        target.model.load_state_dict(state["model"], strict=True)
        target.optimizer.load_state_dict(optimizer_state)
        if target.scaler is not None:
            target.scaler.load_state_dict(state["loss_scaler"])
        target.registered.load(_registered(state))
    except BaseException:
        snapshot.restore(target)
        raise
    return Progress(state["step_count"], state["skipped_steps"], state["seed"])


def load_received(
    state: object,
    current: Callable[[], dict[str, Any]],
    load_state_dict: Callable[..., None],
) -> Callable[[], None]:
    """Loads a state the members sent to a newcomer (Note [Joining a worker set]) with
    ``load_state_dict``, copying it (its tensors are views of the received buffer), and
    returns what puts the newcomer's ``current`` state back, should another newcomer
    fail."""
    if not isinstance(state, dict):
        raise ValueError(f"the members sent a {type(state).__name__}, not a training state")
    before = copy_to_cpu(current())
    load_state_dict(state)
    return lambda: load_state_dict(before, assign=True)


def copy_to_cpu(value: Any) -> Any:
    """A CPU copy of a state (or any tree of tensors), keeping each state dict's
    ``_metadata``: what a caller keeps to put a state back later."""
    return map_tensors(value, lambda t: t.detach().to("cpu", copy=True), copy.deepcopy)


@dataclass
class _Snapshot:
    """What loading a state replaces, kept to roll back a failed load.

    Tensors are copied to the CPU: a rollback is rare, and a second copy of the
    optimizer state on an accelerator could itself run it out of memory.
    """

    model: dict[str, Any]
    optimizer: dict[str, Any]
    scaler: dict[str, Any] | None
    registered: dict[str, Any]

    @classmethod
    def take(cls, target: Target) -> _Snapshot:
        return cls(
            model=copy_to_cpu(target.model.state_dict()),
            optimizer=copy_to_cpu(target.optimizer.state_dict()),
            scaler=None if target.scaler is None else dict(target.scaler.state_dict()),
            registered=target.registered.snapshot(),
        )

    def restore(self, target: Target) -> None:
        target.model.load_state_dict(self.model, strict=True)
        target.optimizer.load_state_dict(self.optimizer)
        if target.scaler is not None and self.scaler is not None:
            target.scaler.load_state_dict(self.scaler)
        target.registered.restore(self.registered)


# ---- validation -------------------------------------------------------------------------


def _validate(target: Target, state: Any) -> None:
    if not isinstance(state, Mapping):
        raise TypeError(
            "executor state must be a dict (from Executor.state_dict()), got "
            f"{type(state).__name__}"
        )
    if state.get("format") != FORMAT:
        raise ValueError(
            f"not a vflow executor state: state['format'] is {state.get('format')!r}, expected "
            f"{FORMAT!r} (a dict from Executor.state_dict(), or the 'executor' entry of a "
            "vflow.save file)"
        )
    version = state.get("version")
    if isinstance(version, bool) or not isinstance(version, int):
        raise TypeError(f"state['version'] must be an int, got {type(version).__name__}")
    if version not in _SUPPORTED_VERSIONS:
        raise ValueError(
            f"state['version'] is {version}; this vflow reads versions {list(_SUPPORTED_VERSIONS)}"
            + (" (the checkpoint was written by a newer vflow)" if version > VERSION else "")
        )
    missing = [key for key in _REQUIRED if key not in state]
    if missing:
        raise ValueError(f"executor state lacks the key(s) {missing}")

    v = _int(state, "virtual_nodes", 1)
    if v != target.virtual_nodes:
        raise ValueError(
            f"the checkpoint was written for V={v} virtual nodes, this executor has "
            f"V={target.virtual_nodes}; V must match (the number of workers need not)"
        )
    _int(state, "seed", 0)
    steps = _int(state, "step_count", 0)
    skipped = _int(state, "skipped_steps", 0)
    if skipped > steps:
        raise ValueError(
            f"state['skipped_steps'] is {skipped} but state['step_count'] only {steps}; "
            "skipped steps are counted among the steps"
        )
    if not isinstance(state["deterministic"], bool):
        raise TypeError(
            f"state['deterministic'] must be a bool, got {type(state['deterministic']).__name__}"
        )
    _check_model(target.model, state["model"])
    _check_optimizer(target.optimizer, state["optimizer"], state["optimizer_class"])
    _check_scaler(target.scaler, state["loss_scaler"])
    target.registered.check(_registered(state), "state['registered']")


def _registered(state: Mapping[str, Any]) -> Any:
    """The registered objects' states; a state written before ``register_state`` existed
    has none."""
    return state.get("registered", {})


def _int(state: Mapping[str, Any], key: str, minimum: int) -> int:
    value = state[key]
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"state[{key!r}] must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"state[{key!r}] must be >= {minimum}, got {value}")
    return value


def _listed(names: list[str]) -> str:
    shown = ", ".join(repr(n) for n in names[:_MAX_LISTED])
    more = len(names) - _MAX_LISTED
    return shown + (f" and {more} more" if more > 0 else "")


def _check_model(model: torch.nn.Module, saved: Any) -> None:
    if not isinstance(saved, Mapping):
        raise TypeError(
            f"state['model'] must be a dict (a model state dict), got {type(saved).__name__}"
        )
    expected = model.state_dict()
    missing = [k for k in expected if k not in saved]
    unexpected = [k for k in saved if k not in expected]
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing key(s) {_listed(missing)}")
        if unexpected:
            parts.append(f"unexpected key(s) {_listed(unexpected)}")
        raise ValueError(
            f"state['model'] does not fit the model: {'; '.join(parts)}; the checkpoint must "
            "come from the same architecture"
        )
    for key, want in expected.items():
        if not isinstance(want, torch.Tensor):
            continue  # extra state (get_extra_state) is the module's to check
        got = saved[key]
        if not isinstance(got, torch.Tensor):
            raise TypeError(f"state['model'][{key!r}] must be a tensor, got {type(got).__name__}")
        if got.shape != want.shape or got.dtype != want.dtype:
            raise ValueError(
                f"state['model'][{key!r}] has shape {tuple(got.shape)} and dtype {got.dtype}, "
                f"the model's has shape {tuple(want.shape)} and dtype {want.dtype}"
            )


def _check_optimizer(optimizer: torch.optim.Optimizer, saved: Any, saved_class: Any) -> None:
    mine = _class_name(optimizer)
    if saved_class != mine:
        # Another optimizer's state loads without complaint and fails at the next step
        # (or, worse, does not).
        raise ValueError(
            f"state['optimizer_class'] is {saved_class!r} but this executor's optimizer is "
            f"{mine!r}; the optimizer state only fits the optimizer that wrote it"
        )
    if not isinstance(saved, Mapping) or not {"state", "param_groups"} <= set(saved):
        raise TypeError(
            "state['optimizer'] must be an optimizer state dict with 'state' and "
            f"'param_groups', got {type(saved).__name__}"
            + (f" with keys {sorted(map(str, saved))}" if isinstance(saved, Mapping) else "")
        )
    groups = saved["param_groups"]
    if not isinstance(groups, list) or not all(isinstance(g, Mapping) for g in groups):
        raise TypeError("state['optimizer']['param_groups'] must be a list of dicts")
    live = optimizer.param_groups
    if len(groups) != len(live):
        raise ValueError(
            f"state['optimizer'] has {len(groups)} parameter group(s), this executor's "
            f"optimizer has {len(live)}; the groups must match"
        )
    ids: set[Any] = set()
    for g, (group, live_group) in enumerate(zip(groups, live)):
        params = group.get("params")
        if not isinstance(params, list) or not all(
            isinstance(i, int) and not isinstance(i, bool) for i in params
        ):
            raise TypeError(
                f"state['optimizer']['param_groups'][{g}]['params'] must be a list of ints"
            )
        if len(params) != len(live_group["params"]):
            raise ValueError(
                f"state['optimizer']['param_groups'][{g}] has {len(params)} parameter(s), the "
                f"optimizer's group {g} has {len(live_group['params'])}; the groups must match"
            )
        ids.update(params)
    per_param = saved["state"]
    if not isinstance(per_param, Mapping):
        raise TypeError(
            f"state['optimizer']['state'] must be a dict, got {type(per_param).__name__}"
        )
    for key, value in per_param.items():
        if key not in ids:
            raise ValueError(
                f"state['optimizer']['state'] has an entry for parameter {key!r}, which no "
                "parameter group lists"
            )
        if not isinstance(value, Mapping):
            raise TypeError(
                f"state['optimizer']['state'][{key!r}] must be a dict, got {type(value).__name__}"
            )


def _check_scaler(scaler: LossScaler | None, saved: Any) -> None:
    if scaler is None:
        if saved is not None:
            raise ValueError(
                "state['loss_scaler'] holds a loss scaler's state but this executor has no "
                "loss scaling; construct it with loss_scale=True (or the same amp) as the "
                "executor that wrote the checkpoint"
            )
        return
    if saved is None:
        raise ValueError(
            "state['loss_scaler'] is None (written without loss scaling) but this executor "
            "scales its loss; construct it with loss_scale=False to load this checkpoint"
        )
    if not isinstance(saved, Mapping):
        raise TypeError(f"state['loss_scaler'] must be a dict, got {type(saved).__name__}")
    scale = saved.get("scale")
    if (
        isinstance(scale, bool)
        or not isinstance(scale, (int, float))
        or not (math.isfinite(scale) and scale > 0)
    ):
        raise ValueError(
            f"state['loss_scaler']['scale'] must be a finite number > 0, got {scale!r}"
        )
    good = saved.get("good_steps")
    if isinstance(good, bool) or not isinstance(good, int) or good < 0:
        raise ValueError(f"state['loss_scaler']['good_steps'] must be an int >= 0, got {good!r}")


# ---- helpers ------------------------------------------------------------------------------


def clone_tree(value: Any) -> Any:
    return map_tensors(value, lambda t: t.detach().clone())


def _class_name(obj: object) -> str:
    kind = type(obj)
    return f"{kind.__module__}.{kind.__qualname__}"
