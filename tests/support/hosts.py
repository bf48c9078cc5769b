"""Several hosts on one machine, for the multi-host tests and the fault benchmark: each
host is a network namespace with one interface (``eth0``) and its own address, all of
them plugged into one bridge that lives in a namespace of its own (the switch), so that
nothing they send reaches the machine's own network.

    with Hosts(3) as hosts:                       # hosts "a", "b", "c"
        store = hosts.run("a", ["python", "-m", "vflow", "rendezvous", "--host",
                                hosts.address("a")], stdout=subprocess.PIPE)
        worker = hosts.run("b", [...], clock_offset_s=30)   # faketime: 30 s ahead
        hosts.link_down("c")        # silence: c's cable pulled, no reset to anybody
        hosts.partition("b", "c")   # b and c no longer reach each other; both reach a
        hosts.partition("b", "c", one_way=True)   # b's packets to c are dropped
        hosts.limit("c", "100mbit")               # tbf on c's interface, both ways
        hosts.stop("c"); hosts.cont("c")          # SIGSTOP / SIGCONT every process of c

Faults are what a cluster's network does:

- a link down is silence: the peers' packets are dropped, nobody gets a reset, as when
  a machine loses power or its cable; a SIGKILL instead closes the process's sockets
  and the peers get a reset at once, which is not the same fault;
- a partition drops packets between two hosts only (nftables in each host's input
  hook), both still reach the others; one way drops only one direction's packets;
- a bandwidth limit is a token bucket (``tc tbf``) on the host's interface for what it
  sends and on its switch port for what it receives. netem (delay, loss) does not exist
  in this kernel;
- a clock offset is ``faketime`` preloaded into one process (and its children).

Everything a ``Hosts`` made is removed on the way out, also when a test fails: every
process still running in a host is killed (SIGKILL, by its pid, as ``ip netns pids``
lists them) and the namespaces are deleted, which deletes their interfaces. Traffic goes
only between the hosts and within each host's loopback.

``missing()`` says why the hosts cannot be made here (not root, no ``ip``, no network
namespaces), or None; ``missing_tools`` what a fault needs that is not installed
(``nft`` for partitions, ``tc`` for limits, ``faketime`` for clocks).
"""

from __future__ import annotations

import itertools
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence
from typing import Any

SUBNET = "10.77.0"  # every Hosts has its own namespaces, so they may share addresses
_TABLE = "vflow_faults"
_counter = itertools.count()


