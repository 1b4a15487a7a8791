"""A chunked, resumable shard store with provenance.

Layout of a store directory ``DIR``::

    DIR/manifest.json            what made the data, and one entry per shard
    DIR/shards/shard-00000.h5    samples [0, shard_size)
    DIR/shards/shard-00001.h5    samples [shard_size, 2 * shard_size) ...

A shard file holds one dataset per array of the app's schema, stacked over the
shard's successful samples (shape ``(n_ok,) + spec.shape``), ``index`` (their
global sample indices, int64, ascending) and one float64 dataset per parameter
under ``params/`` (see :mod:`converge.data.shard_file`). Samples that failed are
absent from the file and listed, with their error and parameters, in the shard's
manifest entry.

Files are written atomically (temp file -> fsync -> re-read and hash -> rename;
see :mod:`converge.data.atomic`), and the same content always gives the same
bytes (no timestamps anywhere), so a run that was interrupted and resumed leaves
exactly the files of one that was not.
The manifest records each shard's sha256; every read checks it. One process
writes a store at a time.
"""
from __future__ import annotations

import io
import json
import math
import warnings
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import h5py
import numpy as np

from .atomic import TEMP_SUFFIX, atomic_write_bytes, json_bytes, json_round_trip, sha256_bytes, sha256_file
from .shard_file import FORMAT_VERSION, RESERVED_NAMES, encode_shard
# Defined in .shard_file; still importable from here, where it was first.
from .shard_file import CHUNK_BYTES  # noqa: F401

MANIFEST = "manifest.json"
SHARD_DIR = "shards"
# Keys that define the data: a store holding different values cannot be resumed.
IDENTITY_KEYS = ("app", "app_config", "seed", "n_samples", "shard_size", "schema")
HEADER_KEYS = IDENTITY_KEYS + ("simulate", "versions")
BASE_PACKAGES = ("converge", "numpy", "h5py", "torch")


class StoreError(RuntimeError):
    """A store directory is missing, foreign, or made with other settings."""


class CorruptShardError(StoreError):
    """A shard file is missing or its bytes do not match the manifest's hash."""


# -- provenance -------------------------------------------------------------------
def package_versions(extra: Iterable[str] = ()) -> dict[str, str]:
    """Installed versions of converge, numpy, h5py, torch and ``extra`` distributions."""
    out = {}
    for name in (*BASE_PACKAGES, *extra):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = "not installed"
    return out


