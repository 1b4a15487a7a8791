"""Follow a dataset while its ensemble is still being written (in-situ training).

``converge train --follow DATASET`` starts as soon as the first shards land and
takes in every shard written since, at each epoch start. Shards are written
atomically and recorded in the manifest only when complete, so a reader never
sees half a shard; each one read is checked against its hash.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

import numpy as np

from .store import ShardStore, StoreError


class FollowTimeout(TimeoutError):
    """No (or not enough) data appeared in the followed dataset in time."""


class DatasetFollower:
    """The written shards of a growing :class:`ShardStore`, re-read when more are written.

    ``refresh()`` returns all arrays stored so far when shards were added since
    the last call, else None; ``complete`` says whether the ensemble has finished.
    """

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.shards_seen: tuple[int, ...] = ()
        self.store = ShardStore.open(self.root)

    @property
    def planned_samples(self) -> int:
        """Samples the ensemble will hold when done (failures aside)."""
        return self.store.n_samples

    @property
    def complete(self) -> bool:
        return not self.store.missing_shards()

    def written(self) -> tuple[int, ...]:
        self.store = ShardStore.open(self.root)  # the writer replaces the manifest atomically
        return tuple(k for k, entry in enumerate(self.store.manifest["shards"]) if entry is not None)

    def refresh(self) -> dict[str, np.ndarray] | None:
        shards = self.written()
        if shards == self.shards_seen:
            return None
        self.shards_seen = shards
        return self.store.load(shards=shards)

    @classmethod
    def wait(cls, root: str | Path, min_samples: int = 2, timeout_s: float = 3600.0, poll_s: float = 5.0,
             report: Callable[[str], None] | None = None) -> DatasetFollower:
        """Block until ``root`` is a dataset with at least ``min_samples`` stored samples."""
        deadline, said = time.monotonic() + timeout_s, ""
        while True:
            try:
                follower = cls(root)
                n = len(follower.store)
                status = f"{root}: {n} of {follower.planned_samples} samples stored"
                if n >= min(min_samples, follower.planned_samples):
                    return follower
            except StoreError:
                status = f"{root}: no dataset yet (waiting for `converge simulate --out {root}`)"
            if report and status != said:
                report(f"waiting for data: {status}")
                said = status
            if time.monotonic() > deadline:
                raise FollowTimeout(f"{status} after {timeout_s:.0f} s; is the ensemble running?")
            time.sleep(poll_s)
