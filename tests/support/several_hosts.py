"""The README's "### Several machines" lines on namespace hosts (tests/support/hosts.py):
the store on one host, workers of examples/train_elastic.py on others, each with its
JSON log (``--log``), and the one-worker run the job must end bitwise equal to. Used by
the multi-host tests (tests/elastic/test_several_machines.py, tests/elastic/
test_faults.py) and by benchmarks/faults.py.

The lines run as the README writes them, from a folder of the run's own in which
``.venv`` and ``examples`` lead to the checkout's, so that relative paths resolve and
every file a worker writes (``final.pt``, the store's journal under
``XDG_STATE_HOME``) lands in that folder. A test replaces the values of some flags
(``--steps``, ``--sleep``, ``--job``) and adds others (``--log``, ``--timeout``)."""

from __future__ import annotations

import datetime
import itertools
import json
import os
import re
import select
import shlex
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from tests.support import REPO_ROOT
from tests.support.hosts import Hosts, wait_for_port

README = REPO_ROOT / "README.md"
SECTION = "### Several machines"
WAIT_S = 120.0


def readme_lines(
    section: str = SECTION, script: str = "examples/train_elastic.py"
) -> tuple[list[str], list[str]]:
    """The store's and the worker's command lines of README.md's ``section`` (by
    default "### Several machines"; the worker's runs ``script``), as words."""
    text = README.read_text(encoding="utf-8")
    found = re.search(rf"^{section}\n(.*?)(?=^##)", text, re.MULTILINE | re.DOTALL)
    assert found, f"README.md has no '{section}' section"
    block = re.search(r"^```bash\n(.*?)^```", found.group(1), re.MULTILINE | re.DOTALL)
    assert block, f"README.md's '{section}' shows no bash block"
    commands = [shlex.split(line, comments=True) for line in block.group(1).splitlines()]
    commands = [words[:-1] if words[-1:] == ["&"] else words for words in commands if words]
    store = [w for w in commands if w[1:4] == ["-m", "vflow", "rendezvous"]]
    worker = [w for w in commands if script in w]
    assert len(store) == 1 and len(worker) == 1, commands
    return store[0], worker[0]


def flag(words: Sequence[str], name: str) -> str:
    return words[list(words).index(name) + 1]


def readme_subnet() -> str:
    """The first three parts of the store's address in the README (its hosts' subnet)."""
    store, _ = readme_lines()
    return flag(store, "--host").rsplit(".", 1)[0]


def replaced(words: Sequence[str], **values: str) -> list[str]:
    """``words`` with the value of each flag in ``values`` (``steps="40"`` for
    ``--steps``) replaced, or appended when the line lacks the flag."""
    out = list(words)
    for name, value in values.items():
        option = "--" + name.replace("_", "-")
        if option in out:
            out[out.index(option) + 1] = value
        else:
            out += [option, value]
    return out


