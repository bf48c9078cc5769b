"""One worker of the elastic torch.compile test (tests/elastic/test_compile.py): the
dropout MLP of tests/support/compiled.py, compiled, trained by vflow.elastic.ElasticJob
in deterministic mode on a fixed sequence of global batches.

    python tests/support/compiled_elastic_worker.py --rdzv HOST:PORT --job ID
        --steps N --log FILE [--out FILE] [--workers K] [--sleep SECONDS]

Until the worker set has ``--workers`` workers, each step sleeps ``--sleep`` seconds
so that the others can join. The log gets one JSON line per committed step
({"step", "workers", "loss"}); the rank-0 worker writes ``--out`` at the end:
{"model", "optimizer", "step"}.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import torch

import vflow
from tests.support.compiled import batches, dropout_mlp, mean_ce
from tests.support.elastic_worker import save_final
from vflow import elastic

V, B, SEED = 6, 24, 3


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    # Generous timeouts: a newcomer compiles its model in its first step, which the
    # others wait for.
    elastic.add_job_arguments(parser, timeout_s=120.0, join_timeout_s=120.0, last_call_s=0.5)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--log", required=True)
    parser.add_argument("--out")
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--sleep", type=float, default=0.0)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    data = batches(args.steps, B)
    log = open(args.log, "a", buffering=1)

    def make_executor(group: Any, timeout: float) -> vflow.Executor:
        model = dropout_mlp()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        return vflow.Executor(
            torch.compile(model),
            optimizer,
            mean_ce,
            V,
            seed=SEED,
            process_group=group,
            timeout=timeout,
            deterministic=True,
        )

    def train_step(ex: vflow.Executor, step: int) -> vflow.StepResult:
        if ex.world_size < args.workers:
            time.sleep(args.sleep)
        result = ex.step(data[step])
        log.write(json.dumps({"step": step, "workers": ex.world_size, "loss": result.loss}) + "\n")
        return result

    job = elastic.job_from_args(args)
    ex = job.run(make_executor, train_step, args.steps)
    if ex is not None and args.out and ex.rank == 0:
        save_final(ex, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
