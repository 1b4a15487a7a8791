"""Scoring a search with MLGWSC-1's own evaluator, and its plots.

``get_stats`` of the challenge's ``evaluate.py`` (imported unchanged from the challenge's folder,
:func:`challenge_folder`) matches foreground events to injections (an event within its ``var`` of
an injection's ``tc`` is a true positive), turns background events into a FAR (``#louder / duration``)
and gives the sensitive distance at each background statistic: the radius of the volume
``V = V_tot N_found / N_inj`` (chirp-distance weighted for the challenge's injection files) with its
sampling error. The challenge's command line takes the foreground's duration as the background's;
a time-slid background lasts longer, so ``duration`` is the slid background's here.

Sensitive distance at a FAR ``F`` per month: the value at the loosest background threshold whose FAR
is at most ``F``; its error ``dr = r dV / (3 V)``. A FAR below ``1 / background`` cannot be read and
gives None.
"""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any, Mapping, Sequence

import h5py
import numpy as np

from .events import read_events
from .slides import SECONDS_PER_MONTH

FARS_PER_MONTH = (1.0, 10.0, 100.0)
PADDING_S = 30.0  # the challenge's generator injects nothing within 30 s of a segment's ends
# MLGWSC-1 as published (Schäfer et al. 2023, PRD 107, 023021), DS1, two detectors, a month of data [Mpc]
PUBLISHED_DS1 = {"PyCBC": {"1": 2492.0, "10": 2551.0, "100": 2687.0},
                 "TPI FSU Jena (best ML)": {"1": 2363.0, "10": 2472.0, "100": 2635.0}}


def challenge_folder() -> Path:
    """The challenge's code: ``$CONVERGE_MLGWSC1``, else ``shared/mlgwsc1`` beside the checkout."""
    env = os.environ.get("CONVERGE_MLGWSC1")
    here = Path(__file__).resolve()
    candidates = [Path(env)] if env else [p / "shared" / "mlgwsc1" for p in here.parents]
    for folder in candidates:
        if (folder / "evaluate.py").is_file():
            return folder
    raise FileNotFoundError("MLGWSC-1's evaluate.py not found: set CONVERGE_MLGWSC1 to the folder holding the "
                            "challenge's generate_data.py and evaluate.py "
                            "(github.com/gwastro/ml-mock-data-challenge-1)")


def challenge_module(name: str = "evaluate"):
    """Import one of the challenge's modules (``evaluate``) from :func:`challenge_folder`, unchanged."""
    path = challenge_folder() / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"mlgwsc1_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def injections_in(injection_file: Path, foreground_files: Sequence[Path]) -> dict[str, np.ndarray]:
    """The injections inside the foreground data (the challenge's ``find_injection_times``, 30 s padding)."""
    evaluate = challenge_module()
    _, inside = evaluate.find_injection_times([str(p) for p in foreground_files], str(injection_file),
                                              padding_start=PADDING_S, padding_end=PADDING_S)
    if not inside.any():
        raise ValueError(f"no injection of {injection_file} lies inside the foreground (30 s from segment ends)")
    with h5py.File(injection_file, "r") as f:
        params = {k: f[k][()][inside] for k in ("tc", "distance", "mass1", "mass2")}
        params["chirp_distance_weighted"] = np.array("chirp_distance" in f)
    return params


def as_rows(columns: Mapping[str, np.ndarray]) -> np.ndarray:
    """Events as the evaluator's (3, N) array of time, stat, var."""
    return np.vstack([columns["time"], columns["stat"], columns["var"]]).astype(np.float64)


