"""Search events: the challenge's event file, written atomically, and clustering in time.

An events file (MLGWSC-1 format) holds three equal-length datasets: ``time`` (GPS s of the
merger, geocentric), ``stat`` (ranking statistic, larger = more signal-like) and ``var`` (the
time tolerance [s] within which an injection counts as found). Searches here add optional
datasets (``slide``, ``far_per_month``, ``far_per_year``, ...) and attributes (``background_s``,
the settings); the challenge's ``evaluate.py`` reads only the three.
"""
from __future__ import annotations

import io
from pathlib import Path
from typing import Any, Mapping

import h5py
import numpy as np

from ...data.atomic import atomic_write_bytes

REQUIRED = ("time", "stat", "var")


def write_events(path: str | Path, columns: Mapping[str, np.ndarray], attrs: Mapping[str, Any] | None = None) -> str:
    """Write an events file atomically (HDF5 built in memory, then :func:`atomic_write_bytes`); returns its sha256.

    ``columns`` holds at least ``time``, ``stat`` and ``var``, all of one length.
    """
    missing = [k for k in REQUIRED if k not in columns]
    lengths = {k: len(np.asarray(v)) for k, v in columns.items()}
    if missing or len(set(lengths.values())) > 1:
        raise ValueError(f"events need {REQUIRED} of one length; missing {missing}, lengths {lengths}")
    buffer = io.BytesIO()
    with h5py.File(buffer, "w") as f:
        for name, values in columns.items():
            f.create_dataset(name, data=np.asarray(values, dtype=np.int64 if name == "slide" else np.float64))
        for key, value in (attrs or {}).items():
            f.attrs[key] = value
    return atomic_write_bytes(path, buffer.getvalue())


def read_events(path: str | Path) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """(columns, attributes) of an events file."""
    with h5py.File(path, "r") as f:
        missing = [k for k in REQUIRED if k not in f]
        if missing:
            raise ValueError(f"{path}: not an events file (no {', '.join(missing)})")
        return {k: f[k][()] for k in f}, dict(f.attrs)


def merge_backgrounds(paths: list[Path], out: Path) -> dict[str, Any]:
    """One background events file from several of the same search over the same data in groups of slides
    (``first_slide``): columns concatenated, ``background_s`` summed; a slide in two files is refused."""
    columns: dict[str, list[np.ndarray]] = {}
    attrs_all = []
    for path in paths:
        cols, attrs = read_events(path)
        if attrs.get("kind") != "background":
            raise ValueError(f"{path} is not a background (time-slide) events file")
        attrs_all.append(attrs)
        for name, values in cols.items():
            columns.setdefault(name, []).append(values)
    if len({str(a.get("method")) for a in attrs_all}) != 1:
        raise ValueError(f"{[str(p) for p in paths]}: backgrounds of different searches cannot be merged")
    spans = sorted((int(a["first_slide"]), int(a["first_slide"]) + int(a["slides"]) - 1) for a in attrs_all)
    if any(b[0] <= a[1] for a, b in zip(spans, spans[1:])):
        raise ValueError(f"slide groups {spans} overlap: the same slide would be counted twice")
    attrs = dict(attrs_all[0])
    attrs.update(background_s=float(sum(a["background_s"] for a in attrs_all)), slides=sum(b - a + 1 for a, b in spans),
                 first_slide=spans[0][0], merged_from=len(paths),
                 seconds=float(sum(a.get("seconds", 0.0) for a in attrs_all)))
    write_events(out, {k: np.concatenate(v) for k, v in columns.items()}, attrs)
    return attrs


def cluster_in_time(times: np.ndarray, stats: np.ndarray, gap: float) -> np.ndarray:
    """Cluster labels (0, 1, ...) of time-sorted points: a new cluster starts where the gap to the previous
    point exceeds ``gap`` seconds."""
    times = np.asarray(times, dtype=np.float64)
    if len(times) and np.any(np.diff(times) < 0):
        raise ValueError("cluster_in_time needs times sorted ascending")
    return np.concatenate([[0], np.cumsum(np.diff(times) > gap)]).astype(np.int64) if len(times) else \
        np.zeros(0, dtype=np.int64)


def loudest_per_cluster(labels: np.ndarray, stats: np.ndarray) -> np.ndarray:
    """Index of the largest ``stats`` in each cluster of ``labels`` (clusters in order)."""
    if len(labels) == 0:
        return np.zeros(0, dtype=np.int64)
    order = np.lexsort((-np.asarray(stats), labels))  # by label, loudest first
    first = np.concatenate([[True], np.diff(labels[order]) != 0])
    return order[first]


def keep_loudest_within(times: np.ndarray, stats: np.ndarray, window: float) -> np.ndarray:
    """Indices of the events that are the loudest within ``window`` s either side (PyCBC-style clustering
    of coincidences); ``times`` need not be sorted."""
    times, stats = np.asarray(times, dtype=np.float64), np.asarray(stats, dtype=np.float64)
    order = np.argsort(times, kind="stable")
    t, s = times[order], stats[order]
    keep = np.ones(len(t), dtype=bool)
    lo = np.searchsorted(t, t - window, side="left")
    hi = np.searchsorted(t, t + window, side="right")
    for i in range(len(t)):  # the number of events is small next to the data; a loop is clear here
        j = lo[i] + int(np.argmax(s[lo[i]:hi[i]]))
        keep[i] = j == i
    return np.sort(order[keep])
