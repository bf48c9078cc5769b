"""The job's record in the store, which says which worker set owns a job, and the
journal that keeps it across restarts of the store.

Note [Fencing a job]
The fact "job J runs" used to live only in the store: a restarted store forgot it,
and a worker started afterwards with the same ``--job`` began J again from step 0
beside the running set (two copies of one job). Now every job has one record,
``vflow/<job>/record``: ``{"lineage": L, "epoch": E, "state": "running" |
"suspended" | "finished"}``, with ``"step": K`` in a suspended record and ``"resumes":
R`` once the job has been resumed (Note [Suspending a job], vflow/elastic/job.py).

- The lineage names the worker set that started the job: ``<boot>/round<N>``, the
  store's boot id (``vflow/store/boot``, new at every start of the store process) and
  the rendezvous round that formed it. Every worker of that round writes the same
  record with compare-and-set on an empty key, so exactly one lineage wins; a round
  that finds another lineage's record does not start the job but knocks at it. Every
  later member, let in by a grow, a recovery or a fallback round, belongs to the
  lineage it joined. The lineage never changes while the job runs.
- The epoch counts the store restarts the lineage has lived through. When a member's
  poller finds the store's boot id changed (the store restarted), it re-registers the
  lineage: compare-and-set from an empty key, or from its own lineage's restored record
  (below), to ``epoch + 1``. All members of the set propose the same bytes, so
  whichever writes first, the others find their own lineage and adopt its epoch.
- A member that finds another lineage in the record (a second copy of the job that
  claimed it while this set could not reach the store) or the job finished is
  *fenced*: it trains no further step and stops with its checkpoint and an error
  saying so. (A member that finds its own lineage suspended, by the others while it
  was out of their set, stops as suspended.)
- Suspending: the members write ``"state": "suspended"`` and the step count with
  compare-and-set from their lineage's running record, all the same bytes, once the
  job's checkpoint is written. Resuming: the first round of workers started from that
  checkpoint claims the record back, compare-and-set from the suspended record (so
  exactly one round wins) to a running record of a new lineage, the round's, with
  ``resumes`` one higher (Note [Resumed generations], vflow/elastic/rendezvous.py).

Why this is safe: the store is linearizable (one server applies one request at a
time), every change of a record is a compare-and-set from a value the writer read, and
a set starts training a job only after its own claim succeeded (on a journaled store:
only once the claim is on disk). So at any moment the record names one lineage, and a
lineage other than the one that claimed the job can train it only from the moment its
claim succeeded -- which, with the journal, needs the record gone: the job never
started, or it finished.

Note [The store's journal]
A restarted store has lost every key; the running workers re-register, but a worker
started before they do would find no record and start the job over. So
``python -m vflow rendezvous`` keeps a journal file of the running jobs' records and
restores them when it starts (marked ``"restored": true``): a worker started then
finds the job running and knocks, and the members re-register and let it in. A job
announces itself once (``vflow/jobs``, an append-only list of ids); the store process
reads the records of the announced jobs every ``JOURNAL_POLL_S``, writes the file
atomically when one changed (``replacing_atomically``: fsync, rename, fsync of the
directory), drops finished jobs, and acknowledges each record it wrote
(``vflow/<job>/journaled``). A worker set that claims a job waits for that
acknowledgement before its first step, so that a job is never trained before the
journal knows it. Suspended jobs stay in the journal, and a suspending set waits for
the acknowledgement of its suspended record before its workers return: a store
restarted after a job was suspended still knows it, so that the job resumes from its
checkpoint instead of starting over. A store without a journal (``--no-journal``, or
a store that another program hosts) says so in ``vflow/store/journal``, and a claim
there does not wait; after such a store restarts, only the members' re-registration
restores the record.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
from collections.abc import Mapping
from typing import Any

import torch.distributed as dist

from vflow.runtime.checkpoint import replacing_atomically

__all__ = [
    "BOOT_KEY",
    "JOBS_KEY",
    "JOURNAL_KEY",
    "Journal",
    "Record",
    "boot_id",
    "default_journal",
    "encode",
    "journaled_key",
    "parse",
    "read",
    "record_key",
    "resumes",
    "running",
    "suspended",
]

BOOT_KEY = "vflow/store/boot"  # the store's boot id, new at each start of its process
JOURNAL_KEY = "vflow/store/journal"  # the journal's path, or "" (none)
JOBS_KEY = "vflow/jobs"  # the ids of the jobs that ever claimed a record, one per line
JOURNAL_POLL_S = 0.1
_KEPT = ("running", "suspended")  # the states of the records the journal keeps

Record = dict[str, Any]

_log = logging.getLogger("vflow")


def record_key(job_id: str) -> str:
    return f"vflow/{job_id}/record"


def journaled_key(job_id: str) -> str:
    return f"vflow/{job_id}/journaled"


def encode(record: Mapping[str, Any]) -> str:
    """The record's bytes: the same for the same record on every worker, so that the
    members' compare-and-sets propose identical values."""
    return json.dumps(dict(record), sort_keys=True, separators=(",", ":"))


