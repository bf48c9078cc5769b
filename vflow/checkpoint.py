"""Checkpoints of an Executor: ``vflow.save`` / ``vflow.load`` and the state dicts
behind ``Executor.state_dict`` / ``Executor.load_state_dict``.

What is saved
  The model's state dict (parameters and buffers), the optimizer's state dict, the
  step counts (``step_count``, ``skipped_steps``), the seed, the loss scaler's state
  and V. That is the executor's whole training state: the random draws of VN i at
  step s come from generators seeded with ``vn_seed(seed, s, i)`` (Note [VN
  randomness] in vflow.rng), so (seed, step_count) *is* the complete VN random
  state; no generator state needs saving, and loading replaces the executor's seed
  with the checkpoint's.

What is not saved
  Whatever lives outside the executor: the caller's own random generators (vflow
  restores them around every step, so they are never mixed up with the VN streams),
  the data loader's position (e.g. the epoch to pass to
  ``vflow.VNBatchSampler.set_epoch``), learning-rate schedulers and the like. Pass
  them to ``save(..., extra=...)``; ``load`` returns them. ``extra`` may hold only
  what ``torch.load(weights_only=True)`` reads back (tensors, numbers, strings,
  bytes, None, lists, tuples, sets, dicts); anything else is rejected at save time
  rather than at resume time.

Plan independence
  Nothing in the state depends on the plan or on the number of workers: every
  worker holds the same parameters and optimizer state after a step, and the VN
  random streams depend on the VN, not on the worker that runs it. A checkpoint
  written by W workers therefore resumes on W' workers (any plan) with the same V;
  V itself must match, since it fixes the VN slices of every global batch.
  ``written_by`` records the writer's world size and plan for information only.
  Resuming bit for bit (not merely to rounding) also needs ``deterministic=True``
  on both sides, which makes the reductions independent of the mapping.

Atomicity
  ``save`` writes to a temporary file in the destination's directory, flushes and
  fsyncs it, renames it over ``path`` (atomic on POSIX and Windows) and fsyncs the
  directory. A process that dies mid-write leaves the previous checkpoint at
  ``path`` intact (and, at worst, a stray ``.<name>.tmp-*`` file next to it, which
  is never mistaken for a checkpoint). On an error in the process, the temporary
  file is removed.

Several workers
  ``save`` is a collective: only rank 0 writes, and every rank returns once the
  file is in place, or raises if rank 0 could not write it. ``load`` is a
  collective as well: every rank reads the file itself (a shared filesystem, or a
  copy per node), and either every rank loads it or none does — if any rank fails,
  or the ranks read different checkpoints (a stale copy on some node), every rank
  raises with its state unchanged, instead of silently training on different
  replicas.
"""

from __future__ import annotations

import collections
import copy
import errno
import math
import os
import pickle
import secrets
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from vflow.distributed import _fingerprint

if TYPE_CHECKING:
    from vflow.executor import Executor

FORMAT = "vflow.executor"
VERSION = 1
_SUPPORTED_VERSIONS = (1,)
# Keys that must be in an executor state of VERSION; "written_by" is informational.
_REQUIRED = (
    "virtual_nodes",
    "seed",
    "step_count",
    "skipped_steps",
    "deterministic",
    "model",
    "optimizer",
    "optimizer_class",
    "loss_scaler",
)
_MAX_LISTED = 8

# ---- state dicts ----------------------------------------------------------------------


def executor_state_dict(ex: Executor) -> dict[str, Any]:
    """``ex``'s training state as a plan-independent dict that survives
    ``torch.save`` / ``torch.load(weights_only=True)``.

    As with ``torch.nn.Module.state_dict``, the tensors are the live ones: the dict
    follows further training unless it is saved or cloned.
    """
    return {
        "format": FORMAT,
        "version": VERSION,
        "virtual_nodes": ex.virtual_nodes,
        "seed": ex.seed,
        "step_count": ex.step_count,
        "skipped_steps": ex.skipped_steps,
        "deterministic": bool(getattr(ex, "deterministic", False)),
        "model": ex.model.state_dict(),
        "optimizer": ex.optimizer.state_dict(),
        "optimizer_class": _class_name(ex.optimizer),
        "loss_scaler": None if ex.scaler is None else ex.scaler.state_dict(),
        "written_by": {
            "world_size": ex.world_size,
            "plan_counts": list(ex.plan.counts),
            "vflow_version": _vflow_version(),
            "torch_version": str(torch.__version__),
        },
    }


