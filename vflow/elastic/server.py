"""The rendezvous store as a process of its own: ``python -m vflow rendezvous``.

It hosts a c10d TCPStore for elastic jobs (``serve``), writes its boot id
(``vflow/store/boot``: a restart is a new id, which is how running workers learn that
their store restarted) and keeps the journal of the running jobs' records (Note [The
store's journal], vflow/elastic/record.py), so that a restart does not forget which
jobs run. No worker hosts a store that others depend on, so no worker's death takes it
down.

The c10d store has no authentication: anybody who can reach its port can read and
write the jobs' keys. ``serve`` listens on loopback only unless told otherwise (Note
[Stores listen only where asked] in vflow/world/store.py).
"""

from __future__ import annotations

import argparse
import datetime
import secrets
import signal
import sys
import threading

import torch.distributed as dist

from vflow.elastic.record import BOOT_KEY, JOURNAL_KEY, JOURNAL_POLL_S, Journal, default_journal
from vflow.world.store import format_endpoint, host_store

__all__ = ["main", "serve"]


def serve(host: str = "127.0.0.1", port: int = 0) -> dist.TCPStore:
    """Hosts a c10d TCPStore for elastic jobs, listening on ``host:port`` only (port 0:
    any free port); ``store.host`` is the address it listens on. The store has no
    authentication; keep it on loopback or a trusted network (Note [Stores listen only
    where asked], vflow/world/store.py). OSError naming ``host:port`` if it cannot.
    It writes a fresh boot id; the journal is ``main``'s."""
    store = host_store(host, port, timeout=datetime.timedelta(seconds=60))
    store.set(BOOT_KEY, secrets.token_hex(8))
    store.set(JOURNAL_KEY, "")
    return store


def main(argv: list[str]) -> int:
    """``python -m vflow rendezvous``: hosts the store until SIGTERM or SIGINT."""
    parser = argparse.ArgumentParser(
        prog="python -m vflow rendezvous",
        description=(
            "Host the rendezvous store of elastic vflow jobs (workers: vflow.elastic). "
            "Prints the 'HOST:PORT' it listens on as its first line and runs until SIGTERM or "
            "Ctrl-C. The c10d store has no authentication: anyone who reaches the port can "
            "read and change the jobs' state, so it listens only on the --host address "
            "(loopback by default). Workers on other machines need that address and port "
            "reachable. It keeps a journal of the running jobs, so that a store restarted at "
            "the same address knows them: a worker started then joins the running job "
            "instead of starting it over."
        ),
    )
    parser.add_argument(
        "--host",
        default="127.0.0.1",
        help="the one address to listen on: IPv4, IPv6 or a hostname (default 127.0.0.1)",
    )
    parser.add_argument("--port", type=int, default=0, help="port (default: any free port)")
    journal = parser.add_mutually_exclusive_group()
    journal.add_argument(
        "--journal",
        metavar="FILE",
        help="the journal of running jobs (default with --port: "
        "$XDG_STATE_HOME/vflow/rendezvous-HOST-PORT.json, ~/.local/state if unset; "
        "without --port: none)",
    )
    journal.add_argument(
        "--no-journal",
        action="store_true",
        help="keep no journal: a restart forgets the running jobs until their workers re-register",
    )
    args = parser.parse_args(argv)
    try:
        store = serve(args.host, args.port)
    except OSError as e:  # names the host and port already
        print(f"python -m vflow rendezvous: {e}", file=sys.stderr)
        return 1
    except (RuntimeError, ValueError) as e:
        print(
            f"python -m vflow rendezvous: cannot listen on "
            f"{format_endpoint(args.host, args.port)}: {e}",
            file=sys.stderr,
        )
        return 1
    path = args.journal
    if path is None and not args.no_journal and args.port:
        path = default_journal(store.host, store.port)
    journal = None
    if path is not None:
        journal = Journal(path, store)
        try:
            restored = journal.restore()
        except RuntimeError as e:
            print(f"python -m vflow rendezvous: {e}", file=sys.stderr)
            return 1
        store.set(JOURNAL_KEY, path)
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    # The address it listens on (a hostname resolved), so the line is what workers need.
    print(format_endpoint(store.host, store.port), flush=True)
    if journal is None:
        print(
            "python -m vflow rendezvous: no journal: if this store restarts, running jobs are "
            "known again only once their workers re-register",
            file=sys.stderr,
            flush=True,
        )
    else:
        known = f"; running jobs restored: {', '.join(restored)}" if restored else ""
        print(f"python -m vflow rendezvous: journal {path}{known}", file=sys.stderr, flush=True)
    failing = False
    while not stop.wait(JOURNAL_POLL_S):
        if journal is None:
            continue
        try:
            journal.sync()
            failing = False
        except OSError as e:  # a full disk: the store serves on, the journal lags
            if not failing:
                print(f"python -m vflow rendezvous: cannot write the journal: {e}", file=sys.stderr)
            failing = True
    return 0
