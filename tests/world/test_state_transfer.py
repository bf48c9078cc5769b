"""How a member's training state reaches new members (Note [Sending the training state],
vflow/world/membership.py): every kind of value a state holds comes back bit for bit,
World.broadcast_own moves the packed buffer without copies, and a join sends the state
point to point from the up-to-date members to the others only."""

from __future__ import annotations

import collections
import pickle
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.support import hosts
from tests.support.several_hosts import state_over_a_slow_link
from vflow.world.group import World
from vflow.world.launch import run_ranks
from vflow.world.membership import Candidate, join, pack_state, sources_of, unpack_state


def _state() -> dict[str, Any]:
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    return {
        "model": model.state_dict(),
        "flags": torch.tensor([True, False, True]),
        "scalar": torch.tensor(3.25, dtype=torch.float64),
        "transposed": torch.arange(12.0).reshape(3, 4).t(),
        "sparse": torch.eye(3).to_sparse(),
        "nested": (1, "text", [torch.arange(5, dtype=torch.int16), None]),
        "empty": torch.empty(0, 5),
        "complex": torch.randn(3, dtype=torch.complex64),
        "half": torch.randn(7).half(),
        "int": 7,
    }


def _assert_same(sent: Any, got: Any, where: str = "state") -> None:
    assert type(got) is type(sent), where
    if isinstance(sent, torch.Tensor):
        assert (got.dtype, got.shape, got.layout) == (sent.dtype, sent.shape, sent.layout), where
        if sent.layout != torch.strided:
            sent, got = sent.to_dense(), got.to_dense()
        got_bytes = got.reshape(-1).view(torch.uint8)
        assert torch.equal(got_bytes, sent.contiguous().reshape(-1).view(torch.uint8)), where
    elif isinstance(sent, dict):
        assert list(got) == list(sent), where
        for key in sent:
            _assert_same(sent[key], got[key], f"{where}[{key!r}]")
    elif isinstance(sent, (list, tuple)):
        assert len(got) == len(sent), where
        for i, (a, b) in enumerate(zip(sent, got, strict=True)):
            _assert_same(a, b, f"{where}[{i}]")
    else:
        assert got == sent, where


def test_every_kind_of_value_comes_back_bit_for_bit() -> None:
    state = _state()
    state["half"][0] = float("nan")  # bits, not values: a NaN must stay this NaN
    data, header_bytes = pack_state(state, torch.device("cpu"))
    got = unpack_state(data.clone(), header_bytes)
    _assert_same(state, got)
    # Modules read their state-dict version from _metadata (BatchNorm's
    # num_batches_tracked): an ordered dict must arrive as one, with it.
    assert isinstance(got["model"], collections.OrderedDict)
    assert got["model"]._metadata == state["model"]._metadata
    rebuilt = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    rebuilt.load_state_dict(got["model"])


def test_tensors_are_aligned_views_of_the_buffer() -> None:
    data, header_bytes = pack_state(_state(), torch.device("cpu"))
    got = unpack_state(data, header_bytes)
    start = data.untyped_storage().data_ptr()
    for value in (got["scalar"], got["complex"], got["model"]["0.weight"]):
        assert value.untyped_storage().data_ptr() == start
        assert (value.data_ptr() - start) % 64 == 0
    # The payload is the tensors' bytes, not a serialisation of them.
    payload = sum(t.numel() * t.element_size() for t in got["model"].values())
    assert data.numel() < header_bytes + payload + 64 * (len(got["model"]) + 12)