def parse(raw: bytes | str) -> Record | None:
    """The record ``raw`` holds, or None for an empty key."""
    text = raw.decode() if isinstance(raw, bytes) else raw
    return json.loads(text) if text else None


def running(lineage: str, epoch: int, resumes: int = 0) -> Record:
    """The record of a job that ``lineage`` trains, ``resumes`` times resumed (the key
    only once the job has been: a job never suspended has the records it always had)."""
    record: Record = {"lineage": lineage, "epoch": epoch, "state": "running"}
    if resumes:
        record["resumes"] = resumes
    return record


def suspended(record: Record, step: int) -> Record:
    """``record`` (the running record of the suspending lineage) suspended at ``step``."""
    kept = {k: v for k, v in record.items() if k != "restored"}
    return dict(kept, state="suspended", step=step)


def resumes(record: Record) -> int:
    """How many times the job of ``record`` has been resumed."""
    return int(record.get("resumes", 0))


def read(store: dist.Store, job_id: str) -> tuple[str, Record | None]:
    """The job's record as stored (its exact bytes, for a compare-and-set: "" when
    there is none) and parsed."""
    key = record_key(job_id)
    raw = store.get(key).decode() if store.check([key]) else ""
    return raw, parse(raw)


def boot_id(store: dist.Store) -> str:
    """The boot id of the store process behind ``store``: the one it wrote when it
    started, or, for a store hosted by another program, the first one any client wrote
    (compare-and-set, so that every client reads the same)."""
    return str(store.compare_set(BOOT_KEY, "", secrets.token_hex(8)).decode())


class Journal:
    """The store process's side of Note [The store's journal]: ``restore`` at start,
    then ``sync`` every JOURNAL_POLL_S."""

    def __init__(self, path: str, store: dist.Store) -> None:
        self.path = path
        self._store = store
        self._written: dict[str, str] = {}  # job: the encoded record last acknowledged

    def restore(self) -> list[str]:
        """Puts the journal's records (running or suspended jobs) back into the store,
        marked restored; returns their job ids. A missing file is an empty journal."""
        try:
            with open(self.path) as f:
                saved = json.load(f)
        except FileNotFoundError:
            saved = {}
        except (OSError, ValueError) as e:
            raise RuntimeError(f"cannot read the journal {self.path!r}: {e}") from e
        jobs = saved.get("jobs", {}) if isinstance(saved, dict) else {}
        for job_id, record in jobs.items():
            restored = dict(record, restored=True)
            self._store.set(record_key(job_id), encode(restored))
            self._store.append(JOBS_KEY, job_id + "\n")
            self._written[job_id] = encode(restored)
        # Written at once: a journal that cannot be written is an error at the start.
        try:
            self._write({job_id: dict(record) for job_id, record in jobs.items()})
        except OSError as e:
            raise RuntimeError(f"cannot write the journal {self.path!r}: {e}") from e
        return sorted(jobs)

    def sync(self) -> None:
        """Reads the announced jobs' records; writes the file and acknowledges the
        records when any changed."""
        if not self._store.check([JOBS_KEY]):
            return
        ids = dict.fromkeys(i for i in self._store.get(JOBS_KEY).decode().split("\n") if i)
        records = {job_id: read(self._store, job_id) for job_id in ids}
        current = {job_id: raw for job_id, (raw, _) in records.items() if raw}
        if current == self._written:
            return
        kept = {
            job_id: {k: v for k, v in record.items() if k != "restored"}
            for job_id, (_, record) in records.items()
            if record is not None and record.get("state") in _KEPT
        }
        self._write(kept)
        for job_id, raw in current.items():
            if self._written.get(job_id) != raw:
                self._store.set(journaled_key(job_id), raw)
        self._written = current

    def _write(self, jobs: Mapping[str, Record]) -> None:
        directory = os.path.dirname(os.path.abspath(self.path))
        os.makedirs(directory, exist_ok=True)
        with replacing_atomically(self.path) as f:
            f.write(json.dumps({"jobs": dict(jobs)}, indent=1, sort_keys=True).encode())


def default_journal(host: str, port: int) -> str:
    """Where ``python -m vflow rendezvous --port P`` keeps its journal unless told:
    under ``$XDG_STATE_HOME`` (default ``~/.local/state``), named by the address, so
    that the store restarted at the same address finds it."""
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(
        os.path.expanduser("~"), ".local", "state"
    )
    safe = host.replace(":", "_").replace("/", "_")
    return os.path.join(base, "vflow", f"rendezvous-{safe}-{port}.json")
