"""Command line: ``python -m vflow <command> [options]``."""

from __future__ import annotations

import sys

COMMANDS = {
    "demo": "train a small CNN on scikit-learn's digits with virtual nodes",
    "bench": "kernel-throughput microbenchmarks (the full suite: benchmarks/run.py)",
    "rendezvous": "host the rendezvous store of elastic jobs (vflow.elastic)",
    "cluster": "schedule many elastic jobs on a cluster: simulate, run, generate (vflow.cluster)",
}


def usage() -> str:
    lines = ["usage: python -m vflow <command> [options]  (or --version)", "", "commands:"]
    lines += [f"  {name:<12}{help_text}" for name, help_text in COMMANDS.items()]
    lines += ["", "python -m vflow <command> --help shows a command's options."]
    return "\n".join(lines)


def version() -> str:
    import torch

    import vflow

    kernels = "CUDA and CPU kernels" if vflow._C.built_with_cuda() else "CPU kernels"
    return (
        f"vflow {vflow.__version__} (torch {torch.__version__}; extension built against "
        f"torch {vflow._C.torch_version}, {kernels})"
    )


def main(argv: list[str]) -> int:
    if not argv:
        print(usage(), file=sys.stderr)
        return 2
    command, rest = argv[0], argv[1:]
    if command in ("-h", "--help"):
        print(usage())
        return 0
    if command in ("-V", "--version"):
        print(version())
        return 0
    if command not in COMMANDS:
        print(f"{usage()}\n\npython -m vflow: error: unknown command {command!r}", file=sys.stderr)
        return 2
    if command == "bench":
        from vflow import bench

        return bench.main(rest)
    if command == "rendezvous":
        from vflow.elastic import server

        return server.main(rest)
    if command == "cluster":
        from vflow.cluster import cli

        return cli.main(rest)
    from vflow import demo

    return demo.main(rest)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