def environment(folder: Path) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), XDG_STATE_HOME=str(folder))
    # Bitwise equality needs the same thread count everywhere; no GPU.
    env.update(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", PYTHONUNBUFFERED="1")
    env.pop("GLOO_SOCKET_IFNAME", None)  # the point: the right interface by default
    return env


def prepare(folder: Path) -> None:
    """Makes ``folder`` a place the README's relative paths resolve from."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in ("examples", ".venv"):
        link = folder / name
        if not link.exists() and (REPO_ROOT / name).exists():
            link.symlink_to(REPO_ROOT / name)


def interpreter(words: list[str]) -> list[str]:
    """The README's interpreter (.venv/bin/python), unless this checkout has none."""
    if not (REPO_ROOT / words[0]).exists():
        words = [sys.executable, *words[1:]]
    return words


class HostJob:
    """One job of the README's lines on ``hosts``: the store on ``store_host``, workers
    by name on any host, each with its log and stderr in ``folder``."""

    def __init__(self, hosts: Hosts, folder: Path, *, store_host: str = "a") -> None:
        prepare(folder)
        self.hosts, self.folder, self.store_host = hosts, folder, store_host
        store, worker = readme_lines()
        self.store_words, self.worker_words = interpreter(store), interpreter(worker)
        self.endpoint = flag(worker, "--rdzv")
        self.store: subprocess.Popen[str] | None = None
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.hosts_of: dict[str, str] = {}
        self.env = environment(folder)

    # ---- the store ---------------------------------------------------------------------

    def start_store(self, *extra: str) -> None:
        host, port = self.endpoint.rsplit(":", 1)
        self.store = self.hosts.run(
            self.store_host,
            [*self.store_words, *extra],
            cwd=self.folder,
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=open(self.folder / "store.err", "a"),
            text=True,
        )
        assert self.store.stdout is not None
        ready, _, _ = select.select([self.store.stdout], [], [], 60)
        assert ready, "the store printed no address within 60 s"
        assert self.store.stdout.readline().strip() == self.endpoint
        wait_for_port(self.hosts, self.store_host, host, int(port), 30)

    def kill_store(self) -> None:
        assert self.store is not None
        self.store.kill()
        self.store.wait(timeout=30)

    # ---- workers -----------------------------------------------------------------------

    def start(
        self, name: str, host: str, *extra: str, clock_offset_s: float = 0.0, **values: str
    ) -> subprocess.Popen[bytes]:
        """The README's worker line on ``host``, with ``values`` replaced and ``extra``
        appended, logging to ``<name>.log``."""
        words = replaced(self.worker_words, log=str(self.log(name)), **values) + list(extra)
        proc = self.hosts.run(
            host,
            words,
            clock_offset_s=clock_offset_s,
            cwd=self.folder,
            env=self.env,
            stdout=subprocess.DEVNULL,
            stderr=open(self.folder / f"{name}.err", "w"),
        )
        self.procs[name], self.hosts_of[name] = proc, host
        return proc

    def log(self, name: str) -> Path:
        return self.folder / f"{name}.log"

    def lines(self, name: str) -> list[dict[str, Any]]:
        path = self.log(name)
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def steps(self, name: str) -> list[dict[str, Any]]:
        return [line for line in self.lines(name) if "loss" in line]

    def events(self, name: str) -> list[dict[str, Any]]:
        ends = [line for line in self.lines(name) if "events" in line]
        assert ends, f"{name} wrote no events:\n{self.stderr(name)}"
        return ends[-1]["events"]

    def stderr(self, name: str, last: int | None = 6000) -> str:
        """What the worker wrote to stderr: its ``last`` characters (None: all)."""
        path = self.folder / f"{name}.err"
        text = path.read_text(errors="replace") if path.exists() else ""
        return text if last is None else text[-last:]

    def wait_until(self, what: str, done: Callable[[], bool], timeout: float = WAIT_S) -> None:
        deadline = time.monotonic() + timeout
        while not done():
            ended = {n: p.returncode for n, p in self.procs.items() if p.poll() is not None}
            if time.monotonic() > deadline:
                raise AssertionError(f"no {what} within {timeout:g} s; ended: {ended}")
            time.sleep(0.05)

    def wait_training(self, names: Sequence[str], workers: int, steps: int = 3) -> None:
        """Until each of ``names`` has committed ``steps`` steps in a set of ``workers``."""

        def done() -> bool:
            for name in names:
                if self.procs[name].poll() is not None:
                    raise AssertionError(f"{name} ended early:\n{self.stderr(name)}")
            return all(
                sum(line["workers"] == workers for line in self.steps(name)) >= steps
                for name in names
            )

        self.wait_until(f"{list(names)} training as {workers}", done)

    def wait(self, names: Sequence[str] | None = None, timeout: float = WAIT_S) -> dict[str, int]:
        deadline = time.monotonic() + timeout
        codes = {}
        for name in names or list(self.procs):
            try:
                codes[name] = self.procs[name].wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise AssertionError(
                    f"{name} still runs after {timeout:g} s:\n{self.stderr(name)}"
                ) from None
        return codes

    def start_three(self, *extra: str, **values: str) -> None:
        """Workers a, b, c on hosts a, b, c, started together (the first round's last
        call takes whoever is there; the others join the running job); returns once all
        three train together."""
        for name in "abc":
            self.start(name, name, *extra, **values)
        self.wait_training(["a", "b", "c"], 3)

    def step_s(self, name: str) -> float:
        """The median time between the worker's steps so far."""
        times = [line["t"] for line in self.steps(name)]
        return statistics.median(b - a for a, b in itertools.pairwise(times))

    def back(self, name: str, since: float, workers: int) -> float:
        """When the worker first committed a step in a set of ``workers`` after
        ``since`` (``time.time()``), once it has."""
        self.wait_until(
            f"{name} training as {workers}",
            lambda: any(s["t"] > since and s["workers"] == workers for s in self.steps(name)),
        )
        return min(s["t"] for s in self.steps(name) if s["t"] > since and s["workers"] == workers)

    def longest_gap(self, name: str, after: float = 0.0) -> float:
        """The longest time between two steps the worker committed after ``after``."""
        times = [s["t"] for s in self.steps(name) if s["t"] > after]
        return max((b - a for a, b in itertools.pairwise(times)), default=0.0)

    def logged_at(self, name: str, text: str) -> float | None:
        """When the worker's stderr first logged a line containing ``text`` (the
        example's log lines begin with their local time, to the millisecond)."""
        for line in self.stderr(name, last=None).splitlines():
            if text in line:
                stamp = line[:23]
                try:
                    when = datetime.datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f")
                except ValueError:
                    continue
                return when.timestamp()
        return None

    def sets_per_step(self) -> dict[int, list[int]]:
        """step -> the set size each worker that committed it logged."""
        by_step: dict[int, list[int]] = {}
        for name in self.procs:
            for line in self.steps(name):
                by_step.setdefault(line["step"], []).append(line["workers"])
        return by_step

    def result(self) -> dict[str, Any]:
        """The state the job's lowest-ranked worker wrote at the end (``--out``)."""
        return torch.load(self.folder / flag(self.worker_words, "--out"), weights_only=True)

    def signal_workers(self, host: str, signum: int) -> None:
        for name, proc in self.procs.items():
            if self.hosts_of[name] == host and proc.poll() is None:
                os.kill(proc.pid, signum)

    def kill(self) -> None:
        for proc in [*self.procs.values(), *([self.store] if self.store else [])]:
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                proc.wait(timeout=30)


@contextmanager
def hosts_job(folder: Path, count: int = 3) -> Iterator[tuple[Hosts, HostJob]]:
    """``count`` hosts with the README's addresses and a job on them whose store runs
    on host a; every process killed and every host removed on the way out."""
    with Hosts(count, subnet=readme_subnet()) as machines:
        job = HostJob(machines, folder)
        try:
            job.start_store()
            yield machines, job
        finally:
            job.kill()


_REFERENCES: dict[tuple[tuple[str, str], ...], dict[str, Any]] = {}


def reference(folder: Path, **values: str) -> dict[str, Any]:
    """The README's worker line alone, on this machine's loopback (a store of its own on
    a free port, no journal), with ``values`` replaced and no sleep: the uninterrupted
    one-worker run the jobs end bitwise equal to. Run once per process and ``values``
    (in ``folder`` the first time)."""
    key = tuple(sorted(values.items()))
    if key not in _REFERENCES:
        _REFERENCES[key] = _run_alone(folder, **values)
    return _REFERENCES[key]


def _run_alone(folder: Path, **values: str) -> dict[str, Any]:
    prepare(folder)
    store, worker = (interpreter(w) for w in readme_lines())
    env = environment(folder)
    server = subprocess.Popen(
        [store[0], "-m", "vflow", "rendezvous", "--no-journal"],
        cwd=folder,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert server.stdout is not None
        endpoint = server.stdout.readline().strip()
        out = folder / "reference.pt"
        words = replaced(worker, rdzv=endpoint, job="reference", out=str(out), sleep="0", **values)
        done = subprocess.run(words, cwd=folder, env=env, capture_output=True, timeout=600)
        assert done.returncode == 0, done.stderr.decode(errors="replace")[-4000:]
        return torch.load(out, weights_only=True)
    finally:
        server.kill()
        server.wait(timeout=30)


def assert_bitwise_equal(got: dict[str, Any], want: dict[str, Any]) -> None:
    """Two states the example wrote (``--out``): the same step, model, optimizer and
    scheduler state, bit for bit."""
    assert got["step"] == want["step"]
    assert got.get("scheduler") == want.get("scheduler")
    assert got["model"].keys() == want["model"].keys()
    for key, value in want["model"].items():
        assert torch.equal(got["model"][key], value), f"model {key} differs"
    got_opt, want_opt = got["optimizer"], want["optimizer"]
    assert got_opt["param_groups"] == want_opt["param_groups"]
    assert got_opt["state"].keys() == want_opt["state"].keys()
    for index, state in want_opt["state"].items():
        assert got_opt["state"][index].keys() == state.keys()
        for key, value in state.items():
            assert torch.equal(got_opt["state"][index][key], value), f"optimizer {index} {key}"


# ---- the faults, played once: the tests assert on them, benchmarks/faults.py measures
# them -----------------------------------------------------------------------------------
# Each plays one fault of tests/elastic/test_faults.py on a HostJob whose store runs,
# with ``flags`` for every worker, and returns the moments it marked (time.time()). The
# job then runs to its end: the caller waits for the workers.


def play_silent_host(machines: Hosts, job: HostJob, flags: dict[str, str]) -> dict[str, float]:
    """a. c's link down once a, b and c train together; up again timeout + 2 s later."""
    job.start_three(**flags)
    step_s = job.step_s("a")
    down = time.time()
    machines.link_down("c")
    back = {name: job.back(name, down, 2) for name in ("a", "b")}
    time.sleep(max(0.0, down + float(flags["timeout"]) + 2.0 - time.time()))
    up = time.time()
    machines.link_up("c")
    return {"step_s": step_s, "down": down, **back, "up": up, "rejoined": job.back("c", up, 3)}


def play_partition(machines: Hosts, job: HostJob, flags: dict[str, str]) -> dict[str, float]:
    """b. b and c cut off from each other (both reach a and the store)."""
    job.start_three(**flags)
    step_s = job.step_s("a")
    cut = time.time()
    machines.partition("b", "c")
    return {"step_s": step_s, "cut": cut, "a": job.back("a", cut, 2)}


def play_silent_store(
    machines: Hosts, job: HostJob, flags: dict[str, str], store_timeout_s: float
) -> dict[str, float]:
    """c. The store's port silent while a, b and c train (each with a checkpoint file
    ``<name>.pt``), until b has taken 30 steps; then host a's link down. Returns once
    b and c have ended."""
    extra = ("--store-timeout", f"{store_timeout_s:g}")
    for name in "abc":
        job.start(name, name, *extra, checkpoint=str(job.folder / f"{name}.pt"), **flags)
    job.wait_training(["a", "b", "c"], 3)
    _, port = job.endpoint.rsplit(":", 1)
    silent = time.time()
    machines.block_port(job.store_host, int(port))
    job.wait_until(
        "steps without the store",
        lambda: sum(line["t"] > silent for line in job.steps("b")) >= 30,
    )
    down = time.time()
    machines.link_down(job.store_host)
    job.wait(["b", "c"], timeout=float(flags["timeout"]) + store_timeout_s + 60)
    return {"silent": silent, "down": down, "ended": time.time()}


def play_store_restart(machines: Hosts, job: HostJob, flags: dict[str, str]) -> dict[str, float]:
    """d. The store killed and started again at its address while a, b and c train;
    once all three re-registered the job, worker "late" starts on host b."""
    job.start_three(**flags)
    killed = time.time()
    job.kill_store()
    job.start_store()
    restarted = time.time()
    said = "re-registered the job"
    job.wait_until("re-registration", lambda: all(job.logged_at(n, said) for n in "abc"), 60)
    registered = max(job.logged_at(n, said) or 0.0 for n in "abc")
    job.start("late", "b", **flags)
    joined = job.back("late", restarted, 4)
    return {"killed": killed, "restarted": restarted, "registered": registered, "joined": joined}


def play_skew(machines: Hosts, job: HostJob, flags: dict[str, str]) -> dict[str, float]:
    """e. a, b and c start together, all in the job's first round (--min-workers 3),
    c's clock 30 s ahead."""
    for name in "abc":
        offset = 30.0 if name == "c" else 0.0
        job.start(name, name, "--min-workers", "3", clock_offset_s=offset, **flags)
    return {}


def play_stopped_host(machines: Hosts, job: HostJob, flags: dict[str, str]) -> dict[str, float]:
    """f. Every process of host c stopped for timeout + 2 s, then continued."""
    job.start_three(**flags)
    step_s = job.step_s("a")
    stopped = time.time()
    machines.stop("c")
    time.sleep(float(flags["timeout"]) + 2.0)
    machines.cont("c")
    return {"step_s": step_s, "stopped": stopped, "rejoined": job.back("c", stopped, 3)}


def play_slow_link(machines: Hosts, job: HostJob, flags: dict[str, str]) -> dict[str, float]:
    """g. c's link limited to 100 Mbit/s; a and b train; c joins late (from a's step
    60), so that few steps carry the gradients over the slow link."""
    machines.limit("c", "100mbit")
    job.start("a", "a", **flags)
    job.start("b", "b", **flags)
    job.wait_training(["a", "b"], 2, steps=1)
    job.wait_until("step 60", lambda: len(job.steps("a")) >= 60)
    job.start("c", "c", **flags)
    return {}


_SEND_STATE = r"""
import sys, time, datetime, json
import torch, torch.distributed as dist
from vflow.elastic.rendezvous import Round, round_group
from vflow.world.group import World
from vflow.world.membership import _send_state
from vflow.world.store import host_store, connect_store
rank, address = int(sys.argv[1]), sys.argv[2]
megabytes, timeout = int(sys.argv[3]), float(sys.argv[4])
if rank == 0:
    store = host_store(address, 29500, timeout=datetime.timedelta(seconds=60))
else:
    store = connect_store(address, 29500, connect_s=30, timeout_s=60, silence_s=30)
rnd = Round(0, rank, 2, "transfer", lambda: store)
group = round_group(rnd, datetime.timedelta(seconds=timeout), interface="eth0")
world = World(group, datetime.timedelta(seconds=timeout))
sent = torch.arange(megabytes << 18, dtype=torch.float32)  # megabytes of float32
got = {}
world.gather_ints([0], "ready", None)  # both sides connected before the clock starts
start = time.monotonic()
def load(state):
    got["w"] = state["w"].clone()
    return lambda: None
_send_state(world, [0], lambda: {"w": sent}, load)
seconds = time.monotonic() - start
equal = rank == 0 or torch.equal(got["w"], sent)
print(json.dumps({"seconds": seconds, "equal": equal}), flush=True)
"""


def state_over_a_slow_link(megabytes: int, timeout_s: float, rate: str) -> dict[str, Any]:
    """A training state of ``megabytes`` sent, as a grow sends it, from host a to host b
    behind a ``rate`` token bucket, on a group whose timeout is ``timeout_s`` (Note
    [Sending the training state]): the receiver's ``{"seconds", "equal"}``."""
    with Hosts(2) as machines:
        machines.limit("b", rate)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), OMP_NUM_THREADS="1")
        args = [machines.address("a"), str(megabytes), str(timeout_s)]
        procs = [
            machines.run(
                name,
                [sys.executable, "-c", _SEND_STATE, str(rank), *args],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for rank, name in enumerate("ab")
        ]
        outputs = [p.communicate(timeout=120) for p in procs]
    for proc, (_, err) in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, err[-3000:]
    return json.loads(outputs[1][0])