def load_executor_state_dict(ex: Executor, state: Any) -> None:
    """Restores ``state`` (from ``executor_state_dict``) into ``ex``.

    Everything is validated before anything changes; a state that does not fit
    raises TypeError/ValueError naming the key. Should applying it still fail
    (say, out of memory half-way), the model, optimizer, loss scaler, seed and step
    counts are rolled back before the error propagates.
    """
    _load(ex, state, owned=False)


def _load(ex: Executor, state: Any, *, owned: bool) -> _Snapshot:
    """Validates and applies ``state``; returns the snapshot of what it replaced.

    ``owned``: ``state`` was read from a file just now and nobody else holds its
    tensors, so the optimizer may adopt them instead of copies.
    """
    _validate(ex, state)
    snapshot = _Snapshot.take(ex)
    optimizer_state = state["optimizer"]
    if not owned:
        # Optimizer.load_state_dict keeps tensors that already have the parameter's
        # dtype and device instead of copying them; two executors would then update
        # the same momentum buffers in place.
        optimizer_state = {**optimizer_state, "state": _clone_tree(optimizer_state["state"])}
    try:
        ex.model.load_state_dict(state["model"], strict=True)
        ex.optimizer.load_state_dict(optimizer_state)
        if ex.scaler is not None:
            ex.scaler.load_state_dict(state["loss_scaler"])
        ex.step_count = state["step_count"]
        ex.skipped_steps = state["skipped_steps"]
        ex.seed = state["seed"]
    except BaseException:
        snapshot.restore(ex)
        raise
    return snapshot


@dataclass
class _Snapshot:
    """What loading a state replaces, kept to roll back a failed load.

    Tensors are copied to the CPU: a rollback is rare, and a second copy of the
    optimizer state on an accelerator could itself run it out of memory.
    """

    model: dict[str, Any]
    optimizer: dict[str, Any]
    scaler: dict[str, Any] | None
    step_count: int
    skipped_steps: int
    seed: int

    @classmethod
    def take(cls, ex: Executor) -> _Snapshot:
        model_state = ex.model.state_dict()
        model = collections.OrderedDict((k, _copy_to_cpu(v)) for k, v in model_state.items())
        # Modules read their state-dict version from _metadata (e.g. BatchNorm's
        # num_batches_tracked); without it they would take the state for an old one.
        metadata = getattr(model_state, "_metadata", None)
        if metadata is not None:
            model._metadata = copy.deepcopy(metadata)  # type: ignore[attr-defined]
        return cls(
            model=model,
            optimizer=_copy_to_cpu(ex.optimizer.state_dict()),
            scaler=None if ex.scaler is None else dict(ex.scaler.state_dict()),
            step_count=ex.step_count,
            skipped_steps=ex.skipped_steps,
            seed=ex.seed,
        )

    def restore(self, ex: Executor) -> None:
        ex.model.load_state_dict(self.model, strict=True)
        ex.optimizer.load_state_dict(self.optimizer)
        if ex.scaler is not None and self.scaler is not None:
            ex.scaler.load_state_dict(self.scaler)
        ex.step_count = self.step_count
        ex.skipped_steps = self.skipped_steps
        ex.seed = self.seed


# ---- validation -------------------------------------------------------------------------


