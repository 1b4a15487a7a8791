"""CNN against matched filtering on exactly the same whitened windows.

The test set is fixed and seeded: ``n_noise`` noise-only windows set the
thresholds at each false-alarm probability (FAP, per window), and for each
optimal SNR of ``snrs`` the test waveforms are cropped at a random merger time,
scaled to that SNR and added to fresh noise. Both detectors score every window
in one run on this machine; their compute time per second of strain is measured
side by side on the first ``timing_windows`` windows (same thread count) and
their ratio reported as the speed-up. The matched-filter scores of a test set
are cached beside it (they do not depend on the network), so evaluating a new
network on the same 100k-window test set takes minutes, not an hour.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ...config import ConfigError, from_dict, to_dict
from ...data.atomic import atomic_write_bytes
from ...data.store import ShardStore, sha256_file
from ...train.loop import autocast_context, load_model
from ...train.precision import resolve_precision
from .bank import bank_path, load_bank
from .config import GWConfig
from .matched_filter import matched_filter_snr
from .pipeline import signal_windows, stream_seed, whitened_noise


@dataclass(frozen=True)
class GWEvalConfig:
    """Settings of ``converge evaluate gw`` (the ``[evaluate]`` table)."""

    n_noise: int = 10_000
    n_per_snr: int = 200
    snrs: tuple[float, ...] = (2, 4, 5, 6, 7, 8, 9, 10, 12, 14, 16, 18, 20)
    faps: tuple[float, ...] = (1e-2, 1e-3)
    roc_snrs: tuple[float, ...] = (6, 8, 10)
    seed: int = 20181
    batch_size: int = 256
    timing_windows: int = 4096  # windows on which both methods are timed, side by side
    precision: str = "auto"  # CNN inference (auto: bf16 where the CPU has bf16 units); the head is fp32 (model.py)

    def __post_init__(self) -> None:
        for fap in self.faps:
            if not 0 < fap < 1:
                raise ConfigError(f"evaluate.faps: {fap} is not a probability in (0, 1)")
            if self.n_noise * fap < 5:
                raise ConfigError(
                    f"evaluate.n_noise={self.n_noise}: FAP {fap} needs at least {int(5 / fap)} noise windows "
                    "for a threshold (5 louder noise windows); raise n_noise or drop that FAP"
                )
        if self.n_per_snr < 1:
            raise ConfigError(f"evaluate.n_per_snr={self.n_per_snr}: must be >= 1")
        if self.precision not in ("auto", "bf16", "fp16", "fp32"):
            raise ConfigError(f"evaluate.precision={self.precision!r}: choose auto, bf16, fp16 or fp32")


def window_batches(cfg: GWConfig, ev: GWEvalConfig, signals: torch.Tensor):
    """Yield (kind, snr, windows) chunks of the fixed test set: noise, then each SNR."""
    g = torch.Generator().manual_seed(stream_seed(ev.seed, 0))
    for start in range(0, ev.n_noise, ev.batch_size):
        yield "noise", 0.0, whitened_noise(cfg, min(ev.batch_size, ev.n_noise - start), g)
    for snr in ev.snrs:
        picks = torch.arange(ev.n_per_snr) % len(signals)
        for start in range(0, ev.n_per_snr, ev.batch_size):
            idx = picks[start : start + ev.batch_size]
            x = whitened_noise(cfg, len(idx), g)
            x += signal_windows(cfg, signals[idx], torch.full((len(idx),), float(snr)), g)
            yield "signal", float(snr), x


def _cache_key(snr: float) -> str:
    return f"snr_{snr:g}"


def matched_filter_cache_path(data_dir: Path, ev: GWEvalConfig, cfg: GWConfig) -> Path:
    """Where the matched-filter scores of this exact test set live.

    The scores depend only on the test windows (data, seed, sizes, SNRs) and the
    bank, never on the CNN: they are computed once and reused, so a new network is
    evaluated in minutes. The key hashes everything they depend on; evaluation
    still recomputes the timed windows and checks them against the cache.
    """
    bank_file = bank_path(cfg)
    key = {"manifest": sha256_file(Path(data_dir) / "manifest.json"), "bank": sha256_file(bank_file),
           "windows": {k: v for k, v in to_dict(ev).items() if k in ("n_noise", "n_per_snr", "snrs", "seed",
                                                                     "batch_size")}}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return Path(data_dir) / "cache" / f"matched_filter-{digest}.npz"


def save_matched_filter_cache(path: Path, by_snr: dict[float, list[np.ndarray]]) -> None:
    """Write the scores atomically (temp file, then rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp.npz")
    np.savez(tmp, **{_cache_key(snr): np.concatenate(parts) for snr, parts in by_snr.items()})
    os.replace(tmp, path)


def roc_curve(noise: np.ndarray, signal: np.ndarray, n_points: int = 200) -> dict[str, list[float]]:
    """False-alarm probability and efficiency at thresholds spanning the noise scores."""
    thresholds = np.quantile(noise, np.linspace(0.0, 1.0, n_points))
    fap = [float(np.mean(noise > t)) for t in thresholds]
    eff = [float(np.mean(signal > t)) for t in thresholds]
    return {"fap": fap, "efficiency": eff}


def load_test_signals(cfg: GWConfig, data_dir: Path) -> torch.Tensor:
    """The stored test waveforms, refused if simulated with other physics than ``cfg``."""
    store = ShardStore.open(data_dir)
    theirs = from_dict(GWConfig, store.manifest["app_config"], "app").simulation_settings()
    ours = cfg.simulation_settings()
    if theirs != ours:
        diff = ", ".join(f"{k}: data {theirs[k]!r} vs run {ours[k]!r}" for k in ours if theirs[k] != ours[k])
        raise ValueError(f"test data {data_dir} was simulated with other physics than the run ({diff})")
    return torch.from_numpy(np.ascontiguousarray(store.load(["signal"])["signal"], dtype=np.float32))


def fill_matched_filter_cache(cfg: GWConfig, data_dir: Path, ev: GWEvalConfig, progress: bool = True) -> Path:
    """Score every test window with the bank and cache the scores (no network needed).

    Lets the hour-long matched-filter pass run before, or beside, training; a
    later ``evaluate_run`` on the same test set then reuses it.
    """
    cache = matched_filter_cache_path(data_dir, ev, cfg)
    if cache.is_file():
        return cache
    signals, bank = load_test_signals(cfg, data_dir), load_bank(cfg)
    scores: dict[float, list[np.ndarray]] = {}
    bar = _bar(progress, _n_chunks(ev), "matched filter on the test windows")
    for _, snr, x in window_batches(cfg, ev, signals):
        scores.setdefault(snr, []).append(matched_filter_snr(x, bank).snr.numpy())
        if bar:
            bar.update(bar.task_ids[0], advance=1)
    if bar:
        bar.stop()
    save_matched_filter_cache(cache, scores)
    return cache


def _n_chunks(ev: GWEvalConfig) -> int:
    return -(-ev.n_noise // ev.batch_size) + len(ev.snrs) * -(-ev.n_per_snr // ev.batch_size)


def evaluate_run(app, run_dir: Path, data_dir: Path, out_dir: Path, ev: GWEvalConfig | None = None,
                 progress: bool = True) -> dict[str, Any]:
    """Score the fixed test set with the CNN and the matched-filter bank; write JSON and plots."""
    from .app import efficiency_at_fap

    ev = ev or GWEvalConfig()
    ev = replace(ev, precision=resolve_precision(ev.precision, app.default_precision, torch.device("cpu")))
    model, config = load_model(app, run_dir)
    cfg = from_dict(GWConfig, config["app_config"], "app")
    if cfg.coherent:
        raise ValueError(f"{run_dir} sees {', '.join(cfg.network)}: window-level evaluation is single-detector; "
                         "score a network with `converge search gw` over continuous data (benchmarks/mlgwsc.py)")
    signals = load_test_signals(cfg, data_dir)
    bank = load_bank(cfg)
    cache = matched_filter_cache_path(data_dir, ev, cfg)
    cached = dict(np.load(cache)) if cache.is_file() else None
    scores: dict[str, dict[float, list[np.ndarray]]] = {"cnn": {}, "matched_filter": {}}
    seconds = {"cnn": 0.0, "matched_filter": 0.0}
    n_windows = n_timed = 0
    bar = _bar(progress, _n_chunks(ev), "CNN and matched filter on the test windows")
    for kind, snr, x in window_batches(cfg, ev, signals):
        timed = n_timed < ev.timing_windows  # both methods timed on the same windows, side by side
        t0 = time.perf_counter()
        with torch.inference_mode(), autocast_context(torch.device("cpu"), ev.precision):
            cnn = model(x).float().numpy()
        t1 = time.perf_counter()
        start = sum(len(c) for c in scores["matched_filter"].get(snr, []))
        mf = cached[_cache_key(snr)][start : start + len(x)] if cached is not None else None
        if timed or mf is None:
            fresh = matched_filter_snr(x, bank).snr.numpy()
            if mf is not None and not np.allclose(fresh, mf, rtol=1e-4, atol=1e-4):
                raise RuntimeError(f"cached matched-filter scores {cache} disagree with a recomputation; delete it")
            mf = fresh
        t2 = time.perf_counter()
        if timed:
            seconds["cnn"] += t1 - t0
            seconds["matched_filter"] += t2 - t1
            n_timed += len(x)
        n_windows += len(x)
        scores["cnn"].setdefault(snr, []).append(cnn)
        scores["matched_filter"].setdefault(snr, []).append(mf)
        if bar:
            bar.update(bar.task_ids[0], advance=1)
    if bar:
        bar.stop()
    if cached is None:
        save_matched_filter_cache(cache, scores["matched_filter"])
    strain_seconds = n_timed * cfg.window
    report: dict[str, Any] = {"n_noise": ev.n_noise, "n_per_snr": ev.n_per_snr, "n_templates": len(bank),
                              "n_windows": n_windows, "n_timed_windows": n_timed, "threads": torch.get_num_threads(),
                              "matched_filter_cache": str(cache) if cached is not None else None,
                              "evaluate_config": to_dict(ev), "app_config": config["app_config"],
                              "run": str(run_dir), "data": str(data_dir)}
    for method, by_snr in scores.items():
        noise = np.concatenate(by_snr[0.0])
        eff: dict[str, dict[str, float]] = {}
        thresholds: dict[str, float] = {}
        for fap in ev.faps:
            key = f"{fap:.0e}"
            eff[key] = {}
            for snr in ev.snrs:
                thr, e = efficiency_at_fap(noise, np.concatenate(by_snr[float(snr)]), fap)
                eff[key][f"{snr:g}"] = e
                thresholds[key] = thr
        roc = {f"{s:g}": roc_curve(noise, np.concatenate(by_snr[float(s)])) for s in ev.roc_snrs if float(s) in by_snr}
        report[method] = {"efficiency": eff, "thresholds": thresholds, "roc": roc,
                          "seconds_per_strain_second": seconds[method] / strain_seconds}
    report["speedup"] = report["matched_filter"]["seconds_per_strain_second"] / report["cnn"]["seconds_per_strain_second"]
    out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(out_dir / "evaluation.json", json.dumps(report, indent=2).encode())
    plot_evaluation(report, out_dir)
    return report


def _bar(enabled: bool, total: int, what: str):
    if not enabled:
        return None
    from rich.progress import Progress

    bar = Progress()
    bar.add_task(f"evaluate: {what}", total=total)
    bar.start()
    return bar


def plot_evaluation(report: dict[str, Any], out_dir: Path) -> None:
    """``efficiency.png`` (efficiency vs SNR per FAP) and ``roc.png``, CNN beside matched filter."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    styles = {"cnn": ("CNN", "tab:blue"), "matched_filter": ("matched filter", "tab:orange")}
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    for method, (label, color) in styles.items():
        for fap, ls in zip(report[method]["efficiency"], ("-", "--", ":")):
            curve = report[method]["efficiency"][fap]
            ax.plot([float(s) for s in curve], list(curve.values()), ls, color=color, marker="o", ms=3,
                    label=f"{label}, FAP {fap}")
    ax.set(xlabel="optimal SNR", ylabel="detection efficiency", ylim=(0, 1.02),
           title=f"CNN vs matched filter ({report['n_templates']} templates, {report['n_noise']} noise windows)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out_dir / "efficiency.png", dpi=120)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    for method, (label, color) in styles.items():
        for (snr, roc), ls in zip(report[method]["roc"].items(), ("-", "--", ":")):
            fap = np.maximum(roc["fap"], 1.0 / report["n_noise"])
            ax.plot(fap, roc["efficiency"], ls, color=color, label=f"{label}, SNR {snr}")
    ax.set(xscale="log", xlabel="false-alarm probability per window", ylabel="detection efficiency",
           title="ROC on the fixed test windows")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out_dir / "roc.png", dpi=120)
    plt.close(fig)
