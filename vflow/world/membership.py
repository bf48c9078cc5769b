"""Joining a worker set: what its members check with each other, and the training
state a new member receives.

Note [Joining a worker set]
The Executor's constructor and ``Executor.reconfigure`` run one protocol over the new
group, a sequence of collectives that every rank issues in the same order:

1. One all-gather of a row per rank: a fingerprint of the plan, of the model layout and
   of every agreed setting (Note [Agreement], vflow/runtime/config.py); whether the rank is a
   *member* (its executor has been training in this job: ``reconfigure``) or new to it
   (a constructor); a member's step count and a fingerprint of its progress (step
   counts, seed, loss scaler state); and the rank's *notes*, a few integers it tells the
   others about itself (the executor's: what its automatic planner learned about its
   worker, Note [Plans across worker sets], vflow/planning/auto_plan.py), which
   ``join`` returns, every rank's in rank order, so that every rank of the new set
   reads the same ones. Every rank of a join sends as many.
2. Every rank reads the same table, so every rank decides the same way: all raise if
   any column differs, or if the members are not at the same point of training. Else:
   - nobody is a member (a new job): with ``broadcast_parameters``, rank 0's
     parameters and buffers are broadcast, as DDP does;
   - members at different step counts: an error, unless every member asked for
     ``catch_up`` (an elastic job, where a worker set can break after some of its
     members committed a step and others did not). The members at the highest step
     count must then agree on their progress; those behind become receivers, like
     newcomers, and the ones ahead are the members below;
   - members and newcomers: the lowest-ranked member packs its training state
     (vflow.runtime.training_state: model, optimizer, step counts, seed, loss scaler)
     into one buffer (Note [Sending the training state]) and broadcasts it, its size
     first; each newcomer loads it, bit for bit. A last all-gather of one flag per rank
     makes every rank raise if a newcomer could not;
   - members only (a shrink, or the same workers under a new plan): nothing more.

Nothing of a member changes until the protocol has succeeded, so a failure leaves its
executor on its old worker set. A newcomer whose protocol fails raises from its
constructor, leaving no hooks behind.

Note [Refusing newcomers]
When the members agree with each other and only newcomers (or members behind, under
``catch_up``) differ from them, or fail to load the state, the fault is theirs: every
rank raises ``RefusedNewcomers`` naming those ranks, so that the members can form the
worker set again without them (vflow.elastic does) while each refused rank learns what
it got wrong. Only when the members themselves differ, or nobody is a member yet, does
every rank raise the plain error: there is no running worker set to keep.
"""

from __future__ import annotations

import collections
import copy
import io
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from vflow.world.group import World, fingerprint

_AGREEMENT = "checking that all ranks agree on the plan and the model"
_log = logging.getLogger("vflow")


@dataclass(frozen=True)
class Column:
    """One value all ranks must share: its name, its full text (fingerprinted) and how
    an error shows it."""

    name: str
    text: str
    shown: str


class RefusedNewcomers(ValueError):
    """Note [Refusing newcomers]: the ranks of the new group (``ranks``) that joined
    without matching the members, or could not load their state; raised on every rank.
    Nothing changed on any rank."""

    def __init__(self, message: str, ranks: Sequence[int]) -> None:
        super().__init__(message)
        self.ranks = tuple(ranks)


def check_agreement(
    world: World, columns: Sequence[Column], extra: Sequence[int] = (), step: int | None = None
) -> list[list[int]]:
    """Raises on every rank unless all ranks hold the same ``columns``; returns every
    rank's ``extra`` integers (one all-gather for both)."""
    table = _agreement_table(world, columns, extra, step)
    _check_table(world, columns, table)
    return [r[len(columns) :] for r in table]


def _check_table(world: World, columns: Sequence[Column], table: list[list[int]]) -> None:
    for k, column in enumerate(columns):
        differ = [r for r in range(world.size) if table[r][k] != table[world.rank][k]]
        if differ:
            raise ValueError(_disagreement(world, column, differ))


def _agreement_table(
    world: World, columns: Sequence[Column], extra: Sequence[int], step: int | None
) -> list[list[int]]:
    row = [fingerprint(c.text) for c in columns] + list(extra)
    return world.gather_ints(row, _AGREEMENT, step)


def _disagreement(world: World, column: Column, differ: Sequence[int]) -> str:
    return (
        f"ranks disagree on the {column.name}: rank(s) {list(differ)} of "
        f"{world.description} differ from this rank, which has {column.shown}; every rank "
        "must construct the Executor (and call set_plan or reconfigure) with the same value"
    )


