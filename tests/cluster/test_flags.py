"""vflow/cluster/flags.py: the policy flags both cluster commands take."""

from __future__ import annotations

import argparse

import pytest

from tests.cluster.test_policies import spec
from vflow.cluster.flags import add_policy_arguments, policy_from_args
from vflow.cluster.policies import JobState


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="p")
    parser.add_argument("--policy")
    add_policy_arguments(parser)
    return parser


def test_the_flags_reach_the_policy() -> None:
    args = _parser().parse_args(
        ["--policy", "las", "--interval-s", "2.5", "--las-threshold-s", "4"]
    )
    policy = policy_from_args(args)
    assert policy.name == "las" and policy.interval_s == 2.5 and policy.preemptive
    # Threshold 4 worker-seconds: a job that attained 5 yields to one that attained 0.
    jobs = [
        JobState(spec("a", 1, arrival_s=0.0), workers=1, started=True, attained_s=5.0),
        JobState(spec("b", 1, arrival_s=1.0)),
    ]
    assert policy(1, jobs) == {"a": 0, "b": 1}
    defaults = policy_from_args(_parser().parse_args(["--policy", "las"]))
    assert defaults.interval_s == 60.0 and defaults(1, jobs) == {"a": 1, "b": 0}


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--interval-s", "0"], "--interval-s"),
        (["--las-threshold-s", "-1"], "--las-threshold-s"),
    ],
)
def test_a_bad_value_names_its_flag(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        _parser().parse_args(["--policy", "las", *flags])
    assert message in capsys.readouterr().err


def test_decreasing_thresholds_are_refused() -> None:
    args = _parser().parse_args(["--policy", "las", "--las-threshold-s", "5", "2"])
    with pytest.raises(ValueError, match="las_thresholds_s must be increasing"):
        policy_from_args(args)
