"""Which network a worker's collectives use, and whether two workers can reach each
other.

Note [The interface that reaches the store]
Gloo binds its sockets to one interface, by default the address the hostname resolves
to, unless ``GLOO_SOCKET_IFNAME`` names one; NCCL picks one by its own rules unless
``NCCL_SOCKET_IFNAME`` names one. On one machine vflow put Gloo on loopback, which on
two machines connects nobody; the hostname's address may be an interface that the
other machines cannot reach (a management network, a docker bridge). The one address
every worker of an elastic job is known to reach the others from is the one it reaches
the store from: the workers of a job are meant to share the network the store is on.
So a worker uses, in this order: the interface it was told (``interface=``,
``--interface``), ``GLOO_SOCKET_IFNAME`` when set, and else the interface the kernel
routes the store's address through (a UDP socket "connected" to it, which sends
nothing, then its local address looked up among the interfaces). That is loopback when
the store is on loopback, and the cluster network's interface when the store is on a
head node. NCCL gets the same interface in ``NCCL_SOCKET_IFNAME`` unless the user set
it (it reads the variable when its first communicator is made).

Note [Probing a peer]
A collective that fails tells a worker that the group broke, not who cannot reach
whom: after a partition between two workers, both still reach the store, both answer,
and a worker set re-formed with both would break again. So each worker listens on a
probe socket on its collectives' interface, and workers that must agree on a worker
set first try to connect to each other's probe (``reachable``). A connection attempt
over a live network completes in a round trip; over a silent one (a partition, a
host whose link is down) nothing comes back, in either direction, so the attempt
times out after ``PROBE_TIMEOUT_S``. The probe accepts a connection and closes it: it
says only that packets flow both ways between the two interfaces the collectives use.

A connection can also carry a short message (``tell``): the probe reads what comes
before the peer closes, at most MESSAGE_BYTES, and hands it to its owner. A plain
probe sends nothing and closes at once, so reading costs it a round trip at most; a
peer that neither sends nor closes holds the probe for MESSAGE_WAIT_S.

A refused connection says more: the peer's host answered, and nothing listens on the
probe's port any more, so the process that listened is gone (killed, crashed, exited).
``refused`` asks only that, with a short timeout: a stopped process still accepts (the
kernel completes the connection into its backlog), and a silent host or a partition
answers nothing, so neither is ever taken for dead this way (Note [Beats],
vflow/elastic/rendezvous.py, judges those).
"""

from __future__ import annotations

import array
import fcntl
import ipaddress
import os
import socket
import struct
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

from vflow.world.store import format_endpoint

__all__ = [
    "PROBE_TIMEOUT_S",
    "ProbeListener",
    "check_interface",
    "interface_address",
    "interfaces",
    "loopback_interface",
    "reachable",
    "refused",
    "resolve",
    "route_interface",
    "tell",
]

# Over a LAN a connection completes in well under a millisecond, across a data centre
# in a few; half a second of silence is a cut link, not a slow one.
PROBE_TIMEOUT_S = 0.5
# A refusal comes back in a round trip; a peer that does not answer that quickly is not
# refusing, and whoever asked (an agreement's poll) must not wait for it.
REFUSED_TIMEOUT_S = 0.1
# What a probe reads of a message (Note [Probing a peer]), and how long it waits for it.
MESSAGE_BYTES = 512
MESSAGE_WAIT_S = 0.2
_SIOCGIFCONF = 0x8912
_IFREQ_BYTES = 40  # struct ifreq on 64-bit Linux: a 16-byte name, a 24-byte union


def resolve(host: str, name: str = "rendezvous") -> list[str]:
    """The addresses ``host`` resolves to, or a ValueError naming it and ``name``."""
    try:
        found = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as e:
        raise ValueError(f"{name}: cannot resolve the host {host!r}: {e}") from None
    return list(dict.fromkeys(str(info[4][0]) for info in found))


def interfaces() -> list[str]:
    """The names of this machine's network interfaces."""
    return [name for _, name in socket.if_nameindex()]


def loopback_interface() -> str | None:
    """The name of this machine's loopback interface ("lo" on Linux), if it has one."""
    return next((name for name in interfaces() if name.startswith("lo")), None)


def check_interface(interface: str, name: str = "interface") -> str:
    """``interface`` if this machine has a network interface of that name, else a
    ValueError naming it and the interfaces there are."""
    if not isinstance(interface, str) or not interface:
        raise ValueError(f"{name} must be a network interface's name, got {interface!r}")
    if interface not in interfaces():
        raise ValueError(
            f"{name}: this machine has no network interface {interface!r} "
            f"(it has: {', '.join(interfaces())})"
        )
    return interface


def route_interface(host: str, port: int) -> tuple[str, str]:
    """(interface, local address): where this machine's packets to ``host:port`` leave
    from (Note [The interface that reaches the store]). ValueError when ``host`` does
    not resolve, RuntimeError when no route leads there or the address is on no
    interface."""
    errors = []
    for address in resolve(host):
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            try:
                probe.connect((address, port))  # UDP: picks the route, sends nothing
            except OSError as e:
                errors.append(f"{address}: {e.strerror or e}")
                continue
            local = str(probe.getsockname()[0])
        owner = _interface_of(local)
        if owner is None:
            errors.append(f"{address}: the local address {local} is on no interface")
            continue
        return owner, local
    raise RuntimeError(f"no route from this machine to {host}:{port} ({'; '.join(errors)})")


