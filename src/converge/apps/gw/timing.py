"""Honest merger times: a search's timing bias and tolerance, measured on injections.

A search reports each event's merger time and a tolerance ``var``; the challenge counts an
injection as found by an event within ``var`` of its geocentric ``tc``. Measured here: for
each injection, the loudest event within ``window`` s whose statistic reaches ``stat_floor``
(loud enough not to be a nearby noise event), and its error ``e = t_event - tc``. The bias is
the median error, the tolerance the ``quantile`` (default 99%) of ``|e - bias|``, rounded up to
the millisecond. The search then subtracts the bias and writes the tolerance as ``var``
(``timing.json`` in a CNN run, or any file passed with ``--timing``). Measure on injections
never used for testing (another seed of the challenge's generator).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from ...data.atomic import atomic_write_bytes, json_bytes

TIMING_FILE = "timing.json"
MIN_FOUND = 20  # injections needed for a tolerance at all


def match_injections(event_times: np.ndarray, event_stats: np.ndarray, injection_times: np.ndarray,
                     window: float, stat_floor: float = -np.inf) -> tuple[np.ndarray, np.ndarray]:
    """(injection indices, errors ``t_event - tc`` [s]) for injections with a qualifying event (module doc)."""
    order = np.argsort(event_times)
    t, s = np.asarray(event_times, dtype=np.float64)[order], np.asarray(event_stats, dtype=np.float64)[order]
    keep = s >= stat_floor
    t, s = t[keep], s[keep]
    lo = np.searchsorted(t, injection_times - window, side="left")
    hi = np.searchsorted(t, injection_times + window, side="right")
    found, errors = [], []
    for i, (a, b) in enumerate(zip(lo, hi)):
        if b > a:
            j = a + int(np.argmax(s[a:b]))
            found.append(i)
            errors.append(t[j] - injection_times[i])
    return np.asarray(found, dtype=np.int64), np.asarray(errors, dtype=np.float64)


def measure_timing(event_times: np.ndarray, event_stats: np.ndarray, injection_times: np.ndarray,
                   stat_floor: float, window: float = 1.0, quantile: float = 0.99,
                   applied_offset: float = 0.0) -> dict[str, Any]:
    """The timing record: ``offset_s`` (bias to subtract, including the ``applied_offset`` the events already
    had removed) and ``var_s`` (tolerance), with the error distribution it came from."""
    found, errors = match_injections(event_times, event_stats, injection_times, window, stat_floor)
    if len(found) < MIN_FOUND:
        raise ValueError(f"only {len(found)} injections found above stat {stat_floor:g} within {window:g} s; "
                         f"need {MIN_FOUND} to measure a timing tolerance (more data, or a lower floor)")
    bias = float(np.median(errors))
    spread = np.abs(errors - bias)
    var = float(np.ceil(np.quantile(spread, quantile) * 1e3) / 1e3)
    return {"offset_s": applied_offset + bias, "var_s": var, "quantile": quantile, "n_found": int(len(found)),
            "n_injections": int(len(injection_times)),
            "stat_floor": float(stat_floor) if np.isfinite(stat_floor) else None, "window_s": window,
            "abs_error_s": {q: float(np.quantile(spread, float(q))) for q in ("0.5", "0.9", "0.99")},
            "max_abs_error_s": float(spread.max())}


def write_timing(path: Path, record: dict[str, Any]) -> Path:
    """Write a timing record atomically (a run directory gets ``timing.json``)."""
    path = Path(path)
    path = path / TIMING_FILE if path.is_dir() else path
    atomic_write_bytes(path, json_bytes(record))
    return path


def read_timing(path: Path | None) -> dict[str, Any] | None:
    """A timing record from a file or a run directory's ``timing.json``; None when there is none."""
    if path is None:
        return None
    path = Path(path)
    path = path / TIMING_FILE if path.is_dir() else path
    if not path.is_file():
        return None
    record = json.loads(path.read_text())
    if not {"offset_s", "var_s"} <= set(record) or not record["var_s"] > 0:
        raise ValueError(f"{path}: a timing record needs offset_s and a positive var_s")
    return record
