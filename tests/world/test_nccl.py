"""NCCL's side of vflow.world on one GPU (Note [Interrupting an NCCL wait],
csrc/interrupt.cpp): what a survivor does when told that its set broke, on a group of
one rank, the most one GPU takes (NCCL refuses two ranks on one GPU). CPU machines,
CI's included, have no CUDA device to run it on; benchmarks/gpu_check.sh runs it."""

from __future__ import annotations

import datetime
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

from tests.support.cuda_marks import requires_cuda
from vflow._extension import _C
from vflow.world.group import CollectiveError, World

pytestmark = requires_cuda
TIMEOUT = datetime.timedelta(seconds=30)


@pytest.fixture
def nccl_group() -> Iterator[dist.ProcessGroup]:
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.new_group([0], backend="nccl", timeout=TIMEOUT)
    finally:
        dist.destroy_process_group()


def test_a_collective_on_one_rank_nccl_cuda(nccl_group: dist.ProcessGroup) -> None:
    values = torch.arange(4, dtype=torch.float32, device="cuda")
    _C.all_reduce_sum_(nccl_group, [values], None, TIMEOUT.total_seconds())
    assert values.tolist() == [0.0, 1.0, 2.0, 3.0]


def test_an_interrupted_nccl_world_is_aborted_and_its_next_wait_fails_cuda(
    nccl_group: dist.ProcessGroup,
) -> None:
    world = World(nccl_group, TIMEOUT)
    world.interrupt()
    assert _C.group_interrupted(nccl_group)
    values = torch.ones(4, device="cuda")
    with pytest.raises(RuntimeError):
        _C.all_reduce_sum_(nccl_group, [values], None, TIMEOUT.total_seconds())
    world.abort()  # once is enough: a second call does nothing
    with pytest.raises(CollectiveError, match="communicators were aborted"):
        world._run(lambda: None, "a collective after the abort", 3)
