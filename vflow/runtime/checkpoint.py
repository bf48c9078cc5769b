"""Checkpoints of an Executor: ``vflow.save`` / ``vflow.load``.

What is saved
  ``Executor.state_dict()``: the model, the optimizer, the step counts, the seed, the
  loss scaler's state and V — the executor's whole training state, independent of the
  plan and of the number of workers (vflow.runtime.training_state says why). A checkpoint
  written by W workers therefore resumes on W' workers (any plan) with the same V.
  Resuming bit for bit (not merely to rounding) also needs ``deterministic=True`` on
  both sides, which makes the reductions independent of the mapping.

What is not saved
  Whatever lives outside the executor: the caller's own random generators (vflow
  restores them around every step, so they are never mixed up with the VN streams),
  the data loader's position (e.g. the epoch to pass to
  ``vflow.VNBatchSampler.set_epoch``), learning-rate schedulers and the like. Pass
  them to ``save(..., extra=...)``; ``load`` returns them. ``extra`` may hold only
  what ``torch.load(weights_only=True)`` reads back (tensors, numbers, strings,
  bytes, None, lists, tuples, sets, dicts); anything else is rejected at save time
  rather than at resume time.

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

Only the Executor's public methods are used: ``state_dict``, ``load_state_dict``
and ``world`` (its worker set's rank, size and collectives).
"""

from __future__ import annotations

import collections
import contextlib
import errno
import os
import pickle
import secrets
from collections.abc import Iterator
from typing import Any, BinaryIO

import torch

from vflow.runtime.executor import Executor
from vflow.runtime.training_state import copy_to_cpu
from vflow.world.group import fingerprint

# ---- files ----------------------------------------------------------------------------


def save(path: str | os.PathLike[str], ex: Executor, extra: Any = None) -> None:
    """Writes ``ex``'s state and ``extra`` to ``path`` atomically (see the module
    docstring). With several workers this is a collective that every rank calls:
    rank 0 writes (its ``extra`` is the one saved), and every rank returns once the
    file is in place or raises RuntimeError if rank 0 failed.
    """
    path = _check_path(path, "vflow.save")
    _check_executor(ex, "vflow.save")
    world = ex.world
    if not world.distributed:
        _save_here(path, ex, extra)
        return
    error: Exception | None = None
    if world.rank == 0:
        try:
            _save_here(path, ex, extra)
        except Exception as e:
            error = e
    # Rank 0 catches its own error and reports it here: had it raised instead, the
    # other ranks would wait in this broadcast until the timeout.
    flag = torch.tensor([1.0 if error is None else 0.0], dtype=torch.float64)
    world.broadcast_from(0, [flag], "checkpoint save", ex.step_count)
    if error is not None:
        raise error
    if float(flag) != 1.0:
        raise RuntimeError(
            f"vflow.save: rank 0 failed to write the checkpoint {path!r} (its error says why); "
            "the file at that path, if any, is unchanged"
        )


def save_local(path: str | os.PathLike[str], ex: Executor, extra: Any = None) -> None:
    """Writes ``ex``'s state and ``extra`` to ``path`` atomically from this process
    alone, without a collective: for a worker whose group is broken (vflow.elastic
    leaves a checkpoint this way when too few workers remain). ``load`` reads it."""
    path = _check_path(path, "vflow.runtime.save_local")
    _check_executor(ex, "vflow.runtime.save_local")
    _save_here(path, ex, extra)


def load(path: str | os.PathLike[str], ex: Executor, map_location: Any = None) -> Any:
    """Loads a checkpoint written by ``save`` into ``ex`` and returns its ``extra``.

    The file is read with ``weights_only=True`` onto ``map_location`` (default the
    CPU; the model and optimizer then copy to their parameters' devices). With
    several workers this is a collective that every rank calls with its own copy of
    the file: all ranks load it, or none does and every rank raises.
    """
    path = _check_path(path, "vflow.load")
    _check_executor(ex, "vflow.load")
    world = ex.world
    if not world.distributed:
        checkpoint = _read(path, map_location)
        ex.load_state_dict(checkpoint["executor"], assign=True)
        return checkpoint["extra"]

    error: Exception | None = None
    before: dict[str, Any] | None = None
    extra = None
    try:
        checkpoint = _read(path, map_location)
        extra = checkpoint["extra"]
        before = copy_to_cpu(ex.state_dict())
        ex.load_state_dict(checkpoint["executor"], assign=True)
    except Exception as e:
        error = e
        before = None  # nothing was loaded: load_state_dict changes nothing when it raises
    # What identifies the checkpoint: ranks that read different files (a stale copy)
    # almost surely differ here, and would otherwise go on with different replicas.
    print_ = fingerprint(
        repr((ex.step_count, ex.skipped_steps, ex.seed, ex.scaler and ex.scaler.state_dict()))
    )
    loaded_step = ex.step_count
    try:
        table = world.gather_ints(
            [0 if error is None else 1, print_], "checking that every rank loaded", ex.step_count
        )
    except BaseException:
        if before is not None:
            ex.load_state_dict(before, assign=True)
        raise
    failed = [r for r, (bad, _) in enumerate(table) if bad]
    differ = [r for r, (_, other) in enumerate(table) if other != table[world.rank][1]]
    if failed or differ:
        if before is not None:
            ex.load_state_dict(before, assign=True)
        if error is not None:
            raise error
        if failed:
            raise RuntimeError(
                f"vflow.load: rank(s) {failed} could not load {path!r} (their errors say why); "
                "no rank loaded it, this rank's state is unchanged"
            )
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
    if not isinstance(ex, Executor):
        raise TypeError(f"{where}: ex must be a vflow.Executor, got {type(ex).__name__}")
    if ex.closed:
        raise RuntimeError("this Executor is closed")


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
    write_atomically(path, payload)


@contextlib.contextmanager
def replacing_atomically(path: str | os.PathLike[str]) -> Iterator[BinaryIO]:
    """Yields a binary file whose contents replace ``path`` once the block ends without
    an error, so that a reader (or a crash) sees the old file or the whole new one, never
    a part. On an error the old file stays as it was and the temporary one is removed."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    # Same directory, so that the rename never crosses filesystems (it would not be
    # atomic); O_EXCL, so that concurrent writers never share a temporary file; mode
    # 0o666 rather than mkstemp's 0o600, so the file gets the umask's permissions.
    name = os.path.basename(path)[:180]
    tmp = os.path.join(directory, f".{name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
    try:
        with open(fd, "wb") as f:
            yield f
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


def write_atomically(path: str, payload: Any) -> None:
    """``torch.save(payload)`` to ``path``, atomically (``replacing_atomically``)."""
    with replacing_atomically(path) as f:
        torch.save(payload, f)


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
