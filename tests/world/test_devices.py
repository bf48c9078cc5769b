"""vflow.world.devices.local_gpu: the GPU a worker uses from what its launcher said
(Note [A worker's GPU]). Pure: the environment and the visible count are given."""

from __future__ import annotations

import pytest

from vflow.world.devices import local_gpu


@pytest.mark.parametrize(
    ("environ", "visible", "gpu"),
    [
        ({}, 1, 0),  # one worker per machine
        ({}, 4, 0),
        ({"LOCAL_RANK": "3"}, 4, 3),  # torchrun: the node's GPUs, one per process
        ({"SLURM_LOCALID": "2", "CUDA_VISIBLE_DEVICES": "0,1,2,3"}, 4, 2),  # shared
        ({"SLURM_LOCALID": "3", "CUDA_VISIBLE_DEVICES": "5"}, 1, 0),  # its own GPU
        ({"SLURM_LOCALID": "3", "CUDA_VISIBLE_DEVICES": "4,5"}, 2, 0),  # its own two
        ({"LOCAL_RANK": "1", "SLURM_LOCALID": "0"}, 2, 1),  # torchrun under srun
        ({"LOCAL_RANK": ""}, 2, 0),
    ],
)
def test_the_launchers_index_chooses_the_gpu(
    environ: dict[str, str], visible: int, gpu: int
) -> None:
    assert local_gpu(environ, visible) == gpu


@pytest.mark.parametrize(
    ("environ", "visible", "error", "message"),
    [
        ({}, 0, RuntimeError, "no GPU is visible to this process \\(all of them\\)"),
        (
            {"CUDA_VISIBLE_DEVICES": ""},
            0,
            RuntimeError,
            "no GPU is visible to this process \\(CUDA_VISIBLE_DEVICES=''\\)",
        ),
        # Two torchrun processes on one GPU would fail later, in NCCL.
        ({"LOCAL_RANK": "2"}, 2, ValueError, "LOCAL_RANK=2 names no GPU of this worker's own: 2"),
        (
            {"LOCAL_RANK": "1", "CUDA_VISIBLE_DEVICES": "0"},
            1,
            ValueError,
            "LOCAL_RANK=1 names no GPU",
        ),
        ({"SLURM_LOCALID": "1"}, 1, ValueError, "SLURM_LOCALID=1 names no GPU"),
        ({"LOCAL_RANK": "x"}, 1, ValueError, "LOCAL_RANK must be an int >= 0, got 'x'"),
        ({"SLURM_LOCALID": "-1"}, 1, ValueError, "SLURM_LOCALID must be an int >= 0"),
    ],
)
def test_an_index_without_a_gpu_of_its_own_is_an_error_naming_it(
    environ: dict[str, str], visible: int, error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        local_gpu(environ, visible)
