"""The bytes of one shard file: HDF5, reproducible, chunked for partial reads.

A shard file holds one dataset per array of the app's schema, stacked over the
shard's successful samples (shape ``(n_ok,) + spec.shape``), ``index`` (their
global sample indices, int64, ascending) and one float64 dataset per parameter
under ``params/``. Equal inputs give equal bytes: file-format versions are pinned
and no times are tracked, so a shard's sha256 identifies its content.
"""
from __future__ import annotations

import io
from typing import Mapping

import h5py
import numpy as np

FORMAT_VERSION = 1  # of shard files and of the store manifest that lists them
CHUNK_BYTES = 1 << 20  # ~1 MiB chunks: large enough for fast reads, small enough for partial ones
RESERVED_NAMES = ("index", "params")  # datasets every shard has besides the schema's arrays


def encode_shard(
    shard_id: int,
    arrays: Mapping[str, np.ndarray],
    params: Mapping[str, np.ndarray],
    indices: np.ndarray,
) -> bytes:
    """The HDF5 bytes of one shard; equal inputs give equal bytes."""
    buffer = io.BytesIO()
    # Pinned file-format versions and untracked times make the bytes reproducible.
    with h5py.File(buffer, "w", libver=("earliest", "v110")) as handle:
        handle.attrs["shard"] = shard_id
        handle.attrs["format_version"] = FORMAT_VERSION
        _write_dataset(handle, "index", np.asarray(indices, dtype=np.int64))
        for name in sorted(arrays):
            _write_dataset(handle, name, arrays[name])
        group = handle.create_group("params")
        for name in sorted(params):
            _write_dataset(group, name, np.asarray(params[name], dtype=np.float64))
    return buffer.getvalue()


def _write_dataset(parent: h5py.Group, name: str, data: np.ndarray) -> None:
    row_bytes = max(1, int(np.prod(data.shape[1:], dtype=np.int64)) * data.dtype.itemsize)
    if len(data) == 0:  # a chunk may not exceed the data, so an empty dataset is made growable
        parent.create_dataset(
            name, shape=data.shape, dtype=data.dtype, chunks=(1,) + data.shape[1:],
            maxshape=(None,) + data.shape[1:], track_times=False,
        )
        return
    rows = min(len(data), max(1, CHUNK_BYTES // row_bytes))
    parent.create_dataset(name, data=data, chunks=(rows,) + data.shape[1:], track_times=False)
