"""ArraySource and the seeded split: reproducible, disjoint, complete."""
import numpy as np
import pytest
import torch

from converge.data.sources import ArraySource, split_indices


def test_split_is_seeded_disjoint_and_complete():
    tr, va = split_indices(100, 0.2, seed=3)
    assert len(va) == 20 and len(tr) == 80 and not set(tr) & set(va)
    assert np.array_equal(np.sort(np.concatenate([tr, va])), np.arange(100))
    assert np.array_equal(split_indices(100, 0.2, seed=3)[1], va)
    assert not np.array_equal(split_indices(100, 0.2, seed=4)[1], va)
    with pytest.raises(ValueError, match="too few"):
        split_indices(1, 0.2, 0)


def test_epochs_reshuffle_ranks_partition():
    src = ArraySource({"x": torch.arange(10), "y": torch.arange(10) * 2}, seed=1)
    e0 = torch.cat([b["x"] for b in src.batches(0, 3)])
    e1 = torch.cat([b["x"] for b in src.batches(1, 3)])
    assert sorted(e0.tolist()) == list(range(10)) and not torch.equal(e0, e1)
    assert torch.equal(e0, torch.cat([b["x"] for b in src.batches(0, 3)]))
    b = next(src.batches(0, 4))
    assert torch.equal(b["y"], b["x"] * 2)
    r0 = torch.cat([b["x"] for b in src.batches(0, 3, rank=0, world=2)])
    r1 = torch.cat([b["x"] for b in src.batches(0, 3, rank=1, world=2)])
    assert sorted(torch.cat([r0, r1]).tolist()) == list(range(10))


def test_unequal_lengths_are_refused():
    with pytest.raises(ValueError, match="equal lengths"):
        ArraySource({"a": torch.zeros(3), "b": torch.zeros(4)}, seed=0)
