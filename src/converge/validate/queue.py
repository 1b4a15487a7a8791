"""The fallback queue as training data: ``converge learn APP --from-queue QUEUE --out DATASET``.

Trust-gated serving (:mod:`converge.serve.fallback`) keeps every simulator answer
it gave in place of the surrogate as one ``.npz`` per request: the inputs and the
simulator's outputs under the names of the app's stored samples. These are the
inputs the surrogate was least sure of, labelled at the simulator's level, which
is what active learning would have asked for. This module stacks them, in file
order, into an ordinary shard store (manifest, hashes, provenance), so the usual
``converge train --data DATASET`` retrains on them.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from ..config import from_dict
from ..data.store import ShardStore, sha256_file
from ..simulate.runner import SimulateConfig, dataset_header


class QueueError(ValueError):
    """The queue folder is empty, or its files disagree with each other or with the app."""


def read_queue(queue_dir: Path) -> tuple[list[Path], dict[str, Any], dict[str, list[np.ndarray]]]:
    """The queue's files (by name: time order), their common meta, and their arrays by name."""
    files = sorted(p for p in Path(queue_dir).glob("*.npz") if not p.name.startswith("."))
    if not files:
        raise QueueError(f"{queue_dir}: no queued samples (*.npz written by `converge serve --fallback-queue`)")
    meta: dict[str, Any] | None = None
    arrays: dict[str, list[np.ndarray]] = {}
    for path in files:
        with np.load(path) as f:
            this = json.loads(str(f["meta"]))
            if meta is not None and (this["app"], this["app_config"]) != (meta["app"], meta["app_config"]):
                raise QueueError(f"{path} was served by another app or config than {files[0].name}; "
                                 "queue each model into its own folder")
            meta = meta or this
            for name in f.files:
                if name not in ("meta", "reasons"):
                    arrays.setdefault(name, []).append(f[name])
    return files, meta or {}, arrays


def queue_to_dataset(app: Any, queue_dir: str | Path, out_dir: str | Path, shard_size: int = 256) -> ShardStore:
    """Write the queued simulator answers as a shard store at ``out_dir`` (refused if it exists)."""
    files, meta, parts = read_queue(Path(queue_dir))
    if meta["app"] != app.name:
        raise QueueError(f"{queue_dir} holds {meta['app']!r} samples, not {app.name!r}")
    cfg = from_dict(app.config_cls, meta["app_config"], "app")
    schema = app.schema(cfg)
    missing = sorted(set(schema) - set(parts))
    if missing:
        raise QueueError(f"{queue_dir}: queued files lack {', '.join(missing)}, needed by the {app.name} dataset")
    arrays = {name: np.concatenate(parts[name]).astype(spec.dtype, copy=False) for name, spec in schema.items()}
    n = len(next(iter(arrays.values())))
    if Path(out_dir).exists():
        raise QueueError(f"{out_dir} exists; give a new --out for the queue's dataset")
    header = dataset_header(app, cfg, SimulateConfig(samples=n, seed=0, shard_size=min(shard_size, n)), schema)
    header["simulate"]["origin"] = {"fallback_queue": str(queue_dir),  # where the samples came from
                                    "files": {p.name: sha256_file(p) for p in files}}
    store = ShardStore.create_or_open(out_dir, header)
    for k in range(store.n_shards):
        rows = store.shard_range(k)
        store.write_shard(k, {name: a[rows.start:rows.stop] for name, a in arrays.items()}, {}, list(rows), [])
    return store
