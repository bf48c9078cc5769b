"""The command-line flags of an elastic job, for worker scripts: ``add_job_arguments``
puts ``--rdzv``, ``--job`` and a flag for each ElasticJob option a script names on its
parser, and ``job_from_args`` builds the ElasticJob from what the parser read.

Every flag has one name everywhere (``--timeout`` is ``timeout_s``, ``--keep-alive`` is
``keep_alive_s``, ...), and its value lands under the option's own name
(``args.timeout_s``); ``--rdzv`` and ``--job`` land as ``args.rendezvous`` and
``args.job_id``. Values are checked while parsing, so that a bad one is an error naming
its flag."""

from __future__ import annotations

import argparse
import inspect
import math
from collections.abc import Callable
from typing import Any

from vflow.elastic.job import ElasticJob
from vflow.elastic.rendezvous import parse_endpoint

__all__ = ["add_job_arguments", "job_from_args"]

# The ElasticJob options that add_job_arguments put on this parser, in the namespace
# (set_defaults): job_from_args passes exactly those, so that a script's own flag of
# the same name (a --checkpoint of its own) never reaches ElasticJob.
_ADDED = "_elastic_job_options"


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, got {text!r}")
    return value


def positive_seconds(text: str) -> float:
    """argparse type: a number of seconds > 0 (also for other commands' flags)."""
    value = seconds_or_zero(text)
    if value == 0:
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0, got {text!r}")
    return value