def _validate(ex: Executor, state: Any) -> None:
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
    if v != ex.virtual_nodes:
        raise ValueError(
            f"the checkpoint was written for V={v} virtual nodes, this executor has "
            f"V={ex.virtual_nodes}; V must match (the number of workers need not)"
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
    _check_model(ex.model, state["model"])
    _check_optimizer(ex.optimizer, state["optimizer"], state["optimizer_class"])
    _check_scaler(ex, state["loss_scaler"])


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


def _check_scaler(ex: Executor, saved: Any) -> None:
    if ex.scaler is None:
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


# ---- files ----------------------------------------------------------------------------


def save(path: str | os.PathLike[str], ex: Executor, extra: Any = None) -> None:
    """Writes ``ex``'s state and ``extra`` to ``path`` atomically (see the module
    docstring). With several workers this is a collective that every rank calls:
    rank 0 writes (its ``extra`` is the one saved), and every rank returns once the
    file is in place or raises RuntimeError if rank 0 failed.
    """
    path = _check_path(path, "vflow.save")
    _check_executor(ex, "vflow.save")
    ex._check_open()
    if ex._collectives is None:
        _save_here(path, ex, extra)
        return
    error: Exception | None = None
    if ex.rank == 0:
        try:
            _save_here(path, ex, extra)
        except Exception as e:
            error = e
    # Rank 0 catches its own error and reports it here: had it raised instead, the
    # other ranks would wait in this broadcast until the timeout.
    flag = torch.tensor([1.0 if error is None else 0.0], dtype=torch.float64)
    flag = flag.to(ex._collectives.device)
    ex._collectives.broadcast_from_first([flag], "checkpoint save", ex.step_count)
    if error is not None:
        raise error
    if float(flag) != 1.0:
        raise RuntimeError(
            f"vflow.save: rank 0 failed to write the checkpoint {path!r} (its error says why); "
            "the file at that path, if any, is unchanged"
        )


def load(path: str | os.PathLike[str], ex: Executor, map_location: Any = None) -> Any:
    """Loads a checkpoint written by ``save`` into ``ex`` and returns its ``extra``.

    The file is read with ``weights_only=True`` onto ``map_location`` (default the
    CPU; the model and optimizer then copy to their parameters' devices). With
    several workers this is a collective that every rank calls with its own copy of
    the file: all ranks load it, or none does and every rank raises.
    """
    path = _check_path(path, "vflow.load")
    _check_executor(ex, "vflow.load")
    ex._check_open()
    if ex._collectives is None:
        checkpoint = _read(path, map_location)
        _load(ex, checkpoint["executor"], owned=True)
        return checkpoint["extra"]

    error: Exception | None = None
    snapshot: _Snapshot | None = None
    extra = None
    try:
        checkpoint = _read(path, map_location)
        extra = checkpoint["extra"]
        snapshot = _load(ex, checkpoint["executor"], owned=True)
    except Exception as e:
        error = e
    # What identifies the checkpoint: ranks that read different files (a stale copy)
    # almost surely differ here, and would otherwise go on with different replicas.
    fingerprint = _fingerprint(
        repr((ex.step_count, ex.skipped_steps, ex.seed, ex.scaler and ex.scaler.state_dict()))
    )
    loaded_step = ex.step_count
    mine = torch.tensor([[0 if error is None else 1, fingerprint]], dtype=torch.int64)
    try:
        table = ex._collectives.gather_rows(mine, [1] * ex.world_size, ex.step_count).cpu()
    except BaseException:
        if snapshot is not None:
            snapshot.restore(ex)
        raise
    failed = table[:, 0].nonzero().flatten().tolist()
    if failed or bool((table[:, 1] != table[0, 1]).any()):
        if snapshot is not None:
            snapshot.restore(ex)
        if error is not None:
            raise error
        if failed:
            raise RuntimeError(
                f"vflow.load: rank(s) {failed} could not load {path!r} (their errors say why); "
                "no rank loaded it, this rank's state is unchanged"
            )
        differ = (table[:, 1] != table[ex.rank, 1]).nonzero().flatten().tolist()
        raise ValueError(
            f"vflow.load: rank(s) {differ} read a different checkpoint from {path!r} than this "
            f"rank, whose copy is at step {loaded_step}; every rank must read the same file (a "
            "stale copy on some node?). No rank loaded it"
        )
    return extra


def _check_path(path: Any, where: str) -> str:
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"{where}: path must be a str or os.PathLike, got {type(path).__name__}")
    path = os.fspath(path)
    if not isinstance(path, str):
        raise TypeError(f"{where}: path must name a file as str, got {type(path).__name__}")
    if not path:
        raise ValueError(f"{where}: path is empty")
    return path


def _check_executor(ex: Any, where: str) -> None:
    from vflow.executor import Executor  # here: vflow.executor imports this module

    if not isinstance(ex, Executor):
        raise TypeError(f"{where}: ex must be a vflow.Executor, got {type(ex).__name__}")


def _save_here(path: str, ex: Executor, extra: Any) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise FileNotFoundError(
            f"vflow.save: the directory {directory!r} of {path!r} does not exist; create it first"
        )
    if os.path.isdir(path):
        raise IsADirectoryError(f"vflow.save: {path!r} is a directory; expected a file path")
    _check_loadable(extra, "extra")
    payload = {"executor": ex.state_dict(), "extra": extra}
    _check_loadable(payload["executor"], "the executor state")
    _write_atomically(path, directory, payload)


