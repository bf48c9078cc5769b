"""vflow.elastic.rendezvous: the store process (``python -m vflow rendezvous``), endpoints and
the groups of a round. The rounds themselves run in tests/elastic/test_job.py."""

from __future__ import annotations

import datetime
import signal
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from tests.support.rendezvous import store_process
from vflow.elastic.rendezvous import Round, parse_endpoint, round_group, serve


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
    rnd = Round(number=3, rank=0, world_size=1, store=store)
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
