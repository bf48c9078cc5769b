"""The policy flags that ``python -m vflow cluster simulate`` and ``run`` share:
``add_policy_arguments`` puts ``--interval-s`` and ``--las-threshold-s`` on a parser that
has ``--policy``, and ``policy_from_args`` builds the Policy from what it read (a
ValueError naming the policy or the setting when they do not fit)."""

from __future__ import annotations

import argparse

from vflow.cluster.policies import LAS_THRESHOLDS_S, Policy, get_policy
from vflow.elastic.flags import positive_seconds

__all__ = ["add_policy_arguments", "policy_from_args"]


def add_policy_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--interval-s",
        type=positive_seconds,
        default=None,
        metavar="SECONDS",
        help="also consult the policy this often (default: the policy's own; las: 60)",
    )
    parser.add_argument(
        "--las-threshold-s",
        type=positive_seconds,
        nargs="+",
        default=None,
        metavar="SECONDS",
        help="las: the attained worker-seconds at which a job moves to the next queue "
        f"(default {' '.join(f'{t:g}' for t in LAS_THRESHOLDS_S)})",
    )


def policy_from_args(args: argparse.Namespace) -> Policy:
    return get_policy(
        args.policy, las_thresholds_s=args.las_threshold_s, interval_s=args.interval_s
    )
