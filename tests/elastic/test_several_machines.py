"""README.md's "### Several machines" as a user runs it, on two hosts made of network
namespaces (tests/support/hosts.py) with the README's own addresses: the store line on
the first, the worker line on both, as written and without GLOO_SOCKET_IFNAME, ending
bitwise equal to one worker alone; and the bad input a user on several machines types:
a ``--rdzv`` host that does not resolve, an interface that does not exist, a one-line
error each before anything starts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.support import REPO_ROOT, hosts
from tests.support.several_hosts import (
    HostJob,
    assert_bitwise_equal,
    environment,
    flag,
    interpreter,
    prepare,
    readme_lines,
    readme_subnet,
    reference,
    replaced,
)
from vflow.elastic import ElasticJob

pytest.importorskip("sklearn", reason="the example trains on scikit-learn's digits")

MISSING = hosts.missing()
needs_hosts = pytest.mark.skipif(MISSING is not None, reason=f"multi-host tests: {MISSING}")


@needs_hosts
@pytest.mark.alone  # its workers' collectives time out under other tests' load
def test_the_readme_lines_run_as_written_on_two_hosts(tmp_path: Path) -> None:
    store, worker = readme_lines()
    assert "--host" in store and flag(store, "--host") == flag(worker, "--rdzv").split(":")[0]
    with hosts.Hosts(2, subnet=readme_subnet()) as machines:
        job = HostJob(machines, tmp_path / "job")
        try:
            job.start_store()
            # The lines as written: start() adds only --log, to watch them.
            job.start("first", "a")
            job.wait_training(["first"], 1, steps=1)
            job.start("second", "b")
            codes = job.wait(["first", "second"], timeout=240)
        finally:
            job.kill()
    assert codes == {"first": 0, "second": 0}, job.stderr("first") + job.stderr("second")
    for name in ("first", "second"):
        # The interface that reaches the store, chosen without GLOO_SOCKET_IFNAME.
        assert "collectives on interface eth0" in job.stderr(name), job.stderr(name)
    assert max(line["workers"] for line in job.steps("second")) == 2
    got = torch.load(tmp_path / "job" / flag(worker, "--out"), weights_only=True)
    assert_bitwise_equal(got, reference(tmp_path / "alone"))  # the same as test_faults.py's


def _one_line_error(words: list[str], folder: Path) -> str:
    done = subprocess.run(
        words, cwd=folder, env=environment(folder), capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    return lines[0]


def test_a_rdzv_host_that_does_not_resolve_is_a_one_line_error(tmp_path: Path) -> None:
    prepare(tmp_path)
    _, worker = readme_lines()
    words = replaced(interpreter(worker), rdzv="no-such-host.invalid:29400")
    said = _one_line_error(words, tmp_path)
    assert "cannot resolve the host 'no-such-host.invalid'" in said and "rendezvous" in said
    assert not (tmp_path / flag(worker, "--out")).exists()


def test_an_interface_that_does_not_exist_is_a_one_line_error(tmp_path: Path) -> None:
    prepare(tmp_path)
    _, worker = readme_lines()
    words = replaced(interpreter(worker), rdzv="127.0.0.1:29400", interface="nosuch0")
    said = _one_line_error(words, tmp_path)
    assert "no network interface 'nosuch0'" in said and "interface" in said


def test_the_store_on_a_host_that_does_not_resolve_is_a_one_line_error() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "vflow", "rendezvous", "--host", "no-such-host.invalid"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO_ROOT,
    )
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [
        line for line in done.stderr.strip().splitlines() if "no-such-host.invalid" in line
    ]
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"rendezvous": "no-such-host.invalid:29400"}, "cannot resolve the host"),
        ({"interface": "nosuch0"}, "no network interface 'nosuch0'"),
        ({"interface": ""}, "interface must be a network interface's name"),
    ],
)
def test_elastic_job_checks_the_network_before_anything_starts(
    kwargs: dict[str, str], message: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    args = {"rendezvous": "127.0.0.1:29400", **kwargs}
    with pytest.raises(ValueError, match=message):
        ElasticJob(args.pop("rendezvous"), "j", **args)


def test_gloo_socket_ifname_is_checked_and_the_store_route_chosen_without_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "nosuch0")
    with pytest.raises(ValueError, match="GLOO_SOCKET_IFNAME: this machine has no network"):
        ElasticJob("127.0.0.1:29400", "j")
    monkeypatch.delenv("GLOO_SOCKET_IFNAME")
    loopback = ElasticJob("127.0.0.1:29400", "j").interface
    assert loopback.startswith("lo")  # the store on loopback: loopback