def test_an_unreadable_header_fails_to_load() -> None:
    data, header_bytes = pack_state(_state(), torch.device("cpu"))
    data[: header_bytes // 2] = 7
    with pytest.raises(pickle.UnpicklingError):
        unpack_state(data, header_bytes)


def _broadcast_packed(rank: int, world_size: int) -> tuple[list[float], bool]:
    world = World(dist.group.WORLD, timedelta(seconds=30))
    if rank == 0:
        data, header_bytes = pack_state({"w": torch.arange(1000.0)}, world.device)
        sizes = torch.tensor([header_bytes, data.numel()])
    else:
        sizes = torch.zeros(2, dtype=torch.int64)
    world.broadcast_from(0, [sizes], "sizes", None)
    if rank != 0:
        header_bytes = int(sizes[0])
        data = torch.empty(int(sizes[1]), dtype=torch.uint8)
    before = data.data_ptr()
    world.broadcast_own(0, data, "the state")
    state = unpack_state(data, header_bytes)
    assert isinstance(state, dict)
    return state["w"][::250].tolist(), data.data_ptr() == before


def test_broadcast_own_fills_the_same_tensor_on_every_rank() -> None:
    results = run_ranks(3, _broadcast_packed)
    for r in results:
        assert r.value == ([0.0, 250.0, 500.0, 750.0], True)


def test_broadcast_own_refuses_a_tensor_it_would_have_to_copy() -> None:
    world = World(None, timedelta(seconds=1))
    world.size = 2  # what distributed checks first
    world.group = object()  # type: ignore[assignment]
    with pytest.raises(ValueError, match="tensor must be contiguous and on cpu"):
        world.broadcast_own(0, torch.zeros(4, 2).t(), "the state")


def test_send_own_and_recv_own_refuse_what_they_would_have_to_copy() -> None:
    world = World(None, timedelta(seconds=1))
    with pytest.raises(ValueError, match="this process has no other worker"):
        world.send_own([1], torch.zeros(4), 0, "the state")
    world.size = 2  # what distributed checks first
    world.group = object()  # type: ignore[assignment]
    with pytest.raises(ValueError, match="tensor must be contiguous and on cpu"):
        world.recv_own(1, torch.zeros(4, 2).t(), 0, "the state")


def test_newcomers_are_striped_over_the_up_to_date_members() -> None:
    assert sources_of(5, [0, 1]) == {2: 0, 3: 1, 4: 0}
    assert sources_of(4, [2]) == {0: 2, 1: 2, 3: 2}
    assert sources_of(3, [0, 1, 2]) == {}


# Ranks 0 and 1 are members at step 7 with one state; ranks 2, 3 and 4 are newcomers
# (rank 3 behind a large state: 3 chunks of STATE_CHUNK_BYTES) with another.
_MEMBERS = (0, 1)


def _join_as(rank: int, world_size: int) -> dict[str, Any]:
    world = World(dist.group.WORLD, timedelta(seconds=60))
    member = rank in _MEMBERS
    held = {
        "w": torch.full((3,), 1.5 if member else float(rank)),
        "big": torch.arange(5 << 19, dtype=torch.float64) * (1 if member else -1),
    }
    calls = {"state": 0, "load": 0}

    def state() -> object:
        calls["state"] += 1
        return held

    def load_state(got: object) -> Any:
        assert isinstance(got, dict)
        calls["load"] += 1
        previous = {k: v.clone() for k, v in held.items()}
        for key, value in got.items():
            held[key] = value.clone()
        return lambda: held.update(previous)

    notes = join(
        world,
        [],
        Candidate(
            member,
            7 if member else 0,
            "progress" if member else f"new {rank}",
            notes=(rank, -(2**62) - rank),
        ),
        state=state,
        load_state=load_state,
        fresh_start=lambda: None,
    )
    return {"held": held, "calls": calls, "notes": notes}


def test_a_join_sends_the_state_to_the_newcomers_only() -> None:
    """Note [Sending the training state]: the members' states stay as they were, bit for
    bit; every newcomer ends with the members' state; each member packs its state only
    if it serves a newcomer (striped: rank 0 serves 2 and 4, rank 1 serves 3) and loads
    nothing. Every rank reads every rank's notes (Note [Joining a worker set])."""
    results = {r.rank: r.value for r in run_ranks(5, _join_as, timeout=120)}
    for value in results.values():
        assert value["notes"] == [(r, -(2**62) - r) for r in range(5)]
    member_state = results[0]["held"]
    assert torch.equal(member_state["w"], torch.full((3,), 1.5))
    assert torch.equal(member_state["big"], torch.arange(5 << 19, dtype=torch.float64))
    for rank, value in results.items():
        for key, tensor in member_state.items():
            assert torch.equal(value["held"][key], tensor), (rank, key)
        if rank in _MEMBERS:
            assert value["calls"] == {"state": 1, "load": 0}, rank
        else:
            assert value["calls"] == {"state": 0, "load": 1}, rank


# ---- a state larger than one timeout's worth of a slow link --------------------------


@pytest.mark.alone  # reads the transfer's time
@pytest.mark.skipif(
    (hosts_missing := hosts.missing() or (hosts.missing_tools("tc") or None)) is not None,
    reason=f"multi-host tests: {hosts_missing}",
)
def test_a_state_larger_than_the_timeout_allows_crosses_a_slow_link_chunk_by_chunk() -> None:
    """Note [Sending the training state]: 48 MB to a host behind 100 Mbit/s (tbf) takes
    about 4 s, twice the 2 s timeout, and arrives whole: each chunk's broadcast (8 MB,
    0.7 s at that rate) is bounded by the timeout, not the whole state's."""
    megabytes, timeout = 48, 2.0
    received = state_over_a_slow_link(megabytes, timeout, "100mbit")
    assert received["equal"]
    at_the_rate = megabytes * 2**20 * 8 / 100e6  # 4.0 s
    assert at_the_rate <= received["seconds"] <= 3 * at_the_rate, received
    assert received["seconds"] > timeout
