"""The job's training state on disk: ``vflow.pipeline.save`` writes each stage's part
of it with torch.distributed.checkpoint (DCP), from the processes that hold it, and
``vflow.pipeline.load`` reads into any grid's executors the entries of their stages.

Note [Checkpoints per stage]
Gathering the whole model onto every process to write one file (what
``PipelineExecutor.full_state_dict`` does) costs every process the memory of all the
stages, and pipelines exist for models that do not fit one process. So ``save`` writes
with DCP: every process of the grid hands ``torch.distributed.checkpoint.save`` its own
stage's tensors, referenced, not copied, under the names of the state of Note [A state
for every grid] (vflow/pipeline/state.py), flattened into keys that no two stages
share:

    "vflow"                               V, seed, step counts, deterministic, optimizer
                                          class, written_by (alike on every process)
    "registered"                          stage 0's registered objects (Note [Registered
                                          state]); written by stage 0 only, read by all
    "model.<name>"                        a tensor (or extra state) of the unsplit model,
                                          "model.3.fc.weight"
    "optimizer.param.<name>"              parameter <name>'s group hyperparameters and
                                          the layout of its optimizer state
    "optimizer.state.<name>.<key>"        a tensor of its optimizer state, e.g.
                                          "optimizer.state.3.fc.weight.exp_avg"

The hyperparameters go by parameter, not by group, because a group is a stage's own:
two stages would otherwise write "the same" key with different values. The replicas
of a stage write the same keys with the same values, and DCP's default planner keeps
one writer per key, spreading a stage's keys over its replicas. Each process writes
one file, ``__<grid rank>_0.distcp``; the grid's first process adds ``.metadata`` (the
keys' shapes, dtypes and places) last. Nothing of the state crosses between processes:
the peak memory of a process while saving is its stage's, plus one tensor at a time
being serialised (``benchmarks/pipeline_checkpoint.py`` measures it).

Loading needs no collective to read: every process reads ``.metadata`` and the entries
of its own stage alone, whatever grid wrote them (another R, another S or cut, or
``stages=1`` on one process), so it reads only its stage's bytes. The model's keys are
checked against the whole model first (``PipelineExecutor.model`` keeps the other
stages' segments on the meta device, with their shapes), so a checkpoint of another
model, or of another V, is refused by every process with the same message before
anything is read or changed. Then the processes agree (one small gather) that each
could read and validate its stage, and load; a process that still fails in loading
(a registered object's ``load_state_dict`` raising, say) makes the others put their
stage back as it was, from a copy on the CPU that each keeps while loading (on a grid
of more than one process: a process alone has nobody to disagree with).

A save is atomic: DCP writes into a fresh directory beside ``path``
(``.<name>.dcp-<token>``), and once every process has written its file and the first
process the metadata, that process points ``path`` at it by a symbolic link, replaced
in one rename (a directory cannot be renamed over another one that is not empty). A
crash at any point leaves ``path`` pointing at the previous checkpoint, whole; the
previous directory, and any left behind by a save that crashed, are removed after the
rename. ``path`` must therefore be a link that ``save`` made, or nothing: a real
directory or a file there is refused, never deleted. All processes must see one
filesystem (a shared one, across machines).

A file at ``path`` is a checkpoint of the earlier format, the whole state in one
``torch.save`` file (written by ``save`` before this note): ``load`` still reads it,
every process the whole file, with the same checks and agreement.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import re
import secrets
import shutil
import warnings
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import ReadItem

from vflow.pipeline import state as pipeline_state
from vflow.pipeline.executor import PipelineExecutor
from vflow.runtime.checkpoint import _fsync_directory
from vflow.runtime.training_state import copy_to_cpu
from vflow.world.group import World, fingerprint

HEADER = "vflow"
REGISTERED = "registered"
MODEL = "model."
PARAM = "optimizer.param."
OPTIMIZER_STATE = "optimizer.state."
_LISTED = 8


# ---- save -------------------------------------------------------------------------------


def save(path: str | os.PathLike[str], ex: PipelineExecutor) -> None:
    """Writes the job's state to the directory ``path``, each process its own stage's
    part (Note [Checkpoints per stage]), atomically: a crash leaves the previous
    checkpoint at ``path``. A collective of the grid: it returns on every process once
    the checkpoint is in place, and raises on every process if any could not write."""
    path = _checked_path(path, "vflow.pipeline.save")
    world = World(ex.grid.group, ex.config.timeout)
    step = ex.step_count
    failure: Exception | None = None
    entries: dict[str, Any] = {}
    token = 0
    try:
        entries = _stage_entries(ex)
        if world.rank == 0:
            token = _make_temporary(path)
    except Exception as e:  # told to the others below, then raised here
        failure = e
    # Every process enters DCP's collectives, or none does: one that raised before them
    # would leave the others waiting in them until the timeout.
    table = world.gather_ints(
        [int(failure is None), token], f"gather of whether {path} can be written", step
    )
    token = table[0][1]
    published = False
    if failure is None and all(ok for ok, _ in table):
        try:
            _write(entries, path, _temporary(path, token), ex)
            if world.rank == 0:  # DCP raises everywhere unless every process wrote
                _point(path, token)
                published = True  # from here on the new directory must stay
                _tidy(path, token)
        except Exception as e:
            failure = e
        table = world.gather_ints(
            [int(failure is None), 0], f"gather of whether {path} was written", step
        )
    if world.rank == 0 and token and not published and not all(ok for ok, _ in table):
        shutil.rmtree(_temporary(path, token), ignore_errors=True)
    if failure is not None:
        raise failure
    failed = [rank for rank, (ok, _) in enumerate(table) if not ok]
    if failed:
        raise OSError(
            f"vflow.pipeline.save: process(es) {failed} of the grid could not write {path!r} "
            "(their own errors say why); the checkpoint at that path, if any, is unchanged"
        )


def _stage_entries(ex: PipelineExecutor) -> dict[str, Any]:
    """This process's DCP state dict: its stage's live tensors (no copies) and small
    objects, under keys no other stage writes (Note [Checkpoints per stage])."""
    part = ex.stage_state_dict()
    entries: dict[str, Any] = {HEADER: _header(ex)}
    if ex.grid.stage == 0:
        entries[REGISTERED] = part["registered"]
    for key, value in part["model"].items():
        entries[MODEL + key] = value
    for group in part["param_groups"]:
        hyper = {k: v for k, v in group.items() if k != "params"}
        for name in group["params"]:
            state = part["optimizer_state"].get(name)
            tensors = [] if state is None else [k for k, v in state.items() if _is_tensor(v)]
            entries[PARAM + name] = {
                "group": hyper,
                # None: no state yet (never stepped); else its keys in order, the tensors
                # under keys of their own and the rest (ints, say) here.
                "keys": None if state is None else list(state),
                "tensors": tensors,
                "values": {} if state is None else {k: state[k] for k in state if k not in tensors},
            }
            for key in tensors:
                entries[f"{OPTIMIZER_STATE}{name}.{key}"] = state[key]  # type: ignore[index]
    return entries


def _header(ex: PipelineExecutor) -> dict[str, Any]:
    kind = type(ex.optimizer)
    return {
        "format": pipeline_state.FORMAT,
        "version": pipeline_state.VERSION,
        "virtual_nodes": ex.virtual_nodes,
        "seed": ex.seed,
        "step_count": ex.step_count,
        "skipped_steps": ex.skipped_steps,
        "deterministic": bool(ex.deterministic),
        "optimizer_class": f"{kind.__module__}.{kind.__qualname__}",
        # One scale for the grid (Note [Mixed precision on a grid]): alike on every process.
        "loss_scaler": None if ex.scaler is None else ex.scaler.state_dict(),
        "written_by": {
            "replicas": ex.grid.replicas,
            "stages": ex.grid.stages,
            "plan_counts": list(ex.plan.counts),
            "layout": "torch.distributed.checkpoint, per stage",
        },
    }


def _is_tensor(value: object) -> bool:
    return isinstance(value, torch.Tensor)


def _temporary(path: str, token: int) -> str:
    directory, name = os.path.split(os.path.abspath(path))
    return os.path.join(directory, f".{name[:180]}.dcp-{token:08x}")


def _version_pattern(path: str) -> re.Pattern[str]:
    name = os.path.basename(os.path.abspath(path))[:180]
    return re.compile(re.escape(f".{name}.dcp-") + r"[0-9a-f]{8}(\.link)?")


def _make_temporary(path: str) -> int:
    """On the grid's first process: checks that ``path`` may be replaced and makes the
    directory the processes write into; returns its token."""
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise FileNotFoundError(
            f"vflow.pipeline.save: the directory {directory!r} of {path!r} does not exist; "
            "create it first"
        )
    if os.path.lexists(path) and not os.path.islink(path):
        kind = "a directory" if os.path.isdir(path) else "a file"
        raise FileExistsError(
            f"vflow.pipeline.save: {path!r} is {kind} that vflow.pipeline.save did not make "
            "(it makes a link to the checkpoint's directory, replaced atomically); remove it "
            "or save elsewhere"
            + (
                " (a file there may be a checkpoint of the earlier single-file format)"
                if kind == "a file"
                else ""
            )
        )
    for _ in range(16):
        token = secrets.randbits(32) or 1
        try:
            os.mkdir(_temporary(path, token))
        except FileExistsError:
            continue
        return token
    raise FileExistsError(f"vflow.pipeline.save: no free temporary name beside {path!r}")


@contextlib.contextmanager
def _dcp_errors(what: str) -> Iterator[None]:
    """DCP's CheckpointException as an OSError: DCP raises it, a BaseException, on every
    process of a save when any process failed (with every failure in it), and it must
    not slip past the ``except Exception`` that tells the other processes."""
    try:
        with warnings.catch_warnings():
            # DCP warns that it assumes one process when given none: that is meant here.
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            yield
    except CheckpointException as e:
        failures = "; ".join(
            f"process {rank}: {type(error).__name__}: {error}"
            for rank, (error, _trace) in sorted(e.failures.items())
        )
        raise OSError(f"{what} failed on {failures}") from e


def _write(entries: dict[str, Any], path: str, directory: str, ex: PipelineExecutor) -> None:
    writer = dcp.FileSystemWriter(directory, single_file_per_rank=True, sync_files=True)
    # Flattening would split the small objects' dicts into keys of their own.
    planner = dcp.DefaultSavePlanner(flatten_state_dict=False, flatten_sharded_tensors=False)
    with _dcp_errors(f"vflow.pipeline.save: writing {path!r}"):
        dcp.save(
            entries,
            storage_writer=writer,
            planner=planner,
            process_group=ex.grid.group,
            no_dist=ex.grid.group is None,
        )


def _point(path: str, token: int) -> None:
    """Points ``path`` at the written directory, in one rename."""
    written = _temporary(path, token)
    _fsync_directory(written)  # the files' names, before anything points at them
    link = f"{written}.link"
    os.symlink(os.path.basename(written), link)  # relative: the pair can move together
    try:
        os.replace(link, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(link)
        raise


def _tidy(path: str, token: int) -> None:
    """After ``_point``: makes the rename durable and removes the previous directory and
    any that a crashed save left behind."""
    directory = os.path.dirname(os.path.abspath(path))
    written = _temporary(path, token)
    try:
        _fsync_directory(directory)
    finally:
        pattern = _version_pattern(path)
        for entry in os.listdir(directory):
            other = os.path.join(directory, entry)
            if not pattern.fullmatch(entry) or other == written:
                continue
            if os.path.islink(other):  # a crash between making the link and the rename
                with contextlib.suppress(OSError):
                    os.remove(other)
            else:
                shutil.rmtree(other, ignore_errors=True)


# ---- load -------------------------------------------------------------------------------


def load(path: str | os.PathLike[str], ex: PipelineExecutor) -> None:
    """Loads the checkpoint at ``path`` (from ``save`` on any grid with the same V and
    segments, or a file of the earlier single-file format) into ``ex``'s stage. A
    collective of the grid: every process reads its own stage's entries, and either
    every process loads them or none does, each raising (ValueError for a checkpoint
    that does not fit) with its state unchanged."""
    path = _checked_path(path, "vflow.pipeline.load")
    world = World(ex.grid.group, ex.config.timeout)
    step = ex.step_count
    error: Exception | None = None
    state: dict[str, Any] = {}
    identity = 0
    try:
        state, identity = _read(path, ex)
        # Everything load_state_dict checks on this stage, now, so that a refusal comes
        # before any process has changed.
        pipeline_state.stage_state(state, ex.stage_module, ex.optimizer, {}, ex.segment_names)
    except Exception as e:
        error = e
    table = world.gather_ints(
        [int(error is not None), identity], f"gather of whether {path} could be read", step
    )
    failed = [rank for rank, (bad, _) in enumerate(table) if bad]
    if error is not None:
        raise error
    if failed:
        raise ValueError(
            f"vflow.pipeline.load: process(es) {failed} of the grid refused {path!r} (their own "
            "errors say why); nothing was changed"
        )
    differ = [rank for rank, (_, other) in enumerate(table) if other != identity]
    if differ:
        raise ValueError(
            f"vflow.pipeline.load: process(es) {differ} read another checkpoint at {path!r} "
            "than this process (it was replaced meanwhile, or a copy differs); every process "
            "must read the same one. Nothing was changed"
        )
    before = _stage_snapshot(ex) if world.distributed else None
    try:
        ex.load_state_dict(state)
    except Exception as e:  # this stage is as it was: load_state_dict is all or nothing
        error = e
    del state
    table = world.gather_ints(
        [int(error is not None), 0], f"gather of whether {path} was loaded", step
    )
    failed = [rank for rank, (bad, _) in enumerate(table) if bad]
    if failed and error is None and before is not None:
        ex.load_state_dict(before)
    if error is not None:
        raise error
    if failed:
        raise RuntimeError(
            f"vflow.pipeline.load: process(es) {failed} of the grid could not load {path!r} "
            "(their own errors say why); no process loaded it, this one's stage is unchanged"
        )


def _stage_snapshot(ex: PipelineExecutor) -> dict[str, Any]:
    """This stage's state as it is, on the CPU: what a process puts back when another
    could not load."""
    return copy_to_cpu(ex.state_dict())


def _read(path: str, ex: PipelineExecutor) -> tuple[dict[str, Any], int]:
    """This stage's state in the layout of Note [A state for every grid] (the whole
    state for a single file), checked against the whole model; and what identifies the
    checkpoint, for the processes to compare."""
    if os.path.isfile(path):
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError) as e:
            raise ValueError(f"vflow.pipeline.load: could not read {path!r}: {e}") from e
        if (
            isinstance(state, Mapping)
            and state.get("format") == pipeline_state.FORMAT
            and isinstance(state.get("model"), Mapping)
        ):
            _check_model(
                {k: _shape_of(v) for k, v in state["model"].items()}, state.get("virtual_nodes"), ex
            )
        return state, fingerprint(repr(_progress(state)))
    if not os.path.isdir(path):
        raise FileNotFoundError(f"vflow.pipeline.load: no checkpoint at {path!r}")
    # The directory it points at now: a save that replaces it meanwhile must not mix two.
    directory = os.path.realpath(path)
    try:
        metadata = dcp.FileSystemReader(directory).read_metadata()
    except FileNotFoundError as e:
        raise ValueError(
            f"vflow.pipeline.load: {path!r} is a directory without DCP metadata, not a "
            "checkpoint of vflow.pipeline.save"
        ) from e
    stored = metadata.state_dict_metadata
    if HEADER not in stored:
        raise ValueError(
            f"vflow.pipeline.load: {path!r} is a torch.distributed.checkpoint without the "
            f"{HEADER!r} entry: not a checkpoint of vflow.pipeline.save"
        )
    header = _load(directory, {HEADER: None})[HEADER]
    if not isinstance(header, Mapping) or header.get("format") != pipeline_state.FORMAT:
        raise ValueError(f"vflow.pipeline.load: {path!r} is not a vflow pipeline checkpoint")
    if header.get("version") != pipeline_state.VERSION:
        raise ValueError(
            f"vflow.pipeline.load: {path!r} is of version {header.get('version')!r}; this vflow "
            f"reads {pipeline_state.VERSION}"
        )
    _check_model(
        {k[len(MODEL) :]: _shape_of(v) for k, v in stored.items() if k.startswith(MODEL)},
        header.get("virtual_nodes"),
        ex,
    )
    return _read_stage(directory, metadata, dict(header), ex), fingerprint(
        repr((_progress(header), metadata.storage_meta and metadata.storage_meta.save_id))
    )


def _read_stage(
    directory: str, metadata: Metadata, header: dict[str, Any], ex: PipelineExecutor
) -> dict[str, Any]:
    """Reads this stage's entries: first the small objects, which say which optimizer
    tensors there are, then the tensors, into tensors of the stored shapes."""
    stored = metadata.state_dict_metadata
    names = pipeline_state.parameter_names(ex.stage_module, ex.optimizer)
    lacking = [PARAM + n for n in names if PARAM + n not in stored]
    if lacking:
        raise ValueError(
            f"vflow.pipeline.load: the checkpoint lacks this stage's optimizer entries "
            f"{_listed(lacking)}: it must come from the same model and optimizer"
        )
    model_keys = list(ex.stage_module.state_dict())
    objects: dict[str, Any] = {PARAM + n: None for n in names}
    objects.update(
        {MODEL + k: None for k in model_keys if isinstance(stored[MODEL + k], BytesStorageMetadata)}
    )
    if REGISTERED in stored:
        objects[REGISTERED] = None
    objects = _load(directory, objects)
    tensors: dict[str, torch.Tensor] = {}
    for key in model_keys:
        if MODEL + key not in objects:
            tensors[MODEL + key] = _empty(stored[MODEL + key], MODEL + key)
    for name in names:
        layout = objects[PARAM + name]
        for key in layout["tensors"]:
            full = f"{OPTIMIZER_STATE}{name}.{key}"
            if full not in stored:
                raise ValueError(f"vflow.pipeline.load: the checkpoint lacks {full!r}")
            tensors[full] = _empty(stored[full], full)
    tensors = _load(directory, tensors)

    optimizer_state: dict[str, dict[str, Any]] = {}
    param_groups = []
    for name in names:
        layout = objects[PARAM + name]
        if layout["keys"] is not None:
            values = {**layout["values"]}
            values.update({k: tensors[f"{OPTIMIZER_STATE}{name}.{k}"] for k in layout["tensors"]})
            optimizer_state[name] = {k: values[k] for k in layout["keys"]}
        param_groups.append({**layout["group"], "params": [name]})
    model = OrderedDict(
        (k, objects[MODEL + k] if MODEL + k in objects else tensors[MODEL + k]) for k in model_keys
    )
    return {
        **header,
        "model": model,
        "optimizer": {"state": optimizer_state, "param_groups": param_groups},
        "registered": objects.get(REGISTERED, {}),
    }


class _LoadPlanner(dcp.DefaultLoadPlanner):
    """DCP's default reading of a flat state dict, with the small objects read back as
    ``torch.load(weights_only=True)`` reads (DCP's own unpickles anything)."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def load_bytes(self, read_item: ReadItem, value: Any) -> None:
        self.state_dict[read_item.dest_index.fqn] = torch.load(value, weights_only=True)


def _load(directory: str, wanted: dict[str, Any]) -> dict[str, Any]:
    """``wanted``'s entries from the checkpoint in ``directory``, read by this process
    alone (no collective: each process reads its own stage's)."""
    with _dcp_errors(f"vflow.pipeline.load: reading {directory!r}"):
        dcp.load(
            wanted,
            storage_reader=dcp.FileSystemReader(directory),
            planner=_LoadPlanner(),
            no_dist=True,
        )
    return wanted


def _empty(stored: Any, key: str) -> torch.Tensor:
    if not isinstance(stored, TensorStorageMetadata):
        raise ValueError(f"vflow.pipeline.load: the checkpoint's {key!r} is not a tensor")
    return torch.empty(stored.size, dtype=stored.properties.dtype)


def _shape_of(value: Any) -> tuple[tuple[int, ...], torch.dtype] | None:
    """A stored entry's shape and dtype; None for one that is not a tensor."""
    if isinstance(value, torch.Tensor):
        return tuple(value.shape), value.dtype
    if isinstance(value, TensorStorageMetadata):
        return tuple(value.size), value.properties.dtype
    return None


def _check_model(
    stored: dict[str, tuple[tuple[int, ...], torch.dtype] | None],
    virtual_nodes: Any,
    ex: PipelineExecutor,
) -> None:
    """Refuses a checkpoint of another model or V. It compares with the whole model,
    every stage's segments (those of other stages are on the meta device), so that
    every process refuses alike, whichever stage it holds."""
    if virtual_nodes != ex.virtual_nodes:
        raise ValueError(
            f"vflow.pipeline.load: the checkpoint was written for V={virtual_nodes!r} virtual "
            f"nodes, this executor has V={ex.virtual_nodes}; V must match (the grid need not)"
        )
    segments = set(ex.segment_names)
    foreign = [k for k in stored if k.split(".", 1)[0] not in segments]
    if foreign:
        raise ValueError(
            f"vflow.pipeline.load: the checkpoint has model entries of no segment of this "
            f"model, {_listed(foreign)}: it must come from the same model (segments "
            f"{ex.segment_names})"
        )
    whole = {k: _shape_of(v) for k, v in ex.model.state_dict().items()}
    missing = [k for k in whole if k not in stored]
    unexpected = [k for k in stored if k not in whole]
    if missing or unexpected:
        parts = [f"lacks the model's entries {_listed(missing)}"] if missing else []
        parts += [f"has entries the model lacks, {_listed(unexpected)}"] if unexpected else []
        raise ValueError(
            f"vflow.pipeline.load: the checkpoint {' and '.join(parts)}: it must come from the "
            "same model (the same segments under the same names)"
        )
    for key, want in whole.items():
        if want is not None and stored[key] != want:
            raise ValueError(
                f"vflow.pipeline.load: the checkpoint's model entry {key!r} has shape and dtype "
                f"{stored[key]}, the model's {want}: it must come from the same model"
            )


def _progress(state: Any) -> tuple[Any, ...]:
    get = state.get if isinstance(state, Mapping) else (lambda _key: None)
    return (get("step_count"), get("skipped_steps"), get("seed"))


def _listed(names: list[str]) -> str:
    shown = ", ".join(repr(n) for n in names[:_LISTED])
    more = len(names) - _LISTED
    return "[" + shown + (f" and {more} more" if more > 0 else "") + "]"


def _checked_path(path: Any, where: str) -> str:
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"{where}: path must be a str or os.PathLike, got {type(path).__name__}")
    text = os.fspath(path)
    if not isinstance(text, str) or not text:
        raise ValueError(f"{where}: path must be a non-empty str, got {text!r}")
    return text