def interface_address(interface: str) -> str:
    """An address of ``interface`` (IPv4 first), for a socket the peers reach there."""
    for address, owner in _addresses():
        if owner == interface:
            return address
    raise RuntimeError(f"the network interface {interface!r} has no address")


def _interface_of(address: str) -> str | None:
    wanted = ipaddress.ip_address(address.split("%")[0])
    for candidate, owner in _addresses():
        if ipaddress.ip_address(candidate) == wanted:
            return owner
    if wanted.is_loopback:
        return loopback_interface()
    return None


def _addresses() -> list[tuple[str, str]]:
    """(address, interface) of every address on this machine: IPv4 from the kernel's
    SIOCGIFCONF, IPv6 from /proc/net/if_inet6 (Linux)."""
    found = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        buffer = array.array("B", b"\0" * (_IFREQ_BYTES * 128))
        address, _ = buffer.buffer_info()
        request = struct.pack("iL", len(buffer), address)
        length = struct.unpack("iL", fcntl.ioctl(s.fileno(), _SIOCGIFCONF, request))[0]
        raw = buffer.tobytes()[:length]
    for at in range(0, len(raw), _IFREQ_BYTES):
        name = raw[at : at + 16].split(b"\0", 1)[0].decode()
        found.append((socket.inet_ntoa(raw[at + 20 : at + 24]), name.split(":")[0]))
    if os.path.exists("/proc/net/if_inet6"):
        with open("/proc/net/if_inet6") as table:
            for line in table:
                fields = line.split()
                if len(fields) >= 6:
                    packed = bytes.fromhex(fields[0])
                    found.append((socket.inet_ntop(socket.AF_INET6, packed), fields[5]))
    return found


class ProbeListener:
    """A socket on ``address`` that accepts connections and closes them at once
    (Note [Probing a peer]), or, with ``on_message``, once it has read what the peer
    sent, which ``on_message`` gets (called on the listener's thread; it must be quick);
    ``endpoint`` is what peers connect to. ``close()`` stops it."""

    def __init__(self, address: str, on_message: Callable[[str], None] | None = None) -> None:
        self._on_message = on_message
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        self._socket = socket.socket(family, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind((address, 0))
        # Every survivor of a large set may probe this one at once: a full accept queue
        # drops connection attempts, which would read as a cut link.
        self._socket.listen(socket.SOMAXCONN)
        host, port = self._socket.getsockname()[:2]
        self.endpoint = format_endpoint(host, port)
        self._closed = False
        self._thread = threading.Thread(target=self._serve, name="vflow-probe", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._closed:
            try:
                peer, _ = self._socket.accept()
            except OSError:
                return  # closed
            with peer:
                if self._on_message is not None:
                    message = _read_message(peer)
                    if message:
                        self._on_message(message)

    def close(self) -> None:
        self._closed = True
        try:
            self._socket.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._socket.close()


def _read_message(peer: socket.socket) -> str:
    """What ``peer`` sent before it closed, within MESSAGE_WAIT_S and MESSAGE_BYTES."""
    peer.settimeout(MESSAGE_WAIT_S)
    data = b""
    try:
        while len(data) < MESSAGE_BYTES:
            chunk = peer.recv(MESSAGE_BYTES - len(data))
            if not chunk:
                break
            data += chunk
    except OSError:
        pass
    return data.decode(errors="replace")


def refused(endpoints: Sequence[str], timeout_s: float = REFUSED_TIMEOUT_S) -> list[bool]:
    """Whether a connection to each ``"HOST:PORT"`` of ``endpoints`` is refused within
    ``timeout_s``: the host is up and the probe's process is gone (Note [Probing a
    peer]). A timeout, an accepted connection or any other error is False."""
    if not endpoints:
        return []

    def is_refused(endpoint: str) -> bool:
        host, _, port = endpoint.rpartition(":")
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
                return False
        except ConnectionRefusedError:
            return True
        except (OSError, ValueError):
            return False

    with ThreadPoolExecutor(max_workers=min(32, len(endpoints))) as pool:
        return list(pool.map(is_refused, endpoints))


def reachable(endpoints: Sequence[str], timeout_s: float = PROBE_TIMEOUT_S) -> list[bool]:
    """Whether a connection to each ``"HOST:PORT"`` of ``endpoints`` completes within
    ``timeout_s``, tried all at once (Note [Probing a peer])."""
    if not endpoints:
        return []

    def connects(endpoint: str) -> bool:
        host, _, port = endpoint.rpartition(":")
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
                return True
        except (OSError, ValueError):
            return False

    with ThreadPoolExecutor(max_workers=min(32, len(endpoints))) as pool:
        return list(pool.map(connects, endpoints))


def tell(endpoints: Sequence[str], message: str, timeout_s: float = PROBE_TIMEOUT_S) -> list[bool]:
    """Sends ``message`` (at most MESSAGE_BYTES) to the probe at each ``"HOST:PORT"`` of
    ``endpoints``, all at once; whether each was delivered to the peer's socket."""
    payload = message.encode()
    if len(payload) > MESSAGE_BYTES:
        raise ValueError(f"message must be at most {MESSAGE_BYTES} bytes, got {len(payload)}")
    if not endpoints:
        return []

    def send(endpoint: str) -> bool:
        host, _, port = endpoint.rpartition(":")
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s) as s:
                s.sendall(payload)
            return True
        except (OSError, ValueError):
            return False

    with ThreadPoolExecutor(max_workers=min(32, len(endpoints))) as pool:
        return list(pool.map(send, endpoints))
