"""Calibration of a predicted spread against the actual error on held-out data.

Given, per held-out sample, the ensemble's spread ``s_i`` and its actual error
``e_i = mean_i - truth_i`` (same units):

- **binned RMSE**: samples sorted by spread into equal-count bins; in each bin the
  mean spread against ``sqrt(mean(e^2))``. A calibrated spread lies on ``RMSE = s``
  (Levi et al., "Evaluating and calibrating uncertainty prediction in regression
  tasks", Sensors 22, 5540 (2022)).
- **coverage**: the fraction with ``|e_i| <= k s_i`` for k = 1, 2, 3. Gaussian
  errors of standard deviation ``s_i`` give ``erf(k / sqrt 2)`` = 0.683, 0.954, 0.997.
- **Spearman rank correlation** between ``s`` and ``|e|``: does a larger spread
  mean a larger error, whatever the scale (ranks with ties averaged).
- **threshold**: the spread up to which a prediction is trusted. The rule
  (selective prediction with a risk bound, Geifman and El-Yaniv, NeurIPS 2017):
  the largest observed spread ``t`` such that, among the calibration samples with
  ``s_i <= t``, at most a fraction ``max_exceed`` have ``|e_i| > target``, with at
  least ``min_count`` samples in that trusted set. So "trust when spread <= t"
  keeps the exceedance rate at ``max_exceed`` or below on the calibration set, and
  never extrapolates: ``t`` is at most the largest spread seen. If even the
  ``min_count`` lowest-spread samples break the bound, ``t = 0`` (trust nothing).
  (The rule "the smallest spread above which the error exceeds the target in more
  than X% of cases" was not used: whenever the overall exceedance rate is above X
  it returns the smallest spread, however well the spread ranks the errors.)

``calibration.json`` holds these with the target, the rule's settings and its
consequences on the calibration set (trusted fraction, exceedance among trusted).
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from ..data.atomic import atomic_write_bytes, json_bytes

CALIBRATION_FILE = "calibration.json"
COVERAGE_KS = (1, 2, 3)


def _check_pair(spread: np.ndarray, error: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    spread = np.asarray(spread, dtype=np.float64).reshape(-1)
    error = np.asarray(error, dtype=np.float64).reshape(-1)
    if spread.shape != error.shape:
        raise ValueError(f"spread has {spread.size} values but error has {error.size}: give one of each per sample")
    if spread.size == 0:
        raise ValueError("no samples: calibration needs held-out predictions with their errors")
    if not (np.all(np.isfinite(spread)) and np.all(np.isfinite(error))):
        raise ValueError("spread or error holds NaN or inf; drop those samples (and report them) first")
    if np.any(spread < 0):
        raise ValueError("spread must be >= 0 (a standard deviation)")
    return spread, error


def binned_rmse(spread: np.ndarray, error: np.ndarray, n_bins: int = 8) -> dict[str, list[float]]:
    """Equal-count bins of increasing spread: mean spread, RMSE of the error and count per bin."""
    spread, error = _check_pair(spread, error)
    order = np.argsort(spread, kind="stable")
    bins = [b for b in np.array_split(order, min(n_bins, spread.size)) if b.size]
    return {"spread": [float(spread[b].mean()) for b in bins],
            "rmse": [float(np.sqrt(np.mean(error[b] ** 2))) for b in bins],
            "count": [int(b.size) for b in bins]}


def coverage(spread: np.ndarray, error: np.ndarray, ks: Sequence[float] = COVERAGE_KS) -> dict[str, float]:
    """Fraction of samples with ``|error| <= k * spread``, by k."""
    spread, error = _check_pair(spread, error)
    return {f"{k:g}": float(np.mean(np.abs(error) <= k * spread)) for k in ks}


def gaussian_coverage(ks: Sequence[float] = COVERAGE_KS) -> dict[str, float]:
    """``P(|e| <= k sigma) = erf(k / sqrt 2)`` for Gaussian errors: what a calibrated spread gives."""
    return {f"{k:g}": math.erf(k / math.sqrt(2.0)) for k in ks}


def _ranks(x: np.ndarray) -> np.ndarray:
    """Ranks 1..n, ties sharing their mean rank."""
    order = np.argsort(x, kind="stable")
    sorted_x = x[order]
    starts = np.flatnonzero(np.r_[True, sorted_x[1:] != sorted_x[:-1]])  # first index of each tie group
    ends = np.r_[starts[1:], x.size]
    mean_rank = (starts + ends + 1) / 2.0  # mean of ranks start+1 .. end
    ranks = np.empty(x.size)
    ranks[order] = np.repeat(mean_rank, ends - starts)
    return ranks


def spearman(x: np.ndarray, y: np.ndarray) -> float:
    """Spearman's rho: the Pearson correlation of the ranks (NaN if either is constant)."""
    x, y = np.asarray(x, dtype=np.float64).reshape(-1), np.asarray(y, dtype=np.float64).reshape(-1)
    if x.shape != y.shape or x.size < 2:
        raise ValueError(f"need two equally long samples of at least 2 values, got {x.size} and {y.size}")
    rx, ry = _ranks(x) - (x.size + 1) / 2.0, _ranks(y) - (y.size + 1) / 2.0
    denominator = math.sqrt(float(rx @ rx) * float(ry @ ry))
    return float(rx @ ry / denominator) if denominator > 0 else math.nan


