"""vflow.mapping.batching: the split of a global batch into VNs."""

from collections import namedtuple

import pytest
import torch

from vflow.mapping.batching import batch_size, concat_outputs, slice_batch, split_sizes


@pytest.mark.parametrize(
    ("b", "v", "expected"),
    [(8, 8, [1] * 8), (8, 3, [3, 3, 2]), (17, 4, [5, 4, 4, 4]), (5, 1, [5]), (1, 1, [1])],
)
def test_split_sizes(b, v, expected):
    assert split_sizes(b, v) == expected
    assert sum(expected) == b and max(expected) - min(expected) <= 1


def test_split_sizes_rejects_fewer_samples_than_vns():
    with pytest.raises(ValueError, match="batch has 3 samples but virtual_nodes=4"):
        split_sizes(3, 4)


def test_nested_batches_slice_in_order():
    Pair = namedtuple("Pair", "a b")
    batch = {"x": torch.arange(10), "pair": Pair(torch.arange(10) * 2, [torch.ones(10, 2)])}
    assert batch_size(batch) == 10
    part = slice_batch(batch, 3, 7)
    assert part["x"].tolist() == [3, 4, 5, 6]
    assert isinstance(part["pair"], Pair) and part["pair"].a.tolist() == [6, 8, 10, 12]
    assert part["pair"].b[0].shape == (4, 2)


def test_batch_size_errors_name_the_member():
    with pytest.raises(ValueError, match=r"batch\['y'\] has 9 samples in dim 0 but batch\['x'\]"):
        batch_size({"x": torch.zeros(10), "y": torch.zeros(9)})
    with pytest.raises(TypeError, match=r"batch\[1\] is a str"):
        batch_size((torch.zeros(3), "labels"))
    with pytest.raises(ValueError, match=r"batch\[0\] is a 0-dim tensor"):
        batch_size((torch.tensor(1.0),))
    with pytest.raises(ValueError, match="batch holds no tensors"):
        batch_size(())


def test_concat_outputs_keeps_structure():
    outs = [{"logits": torch.ones(2, 3) * i, "aux": (torch.ones(2) * i,)} for i in range(3)]
    cat = concat_outputs(outs)
    assert cat["logits"].shape == (6, 3) and cat["aux"][0].tolist() == [0, 0, 1, 1, 2, 2]
    with pytest.raises(ValueError, match="0-dim tensor"):
        concat_outputs([torch.tensor(1.0), torch.tensor(2.0)])