def _refuse_differing_newcomers(
    world: World, columns: Sequence[Column], table: list[list[int]], members: list[int]
) -> None:
    """Note [Refusing newcomers]: raises RefusedNewcomers when the members agree and
    some other ranks differ from them."""
    reference = table[members[0]]
    if any(table[r][: len(columns)] != reference[: len(columns)] for r in members):
        return  # the members themselves differ: check_agreement's error
    differ: dict[int, list[Column]] = {}
    for r in range(world.size):
        for k, column in enumerate(columns):
            if table[r][k] != reference[k]:
                differ.setdefault(r, []).append(column)
    if not differ:
        return
    refused = sorted(differ)
    if world.rank in differ:
        names = ", ".join(f"the {c.name} (this worker has {c.shown})" for c in differ[world.rank])
        raise RefusedNewcomers(
            f"this worker was refused by the members of {world.description}: it differs from "
            f"them on {names}; it must be started with the same settings and model as the "
            "running job",
            refused,
        )
    names = sorted({c.name for cols in differ.values() for c in cols})
    raise RefusedNewcomers(
        f"new rank(s) {refused} of {world.description} differ from the members on the "
        f"{', '.join(names)} and were refused; the worker set was not changed",
        refused,
    )


@dataclass(frozen=True)
class Candidate:
    """What this rank brings to a new worker set."""

    member: bool  # it has been training in this job
    step_count: int
    progress: str  # text of its step counts, seed and loss scaler state
    catch_up: bool = False  # a member behind the others may receive their state
    # Note [Joining a worker set]: int64 words for the others (as many on every rank).
    notes: tuple[int, ...] = ()


# Note [Joining a worker set]: the integers of a row after the columns' fingerprints and
# before the notes.
_CANDIDATE_INTS = 4


def join(
    world: World,
    columns: Sequence[Column],
    candidate: Candidate,
    *,
    state: Callable[[], object],
    load_state: Callable[[object], Callable[[], None]],
    fresh_start: Callable[[], None],
) -> list[tuple[int, ...]]:
    """Runs Note [Joining a worker set] for this rank and returns every rank's
    ``candidate.notes``, in rank order. ``state`` (on the member that sends) returns the
    training state, a tree of dicts, lists and tensors; ``load_state`` (on a newcomer)
    applies it (its tensors are views of a receive buffer: to be copied, not kept) and
    returns what puts the newcomer's own state back, should another newcomer fail;
    ``fresh_start`` runs when nobody is a member yet."""
    extra = [
        int(candidate.member),
        candidate.step_count,
        fingerprint(candidate.progress),
        int(candidate.catch_up),
        *candidate.notes,
    ]
    table = _agreement_table(world, columns, extra, None)
    rows = [r[len(columns) : len(columns) + _CANDIDATE_INTS] for r in table]
    notes = [tuple(r[len(columns) + _CANDIDATE_INTS :]) for r in table]
    members = [r for r, (member, _, _, _) in enumerate(rows) if member]
    if members:
        _refuse_differing_newcomers(world, columns, table, members)
    _check_table(world, columns, table)
    if not members:
        fresh_start()
        return notes
    catch_up = {rows[r][3] for r in members}
    if len(catch_up) > 1:
        raise ValueError(
            f"the members of {world.description} disagree on catch_up (by rank: "
            f"{ {r: bool(rows[r][3]) for r in members} }); every member must pass the same"
        )
    ahead = members
    if catch_up == {1}:
        latest = max(rows[r][1] for r in members)
        ahead = [r for r in members if rows[r][1] == latest]
    progress = {(rows[r][1], rows[r][2]) for r in ahead}
    if len(progress) > 1:
        steps = {r: rows[r][1] for r in members}
        raise ValueError(
            f"the members of {world.description} are at different points of training "
            f"(step counts by rank: {steps}); only executors that took the same steps can "
            "form one worker set"
        )
    if len(ahead) == world.size:
        return notes
    _send_state(world, ahead, state, load_state)
    return notes


def sources_of(world_size: int, up_to_date: Sequence[int]) -> dict[int, int]:
    """Note [Sending the training state]: the member each other rank receives the state
    from, newcomers striped over the up-to-date members in rank order."""
    behind = [r for r in range(world_size) if r not in set(up_to_date)]
    return {rank: up_to_date[i % len(up_to_date)] for i, rank in enumerate(behind)}