def _write_atomically(path: str, directory: str, payload: Any) -> None:
    # Same directory, so that the rename never crosses filesystems (it would not be
    # atomic); O_EXCL, so that concurrent writers never share a temporary file; mode
    # 0o666 rather than mkstemp's 0o600, so the checkpoint gets the umask's permissions.
    name = os.path.basename(path)[:180]
    tmp = os.path.join(directory, f".{name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
    try:
        with open(fd, "wb") as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.remove(tmp)
        except FileNotFoundError:
            pass
        raise
    _fsync_directory(directory)


def _fsync_directory(directory: str) -> None:
    """Makes the rename itself durable (POSIX only: Windows cannot open a directory)."""
    if os.name != "posix":
        return
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as e:
        # Some filesystems cannot fsync a directory; the file is in place regardless.
        if e.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
            raise
    finally:
        os.close(fd)


def _read(path: str, map_location: Any) -> dict[str, Any]:
    try:
        checkpoint = torch.load(
            path, map_location="cpu" if map_location is None else map_location, weights_only=True
        )
    except FileNotFoundError as e:
        raise FileNotFoundError(f"vflow.load: no checkpoint at {path!r}") from e
    except torch.OutOfMemoryError:
        raise
    except (pickle.UnpicklingError, EOFError, RuntimeError) as e:
        raise ValueError(
            f"vflow.load: could not read {path!r} as a checkpoint (truncated, or not written "
            f"by vflow.save?): {e}"
        ) from e
    if not isinstance(checkpoint, dict) or set(checkpoint) != {"executor", "extra"}:
        shown = sorted(map(str, checkpoint)) if isinstance(checkpoint, dict) else None
        raise ValueError(
            f"vflow.load: {path!r} is not a vflow.save checkpoint: expected a dict with the keys "
            f"['executor', 'extra'], got a {type(checkpoint).__name__}"
            + (f" with the keys {shown}" if shown is not None else "")
            + " (a bare Executor.state_dict() loads with Executor.load_state_dict)"
        )
    return checkpoint


# ---- helpers ------------------------------------------------------------------------------

# What torch.load(weights_only=True) reads back: exactly these types, not subclasses
# (a namedtuple pickles as its class, which the weights-only unpickler refuses).
_ATOMS = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device)
_TENSORS = (torch.Tensor, torch.nn.Parameter)
_SEQUENCES = (list, tuple, set, torch.Size)
_MAPPINGS = (dict, collections.OrderedDict)


def _check_loadable(value: Any, where: str) -> None:
    """Raises TypeError naming the first thing in ``value`` that a weights-only
    load would refuse: better at save time than when resuming."""
    seen: set[int] = set()

    def walk(item: Any, at: str) -> None:
        kind = type(item)
        if kind in _ATOMS or kind in _TENSORS:
            return
        if kind in _SEQUENCES or kind in _MAPPINGS:
            if id(item) in seen:
                return
            seen.add(id(item))
            if kind in _MAPPINGS:
                for key, child in item.items():
                    walk(key, f"{at} (key {key!r})")
                    walk(child, f"{at}[{key!r}]")
            else:
                for k, child in enumerate(item):
                    walk(child, f"{at}[{k}]")
            return
        raise TypeError(
            f"vflow.save: {at} is a {kind.__module__}.{kind.__qualname__}, which "
            "torch.load(weights_only=True) cannot read back; use tensors, numbers, strings, "
            "bytes, None, and lists, tuples, sets and dicts of them"
        )

    walk(value, where)


def _map_tensors(
    value: Any, fn: Callable[[torch.Tensor], torch.Tensor], leaf: Callable[[Any], Any]
) -> Any:
    """``value`` with every tensor in its dicts, lists and tuples replaced by ``fn(t)``
    and every other leaf by ``leaf(x)``."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, Mapping):
        return {k: _map_tensors(v, fn, leaf) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_map_tensors(v, fn, leaf) for v in value)
    return leaf(value)


def _clone_tree(value: Any) -> Any:
    return _map_tensors(value, lambda t: t.detach().clone(), lambda x: x)


def _copy_to_cpu(value: Any) -> Any:
    return _map_tensors(value, lambda t: t.detach().to("cpu", copy=True), copy.deepcopy)


def _class_name(obj: object) -> str:
    kind = type(obj)
    return f"{kind.__module__}.{kind.__qualname__}"


def _vflow_version() -> str:
    import vflow  # here: vflow imports this module while it initialises

    return str(getattr(vflow, "__version__", "unknown"))
