import pytest
import torch

CUDA = torch.cuda.is_available()

requires_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")


def devices() -> list[str]:
    """Devices a device-parametrised test runs on: always the CPU, CUDA when present."""
    return ["cpu", "cuda"] if CUDA else ["cpu"]


@pytest.fixture(autouse=True)
def _fixed_seed():
    torch.manual_seed(1234)