def missing() -> str | None:
    """Why namespace hosts cannot be made on this machine, or None when they can."""
    if os.name != "posix" or not hasattr(os, "geteuid"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces need root (run the tests as root to get them)"
    if shutil.which("ip") is None:
        return "the 'ip' command (iproute2) is not installed"
    probe = f"vflow-probe-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"'ip netns add' failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def missing_tools(*tools: str) -> list[str]:
    """The ones of ``tools`` that are not on PATH."""
    return [tool for tool in tools if shutil.which(tool) is None]


def cannot(*tools: str) -> str | None:
    """Why hosts with the faults that need ``tools`` cannot be made here, or None."""
    lacking = missing_tools(*tools)
    if lacking:
        return missing() or f"needs {', '.join(lacking)} (apt-get install nftables faketime)"
    return missing()


class HostError(RuntimeError):
    """A command that sets up or changes the hosts failed."""


class Hosts:
    """``count`` hosts named "a", "b", ... with addresses ``<subnet>.1``, ``<subnet>.2``,
    ... (10.77.0.1, ... by default); see the module docstring. A context manager: the
    hosts exist inside ``with``. Every Hosts has namespaces of its own, so hosts of
    different Hosts may have the same addresses (the README's, say) without meeting."""

    def __init__(self, count: int, subnet: str = SUBNET) -> None:
        if not 1 <= count <= 26:
            raise ValueError(f"count must be in 1..26, got {count}")
        self.subnet = subnet
        self.names = [chr(ord("a") + i) for i in range(count)]
        tag = f"vflow-{os.getpid()}-{next(_counter)}"
        self._switch = f"{tag}-sw"
        self._namespaces = {name: f"{tag}-{name}" for name in self.names}
        self._made: list[str] = []
        self._procs: list[subprocess.Popen[Any]] = []
        self._filtered: set[str] = set()

    # ---- set-up and teardown ---------------------------------------------------

    def __enter__(self) -> Hosts:
        try:
            self._make()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _make(self) -> None:
        self._ip("netns", "add", self._switch)
        self._made.append(self._switch)
        self._ip("-n", self._switch, "link", "add", "br0", "type", "bridge")
        self._ip("-n", self._switch, "link", "set", "br0", "up")
        for i, name in enumerate(self.names):
            ns = self._namespaces[name]
            self._ip("netns", "add", ns)
            self._made.append(ns)
            port = f"p{name}"
            # Both ends are made inside the namespaces: no interface ever appears in the
            # machine's own namespace, so concurrent Hosts cannot clash on names.
            self._ip(
                "link", "add", "eth0", "netns", ns, "type", "veth",
                "peer", "name", port, "netns", self._switch,
            )  # fmt: skip
            self._ip("-n", self._switch, "link", "set", port, "master", "br0")
            self._ip("-n", self._switch, "link", "set", port, "up")
            self._ip("-n", ns, "addr", "add", f"{self.subnet}.{i + 1}/24", "dev", "eth0")
            self._ip("-n", ns, "link", "set", "eth0", "up")
            self._ip("-n", ns, "link", "set", "lo", "up")

    def close(self) -> None:
        """Kills every process left in the hosts and deletes the namespaces."""
        for ns in self._made:
            for pid in self._pids(ns):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for proc in self._procs:
            if proc.poll() is None:
                proc.kill()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        for ns in reversed(self._made):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self._made.clear()

    # ---- what the tests use ----------------------------------------------------

    def address(self, name: str) -> str:
        return f"{self.subnet}.{self._index(name) + 1}"

    def namespace(self, name: str) -> str:
        self._index(name)
        return self._namespaces[name]

    def run(
        self, name: str, argv: Sequence[str], *, clock_offset_s: float = 0.0, **popen: Any
    ) -> subprocess.Popen[Any]:
        """Starts ``argv`` inside host ``name`` (``ip netns exec``); with
        ``clock_offset_s``, under ``faketime`` that many seconds ahead (or behind)."""
        command = list(argv)
        if clock_offset_s:
            if missing_tools("faketime"):
                raise HostError("a clock offset needs faketime (apt-get install faketime)")
            command = ["faketime", "-f", f"{clock_offset_s:+g}s", *command]
        proc = subprocess.Popen(["ip", "netns", "exec", self.namespace(name), *command], **popen)
        self._procs.append(proc)
        return proc

    def command(self, name: str, argv: Sequence[str]) -> list[str]:
        """``argv`` as a command line that runs it inside host ``name``."""
        return ["ip", "netns", "exec", self.namespace(name), *argv]

    def link_down(self, name: str) -> None:
        """Host ``name`` goes silent: its interface is down, its peers hear nothing."""
        self._ip("-n", self.namespace(name), "link", "set", "eth0", "down")

    def link_up(self, name: str) -> None:
        self._ip("-n", self.namespace(name), "link", "set", "eth0", "up")

    def partition(self, first: str, second: str, *, one_way: bool = False) -> None:
        """Drops the packets between ``first`` and ``second`` (both ways), or only those
        from ``first`` to ``second`` (``one_way``); both still reach every other host."""
        self._drop(second, first)
        if not one_way:
            self._drop(first, second)

    def block_port(self, name: str, port: int) -> None:
        """Host ``name`` drops every TCP packet to its ``port`` (from anybody, itself
        included): the server there goes silent, the host does not."""
        self._filter(name)
        rule = ["tcp", "dport", str(port), "drop"]
        self._nft(name, "add", "rule", "inet", _TABLE, "input", *rule)

    def heal(self, first: str, second: str) -> None:
        """Removes the partitions between ``first`` and ``second``."""
        for at in (first, second):
            if at in self._filtered:
                self._nft(at, "flush", "chain", "inet", _TABLE, "input")

    def limit(self, name: str, rate: str = "100mbit") -> None:
        """A token bucket of ``rate`` on what host ``name`` sends and receives."""
        if missing_tools("tc"):
            raise HostError("a bandwidth limit needs tc (iproute2)")
        tbf = ["root", "tbf", "rate", rate, "burst", "32kbit", "latency", "50ms"]
        for ns, dev in ((self.namespace(name), "eth0"), (self._switch, f"p{name}")):
            _check(["tc", "-n", ns, "qdisc", "replace", "dev", dev, *tbf])

    def unlimit(self, name: str) -> None:
        for ns, dev in ((self.namespace(name), "eth0"), (self._switch, f"p{name}")):
            subprocess.run(
                ["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"], capture_output=True
            )

    def stop(self, name: str) -> list[int]:
        """SIGSTOP to every process of host ``name``: a wedged machine. Returns the pids."""
        return self._signal(name, signal.SIGSTOP)

    def cont(self, name: str) -> list[int]:
        """SIGCONT to every process of host ``name``."""
        return self._signal(name, signal.SIGCONT)

    def pids(self, name: str) -> list[int]:
        """The processes running in host ``name`` now."""
        return self._pids(self.namespace(name))

    # ---- helpers ---------------------------------------------------------------

    def _index(self, name: str) -> int:
        if name not in self._namespaces:
            raise ValueError(f"no host {name!r}; the hosts are {self.names}")
        return self.names.index(name)

    def _signal(self, name: str, signum: int) -> list[int]:
        pids = self.pids(name)
        for pid in pids:
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass
        return pids

    @staticmethod
    def _pids(ns: str) -> list[int]:
        listed = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
        return [int(p) for p in listed.stdout.split()]

    def _drop(self, at: str, source: str) -> None:
        """At host ``at``, drops every packet that comes from ``source``."""
        self._filter(at)
        rule = ["ip", "saddr", self.address(source), "drop"]
        self._nft(at, "add", "rule", "inet", _TABLE, "input", *rule)

    def _filter(self, name: str) -> None:
        """An nftables table with an input chain in host ``name``, once."""
        if missing_tools("nft"):
            raise HostError("partitions need nftables (apt-get install nftables)")
        if name not in self._filtered:
            self._nft(name, "add", "table", "inet", _TABLE)
            chain = "{ type filter hook input priority 0; }"
            self._nft(name, "add", "chain", "inet", _TABLE, "input", chain)
            self._filtered.add(name)

    def _nft(self, name: str, *args: str) -> None:
        _check(["ip", "netns", "exec", self.namespace(name), "nft", *args])

    @staticmethod
    def _ip(*args: str) -> None:
        _check(["ip", *args])


def _check(command: list[str]) -> None:
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise HostError(f"{' '.join(command)}: {done.stderr.strip() or done.returncode}")


def wait_for_port(hosts: Hosts, name: str, address: str, port: int, timeout_s: float) -> None:
    """Waits until ``address:port`` accepts connections as seen from host ``name``."""
    probe = (
        "import socket,sys\n"
        f"s=socket.create_connection(({address!r},{port}),timeout=1)\n"
        "s.close()\n"
    )
    deadline = time.monotonic() + timeout_s
    while True:
        done = subprocess.run(
            hosts.command(name, ["python3", "-c", probe]), capture_output=True, text=True
        )
        if done.returncode == 0:
            return
        if time.monotonic() > deadline:
            raise HostError(f"{address}:{port} not reachable from host {name} in {timeout_s} s")
        time.sleep(0.2)
