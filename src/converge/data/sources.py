"""Batch sources over stored arrays, reproducible per (seed, epoch, rank).

:class:`ArraySource` serves apps whose training samples are the stored arrays
themselves (the chem app's conformers); apps that draw cheap randomness per
batch (the gw app's fresh noise) write their own source on the same contract
(:class:`converge.contract.BatchSource`).
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Iterator, Mapping

import numpy as np
import torch


def stream_seed(*parts: int) -> int:
    """A 63-bit seed from integers, stable across processes and platforms."""
    digest = hashlib.sha256(np.asarray(parts, dtype=np.int64).tobytes()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def split_indices(n: int, val_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(train, validation) index arrays: a seeded random split with at least one of each."""
    if n < 2:
        raise ValueError(f"{n} stored sample(s) are too few to split off a validation set")
    perm = np.random.default_rng(stream_seed(seed, 7)).permutation(n)
    n_val = min(max(1, int(round(val_fraction * n))), n - 1)
    return np.sort(perm[n_val:]), np.sort(perm[:n_val])


@dataclass
class ArraySource:
    """Batches of rows of ``arrays`` (equal leading lengths), reshuffled every epoch."""

    arrays: Mapping[str, torch.Tensor]
    seed: int
    shuffle: bool = True

    def __post_init__(self) -> None:
        lengths = {k: len(v) for k, v in self.arrays.items()}
        if len(set(lengths.values())) != 1:
            raise ValueError(f"arrays of a source must have equal lengths, got {lengths}")

    def __len__(self) -> int:
        return len(next(iter(self.arrays.values())))

    def batches(self, epoch: int, batch_size: int, rank: int = 0, world: int = 1) -> Iterator[dict[str, torch.Tensor]]:
        if self.shuffle:
            order = torch.randperm(len(self), generator=torch.Generator().manual_seed(stream_seed(self.seed, epoch)))
        else:
            order = torch.arange(len(self))
        order = order[rank::world]
        for start in range(0, len(order), batch_size):
            idx = order[start : start + batch_size]
            yield {k: v[idx] for k, v in self.arrays.items()}
