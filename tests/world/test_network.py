"""vflow.world.network and the store's clients (vflow.world.store.connect_store): which
interface reaches the store, probes between workers, names that do not resolve or
exist, and a store that goes silent, on hosts made of network namespaces where it takes
them (tests/support/hosts.py)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys

import pytest

from tests.support import hosts
from tests.support.rendezvous import until
from vflow.world import network

MISSING = hosts.missing()
needs_hosts = pytest.mark.skipif(MISSING is not None, reason=f"multi-host tests: {MISSING}")


def test_the_store_on_loopback_is_reached_over_loopback() -> None:
    interface, local = network.route_interface("127.0.0.1", 29400)
    assert interface.startswith("lo") and local == "127.0.0.1"
    assert network.interface_address(interface) == "127.0.0.1"


def test_names_that_do_not_resolve_or_exist_are_named() -> None:
    with pytest.raises(ValueError, match=r"rendezvous: cannot resolve the host 'x\.invalid'"):
        network.resolve("x.invalid")
    with pytest.raises(ValueError, match="no network interface 'nosuch0' .*it has: lo"):
        network.check_interface("nosuch0")


def test_a_probe_answers_while_it_listens_and_not_after() -> None:
    listener = network.ProbeListener("127.0.0.1")
    try:
        assert network.reachable([listener.endpoint]) == [True]
    finally:
        listener.close()
    assert network.reachable([listener.endpoint]) == [False]
    assert network.reachable([]) == []


def test_a_probe_hands_on_a_message_and_a_plain_probe_says_nothing() -> None:
    heard: list[str] = []
    listener = network.ProbeListener("127.0.0.1", on_message=heard.append)
    try:
        assert network.reachable([listener.endpoint]) == [True]
        assert network.tell([listener.endpoint], "broken vflow/job/set3") == [True]
        until("the message", lambda: bool(heard))
        # A peer that connects and neither sends nor closes holds the probe a moment
        # only; what comes after it is heard.
        with socket.create_connection(("127.0.0.1", int(listener.endpoint.split(":")[1]))):
            assert network.tell([listener.endpoint], "second") == [True]
            until("the second message", lambda: len(heard) == 2, timeout=5.0)
        assert heard == ["broken vflow/job/set3", "second"]  # the plain probe said nothing
        with pytest.raises(ValueError, match="message must be at most 512 bytes, got 513"):
            network.tell([listener.endpoint], "x" * 513)
    finally:
        listener.close()
    assert network.tell([listener.endpoint], "late") == [False]
    assert network.tell([], "nobody") == []


def test_a_refusal_says_the_process_is_gone_and_a_stopped_one_does_not_refuse() -> None:
    """Note [Probing a peer]: a probe whose process is gone refuses at once; a listening
    probe, and one whose process is stopped (the kernel still completes connections
    into its backlog), do not."""
    listener = network.ProbeListener("127.0.0.1")
    stopped = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import socket, time\n"
            "s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen(8)\n"
            "print(s.getsockname()[1], flush=True); time.sleep(120)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert stopped.stdout is not None
        port = int(stopped.stdout.readline())
        os.kill(stopped.pid, signal.SIGSTOP)
        assert network.refused([listener.endpoint, f"127.0.0.1:{port}"]) == [False, False]
    finally:
        listener.close()
        stopped.kill()
        stopped.wait(timeout=30)
    assert network.refused([listener.endpoint, f"127.0.0.1:{port}"]) == [True, True]
    assert network.refused([]) == []


_ON_A_HOST = r"""
import json, sys, time
from vflow.world import network
from vflow.world.store import connect_store
store_host, port = sys.argv[1], int(sys.argv[2])
interface, local = network.route_interface(store_host, port)
store = connect_store(store_host, port, connect_s=10, timeout_s=60, silence_s=3)
store.set("ready", "1")
print(json.dumps({"interface": interface, "local": local}), flush=True)
sys.stdin.readline()  # the test cuts the store's link, then says go
start = time.monotonic()
try:
    store.add("n", 1)
    outcome = "answered"
except Exception as e:
    outcome = type(e).__name__ + ": " + str(e).splitlines()[0]