def schema_to_json(schema: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """``{name: ArraySpec}`` as ``{name: {"shape": [...], "dtype": "float32"}}``."""
    return {
        name: {"shape": [int(d) for d in spec.shape], "dtype": np.dtype(spec.dtype).name}
        for name, spec in schema.items()
    }


# -- shard files ------------------------------------------------------------------
def shard_file_name(shard_id: int) -> str:
    return f"{SHARD_DIR}/shard-{shard_id:05d}.h5"


# -- the store --------------------------------------------------------------------
class ShardStore:
    """A directory of shard files plus the manifest that describes them.

    Make one with :meth:`create_or_open` (to write) or :meth:`open` (to read).
    """

    def __init__(self, root: Path, manifest: dict[str, Any], writable: bool = False) -> None:
        self.root = root
        self.manifest = manifest
        self.writable = writable

    # -- construction ---------------------------------------------------------------
    @classmethod
    def create_or_open(cls, root: str | Path, header: Mapping[str, Any]) -> ShardStore:
        """Open the store at ``root`` for writing, creating it if needed.

        ``header`` holds ``app``, ``app_config``, ``simulate``, ``seed``,
        ``n_samples``, ``shard_size``, ``schema`` (see :func:`schema_to_json`) and
        ``versions``. An existing store must agree on all but ``simulate`` and
        ``versions`` (those differing only warn), and ``n_samples``, which may
        grow: sample ``i`` draws from ``[seed, i]`` whatever the total, so the
        written shards stay and only the new samples are computed (a short last
        shard is recomputed at its full size).
        """
        root = Path(root)
        header = _check_header(header)
        if (root / MANIFEST).exists():
            store = cls.open(root)
            if _only_grows(store.manifest, header):
                store._grow(int(header["n_samples"]), header.get("simulate"))
            _compare_headers(store.manifest, header, root)
            store.writable = True
            store._remove_stale_temps()
            return store
        if root.exists() and any(root.iterdir()):
            raise StoreError(
                f"{root} exists, is not empty and holds no {MANIFEST}, so it is not a converge "
                "dataset; choose another --out or empty it"
            )
        n_shards = math.ceil(header["n_samples"] / header["shard_size"])
        manifest = {**header, "format_version": FORMAT_VERSION, "n_shards": n_shards, "shards": [None] * n_shards}
        (root / SHARD_DIR).mkdir(parents=True, exist_ok=True)
        store = cls(root, manifest, writable=True)
        store._write_manifest()
        return store

    @classmethod
    def open(cls, root: str | Path) -> ShardStore:
        """Open an existing store to read it."""
        root = Path(root)
        if not root.is_dir():
            raise StoreError(f"dataset {root} does not exist; make it with `converge simulate --out {root}`")
        path = root / MANIFEST
        if not path.is_file():
            raise StoreError(f"{root} has no {MANIFEST}: it is not a dataset made by `converge simulate --out`")
        try:
            manifest = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise StoreError(f"{path} is not valid JSON ({err}); delete {root} and simulate it afresh") from None
        found = manifest.get("format_version") if isinstance(manifest, dict) else None
        if found != FORMAT_VERSION:
            raise StoreError(f"{path}: format_version {found!r}, not {FORMAT_VERSION}; use the converge that wrote it")
        return cls(root, manifest, writable=False)

    # -- description ----------------------------------------------------------------
    @property
    def n_shards(self) -> int:
        return int(self.manifest["n_shards"])

    @property
    def shard_size(self) -> int:
        return int(self.manifest["shard_size"])

    @property
    def n_samples(self) -> int:
        return int(self.manifest["n_samples"])

    @property
    def schema(self) -> dict[str, dict[str, Any]]:
        return self.manifest["schema"]

    def shard_range(self, shard_id: int) -> range:
        """Global sample indices that belong to shard ``shard_id``."""
        self._check_shard_id(shard_id)
        start = shard_id * self.shard_size
        return range(start, min(start + self.shard_size, self.n_samples))

    def shard_path(self, shard_id: int) -> Path:
        return self.root / shard_file_name(shard_id)

    def missing_shards(self) -> list[int]:
        return [k for k, entry in enumerate(self.manifest["shards"]) if entry is None]

    def __len__(self) -> int:
        return sum(entry["n_ok"] for entry in self.manifest["shards"] if entry is not None)

    def failures(self) -> list[dict[str, Any]]:
        """Failed samples of all written shards, by index: ``{index, error, params}``."""
        return [f for entry in self.manifest["shards"] if entry is not None for f in entry["failures"]]

    # -- integrity ------------------------------------------------------------------
    def shard_problem(self, shard_id: int) -> str | None:
        """Why shard ``shard_id`` is not complete, or None if it is."""
        entry = self.manifest["shards"][shard_id]
        path = self.shard_path(shard_id)
        if entry is None:
            return f"{path}: never written (the run stopped early); rerun `converge simulate` with this --out"
        if not path.is_file():
            return _missing_message(path)
        if sha256_file(path) != entry["sha256"]:
            return _corrupt_message(path)
        return None

    def is_complete(self, shard_id: int) -> bool:
        """Whether the shard was written and its file still has the recorded hash."""
        return self.shard_problem(shard_id) is None

    def verify(self) -> list[str]:
        """Every problem found (empty when the store is complete and intact)."""
        return [p for k in range(self.n_shards) if (p := self.shard_problem(k)) is not None]

    # -- writing --------------------------------------------------------------------
    def write_shard(
        self,
        shard_id: int,
        arrays: Mapping[str, np.ndarray],
        params: Mapping[str, np.ndarray],
        indices: Sequence[int] | np.ndarray,
        failures: Sequence[Mapping[str, Any]],
    ) -> None:
        """Write one shard atomically, then record it (with its hash) in the manifest.

        ``arrays`` are stacked over the successful samples ``indices`` (ascending);
        ``failures`` list the others as ``{index, error, params}``; together they
        must cover the shard's range exactly.
        """
        if not self.writable:
            raise StoreError(f"{self.root} was opened read-only; use ShardStore.create_or_open to write")
        indices = np.asarray(indices, dtype=np.int64).reshape(-1)
        failures = sorted(
            ({"index": int(f["index"]), "error": str(f["error"]),
              "params": {str(k): float(v) for k, v in (f.get("params") or {}).items()}} for f in failures),
            key=lambda f: f["index"],
        )
        self._check_coverage(shard_id, indices, [f["index"] for f in failures])
        arrays = self._check_arrays(arrays, len(indices))
        params = {str(k): np.asarray(v, dtype=np.float64).reshape(-1) for k, v in params.items()}
        for name, values in params.items():
            if len(values) != len(indices) or "/" in name:
                raise ValueError(f"shard {shard_id}: parameter {name!r} needs one value per stored sample and no '/'")
        data = encode_shard(shard_id, arrays, params, indices)
        digest = atomic_write_bytes(self.shard_path(shard_id), data)
        self.manifest["shards"][shard_id] = {
            "file": shard_file_name(shard_id), "n_ok": int(len(indices)), "sha256": digest, "failures": failures,
        }
        self._write_manifest()

    def _check_coverage(self, shard_id: int, indices: np.ndarray, failed: list[int]) -> None:
        expected = list(self.shard_range(shard_id))
        if np.any(np.diff(indices) <= 0):
            raise ValueError(f"shard {shard_id}: indices must be strictly ascending")
        if sorted(indices.tolist() + failed) != expected:
            raise ValueError(
                f"shard {shard_id}: stored indices and failures must together cover "
                f"[{expected[0]}, {expected[-1] + 1}) exactly once"
            )

    def _check_arrays(self, arrays: Mapping[str, np.ndarray], n: int) -> dict[str, np.ndarray]:
        if set(arrays) != set(self.schema):
            raise ValueError(f"arrays {sorted(arrays)} do not match the schema's {sorted(self.schema)}")
        out = {}
        for name, spec in self.schema.items():
            value = np.asarray(arrays[name])
            if value.shape != (n, *spec["shape"]):
                raise ValueError(f"array {name!r} has shape {value.shape}, expected {(n, *spec['shape'])}")
            out[name] = value.astype(spec["dtype"], copy=False)
        return out

    def _grow(self, n_samples: int, simulate: Mapping[str, Any] | None) -> None:
        """Extend the manifest to ``n_samples`` samples (and ``simulate``'s count); the new shards are unwritten."""
        old_shards = self.manifest["shards"]
        if self.n_samples % self.shard_size and old_shards[-1] is not None:
            old_shards[-1] = None  # its range grows with the total, so it is computed again
        n_shards = math.ceil(n_samples / self.shard_size)
        self.manifest.update(n_samples=n_samples, n_shards=n_shards,
                             shards=old_shards + [None] * (n_shards - len(old_shards)))
        if isinstance(self.manifest.get("simulate"), dict) and simulate and "samples" in simulate:
            self.manifest["simulate"]["samples"] = simulate["samples"]
        self._write_manifest()

    def _write_manifest(self) -> None:
        atomic_write_bytes(self.root / MANIFEST, json_bytes(self.manifest))

    def _remove_stale_temps(self) -> None:
        """Delete temp files a crashed write left behind (only ours: ``.NAME.*.tmp``)."""
        for directory in (self.root, self.root / SHARD_DIR):
            for path in directory.glob(f".*{TEMP_SUFFIX}"):
                path.unlink(missing_ok=True)

    # -- reading --------------------------------------------------------------------
    def load(
        self,
        names: Iterable[str] | None = None,
        *,
        shards: Iterable[int] | None = None,
        index_range: tuple[int, int] | None = None,
        verify: bool = True,
    ) -> dict[str, np.ndarray]:
        """Arrays concatenated over shards in order, plus ``index``.

        ``names`` picks arrays (default: all of the schema, and ``index``);
        ``shards`` picks shard ids; ``index_range=(start, stop)`` keeps the
        stored samples with start <= index < stop, reading only the shards and
        rows it touches. Each shard read is checked against its hash first.
        """
        known = [*self.schema, "index"]
        wanted = list(known if names is None else names)
        unknown = [n for n in wanted if n not in known]
        if unknown:
            raise KeyError(f"unknown array {unknown[0]!r}; this dataset has: {', '.join(known)}")
        parts = self._read_parts(shards, index_range, verify, lambda h, lo, hi: {n: h[n][lo:hi] for n in wanted})
        return {n: np.concatenate([p[n] for p in parts]) if parts else self._empty(n) for n in wanted}

    def params(
        self,
        *,
        shards: Iterable[int] | None = None,
        index_range: tuple[int, int] | None = None,
        verify: bool = True,
    ) -> dict[str, np.ndarray]:
        """Parameters of the stored samples (aligned with :meth:`load`), float64.

        A parameter that some samples lack is NaN for them.
        """
        def read(handle: h5py.File, lo: int, hi: int) -> dict[str, Any]:
            return {"n": hi - lo, "params": {n: handle["params"][n][lo:hi] for n in handle["params"]}}

        parts = self._read_parts(shards, index_range, verify, read)
        names = sorted({n for part in parts for n in part["params"]})
        return {
            n: np.concatenate([p["params"].get(n, np.full(p["n"], np.nan)) for p in parts]) for n in names
        }

    def _read_parts(
        self,
        shards: Iterable[int] | None,
        index_range: tuple[int, int] | None,
        verify: bool,
        read: Callable[[h5py.File, int, int], dict[str, Any]],
    ) -> list[dict[str, Any]]:
        selected = self._select_shards(shards, index_range)
        parts = []
        for shard_id in selected:
            with self._open_shard(shard_id, verify) as handle:
                index = handle["index"][:]
                lo, hi = 0, len(index)
                if index_range is not None:
                    lo, hi = (int(i) for i in np.searchsorted(index, index_range))
                parts.append(read(handle, lo, hi))
        return parts

    def _select_shards(self, shards: Iterable[int] | None, index_range: tuple[int, int] | None) -> list[int]:
        selected = list(range(self.n_shards)) if shards is None else sorted(set(shards))
        for shard_id in selected:
            self._check_shard_id(shard_id)
        if index_range is not None:
            start, stop = index_range
            selected = [k for k in selected if self.shard_range(k).start < stop and self.shard_range(k).stop > start]
        missing = [k for k in selected if self.manifest["shards"][k] is None]
        if missing:
            raise StoreError(
                f"{self.root}: shards {missing} were never written; rerun `converge simulate` with this --out to finish"
            )
        return selected

    def _open_shard(self, shard_id: int, verify: bool) -> h5py.File:
        path = self.shard_path(shard_id)
        if not path.is_file():
            raise CorruptShardError(_missing_message(path))
        if not verify:
            return h5py.File(path, "r")
        data = path.read_bytes()  # hash and parse the same bytes, so nothing can change in between
        if sha256_bytes(data) != self.manifest["shards"][shard_id]["sha256"]:
            raise CorruptShardError(_corrupt_message(path))
        return h5py.File(io.BytesIO(data), "r")

    def _empty(self, name: str) -> np.ndarray:
        if name == "index":
            return np.empty(0, dtype=np.int64)
        spec = self.schema[name]
        return np.empty((0, *spec["shape"]), dtype=spec["dtype"])

    def _check_shard_id(self, shard_id: int) -> None:
        if not 0 <= shard_id < self.n_shards:
            raise IndexError(f"shard {shard_id} does not exist; this dataset has shards 0..{self.n_shards - 1}")


def _missing_message(path: Path) -> str:
    return f"{path}: listed in the manifest but missing; `converge simulate --repair` recreates it"


def _corrupt_message(path: Path) -> str:
    return f"{path}: hash mismatch, the file is corrupt; `converge simulate --repair` recreates it"


def _check_header(header: Mapping[str, Any]) -> dict[str, Any]:
    missing = [k for k in HEADER_KEYS if k not in header]
    if missing:
        raise ValueError(f"store header lacks {missing}; it needs {list(HEADER_KEYS)}")
    header = json_round_trip({k: header[k] for k in HEADER_KEYS})
    if header["n_samples"] < 1 or header["shard_size"] < 1:
        raise ValueError("store header: n_samples and shard_size must be >= 1")
    clash = [n for n in header["schema"] if n in RESERVED_NAMES or "/" in n]
    if clash:
        raise ValueError(f"schema array name {clash[0]!r} is reserved or holds '/'; rename it in the app's schema()")
    return header


def _only_grows(stored: Mapping[str, Any], header: Mapping[str, Any]) -> bool:
    """Whether ``header`` asks for more samples of the stored dataset and nothing else."""
    differ = [k for k in IDENTITY_KEYS if stored.get(k) != header[k]]
    return differ == ["n_samples"] and int(header["n_samples"]) > int(stored["n_samples"])


def _compare_headers(stored: Mapping[str, Any], header: Mapping[str, Any], root: Path) -> None:
    differ = [k for k in IDENTITY_KEYS if stored.get(k) != header[k]]
    if differ:
        detail = "; ".join(f"{k}: stored {stored.get(k)!r}, requested {header[k]!r}" for k in differ)
        fewer = " (a dataset can grow, never shrink)" if differ == ["n_samples"] else ""
        raise StoreError(
            f"{root} holds a dataset made with other settings ({detail}){fewer}; "
            f"use another --out, or delete {root} to start over"
        )
    for key in ("simulate", "versions"):
        if stored.get(key) != header[key]:
            warnings.warn(
                f"{root}: resuming a dataset whose {key} differ (stored {stored.get(key)}, now {header[key]}); "
                "the manifest keeps the stored values",
                stacklevel=3,
            )