def _send_state(
    world: World,
    up_to_date: Sequence[int],
    state: Callable[[], object],
    load_state: Callable[[object], Callable[[], None]],
) -> None:
    source_of = sources_of(world.size, up_to_date)
    started = time.monotonic()
    data: torch.Tensor | None = None
    if world.rank in source_of:
        source = source_of[world.rank]
        sizes = torch.zeros(2, dtype=torch.int64, device=world.device)
        world.recv_own(source, sizes, 0, f"receiving the training state's size from rank {source}")
        header_bytes = int(sizes[0])
        data = torch.empty(int(sizes[1]), dtype=torch.uint8)
        staging = _staging(data, world.device)
        # Note [Sending the training state]: chunk by chunk, each bounded by the timeout.
        for tag, at in enumerate(range(0, data.numel(), STATE_CHUNK_BYTES), start=1):
            chunk = data[at : at + STATE_CHUNK_BYTES]
            landing = chunk if staging is None else staging[: chunk.numel()]
            world.recv_own(source, landing, tag, f"receiving the training state from rank {source}")
            if staging is not None:
                chunk.copy_(landing)
    else:
        mine = [rank for rank, source in source_of.items() if source == world.rank]
        if mine:
            data, header_bytes = pack_state(state(), torch.device("cpu"))
            staging = _staging(data, world.device)
            sizes = torch.tensor(
                [header_bytes, data.numel()], dtype=torch.int64, device=world.device
            )
            world.send_own(mine, sizes, 0, f"sending the training state's size to ranks {mine}")
            for tag, at in enumerate(range(0, data.numel(), STATE_CHUNK_BYTES), start=1):
                chunk = data[at : at + STATE_CHUNK_BYTES]
                if staging is not None:
                    chunk = staging[: chunk.numel()].copy_(chunk)
                world.send_own(mine, chunk, tag, f"sending the training state to ranks {mine}")
    if data is not None:
        _log.debug(
            "vflow: the training state (%d bytes) %s in %.3f s",
            data.numel(),
            "received" if world.rank in source_of else "sent",
            time.monotonic() - started,
        )
    error: Exception | None = None
    undo: Callable[[], None] | None = None
    if world.rank in source_of:
        assert data is not None
        try:
            undo = load_state(unpack_state(data, header_bytes))
        except Exception as e:
            error = e
    del data
    try:
        flags = world.gather_ints([int(error is None)], "checking that new members loaded", None)
    except BaseException:
        if undo is not None:
            undo()
        raise
    if error is not None:
        failed = [r for r, (ok,) in enumerate(flags) if not ok]
        raise RefusedNewcomers(
            f"this worker could not load the training state the members of "
            f"{world.description} sent: {type(error).__name__}: {error}",
            failed,
        ) from error
    failed = [r for r, (ok,) in enumerate(flags) if not ok]
    if failed:
        if undo is not None:
            undo()
        raise RefusedNewcomers(
            f"rank(s) {failed} of {world.description} could not load the training state sent "
            "to new members (their errors say why) and were refused; the worker set was not "
            "changed",
            failed,
        )


def serialize(state: object) -> bytes:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


def deserialize(data: bytes) -> object:
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)


# Note [Sending the training state]
# Only the workers that need the state receive it: each newcomer (and, with catch_up, a
# member behind the others) gets it point to point from one up-to-date member, the
# newcomers striped over those members in rank order (``sources_of``). A member sends
# to its share of the newcomers all at once and receives nothing; the other members
# take no part until the final check that every newcomer loaded it. So a grow moves
# the state once per newcomer, not once per worker of the set (a broadcast did: N - 1
# copies, the members' included, and a broadcast's rounds grow with N), and a member's
# part in it depends on how many newcomers it serves, not on N. (Under NCCL each pair's
# first transfer sets up a communicator of its own; not run here: no GPU.)
# The state goes as one uint8 buffer: a header (the state's tree, with
# each dense tensor replaced by an empty one of its dtype, and where each tensor's
# bytes are), then the tensors' bytes, each at an offset aligned for any dtype. The
# sender copies the state once into the buffer; a receiver's tensors are views into it,
# which loading copies where they belong. Serialising the whole state with torch.save
# instead cost a 12.6 M-parameter model's member about 0.1 s and each newcomer 0.1 s
# more (a copy into bytes on either side and the pickling), all of it time in which
# the members stood still (benchmarks/elastic.py's grow). Whoever receives a state
# always knows its size first, so it receives every chunk even when the header turns
# out unreadable; it then fails to load, like any bad state.
# The buffer is in host memory on either side, whatever the group's device: on NCCL it
# crosses through one chunk-sized buffer on the GPU (``_staging``), so that a grow
# costs a member and a newcomer STATE_CHUNK_BYTES of GPU memory, not a copy of the
# whole state beside the model and optimizer they hold (host memory, more plentiful,
# holds the copy), and a newcomer's received tensors, host views, are copied where
# they belong by loading, as a checkpoint's are.
# The buffer crosses in chunks of STATE_CHUNK_BYTES, one transfer each, and the timeout
# bounds each chunk, not the whole: a state of many gigabytes over a slow link takes
# what its bandwidth says (benchmarks/faults.py, the slow link), while a peer that stops
# is still noticed within the timeout. A chunk must cross the slowest link within
# timeout_s: 8 MB at 10 s is 6.4 Mbit/s.
_ALIGN = 64
STATE_CHUNK_BYTES = 8 << 20


