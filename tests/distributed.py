"""Run a function on N ranks of a Gloo process group on localhost, for tests.

Multi-rank behaviour (collectives, a rank failing mid-step) can only be tested with
real processes. The launcher is ``vflow.launch`` (shared with the demo and the
distributed benchmark); tests import it from here:

    results = run_ranks(world_size, fn, *args, timeout=120.0, collective_timeout=60.0,
                        expect_failure=False)

calls ``fn(rank, world_size, *args)`` on every rank (one torch thread each) and
returns a ``RankResult(rank, value, error)`` per rank; ``current_store()`` gives a rank
the rendezvous store. See ``vflow/launch.py`` for the guarantees (bounded waits,
results through files, a hung rank's stacks in the TimeoutError).
"""

from vflow.launch import RankError, RankResult, current_store, run_ranks

__all__ = ["RankError", "RankResult", "current_store", "run_ranks"]