def evaluate_events(foreground: Path, background: Path, injection_file: Path, foreground_files: Sequence[Path],
                    background_s: float | None = None) -> dict[str, Any]:
    """Sensitive distance against FAR with ``get_stats`` (module docstring); ``background_s`` defaults to the
    background events file's own ``background_s``."""
    evaluate = challenge_module()
    fg, _ = read_events(foreground)
    bg, bg_attrs = read_events(background)
    duration = float(background_s if background_s is not None else bg_attrs.get("background_s", 0.0))
    if not duration > 0:
        raise ValueError(f"{background}: no background duration; pass background_s or make it with --slides N")
    inj = injections_in(injection_file, foreground_files)
    weighted = bool(inj.pop("chirp_distance_weighted"))
    if not any_true_positive(fg, inj["tc"]):  # get_stats cannot handle a search that finds nothing
        out = {"sensitive_distance_mpc": {f"{x:g}": 0.0 for x in FARS_PER_MONTH}, "threshold": {},
               "sensitive_distance_error_mpc": {f"{x:g}": 0.0 for x in FARS_PER_MONTH},
               "curve": {"far_per_month": [], "distance_mpc": [], "error_mpc": []}, "background_s": duration,
               "n_injections": int(len(inj["tc"])), "n_background_events": int(len(bg["stat"])),
               "n_true_positive_events": 0, "n_false_positive_events": int(len(fg["time"]))}
        return out
    stats = evaluate.get_stats(as_rows(fg), as_rows(bg), inj, duration=duration, chirp_distance=weighted)
    return summarise_stats(stats, inj, duration, bg["stat"])


def any_true_positive(fg: Mapping[str, np.ndarray], tc: np.ndarray) -> bool:
    """Whether some event lies within its ``var`` of an injection (as get_stats counts a true positive)."""
    if len(fg["time"]) == 0:
        return False
    tc = np.sort(tc)
    i = np.clip(np.searchsorted(tc, fg["time"]), 1, len(tc) - 1) if len(tc) > 1 else np.zeros(len(fg["time"]), int)
    nearest = np.minimum(np.abs(tc[i] - fg["time"]), np.abs(tc[np.maximum(i - 1, 0)] - fg["time"]))
    return bool(np.any(nearest <= fg["var"]))


def summarise_stats(stats: Mapping[str, np.ndarray], inj: Mapping[str, np.ndarray], duration: float,
                    background_stats: np.ndarray) -> dict:
    """The headline figures of ``get_stats``: sensitive distance (and error) at 1, 10, 100 per month, the curve."""
    far = np.asarray(stats["far"]) * SECONDS_PER_MONTH  # per month, for the background stats sorted ascending
    radius = np.asarray(stats["sensitive-distance"])
    vol, vol_err = np.asarray(stats["sensitive-volume"]), np.asarray(stats["sensitive-volume-error"])
    error = radius * vol_err / (3 * np.maximum(vol, 1e-300))
    noise = np.sort(np.asarray(background_stats, dtype=np.float64))
    out: dict[str, Any] = {"sensitive_distance_mpc": {}, "sensitive_distance_error_mpc": {}, "threshold": {}}
    for level in FARS_PER_MONTH:
        key = f"{level:g}"
        ok = np.flatnonzero(far <= level)
        if level < SECONDS_PER_MONTH / duration or len(ok) == 0:  # below what the background resolves
            out["sensitive_distance_mpc"][key] = out["sensitive_distance_error_mpc"][key] = None
            out["threshold"][key] = None
            continue
        i = int(ok[0])  # the loosest threshold with FAR <= level (far falls as the threshold rises)
        out["sensitive_distance_mpc"][key] = float(radius[i])
        out["sensitive_distance_error_mpc"][key] = float(error[i])
        out["threshold"][key] = float(noise[i])
    keep = curve_points(len(far))
    out["curve"] = {"far_per_month": far[keep].tolist(), "distance_mpc": radius[keep].tolist(),
                    "error_mpc": error[keep].tolist()}
    out.update({"background_s": duration, "n_injections": int(len(inj["tc"])),
                "n_background_events": int(len(noise)),
                "n_true_positive_events": int(len(stats["true-positive-event-indices"])),
                "n_false_positive_events": int(len(stats["false-positive-event-indices"]))})
    return out


def curve_points(n: int, n_log: int = 400, n_loud: int = 200) -> np.ndarray:
    """Indices (ascending) of a background threshold curve of ``n`` points worth plotting: the ``n_loud`` loudest
    (the low FARs that matter) and ``n_log`` more spaced evenly in log FAR."""
    louder = np.unique(np.geomspace(1, max(n, 1), n_log).astype(np.int64))  # background events above
    return np.unique(np.concatenate([n - louder, np.arange(max(0, n - n_loud), n)])).clip(0, max(n - 1, 0))[:n]


