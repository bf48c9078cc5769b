"""The c10d ``TCPStore`` servers vflow hosts, listening on exactly the address asked for.

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

import socket
from datetime import timedelta

import torch.distributed as dist

__all__ = ["format_endpoint", "host_store"]


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
