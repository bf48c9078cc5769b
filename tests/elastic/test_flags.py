"""vflow.elastic.add_job_arguments / job_from_args: the job's command-line flags that
the worker scripts share (examples/train_elastic.py, tests/support/elastic_worker.py,
benchmarks/_elastic_worker.py). No process or store: ElasticJob connects only in run."""

from __future__ import annotations

import argparse

import pytest

from vflow.elastic import ElasticJob, add_job_arguments, job_from_args

ENDPOINT = ["--rdzv", "127.0.0.1:29400", "--job", "j1"]


def _parser(*options: str, **defaults: object) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="worker")
    add_job_arguments(parser, *options, **defaults)
    return parser


def test_flags_build_the_job_with_their_values_and_defaults() -> None:
    parser = _parser("keep_alive_s", timeout_s=30.0, min_workers=1, checkpoint=None)
    args = parser.parse_args([*ENDPOINT, "--timeout", "7", "--checkpoint", "c.pt"])
    assert (args.rendezvous, args.job_id, args.timeout_s) == ("127.0.0.1:29400", "j1", 7.0)
    job = job_from_args(args, max_workers=8)
    assert isinstance(job, ElasticJob)
    assert (job.rendezvous, job.job_id) == ("127.0.0.1:29400", "j1")
    assert (job.timeout_s, job.min_workers, job.max_workers) == (7.0, 1, 8)
    assert job.checkpoint == "c.pt"
    assert job.keep_alive_s == 0.5  # named without a default: ElasticJob's
    assert job.join_timeout_s == 600.0  # no flag: ElasticJob's default


def test_a_scripts_own_flag_of_an_options_name_does_not_reach_the_job() -> None:
    parser = _parser("timeout_s")
    parser.add_argument("--checkpoint", default="restart.pt")  # the script's own meaning
    job = job_from_args(parser.parse_args(ENDPOINT))
    assert job.checkpoint is None


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--job", "j1"], "the following arguments are required: --rdzv"),
        (["--rdzv", "localhost", "--job", "j1"], "argument --rdzv: the address must be"),
        (["--rdzv", "h:1", "--job", "a b"], "argument --job: must be non-empty"),
        ([*ENDPOINT, "--timeout", "0"], "argument --timeout: must be a number of seconds > 0"),
        ([*ENDPOINT, "--timeout", "nan"], "argument --timeout: must be a number of seconds"),
        (
            [*ENDPOINT, "--last-call", "-1"],
            "argument --last-call: must be a number of seconds >= 0",
        ),
        ([*ENDPOINT, "--min-workers", "0"], "argument --min-workers: must be a whole number >= 1"),
        ([*ENDPOINT, "--backend", "mpi"], "argument --backend: must be 'gloo' or 'nccl'"),
        ([*ENDPOINT, "--gpu", "-1"], "argument --gpu: must be an int >= 0"),
        ([*ENDPOINT, "--gpu", "one"], "argument --gpu: must be an int >= 0"),
    ],
)
def test_a_bad_value_is_an_error_naming_its_flag(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    parser = _parser("timeout_s", "last_call_s", "min_workers", "backend", "gpu")
    with pytest.raises(SystemExit):
        parser.parse_args(argv)
    assert message in capsys.readouterr().err


def test_zero_last_call_is_allowed() -> None:
    args = _parser("last_call_s").parse_args([*ENDPOINT, "--last-call", "0"])
    assert job_from_args(args).last_call_s == 0.0


def test_bad_uses_are_clear_errors() -> None:
    with pytest.raises(ValueError, match=r"options must be ElasticJob options .*\['steps'\]"):
        _parser("steps")
    with pytest.raises(ValueError, match=r"options named twice: \['timeout_s'\]"):
        _parser("timeout_s", timeout_s=3.0)
    with pytest.raises(TypeError, match="parser must be an argparse.ArgumentParser"):
        add_job_arguments(None)  # type: ignore[arg-type]
    args = _parser("max_workers").parse_args(ENDPOINT)
    with pytest.raises(ValueError, match=r"fixed options \['max_workers'\] also have flags"):
        job_from_args(args, max_workers=4)
    with pytest.raises(ValueError, match="add_job_arguments set up"):
        job_from_args(argparse.Namespace(rendezvous="127.0.0.1:1", job_id="j"))


def test_optional_job_flags_leave_a_script_without_a_job_until_both_are_given() -> None:
    parser = argparse.ArgumentParser()
    add_job_arguments(parser, "timeout_s", required=False)
    args = parser.parse_args([])
    assert (args.rendezvous, args.job_id) == (None, None)
    with pytest.raises(ValueError, match="needs both --rdzv and --job"):
        job_from_args(args)
    job = job_from_args(parser.parse_args(["--rdzv", "127.0.0.1:29400", "--job", "j"]))
    assert (job.rendezvous, job.job_id) == ("127.0.0.1:29400", "j")


def test_the_gpu_flag_reaches_an_nccl_job_and_is_refused_without_nccl() -> None:
    parser = _parser("backend", "gpu")
    job = job_from_args(parser.parse_args([*ENDPOINT, "--backend", "nccl", "--gpu", "3"]))
    assert (job.backend, job.gpu) == ("nccl", 3)
    assert job_from_args(parser.parse_args(ENDPOINT)).gpu is None
    with pytest.raises(ValueError, match="gpu=1 needs backend='nccl'"):
        job_from_args(parser.parse_args([*ENDPOINT, "--gpu", "1"]))
