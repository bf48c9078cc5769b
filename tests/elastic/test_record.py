"""The job's record and the store's journal (Note [Fencing a job], Note [The store's
journal], vflow/elastic/record.py), against a real store process that the tests kill
and start again at the same address, and inspect with a client of their own."""

from __future__ import annotations

import datetime
import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from tests.support import elastic_worker
from tests.support.rendezvous import store_process, until, worker_rendezvous
from vflow.elastic import record as records

WORKER = Path(elastic_worker.__file__)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def _store(port: int, *flags: str) -> Iterator[subprocess.Popen[str]]:
    command = [sys.executable, "-m", "vflow", "rendezvous", "--port", str(port), *flags]
    with store_process(command, stderr=subprocess.DEVNULL) as (proc, endpoint):
        assert endpoint == f"127.0.0.1:{port}", endpoint
        yield proc


def _client(port: int) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=10))


def _journal(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())["jobs"] if path.exists() else {}


def test_the_first_claim_wins_and_is_in_the_journal_when_it_returns(tmp_path: Path) -> None:
    port, journal = _free_port(), tmp_path / "journal.json"
    with _store(port, "--journal", str(journal)):
        first, second = (
            worker_rendezvous(f"127.0.0.1:{port}", "j"),
            worker_rendezvous(f"127.0.0.1:{port}", "j"),
        )
        try:
            won = first.claim("vflow/j/boot/round0")
            assert won == {"lineage": "vflow/j/boot/round0", "epoch": 1, "state": "running"}
            # The claim returned once the store had it on disk.
            assert _journal(journal) == {"j": won}
            assert second.claim("vflow/j/boot/round1") == won
            assert second.lineage is None and first.lineage == won
            # Another member of the winning round, claiming after the first did: the job
            # is its set's too (its poller fences on the record, its suspend marks it).
            member = worker_rendezvous(f"127.0.0.1:{port}", "j")
            try:
                assert member.claim("vflow/j/boot/round0") == won and member.lineage == won
            finally:
                member.close()
            raw = _client(port).get(records.record_key("j")).decode()
            assert raw == records.encode(won)  # the same bytes on every worker
            first.finish_record()
            until("the finished job out of the journal", lambda: _journal(journal) == {})
        finally:
            first.close()
            second.close()


def test_a_restarted_store_restores_the_job_and_its_set_re_registers_once(
    tmp_path: Path,
) -> None:
    """The store is killed and started again at its address with its journal: the job's
    record comes back marked restored; the set's members, each noticing on its own,
    put it back with the next epoch, the same one for all; a worker set of another
    lineage that held the job while cut off is fenced."""
    port, journal = _free_port(), tmp_path / "journal.json"
    members = []
    try:
        with _store(port, "--journal", str(journal)):
            first, second, other = (worker_rendezvous(f"127.0.0.1:{port}", "j") for _ in range(3))
            members = [first, second, other]
            record = first.claim("vflow/j/boot/round0")
            second.joined(record)
            other.joined({"lineage": "vflow/j/elsewhere/round0", "epoch": 1, "state": "running"})
            for rank, rdzv in enumerate(members):
                rdzv.adopt("vflow/j/boot/round0", 0, rank)  # the pollers watch the store
        with _store(port, "--journal", str(journal)):
            until(
                "the set re-registered",
                lambda: all(m.lineage and m.lineage["epoch"] == 2 for m in (first, second)),
            )
            until("the other lineage fenced", lambda: other.fenced() is not None)
            stored = records.parse(_client(port).get(records.record_key("j")))
            assert stored == {"lineage": "vflow/j/boot/round0", "epoch": 2, "state": "running"}
            assert other.fenced() == stored or other.fenced()["lineage"] == stored["lineage"]
            assert first.fenced() is None and second.fenced() is None
            until("the journal at epoch 2", lambda: _journal(journal)["j"]["epoch"] == 2)
    finally:
        for rdzv in members:
            rdzv.close()


@pytest.mark.slow
def test_a_worker_of_a_job_the_restarted_store_restored_waits_and_never_starts_it(
    tmp_path: Path,
) -> None:
    """Note [The store's journal]: a worker that finds its job restored but not yet
    re-registered cannot tell whether the job's workers will come back: it knocks and
    waits, says why, and at its join deadline gives up without having trained a step
    (it would otherwise start a second copy from step 0)."""
    port, journal = _free_port(), tmp_path / "journal.json"
    running = records.running("vflow/j/gone/round0", 3)
    journal.write_text(json.dumps({"jobs": {"j": running}}))
    with _store(port, "--journal", str(journal)):
        log = tmp_path / "w.log"
        done = subprocess.run(
            [
                sys.executable,
                str(WORKER),
                "--rdzv",
                f"127.0.0.1:{port}",
                "--job",
                "j",
                "--steps",
                "5",
                "--log",
                str(log),
                "--join-timeout",
                "3",
            ],
            env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)),
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert done.returncode == 1, done.stderr[-3000:]
    assert "ran on the store at" in done.stderr and "before the store restarted" in done.stderr
    assert "JoinRefused" in done.stderr
    assert not [line for line in log.read_text().splitlines() if '"indices"' in line]


def test_a_store_without_a_journal_says_what_a_restart_costs() -> None:
    command = [sys.executable, "-m", "vflow", "rendezvous", "--no-journal"]
    with store_process(command, stderr=subprocess.PIPE) as (proc, endpoint):
        assert endpoint.startswith("127.0.0.1:")
        assert proc.stderr is not None
        line = proc.stderr.readline()
        proc.terminate()
        proc.wait(timeout=30)
        proc.stderr.close()
    assert "no journal" in line and "re-register" in line


def test_the_journal_defaults_to_the_state_folder_with_a_fixed_port(tmp_path: Path) -> None:
    port = _free_port()
    env = dict(os.environ, XDG_STATE_HOME=str(tmp_path))
    with store_process(
        [sys.executable, "-m", "vflow", "rendezvous", "--port", str(port)],
        env=env,
        stderr=subprocess.PIPE,
    ) as (proc, _):
        assert proc.stderr is not None
        line = proc.stderr.readline()
        proc.terminate()
        proc.wait(timeout=30)
        proc.stderr.close()
    path = tmp_path / "vflow" / f"rendezvous-127.0.0.1-{port}.json"
    assert f"journal {path}" in line
    assert json.loads(path.read_text()) == {"jobs": {}}