def _staging(data: torch.Tensor, device: torch.device) -> torch.Tensor | None:
    """Note [Sending the training state]: the one chunk-sized buffer on the group's
    ``device`` that ``data``, in host memory, crosses through; None when the group
    sends host memory itself."""
    if device.type == "cpu":
        return None
    return torch.empty(min(data.numel(), STATE_CHUNK_BYTES), dtype=torch.uint8, device=device)


def pack_state(state: object, device: torch.device) -> tuple[torch.Tensor, int]:
    """Note [Sending the training state]: ``state`` as one uint8 tensor on ``device``,
    and how many of its bytes are the header."""
    tensors: list[torch.Tensor] = []

    def placeholder(t: torch.Tensor) -> torch.Tensor:
        if t.layout != torch.strided:
            return t  # a sparse or other tensor travels in the header, pickled
        tensors.append(t.detach())
        return torch.empty(0, dtype=t.dtype)

    skeleton = map_tensors(state, placeholder)
    layout: list[tuple[list[int], int]] = []
    end = 0
    for t in tensors:
        layout.append((list(t.shape), end))
        end = _aligned(end + t.numel() * t.element_size())
    header = serialize({"state": skeleton, "layout": layout})
    start = _aligned(len(header))
    data = torch.zeros(start + end, dtype=torch.uint8, device=device)
    data[: len(header)] = torch.frombuffer(bytearray(header), dtype=torch.uint8)
    for t, (_, at) in zip(tensors, layout, strict=True):
        raw = t.reshape(-1).view(torch.uint8)
        data[start + at : start + at + raw.numel()].copy_(raw)
    return data, len(header)


def unpack_state(data: torch.Tensor, header_bytes: int) -> object:
    """The state ``pack_state`` packed into ``data``; its tensors are views of ``data``."""
    header = deserialize(data[:header_bytes].cpu().numpy().tobytes())
    start = _aligned(header_bytes)
    layout = iter(header["layout"])

    def place(t: torch.Tensor) -> torch.Tensor:
        if t.layout != torch.strided:
            return t
        shape, at = next(layout)
        size = math.prod(shape) * t.element_size()
        return data[start + at : start + at + size].view(t.dtype).view(shape)

    return map_tensors(header["state"], place)


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def map_tensors(
    value: Any,
    fn: Callable[[torch.Tensor], torch.Tensor],
    leaf: Callable[[Any], Any] | None = None,
) -> Any:
    """``value`` with every tensor in its dicts, lists and tuples replaced by ``fn(t)``
    and every other leaf by ``leaf(x)`` (default: kept), in a fixed order. An ordered
    dict stays one, with its ``_metadata``: modules read their state-dict version from
    it (e.g. BatchNorm's num_batches_tracked), and without it would take the state for
    an old one."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, Mapping):
        out = collections.OrderedDict() if isinstance(value, collections.OrderedDict) else {}
        for key, item in value.items():
            out[key] = map_tensors(item, fn, leaf)
        metadata = getattr(value, "_metadata", None)
        if metadata is not None:
            out._metadata = copy.deepcopy(metadata)  # type: ignore[attr-defined]
        return out
    if isinstance(value, (list, tuple)):
        return type(value)(map_tensors(item, fn, leaf) for item in value)
    return value if leaf is None else leaf(value)
