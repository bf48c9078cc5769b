"""The c10d ``TCPStore`` servers vflow hosts, listening on exactly the address asked for,
and the clients vflow connects to a store that may go silent.

Note [Stores listen only where asked]
The c10d store has no authentication: whoever reaches its port can read and write every
key (who is in a job, where the process groups' peers listen) and so disturb or take
over the job. Yet a ``TCPStore`` server listens on every interface whatever host it is
given (the host only tells its own client where to connect). So vflow binds the
listening socket itself, to exactly (host, port), and hands it to the store with
``master_listen_fd``: the store is reachable only where the caller said, loopback
unless told otherwise. Every store vflow hosts is made by ``host_store``: the one
``vflow.world.launch.run_ranks`` hosts on 127.0.0.1 and ``python -m vflow rendezvous``'s
on its ``--host``.
"""

from __future__ import annotations

import os
import socket
import threading
from collections import Counter
from datetime import timedelta

import torch.distributed as dist

__all__ = ["CountingStore", "RequestCounts", "connect_store", "format_endpoint", "host_store"]


def host_store(host: str, port: int, *, timeout: timedelta) -> dist.TCPStore:
    """A ``TCPStore`` server listening on ``host:port`` only (port 0: a free port the OS
    picks); ``host`` is an IPv4 or IPv6 address or a hostname, which is resolved and the
    first of its addresses that can be bound is used. ``store.host`` is that numeric
    address and ``store.port`` the port. It does not wait for clients; ``timeout``
    bounds its own client's operations. Raises OSError naming ``host:port`` when it
    cannot listen there (see Note [Stores listen only where asked])."""
    if not isinstance(host, str) or not host:
        raise ValueError(f"host must be a non-empty address or hostname, got {host!r}")
    if not isinstance(port, int) or isinstance(port, bool) or not 0 <= port < 65536:
        raise ValueError(f"port must be an int in 0..65535, got {port!r}")
    sock = _listen(host, port)
    address, bound_port = sock.getsockname()[:2]
    # The store owns the descriptor from here on, and closes it also when it raises:
    # closing it here again could close a descriptor number reused meanwhile.
    fd = sock.detach()
    return dist.TCPStore(
        address,
        bound_port,
        is_master=True,
        wait_for_workers=False,
        timeout=timeout,
        master_listen_fd=fd,
        use_libuv=True,
    )


