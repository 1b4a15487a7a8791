"""``converge detect``: slide the trained CNN along a strain file.

The PSD is estimated from the data itself (Welch, 4 s Hann segments, median
average, robust to a loud signal), the whole strain is whitened at once with it
(after a Tukey taper at the ends), and the CNN scores windows every ``stride``
seconds. Windows above the threshold are clustered (gaps shorter than one
window join a cluster) into triggers: the cluster's loudest score and its
estimated merger time (window starts plus the middle of the trained
merger-time range, averaged over the cluster's windows).
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import scipy.signal
import torch

from ...config import from_dict
from ...data.atomic import atomic_write_bytes
from ...train.loop import load_model
from .app import GWApp
from .config import GWConfig
from .noise import interpolate_psd, welch_psd, whiten
from .strainfile import StrainFileError, read_strain

__all__ = ["StrainFileError", "detect_file", "cluster_triggers", "score_strain"]


def score_strain(model: torch.nn.Module, cfg: GWConfig, whitened: np.ndarray, stride: int,
                 batch_size: int = 256) -> tuple[np.ndarray, np.ndarray]:
    """(window start indices, CNN logits) for windows every ``stride`` samples."""
    x = torch.from_numpy(np.ascontiguousarray(whitened, dtype=np.float32))
    windows = x.unfold(0, cfg.window_samples, stride)  # (W, N)
    starts = np.arange(windows.shape[0]) * stride
    scores = []
    with torch.inference_mode():
        for i in range(0, len(windows), batch_size):
            scores.append(model(windows[i : i + batch_size].contiguous()).float().numpy())
    return starts, np.concatenate(scores) if scores else np.zeros(0)


def cluster_triggers(times: np.ndarray, scores: np.ndarray, threshold: float, gap: float) -> list[dict[str, float]]:
    """Group above-threshold windows whose times lie within ``gap`` s of each other."""
    above = np.flatnonzero(scores > threshold)
    triggers: list[dict[str, float]] = []
    if len(above) == 0:
        return triggers
    groups = np.split(above, np.flatnonzero(np.diff(times[above]) > gap) + 1)
    for g in groups:
        best = g[np.argmax(scores[g])]
        triggers.append({"gps_time": float(np.mean(times[g])), "score": float(scores[best]), "n_windows": len(g)})
    return triggers


def detect_file(strain_path: Path, run_dir: Path, threshold: float | None = None, stride: float = 0.125,
                out: Path | None = None) -> dict[str, Any]:
    """Run detection on a GWOSC-layout file; writes and returns the triggers."""
    app = GWApp()
    model, config = load_model(app, run_dir)
    cfg = from_dict(GWConfig, config["app_config"], "app")
    if threshold is None:
        threshold = default_threshold(Path(run_dir))
    t0 = time.perf_counter()
    strain = read_strain(strain_path)
    if abs(strain.sample_rate - cfg.sample_rate) > 1e-6:
        raise StrainFileError(f"{strain_path}: sample rate {strain.sample_rate:g} Hz, but the run was trained at "
                              f"{cfg.sample_rate} Hz; resample the strain (e.g. scipy.signal.resample_poly)")
    n = len(strain.data)
    if n < 8 * cfg.window_samples:
        raise StrainFileError(f"{strain_path}: {n / strain.sample_rate:g} s of strain is too short; "
                              f"need at least {8 * cfg.window:g} s to estimate the PSD")
    freqs, psd_est = welch_psd(strain.data, strain.sample_rate)
    psd = interpolate_psd(freqs, psd_est, n, strain.sample_rate, cfg.f_lower)
    taper = scipy.signal.windows.tukey(n, alpha=2 * cfg.window_samples / n)
    whitened = whiten(strain.data * taper, psd, strain.sample_rate)
    step = max(1, int(round(stride * cfg.sample_rate)))
    starts, scores = score_strain(model, cfg, whitened, step)
    # skip windows that overlap the tapered ends
    keep = (starts >= cfg.window_samples) & (starts + 2 * cfg.window_samples <= n)
    starts, scores = starts[keep], scores[keep]
    merger_offset = 0.5 * (cfg.merger_min + cfg.merger_max)
    times = strain.gps_start + starts / strain.sample_rate + merger_offset
    triggers = cluster_triggers(times, scores, threshold, gap=cfg.window)
    seconds = time.perf_counter() - t0
    out = Path(out) if out else Path(strain_path).with_suffix(".triggers.json")
    result = {"strain": str(strain_path), "run": str(run_dir), "threshold": threshold, "stride": stride,
              "detector": strain.detector, "gps_start": strain.gps_start, "duration": n / strain.sample_rate,
              "n_windows": int(len(scores)), "seconds": seconds,
              "strain_seconds_per_second": n / strain.sample_rate / seconds, "triggers": triggers, "out": str(out)}
    atomic_write_bytes(out, json.dumps(result, indent=2).encode())
    return result


def default_threshold(run_dir: Path) -> float:
    """The CNN threshold at FAP 1e-3 per window from the run's evaluation."""
    path = run_dir / "evaluation.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: pass --threshold, or run `converge evaluate gw --run {run_dir}` "
                                "first to set it from noise at FAP 1e-3")
    thresholds = json.loads(path.read_text())["cnn"]["thresholds"]
    return float(thresholds.get("1e-03", max(thresholds.values())))