print(json.dumps({"seconds": time.monotonic() - start, "outcome": outcome}), flush=True)
"""


@needs_hosts
def test_a_worker_picks_the_interface_to_the_store_and_a_silent_store_fails_in_bounds() -> None:
    """Note [The interface that reaches the store] and Note [A store that goes silent]:
    on host b the store's address on host a is reached through eth0 from b's address;
    once a's link is down, a request fails within the 3 s asked for (torch's own client
    would wait for the kernel's retransmissions, about 15 minutes)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    with hosts.Hosts(2) as machines:
        store = machines.run(
            "a",
            [sys.executable, "-m", "vflow", "rendezvous", "--host", machines.address("a"),
             "--port", "29400", "--no-journal"],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        )  # fmt: skip
        assert store.stdout is not None and store.stdout.readline().strip()
        client = machines.run(
            "b",
            [sys.executable, "-c", _ON_A_HOST, machines.address("a"), "29400"],
            env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert client.stdout is not None and client.stdin is not None
        chosen = json.loads(client.stdout.readline())
        assert chosen == {"interface": "eth0", "local": machines.address("b")}
        machines.link_down("a")
        client.stdin.write("go\n")
        client.stdin.flush()
        ended = json.loads(client.stdout.readline())
        client.wait(timeout=30)
    assert "timed out" in ended["outcome"], ended
    assert ended["seconds"] <= 3.0 + 3.0, ended


# vflow.world.network.reachable's connection attempt, without importing torch.
_PROBE_FROM_A_HOST = r"""
import json, socket, sys
def connects(endpoint):
    host, port = endpoint.rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=0.5).close()
        return True
    except OSError:
        return False
print(json.dumps([connects(e) for e in sys.argv[1:]]))
"""


# vflow.world.network.refused, from a host.
_REFUSED_FROM_A_HOST = r"""
import json, sys
from vflow.world import network
print(json.dumps(network.refused(sys.argv[1:])))
"""


@needs_hosts
@pytest.mark.skipif(bool(hosts.missing_tools("nft")), reason="multi-host tests: needs nft")
def test_partitions_of_the_test_hosts_cut_exactly_the_pairs_asked() -> None:
    """The fixture's partitions (tests/support/hosts.py), seen by the probes: a cut
    between a and b leaves both reaching c, and b's silence is no refusal (c's port
    without a listener is); one way (a's packets to b dropped) cuts a
    TCP connection in both directions (its handshake needs both); healed, all reach all."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    with hosts.Hosts(3) as machines:
        listen = (
            "import socket, sys, time\n"
            "s = socket.socket(); s.bind((sys.argv[1], 7000)); s.listen()\n"
            "print('up', flush=True); time.sleep(120)"
        )
        listeners = {
            name: machines.run(
                name,
                [sys.executable, "-c", listen, machines.address(name)],
                env=env,
                stdout=subprocess.PIPE,
                text=True,
            )
            for name in machines.names
        }
        for proc in listeners.values():
            assert proc.stdout is not None and proc.stdout.readline().strip() == "up"

        def reach(source: str) -> dict[str, bool]:
            others = [n for n in machines.names if n != source]
            targets = [f"{machines.address(n)}:7000" for n in others]
            done = subprocess.run(
                machines.command(source, [sys.executable, "-c", _PROBE_FROM_A_HOST, *targets]),
                env=env, capture_output=True, text=True, timeout=60,
            )  # fmt: skip
            return dict(zip(others, json.loads(done.stdout), strict=True))

        machines.partition("a", "b")
        assert reach("a") == {"b": False, "c": True} and reach("b") == {"a": False, "c": True}
        # Silence is not a refusal: a partitioned peer is never taken for a dead one.
        refused = subprocess.run(
            machines.command("a", [sys.executable, "-c", _REFUSED_FROM_A_HOST,
                                   f"{machines.address('b')}:7000",
                                   f"{machines.address('c')}:7001"]),
            env=env, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert json.loads(refused.stdout) == [False, True], refused.stderr
        machines.heal("a", "b")
        machines.partition("a", "b", one_way=True)
        assert reach("a") == {"b": False, "c": True} and reach("b") == {"a": False, "c": True}
        machines.heal("a", "b")
        assert reach("a") == {"b": True, "c": True} and reach("c") == {"a": True, "b": True}