def seconds_or_zero(text: str) -> float:
    """argparse type: a number of seconds >= 0."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"must be a number of seconds >= 0, got {text!r}")
    return value


def _endpoint(text: str) -> str:
    try:
        parse_endpoint(text, "the address")
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def _job_id(text: str) -> str:
    if not text or any(c.isspace() for c in text):
        raise argparse.ArgumentTypeError(f"must be non-empty and without spaces, got {text!r}")
    return text


def _name(text: str) -> str:
    if not text or any(c.isspace() for c in text):
        raise argparse.ArgumentTypeError(f"must be an interface's name, got {text!r}")
    return text


def _index(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an int >= 0, got {text!r}")
    return value


def _backend(text: str) -> str:
    if text not in ("gloo", "nccl"):
        raise argparse.ArgumentTypeError(f"must be 'gloo' or 'nccl', got {text!r}")
    return text


# option -> (flag, parse, help); the metavar follows from the parse function
_OPTIONS: dict[str, tuple[str, Callable[[str], Any], str]] = {
    "min_workers": (
        "--min-workers",
        _count,
        "a round forms once this many workers are there; the job stops below it",
    ),
    "max_workers": (
        "--max-workers",
        _count,
        "more workers wait for a place (default: V, every worker needs a VN)",
    ),
    "timeout_s": (
        "--timeout",
        positive_seconds,
        "seconds a collective may take: how long a hung worker stalls the others",
    ),
    "group_timeout_s": (
        "--group-timeout",
        positive_seconds,
        "seconds creating a worker set's process group may take (default: grows with the "
        "set, max(--timeout, N*N/10000))",
    ),
    "join_deadline_s": (
        "--join-deadline",
        positive_seconds,
        "seconds the members wait for newcomers to connect (default: the group timeout)",
    ),
    "gone_after_s": (
        "--gone-after",
        positive_seconds,
        "seconds of silence after which a worker is gone (a killed one is found sooner)",
    ),
    "join_timeout_s": (
        "--join-timeout",
        positive_seconds,
        "seconds a round may take to form, e.g. waiting for joiners below --min-workers",
    ),
    "last_call_s": (
        "--last-call",
        seconds_or_zero,
        "seconds a round that has --min-workers waits for more",
    ),
    "keep_alive_s": ("--keep-alive", positive_seconds, "seconds between a worker's heartbeats"),
    "keep_alive_attempts": (
        "--keep-alive-attempts",
        _count,
        "missed heartbeats after which a worker counts as dead",
    ),
    "store_timeout_s": (
        "--store-timeout",
        positive_seconds,
        "seconds to reach the rendezvous store",
    ),
    "max_recoveries": (
        "--max-recoveries",
        _count,
        "rounds in a row that may fail to form before the worker gives up",
    ),
    "checkpoint": (
        "--checkpoint",
        str,
        "this worker writes its state here when the job stops for too few workers; a "
        "suspended job (SIGUSR1) is saved here, and resumes from here",
    ),
    "backend": ("--backend", _backend, "'gloo' (CPU) or 'nccl' (one GPU per worker)"),
    "gpu": (
        "--gpu",
        _index,
        "with --backend nccl: the visible GPU this worker uses (default: LOCAL_RANK, else "
        "SLURM_LOCALID, else the first)",
    ),
    "interface": (
        "--interface",
        _name,
        "the network interface the collectives use (default: GLOO_SOCKET_IFNAME, else the "
        "one that reaches the store)",
    ),
}

_METAVARS: dict[Callable[[str], Any], str] = {
    _count: "N",
    positive_seconds: "SECONDS",
    seconds_or_zero: "SECONDS",
    str: "FILE",
    _backend: "NAME",
    _index: "INDEX",
    _name: "NAME",
}


def add_job_arguments(
    parser: argparse.ArgumentParser, *options: str, required: bool = True, **defaults: Any
) -> None:
    """Adds ``--rdzv HOST:PORT`` and ``--job ID`` (both required, unless ``required`` is
    False: a script that runs elastically only when given them) to ``parser``, and a
    flag for each ElasticJob option named in ``options`` (with ElasticJob's default) or
    in ``defaults`` (with the given default), e.g.
    ``add_job_arguments(parser, "keep_alive_s", timeout_s=30.0, checkpoint=None)``.
    Options not named get no flag: ``job_from_args`` leaves them to ElasticJob's defaults
    or to the values the script fixes."""
    if not isinstance(parser, argparse.ArgumentParser):
        raise TypeError(f"parser must be an argparse.ArgumentParser, got {type(parser).__name__}")
    names = [*options, *defaults]
    unknown = [name for name in names if name not in _OPTIONS]
    if unknown:
        raise ValueError(
            f"options must be ElasticJob options ({', '.join(_OPTIONS)}), got {unknown}"
        )
    twice = sorted({name for name in options if options.count(name) > 1 or name in defaults})
    if twice:
        raise ValueError(f"options named twice: {twice}")
    signature = inspect.signature(ElasticJob.__init__).parameters
    parser.add_argument(
        "--rdzv",
        dest="rendezvous",
        required=required,
        type=_endpoint,
        metavar="HOST:PORT",
        help="the rendezvous store (python -m vflow rendezvous)",
    )
    parser.add_argument(
        "--job",
        dest="job_id",
        required=required,
        type=_job_id,
        metavar="ID",
        help="the job's id on that store; every worker of the job passes the same",
    )
    for name in names:
        flag, parse, text = _OPTIONS[name]
        default = defaults[name] if name in defaults else signature[name].default
        shown = "" if default is None else f" (default {default})"
        parser.add_argument(
            flag,
            dest=name,
            type=parse,
            default=default,
            metavar=_METAVARS[parse],
            help=text + shown,
        )
    parser.set_defaults(**{_ADDED: tuple(names)})


def job_from_args(args: argparse.Namespace, **fixed: Any) -> ElasticJob:
    """The ElasticJob of ``args`` (parsed by a parser that ``add_job_arguments`` set
    up): its rendezvous and job id, the options that have flags, and ``fixed``: options
    the script sets itself (e.g. ``max_workers=args.virtual_nodes``)."""
    flagged = getattr(args, _ADDED, None)
    if flagged is None:
        raise ValueError("args must come from a parser that vflow.elastic.add_job_arguments set up")
    both = sorted(set(flagged) & set(fixed))
    if both:
        raise ValueError(
            f"fixed options {both} also have flags ({', '.join(_OPTIONS[n][0] for n in both)}); "
            "give each option one source"
        )
    if getattr(args, "rendezvous", None) is None or getattr(args, "job_id", None) is None:
        raise ValueError("an elastic job needs both --rdzv and --job")
    options = {name: getattr(args, name) for name in flagged}
    return ElasticJob(args.rendezvous, args.job_id, **options, **fixed)
