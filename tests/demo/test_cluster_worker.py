"""vflow/demo/cluster_worker.py's flags: the job's step times read by the trace's rules
(the same interpolation as the simulator's), and bad values refused naming the flag.
Real runs of the worker: tests/cluster/test_runner.py."""

from __future__ import annotations

import pytest

from vflow.demo.cluster_worker import parse_args

FLAGS = ["--rdzv", "127.0.0.1:29400", "--job", "j", "--steps", "10", "--log", "x.jsonl"]


def test_step_times_follow_the_trace_interpolation() -> None:
    args = parse_args([*FLAGS, "--virtual-nodes", "4", "--step-s", '{"2": 0.42, "4": 0.21}'])
    assert args.spec.step_time(4) == pytest.approx(0.21)
    assert args.spec.step_time(3) == pytest.approx(0.28)  # throughput interpolated
    assert args.spec.max_workers == 4
    assert (args.batch_size, args.seed, args.timeout_s) == (32, 0, 30.0)


def test_the_collective_timeout_follows_slow_steps() -> None:
    args = parse_args([*FLAGS, "--virtual-nodes", "2", "--step-s", '{"1": 20.0, "2": 11.0}'])
    assert args.timeout_s == 60.0
    args = parse_args([*FLAGS, "--virtual-nodes", "2", "--step-s", '{"1": 20}', "--timeout", "5"])
    assert args.timeout_s == 5.0


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--virtual-nodes", "4", "--step-s", "{"], "--step-s"),
        (["--virtual-nodes", "4", "--step-s", '{"0": 1.0}'], "step_s keys"),
        (["--virtual-nodes", "4", "--step-s", '{"1": -1}'], "step_s['1']"),
        (["--virtual-nodes", "2", "--step-s", '{"4": 0.1}'], "no usable worker count"),
        (["--virtual-nodes", "0", "--step-s", '{"1": 1}'], "--virtual-nodes"),
        (["--virtual-nodes", "64", "--step-s", '{"1": 1}'], "--batch-size"),
    ],
)
def test_refuses_bad_flags_naming_them(
    capsys: pytest.CaptureFixture[str], extra: list[str], message: str
) -> None:
    with pytest.raises(SystemExit) as raised:
        parse_args([*FLAGS, *extra])
    assert raised.value.code == 2
    assert message in capsys.readouterr().err
