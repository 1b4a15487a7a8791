"""Learning curves: test error against simulator calls, where one strategy reaches another's final error,
the fractions by seed, means over seeds, and the plots (:mod:`.active` writes them round by round)."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from ..data.atomic import atomic_write_bytes, json_bytes, json_round_trip


def calls_to_reach(calls: Sequence[float], errors: Sequence[float], target: float,
                   interpolate: bool = False) -> float | None:
    """The fewest simulator calls at which ``errors`` first fall to ``target`` or below (None: never).

    Measured points only by default; ``interpolate`` draws a straight line between the last
    point above ``target`` and the first at or below it and returns where it crosses.
    """
    for k, (c, e) in enumerate(zip(calls, errors)):
        if e <= target:
            if not interpolate or k == 0:
                return float(c)
            c0, e0 = calls[k - 1], errors[k - 1]
            return float(c0 + (c - c0) * (e0 - target) / (e0 - e))
    return None


def reach_random_final(curves: Mapping[str, Sequence[Mapping[str, Any]]], metric: str) -> dict[str, Any]:
    """Where the active curve (``curves["active"]``, rounds with ``simulator_calls``) first reaches the random
    curve's final ``metric`` (interpolated between rounds, :func:`calls_to_reach`), and that as a fraction of
    random's calls (None: never)."""
    calls = [h["simulator_calls"] for h in curves["random"]]
    target = curves["random"][-1][metric]
    reach = calls_to_reach([h["simulator_calls"] for h in curves["active"]],
                           [h[metric] for h in curves["active"]], target, interpolate=True)
    return {"random_final": target, "active_final": curves["active"][-1][metric],
            "active_calls_to_reach_random_final": reach,
            "fraction_of_random_calls": None if reach is None else reach / calls[-1]}


def summarise_seeds(result: Mapping[str, Any], metrics: Sequence[str]) -> dict[str, Any]:
    """``result`` (one comparison, its own ``variants`` beside it) with ``seeds``: each plain run's fraction of
    random's calls by metric (the main run and the variants without batch diversity; :func:`reach_random_final`'s
    dicts under each metric), by seed, and their mean where every seed reached random's final error.

    A run names its ``seed``, ``diversity`` and ``delta`` (a baseline the networks learn on top of: another
    potential, not another seed) at its top level or under ``settings``.
    """
    runs = [result, *result.get("variants", {}).values()]
    plain = {r.get("settings", r).get("seed", 0): r for r in runs
             if not r.get("settings", r).get("diversity") and not r.get("settings", r).get("delta")}
    seeds: dict[str, Any] = {"seeds": sorted(plain)}
    for metric in metrics:
        fractions = [plain[s][metric]["fraction_of_random_calls"] for s in sorted(plain)]
        seeds[metric] = {"fraction_of_random_calls": fractions, "mean": mean_or_none(fractions)}
    if len(plain) > 1 and all("curves" in r for r in plain.values()):
        seeds["against_random_mean"] = against_random_mean([plain[s]["curves"] for s in sorted(plain)], metrics)
    return {**result, "seeds": seeds}


def mean_or_none(values: Sequence[float | None]) -> float | None:
    return None if not values or None in values else sum(values) / len(values)  # type: ignore[arg-type]


def against_random_mean(runs: Sequence[Mapping[str, Sequence[Mapping[str, Any]]]],
                        metrics: Sequence[str]) -> dict[str, Any]:
    """Each seed's active curve judged against random's final error averaged over the seeds, rather than its own
    seed's random draw (curves of ``dft_calls`` per round, one schedule for all): the fraction of random's calls at
    which it first reaches that mean (interpolated, :func:`calls_to_reach`; None: never), by seed, and their mean."""
    calls = [[h["dft_calls"] for h in run[label]] for run in runs for label in ("active", "random")]
    if any(c != calls[0] for c in calls):
        raise ValueError(f"runs differ in their DFT calls per round ({calls}); compare runs of one schedule")
    out: dict[str, Any] = {}
    for metric in metrics:
        if any(h.get(metric) is None for run in runs for curve in run.values() for h in curve):
            continue
        target = float(np.mean([run["random"][-1][metric] for run in runs]))
        fractions = [None if reach is None else reach / calls[0][-1] for reach in
                     (calls_to_reach(calls[0], [h[metric] for h in run["active"]], target, interpolate=True)
                      for run in runs)]
        out[metric] = {"random_final_mean": target, "fraction_of_random_calls": fractions,
                       "mean": mean_or_none(fractions)}
    return out


def mean_curve(curves: Sequence[Sequence[Mapping[str, Any]]], metric: str) -> tuple[list[float], list[float]]:
    """Simulator calls and the mean of ``metric`` over runs (e.g. seeds) that share their calls per round."""
    calls = [[h["simulator_calls"] for h in curve] for curve in curves]
    if any(c != calls[0] for c in calls):
        raise ValueError(f"runs differ in their simulator calls per round ({calls}); average runs of one schedule")
    return [float(c) for c in calls[0]], np.mean([[h[metric] for h in curve] for curve in curves], axis=0).tolist()


def write_learning_curve(out_dir: Path, history: Sequence[Mapping[str, Any]], metrics: Sequence[str],
                         label: str) -> None:
    """``learning_curve.json`` (the rounds' metrics) and ``learning_curve.png`` of one run."""
    atomic_write_bytes(out_dir / "learning_curve.json", json_bytes(json_round_trip(list(history))))
    plot_learning_curves({label: history}, metrics, out_dir / "learning_curve.png")


def plot_learning_curves(curves: Mapping[str, Sequence[Mapping[str, Any]]], metrics: Sequence[str],
                         path: Path) -> None:
    """Test error against simulator calls, one panel per metric, one line per strategy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(metrics), figsize=(5 * len(metrics), 4), squeeze=False)
    for ax, metric in zip(axes[0], metrics):
        for label, history in curves.items():
            ax.plot([h["simulator_calls"] for h in history], [h[metric] for h in history], "o-", label=label)
        ax.set(xlabel="simulator calls (training data)", ylabel=f"test {metric}", yscale="log")
        ax.grid(alpha=0.3, which="both")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