def format_endpoint(host: str, port: int) -> str:
    """``"HOST:PORT"``, with an IPv6 address in brackets (``"[::1]:29400"``)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _listen(host: str, port: int) -> socket.socket:
    """A socket listening on the first address of ``host`` that can be bound."""
    where = f"cannot listen on {format_endpoint(host, port)}"
    try:
        candidates = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise OSError(f"{where}: cannot resolve {host!r}: {e}") from e
    errors = []
    for family, kind, proto, _, address in candidates:
        sock = socket.socket(family, kind, proto)
        try:
            # As c10d does: a fixed port can be listened on again at once after a restart,
            # while old connections linger in TIME_WAIT. (Two listeners on one port stay
            # impossible: that would take SO_REUSEPORT.)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(address)
            sock.listen(socket.SOMAXCONN)
            return sock
        except OSError as e:
            sock.close()
            errors.append(f"{address[0]}: {e.strerror or e}")
    raise OSError(f"{where}: " + "; ".join(errors))


# Note [A store that goes silent]
# A TCPStore client's request to a store whose host went silent (a link down, a
# partition, a power cut: no reset comes back) blocks until the kernel gives up on the
# connection, about 15 minutes by Linux's default retransmissions: the client's
# timeout bounds waits for keys, not a request nobody answers (measured here with
# torch 2.13: check, add, get, compare_set and multi_get all blocked past 25 s with a
# 3 s timeout on a host whose link went down). vflow cannot reach into the client, but
# it can into the client's socket: ``connect_store`` sets TCP_USER_TIMEOUT on it
# (sent data unacknowledged for that long fails the connection) and TCP keepalive
# probes (an idle connection to a silent host fails in about as long), so every
# request on that connection fails with "Connection timed out" within
# ``silence_s`` of the store going silent, including the requests C++ makes on it (a
# process group's creation). A store that is only slow to answer is not affected:
# its kernel acknowledges what it receives. Linux only (elsewhere the sockets are left
# as they are).


def connect_store(
    host: str, port: int, *, connect_s: float, timeout_s: float, silence_s: float
) -> dist.TCPStore:
    """A TCPStore client of ``host:port``: connecting waits up to ``connect_s``, waits
    for keys up to ``timeout_s``, and a store that goes silent fails its requests within
    about ``silence_s`` (Note [A store that goes silent])."""
    store = dist.TCPStore(
        host, port, is_master=False, timeout=timedelta(seconds=connect_s), use_libuv=True
    )
    store.set_timeout(timedelta(seconds=timeout_s))
    addresses = {_plain(info[4][0]) for info in socket.getaddrinfo(host, port)}
    # The client's socket is not exposed: every connection of this process to the
    # store's address gets the same bounds (they are all connections to the store).
    for fd in _descriptors():
        _bound_silence(fd, addresses, port, silence_s)
    return store


def _plain(address: str) -> str:
    """An IPv4 address mapped into IPv6 (``::ffff:10.0.0.1``) as IPv4."""
    return address.removeprefix("::ffff:")


def _descriptors() -> list[int]:
    try:
        return [int(fd) for fd in os.listdir("/proc/self/fd")]
    except OSError:
        return []


def _bound_silence(fd: int, addresses: set[str], port: int, silence_s: float) -> None:
    try:
        sock = socket.socket(fileno=fd)
    except OSError:
        return  # not a socket, or closed since
    try:
        # Unix sockets (a multiprocessing pipe, say) have no address and port.
        if sock.type != socket.SOCK_STREAM or sock.family not in (
            socket.AF_INET,
            socket.AF_INET6,
        ):
            return
        peer = sock.getpeername()
        if peer[1] != port or _plain(peer[0]) not in addresses:
            return
        seconds = max(1, round(silence_s))
        if hasattr(socket, "TCP_USER_TIMEOUT"):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, seconds * 1000)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        if hasattr(socket, "TCP_KEEPIDLE"):
            idle = max(1, seconds // 2)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, idle)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 1)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, max(1, seconds - idle))
    except OSError:
        pass  # not connected, or not TCP
    finally:
        sock.detach()  # the store owns the descriptor


# Note [Counting requests to the store]
# Issue 35 bounds every worker's requests to the rendezvous store (a single process that
# serves the whole job). What is counted is what vflow's protocols send: ``CountingStore``
# wraps a client and counts each call as one request (``multi_get`` and ``multi_set`` are
# one request however many keys they carry: one round trip, as the TCPStore sends them).
# The tests, the benchmarks and the protocol simulator read the counts; production runs
# without the wrapper. Process groups are built on the client itself: Gloo cannot use a
# Python store under a PrefixStore (torch's trampoline does not forward ``clone``), and
# a group's creation is the backend's traffic, not the protocol's.


class RequestCounts:
    """Requests sent through ``CountingStore`` wrappers, by the wrapper's name and
    operation; thread-safe (a worker's poller and main thread share one)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[tuple[str, str]] = Counter()

    def add(self, name: str, op: str) -> None:
        with self._lock:
            self._counts[(name, op)] += 1

    def total(self, name: str | None = None) -> int:
        """All requests, or those of the wrapper ``name``."""
        with self._lock:
            return sum(n for (who, _), n in self._counts.items() if name in (None, who))

    def snapshot(self) -> dict[str, int]:
        """``{"name.op": count}``, for reports."""
        with self._lock:
            return {f"{who}.{op}": n for (who, op), n in sorted(self._counts.items())}


class CountingStore(dist.Store):
    """``inner`` with every request counted in ``counts`` under ``name`` (Note
    [Counting requests to the store]). ``inner`` is the client the requests go to."""

    def __init__(self, inner: dist.Store, counts: RequestCounts, name: str) -> None:
        super().__init__()
        self.inner = inner
        self._counts = counts
        self._name = name

    def _count(self, op: str) -> None:
        self._counts.add(self._name, op)

    def set(self, key: str, value: str | bytes) -> None:
        self._count("set")
        self.inner.set(key, value)

    def get(self, key: str) -> bytes:
        self._count("get")
        return self.inner.get(key)

    def add(self, key: str, value: int) -> int:
        self._count("add")
        return self.inner.add(key, value)

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        self._count("compare_set")
        return self.inner.compare_set(key, expected, desired)

    def check(self, keys: list[str]) -> bool:
        self._count("check")
        return self.inner.check(keys)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self._count("wait")
        if timeout is None:
            self.inner.wait(keys)
        else:
            self.inner.wait(keys, timeout)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        self._count("multi_get")
        return self.inner.multi_get(keys)

    def multi_set(self, keys: list[str], values: list[str | bytes]) -> None:
        self._count("multi_set")
        self.inner.multi_set(keys, values)

    def append(self, key: str, value: str | bytes) -> None:
        self._count("append")
        self.inner.append(key, value)

    def delete_key(self, key: str) -> bool:
        self._count("delete_key")
        return self.inner.delete_key(key)

    def num_keys(self) -> int:
        self._count("num_keys")
        return self.inner.num_keys()

    def set_timeout(self, timeout: timedelta) -> None:
        self.inner.set_timeout(timeout)

    @property
    def timeout(self) -> timedelta:
        return self.inner.timeout