def found_at(foreground: Path, background: Path, injection_file: Path, foreground_files: Sequence[Path],
             far_per_month: float = 1.0, background_s: float | None = None) -> dict[str, np.ndarray]:
    """Each injection's chirp mass, distance and whether an event within ``var`` of it beats the background
    threshold of ``far_per_month`` (for the found/missed plot)."""
    fg, _ = read_events(foreground)
    bg, attrs = read_events(background)
    duration = float(background_s if background_s is not None else attrs["background_s"])
    inj = injections_in(injection_file, foreground_files)
    ascending = np.sort(bg["stat"])
    allowed = int(np.floor(far_per_month * duration / SECONDS_PER_MONTH))  # background events allowed above
    # as get_stats: the threshold is a background event, the loosest with at most `allowed` louder ones
    threshold = ascending[max(0, len(ascending) - 1 - allowed)] if len(ascending) else -np.inf
    order = np.argsort(inj["tc"])
    tc = inj["tc"][order]
    idx = np.clip(np.searchsorted(tc, fg["time"]), 1, max(len(tc) - 1, 1))
    nearest = np.where(np.abs(tc[idx - 1] - fg["time"]) <= np.abs(tc[np.minimum(idx, len(tc) - 1)] - fg["time"]),
                       idx - 1, np.minimum(idx, len(tc) - 1))
    hit = np.abs(tc[nearest] - fg["time"]) <= fg["var"]
    best = np.full(len(tc), -np.inf)
    np.maximum.at(best, nearest[hit], fg["stat"][hit])
    found = np.zeros(len(tc), bool)
    found[order] = best > threshold
    m1, m2 = inj["mass1"], inj["mass2"]
    return {"mchirp": (m1 * m2) ** 0.6 / (m1 + m2) ** 0.2, "distance": inj["distance"], "found": found,
            "threshold": np.array(threshold)}


def plot_sensitivity(results: Mapping[str, Mapping[str, Any]], path: Path, title: str) -> None:
    """The challenge's plot: sensitive distance against FAR per month (decreasing to the right), with error bands
    and the published DS1 figures as markers."""
    from ...bench.artifacts import pyplot, save_figure

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    for (label, r), color in zip(results.items(), ("tab:blue", "tab:orange", "tab:green")):
        c = r["curve"]
        far, dist, err = (np.asarray(c[k]) for k in ("far_per_month", "distance_mpc", "error_mpc"))
        ok = far > 0
        ax.semilogx(far[ok], dist[ok], color=color, label=label)
        ax.fill_between(far[ok], (dist - err)[ok], (dist + err)[ok], color=color, alpha=0.2)
    for (name, figures), marker in zip(PUBLISHED_DS1.items(), ("s", "^")):
        ax.plot([float(k) for k in figures], list(figures.values()), marker, color="k", mfc="none",
                label=f"{name}, published (a month)")
    lo, hi = ax.get_xlim()
    ax.set_xlim(hi, lo)
    ax.set(xlabel="false alarms per month", ylabel="sensitive distance [Mpc]", title=title)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, path)


def plot_found_missed(found: Mapping[str, Mapping[str, np.ndarray]], path: Path, title: str) -> None:
    """Found (coloured) and missed (grey) injections by chirp mass and distance, one panel per search."""
    from ...bench.artifacts import pyplot, save_figure

    plt = pyplot()
    fig, axes = plt.subplots(1, len(found), figsize=(5.2 * len(found), 4.2), sharey=True, squeeze=False)
    for ax, (label, f) in zip(axes[0], found.items()):
        hit = f["found"]
        ax.scatter(f["mchirp"][~hit], f["distance"][~hit], s=6, color="0.6", label=f"missed ({int((~hit).sum())})")
        ax.scatter(f["mchirp"][hit], f["distance"][hit], s=6, color="tab:blue", label=f"found ({int(hit.sum())})")
        ax.set(xlabel="chirp mass [Msun]", title=label)
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("luminosity distance [Mpc]")
    fig.suptitle(title)
    fig.tight_layout()
    save_figure(fig, path)
