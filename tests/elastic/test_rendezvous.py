"""vflow.elastic.rendezvous: the store process (``python -m vflow rendezvous``), endpoints and
the groups of a round. The rounds themselves run in tests/elastic/test_job.py."""

from __future__ import annotations

import datetime
import os
import signal
import subprocess
import sys
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    RendezvousSettings,
    RendezvousTimeout,
    _BackendRendezvousStateHolder,
    _NodeDesc,
    _RendezvousState,
)

from tests.support.rendezvous import store_process
from tests.support.sockets import listening, needs_proc_net
from vflow.elastic.rendezvous import Round, _ClockFreeStateHolder, parse_endpoint, round_group
from vflow.elastic.server import serve


def test_the_store_process_prints_its_address_and_ends_on_sigterm() -> None:
    with store_process() as (proc, endpoint):
        host, port = parse_endpoint(endpoint)
        assert host == "127.0.0.1"  # loopback unless --host says otherwise
        client = dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=10))
        client.set("k", b"v")
        assert client.get("k") == b"v"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0


def test_help_says_the_store_has_no_authentication() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "vflow", "rendezvous", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0
    assert "no authentication" in proc.stdout and "loopback" in proc.stdout


def test_a_port_in_use_is_a_clear_error() -> None:
    store = serve("127.0.0.1", 0)
    proc = subprocess.run(
        [sys.executable, "-m", "vflow", "rendezvous", "--port", str(store.port)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1
    assert f"cannot listen on 127.0.0.1:{store.port}" in proc.stderr


@pytest.mark.parametrize(
    "endpoint", ["", "host", ":80", "host:", "host:0", "host:65536", "host:http", 80]
)
def test_bad_endpoints_are_named(endpoint: object) -> None:
    with pytest.raises((ValueError, TypeError), match="rendezvous must be"):
        parse_endpoint(endpoint)


def test_endpoints() -> None:
    assert parse_endpoint("node0.example.com:29400") == ("node0.example.com", 29400)
    assert parse_endpoint("[::1]:29400") == ("::1", 29400)


def test_a_rounds_group_and_its_subgroups_work_and_are_checked() -> None:
    store = dist.HashStore()
    rnd = Round(3, 0, 1, "vflow/test/round3", lambda: store)
    timeout = datetime.timedelta(seconds=10)
    group = round_group(rnd, timeout)
    assert (group.rank(), group.size()) == (0, 1)
    t = torch.ones(3)
    group.allreduce([t]).wait()
    assert torch.equal(t, torch.ones(3))
    sub = round_group(rnd, timeout, name="shrink1", ranks=[0])
    assert sub.size() == 1
    with pytest.raises(ValueError, match="do not include this worker's 0"):
        round_group(rnd, timeout, name="shrink2", ranks=[1])
    with pytest.raises(ValueError, match="backend must be 'gloo' or 'nccl'"):
        round_group(rnd, timeout, backend="mpi")


def _listening_after_start(*args: str) -> tuple[str, set[tuple[str, int]]]:
    """The address ``python -m vflow rendezvous *args`` prints and where it listens."""
    command = (sys.executable, "-m", "vflow", "rendezvous", "--port", "0", *args)
    with store_process(command) as (proc, endpoint):
        assert proc.poll() is None, f"the store process ended: {endpoint!r}"
        return endpoint, listening(proc.pid)


@needs_proc_net
def test_the_store_process_listens_only_on_loopback_by_default() -> None:
    endpoint, sockets = _listening_after_start()
    _, port = parse_endpoint(endpoint)
    assert sockets == {("127.0.0.1", port)}, f"printed {endpoint}, listens on {sockets}"


@needs_proc_net
def test_the_store_process_listens_only_on_its_host() -> None:
    # 127.0.0.2 is loopback too on Linux, without configuration, yet not 127.0.0.1.
    endpoint, sockets = _listening_after_start("--host", "127.0.0.2")
    assert endpoint.startswith("127.0.0.2:")
    assert sockets == {("127.0.0.2", parse_endpoint(endpoint)[1])}


@needs_proc_net
def test_serve_listens_on_the_address_a_hostname_resolves_to_and_on_ipv6() -> None:
    store = serve("localhost", 0)
    mine = {s for s in listening(os.getpid()) if s[1] == store.port}
    assert mine == {(store.host, store.port)} and store.host in ("127.0.0.1", "::1")
    try:
        ipv6 = serve("::1", 0)
    except OSError as e:
        pytest.skip(f"no IPv6 loopback here: {e}")
    assert {s for s in listening(os.getpid()) if s[1] == ipv6.port} == {("::1", ipv6.port)}
    client = dist.TCPStore(
        "::1", ipv6.port, is_master=False, timeout=datetime.timedelta(seconds=10)
    )
    client.set("k", b"v")
    assert ipv6.get("k") == b"v"


def test_an_address_of_no_interface_here_is_a_clear_error() -> None:
    with pytest.raises(OSError, match=r"cannot listen on 192\.0\.2\.1:29400: 192\.0\.2\.1: "):
        serve("192.0.2.1", 29400)  # TEST-NET-1: never an address of this machine
    proc = subprocess.run(
        [sys.executable, "-m", "vflow", "rendezvous", "--host", "192.0.2.1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1
    assert "python -m vflow rendezvous: cannot listen on 192.0.2.1:0" in proc.stderr


# ---- Note [Heartbeats across clocks] ---------------------------------------------------


def _holders() -> tuple[Any, Any, Any, Any]:
    settings = RendezvousSettings(
        "clocks",
        1,
        3,
        RendezvousTimeout(),
        keep_alive_interval=datetime.timedelta(seconds=0.5),
        keep_alive_max_attempt=2,
    )
    backend = C10dRendezvousBackend(dist.HashStore(), "clocks")
    ahead, behind = _NodeDesc("ahead", 1, 0), _NodeDesc("behind", 2, 0)
    return (
        _ClockFreeStateHolder(backend, settings),
        _BackendRendezvousStateHolder(backend, settings),
        ahead,
        behind,
    )


def _state(beats: dict[Any, datetime.datetime]) -> _RendezvousState:
    state = _RendezvousState()
    state.participants = {node: rank for rank, node in enumerate(beats)}
    state.last_heartbeats = dict(beats)
    return state


def test_heartbeats_from_clocks_30_s_off_are_judged_by_whether_they_change() -> None:
    """A participant whose clock is 30 s behind writes heartbeats that torch's holder
    finds expired at once; vflow's keeps it while its heartbeat changes, drops one
    whose heartbeat stood still for the window (1 s), and restores the values it
    read, so that what it writes back is what the others wrote."""
    clock_free, torch_holder, ahead, behind = _holders()
    now = datetime.datetime.now(datetime.timezone.utc)
    beats = {
        ahead: now + datetime.timedelta(seconds=30),
        behind: now - datetime.timedelta(seconds=30),
    }
    torch_holder._state = _state(beats)
    torch_holder._sanitize()
    assert behind not in torch_holder.state.participants  # dropped while alive
    clock_free._state = _state(beats)
    clock_free._sanitize()
    assert set(clock_free.state.participants) == {ahead, behind}
    assert clock_free.state.last_heartbeats == beats
    time.sleep(1.2)
    beats[behind] += datetime.timedelta(seconds=1.2)  # behind beat; ahead stood still
    clock_free._state = _state(beats)
    clock_free._sanitize()
    assert set(clock_free.state.participants) == {behind}
    assert clock_free.state.last_heartbeats == {behind: beats[behind]}