def spread_threshold(spread: np.ndarray, error: np.ndarray, target: float, max_exceed: float = 0.1,
                     min_count: int = 10) -> float:
    """Largest spread ``t`` with at most ``max_exceed`` of the samples with spread <= t erring
    by more than ``target``, over at least ``min_count`` samples; 0 if none (module docstring)."""
    spread, error = _check_pair(spread, error)
    if not target > 0:
        raise ValueError(f"target={target}: give the largest acceptable error, > 0, in the error's units")
    if not 0 <= max_exceed < 1:
        raise ValueError(f"max_exceed={max_exceed}: a fraction in [0, 1), e.g. 0.1")
    order = np.argsort(spread, kind="stable")
    s, exceeds = spread[order], np.abs(error[order]) > target
    count = np.arange(1, s.size + 1)
    rate = np.cumsum(exceeds) / count  # exceedance among the j+1 lowest spreads
    last_of_ties = np.r_[s[1:] != s[:-1], True]  # a threshold takes in every sample with that spread
    ok = (rate <= max_exceed) & (count >= min_count) & last_of_ties
    return float(s[np.flatnonzero(ok)[-1]]) if ok.any() else 0.0


def _finite_or_none(x: float) -> float | None:
    return x if math.isfinite(x) else None  # JSON has no NaN


def calibrate(spread: np.ndarray, error: np.ndarray, target: float, max_exceed: float = 0.1,
              min_count: int = 10, n_bins: int = 8) -> dict[str, Any]:
    """Every calibration figure of the module docstring, as JSON-ready data."""
    spread, error = _check_pair(spread, error)
    threshold = spread_threshold(spread, error, target, max_exceed, min_count)
    trusted = spread <= threshold if threshold > 0 else np.zeros(spread.size, dtype=bool)
    rms_spread = float(np.sqrt(np.mean(spread**2)))
    return {
        "n": int(spread.size),
        "mean_spread": float(spread.mean()),
        "rmse": float(np.sqrt(np.mean(error**2))),
        "mae": float(np.mean(np.abs(error))),
        "rmse_over_rms_spread": float(np.sqrt(np.mean(error**2)) / rms_spread) if rms_spread > 0 else None,
        "spearman": _finite_or_none(spearman(spread, np.abs(error))),  # None: spread or error constant
        "coverage": coverage(spread, error),
        "gaussian_coverage": gaussian_coverage(),
        "binned": binned_rmse(spread, error, n_bins),
        "threshold": threshold,
        "threshold_rule": {"target": float(target), "max_exceed": float(max_exceed), "min_count": int(min_count),
                           "trust": "spread <= threshold"},
        "trusted_fraction": float(trusted.mean()),
        "exceed_fraction_trusted": float(np.mean(np.abs(error[trusted]) > target)) if trusted.any() else None,
        "exceed_fraction_all": float(np.mean(np.abs(error) > target)),
    }


def write_calibration(run_dir: str | Path, report: dict[str, Any], spread: np.ndarray, error: np.ndarray,
                      quantity: str = "", units: str = "") -> Path:
    """``run_dir/calibration.json`` (atomic) and ``run_dir/calibration.png``; returns the JSON path."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / CALIBRATION_FILE
    atomic_write_bytes(path, json_bytes({**report, "quantity": quantity, "units": units}))
    plot_calibration(spread, error, report, run_dir / "calibration.png", quantity, units)
    return path


def load_calibration(run_dir: str | Path) -> dict[str, Any]:
    path = Path(run_dir) / CALIBRATION_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: calibrate the ensemble on held-out data first")
    return json.loads(path.read_text())


def plot_calibration(spread: np.ndarray, error: np.ndarray, report: dict[str, Any], path: Path,
                     quantity: str = "", units: str = "") -> None:
    """Spread against |error| (scatter), the binned RMSE curve, y = x, the target and the threshold."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    spread, error = _check_pair(spread, error)
    unit = f" [{units}]" if units else ""
    rho = math.nan if report["spearman"] is None else report["spearman"]
    fig, ax = plt.subplots(figsize=(5.5, 4.5))
    ax.scatter(spread, np.abs(error), s=8, alpha=0.5, color="tab:blue", label="|error| per sample")
    binned = report["binned"]
    ax.plot(binned["spread"], binned["rmse"], "o-", color="tab:red", label="RMSE per spread bin")
    top = max(float(spread.max()), float(np.abs(error).max()), 1e-12)
    ax.plot([0, top], [0, top], "k--", lw=0.8, label="RMSE = spread")
    ax.axhline(report["threshold_rule"]["target"], color="tab:green", lw=0.8, label="target error")
    ax.axvline(report["threshold"], color="tab:orange", lw=0.8, label=f"threshold {report['threshold']:.3g}")
    ax.set(xlabel=f"ensemble spread {quantity}{unit}", ylabel=f"|error| {quantity}{unit}",
           title=f"Spearman {rho:.2f}, within 2 spreads {report['coverage']['2']:.0%}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
