"""The shard store: layout, reproducible bytes, integrity checks and partial reads."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest

from converge.data import store as store_module
from converge.data.store import (
    CorruptShardError,
    ShardStore,
    StoreError,
    atomic_write_bytes,
    package_versions,
    sha256_file,
)

N, SHARD = 7, 3  # shards [0, 3), [3, 6), [6, 7)


def header(**changes: Any) -> dict[str, Any]:
    base = {
        "app": "toy",
        "app_config": {"size": 3, "channels": (1, 2)},
        "simulate": {"samples": N, "seed": 1, "shard_size": SHARD, "retries": 2},
        "seed": 1,
        "n_samples": N,
        "shard_size": SHARD,
        "schema": {"x": {"shape": [3], "dtype": "float32"}, "label": {"shape": [], "dtype": "int64"}},
        "versions": package_versions(),
    }
    return base | changes


def shard_content(shard_id: int, failed: tuple[int, ...] = ()) -> dict[str, Any]:
    """Sample i holds x = [i, i + 0.5, i + 1], label = 10 i, parameter a = i / 10; ``failed`` ones are absent."""
    start = shard_id * SHARD
    members = range(start, min(start + SHARD, N))
    idx = np.array([i for i in members if i not in failed], dtype=np.int64)
    return {
        "arrays": {"x": (idx[:, None] + np.array([0, 0.5, 1])).astype(np.float32), "label": 10 * idx},
        "params": {"a": idx / 10},
        "indices": idx,
        "failures": [{"index": i, "error": "ValueError: bad", "params": {"a": i / 10}} for i in failed if i in members],
    }


def write_all(root: Path, order: tuple[int, ...] = (0, 1, 2), failed: tuple[int, ...] = ()) -> ShardStore:
    store = ShardStore.create_or_open(root, header())
    for shard_id in order:
        store.write_shard(shard_id, **shard_content(shard_id, failed))
    return store


def tree_bytes(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_round_trip_and_layout(tmp_path: Path) -> None:
    write_all(tmp_path, failed=(4,))
    store = ShardStore.open(tmp_path)
    assert sorted(p.name for p in (tmp_path / "shards").iterdir()) == [f"shard-0000{k}.h5" for k in range(3)]
    assert len(store) == N - 1
    data = store.load()
    np.testing.assert_array_equal(data["index"], [0, 1, 2, 3, 5, 6])
    np.testing.assert_array_equal(data["label"], 10 * data["index"])
    assert data["x"].dtype == np.float32 and data["x"].shape == (6, 3)
    np.testing.assert_array_equal(store.params()["a"], data["index"] / 10)
    assert store.failures() == [{"index": 4, "error": "ValueError: bad", "params": {"a": 0.4}}]
    with h5py.File(tmp_path / "shards" / "shard-00001.h5") as handle:  # plain HDF5, readable by any tool
        assert sorted(handle) == ["index", "label", "params", "x"] and list(handle["params"]) == ["a"]
        assert handle["x"].chunks is not None
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["shards"][1]["sha256"] == sha256_file(tmp_path / "shards" / "shard-00001.h5")
    assert manifest["shards"][1]["n_ok"] == 2 and manifest["n_shards"] == 3
    assert set(manifest["versions"]) >= {"converge", "numpy", "h5py", "torch"}


def test_partial_reads_touch_only_what_they_need(tmp_path: Path) -> None:
    store = write_all(tmp_path)
    (tmp_path / "shards" / "shard-00000.h5").write_bytes(b"damaged")  # a read that needed it would fail
    np.testing.assert_array_equal(store.load(["label"], shards=[2, 1])["label"], [30, 40, 50, 60])
    part = store.load(index_range=(4, 7))
    assert sorted(part) == ["index", "label", "x"]
    np.testing.assert_array_equal(part["index"], [4, 5, 6])
    np.testing.assert_array_equal(store.params(index_range=(5, 6))["a"], [0.5])
    with pytest.raises(KeyError, match="unknown array 'y'; this dataset has: label, x, index"):
        store.load(["y"])


def test_same_content_gives_the_same_bytes_in_any_write_order(tmp_path: Path) -> None:
    write_all(tmp_path / "a", order=(0, 1, 2))
    write_all(tmp_path / "b", order=(2, 0, 1))
    assert tree_bytes(tmp_path / "a") == tree_bytes(tmp_path / "b")


def test_a_shard_where_every_sample_failed_is_stored_empty(tmp_path: Path) -> None:
    store = write_all(tmp_path, failed=(6,))
    assert store.load(shards=[2])["x"].shape == (0, 3)
    assert store.params(shards=[2])["a"].shape == (0,)
    assert store.verify() == []


def test_corruption_and_loss_are_found_and_named(tmp_path: Path) -> None:
    store = write_all(tmp_path, order=(0, 1))
    problems = store.verify()
    assert len(problems) == 1 and "shard-00002.h5: never written" in problems[0]
    shard = tmp_path / "shards" / "shard-00001.h5"
    raw = bytearray(shard.read_bytes())
    raw[-1] ^= 1
    shard.write_bytes(bytes(raw))
    (tmp_path / "shards" / "shard-00000.h5").unlink()
    problems = ShardStore.open(tmp_path).verify()
    assert "shard-00000.h5: listed in the manifest but missing; `converge simulate --repair`" in problems[0]
    assert "shard-00001.h5: hash mismatch" in problems[1] and "`converge simulate --repair` recreates it" in problems[1]
    assert not store.is_complete(1)
    with pytest.raises(CorruptShardError, match=r"shard-00001\.h5: hash mismatch"):
        store.load(shards=[1])
    with pytest.raises(CorruptShardError, match=r"shard-00000\.h5: listed in the manifest but missing"):
        store.load(shards=[0])
    with pytest.raises(StoreError, match=r"shards \[2\] were never written"):
        store.load(shards=[2])


def test_open_says_what_is_wrong_with_the_directory(tmp_path: Path) -> None:
    with pytest.raises(StoreError, match="does not exist; make it with `converge simulate --out"):
        ShardStore.open(tmp_path / "nowhere")
    with pytest.raises(StoreError, match="has no manifest.json"):
        ShardStore.open(tmp_path)
    (tmp_path / "manifest.json").write_text("{not json")
    with pytest.raises(StoreError, match="manifest.json is not valid JSON"):
        ShardStore.open(tmp_path)
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "notes.txt").write_text("someone else's")
    with pytest.raises(StoreError, match="not empty and holds no manifest.json.*choose another --out"):
        ShardStore.create_or_open(tmp_path / "foreign", header())


def test_another_dataset_in_the_same_directory_is_refused(tmp_path: Path) -> None:
    write_all(tmp_path, order=(0,))
    with pytest.raises(StoreError, match=r"seed: stored 1, requested 2.*use another --out, or delete"):
        ShardStore.create_or_open(tmp_path, header(seed=2))
    schema = {"x": {"shape": [4], "dtype": "float32"}, "label": {"shape": [], "dtype": "int64"}}
    with pytest.raises(StoreError, match=r"schema: stored"):
        ShardStore.create_or_open(tmp_path, header(schema=schema))
    with pytest.warns(UserWarning, match="versions differ"):
        reopened = ShardStore.create_or_open(tmp_path, header(versions={"numpy": "0.0"}))
    assert reopened.manifest["versions"] == package_versions()  # the stored provenance stays


def test_write_shard_refuses_inconsistent_content(tmp_path: Path) -> None:
    store = ShardStore.create_or_open(tmp_path, header())
    content = shard_content(0)
    with pytest.raises(ValueError, match=r"cover \[0, 3\) exactly once"):
        store.write_shard(0, **(content | {"failures": [{"index": 1, "error": "E: x", "params": {}}]}))
    with pytest.raises(ValueError, match=r"array 'x' has shape \(3, 2\), expected \(3, 3\)"):
        store.write_shard(0, **(content | {"arrays": content["arrays"] | {"x": np.zeros((3, 2))}}))
    with pytest.raises(StoreError, match="opened read-only"):
        ShardStore.open(tmp_path).write_shard(0, **content)
    with pytest.raises(ValueError, match="'index' is reserved"):
        ShardStore.create_or_open(tmp_path / "other", header(schema={"index": {"shape": [], "dtype": "int64"}}))


def test_atomic_write_leaves_the_old_file_and_no_temp_file_on_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "f.bin"
    assert atomic_write_bytes(target, b"old") == store_module.sha256_bytes(b"old")

    def failing_fsync(fd: int) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(os, "fsync", failing_fsync)
    with pytest.raises(OSError, match="disk full"):
        atomic_write_bytes(target, b"new")
    assert target.read_bytes() == b"old" and [p.name for p in tmp_path.iterdir()] == ["f.bin"]


def test_reopening_removes_temp_files_a_crash_left(tmp_path: Path) -> None:
    write_all(tmp_path, order=(0,))
    (tmp_path / "shards" / ".shard-00001.h5.abc123.tmp").write_bytes(b"half a file")
    ShardStore.create_or_open(tmp_path, header())
    assert sorted(p.name for p in (tmp_path / "shards").iterdir()) == ["shard-00000.h5"]
