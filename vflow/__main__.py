"""Command line: ``python -m vflow <command> [options]``."""

from __future__ import annotations

import sys


def main(argv: list[str]) -> int:
    commands = {
        "demo": "train a small CNN on scikit-learn's digits with virtual nodes",
        "bench": "run the benchmark suite (quick by default) and summarise it",
    }
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in commands:
        print("usage: python -m vflow <command> [options]\n\ncommands:")
        for name, help_text in commands.items():
            print(f"  {name:<8}{help_text}")
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    if argv[0] == "bench":
        from vflow import bench

        return bench.main(argv[1:])
    from vflow import demo

    return demo.main(argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
