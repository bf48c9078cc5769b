"""The TCP addresses a process listens on, as the kernel reports them (Linux /proc), for
tests that check where a store listens rather than what a process printed."""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

import pytest

_TABLES = (Path("/proc/net/tcp"), Path("/proc/net/tcp6"))
_LISTEN = "0A"  # TCP_LISTEN in the "st" column

needs_proc_net = pytest.mark.skipif(
    not all(table.exists() for table in _TABLES), reason="needs Linux /proc/net/tcp{,6}"
)


def listening(pid: int) -> set[tuple[str, int]]:
    """(address, port) of every TCP socket of process ``pid`` in the LISTEN state."""
    inodes = set()
    fd_dir = Path(f"/proc/{pid}/fd")
    for fd in os.listdir(fd_dir):
        try:
            target = os.readlink(fd_dir / fd)
        except OSError:  # closed since listdir
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    found = set()
    for table in _TABLES:
        for line in table.read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == _LISTEN and fields[9] in inodes:
                found.add(_address(fields[1]))
    return found


def _address(text: str) -> tuple[str, int]:
    """/proc/net/tcp{,6}'s "ADDR:PORT" in hex, the address as 32-bit words in host order."""
    address, port = text.split(":")
    raw = bytes.fromhex(address)
    order = slice(None, None, -1 if sys.byteorder == "little" else 1)
    words = b"".join(raw[i : i + 4][order] for i in range(0, len(raw), 4))
    family = socket.AF_INET if len(raw) == 4 else socket.AF_INET6
    return socket.inet_ntop(family, words), int(port, 16)
