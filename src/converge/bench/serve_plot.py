"""The serving benchmark's figure: throughput against p99 latency, ours and each peer's at its best settings."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping, Sequence

from .peer_settings import PeerSettings


def _annotate_concurrency(ax, rows: Sequence[Mapping[str, Any]]) -> None:
    for r in rows:
        ax.annotate(str(r["concurrency"]), (r["throughput_sps"], r["p99_ms"]), fontsize=7, textcoords="offset points",
                    xytext=(3, 3))


def plot_serve_sweep(reports: Mapping[str, Mapping[str, Any]], path: str | Path) -> Path:
    """Throughput (samples/s) against p99 latency, one panel per report, one line per (mode, format) and one
    per peer (JSON); the model's own best and batch-1 throughputs as vertical lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(reports), figsize=(6.5 * len(reports), 7), squeeze=False)
    for ax, (label, report) in zip(axes[0], reports.items()):
        modes = list(dict.fromkeys(r["mode"] for r in report["sweep"]))
        for mode, fmt in sorted({(r["mode"], r["format"]) for r in report["sweep"]}):
            rows = [r for r in report["sweep"] if (r["mode"], r["format"]) == (mode, fmt) and r["p99_ms"] is not None]
            ax.plot([r["throughput_sps"] for r in rows], [r["p99_ms"] for r in rows], "o-" if fmt == "binary"
                    else "s--", color=f"C{modes.index(mode)}", label=f"{mode}, {fmt}")
            _annotate_concurrency(ax, rows)
        for i, (peer, measured) in enumerate(report.get("peers", {}).items()):
            best = measured.get("settings_best")  # its best setting's sweep only, the confirming pass if any
            setting = PeerSettings(**best).label if best else None
            rows = [r for r in measured.get("confirm_sweep") or measured.get("sweep", []) if r["p99_ms"] is not None
                    and r.get("settings", setting) == setting]
            ax.plot([r["throughput_sps"] for r in rows], [r["p99_ms"] for r in rows], "^:", color=f"C{len(modes) + i}",
                    label=f"{peer} {setting or ''}, {measured.get('format', 'json')}")
            _annotate_concurrency(ax, rows)
        best = report["model_only_best"]
        ax.axvline(best["samples_per_s"], color="k", lw=1, label=f"model alone, batch {best['batch_size']}")
        if report.get("model_only_single"):
            ax.axvline(report["model_only_single"], color="grey", lw=1, ls=":", label="model alone, batch 1")
        peers = " vs " + ", ".join(report["peers"]) if report.get("peers") else ""
        ax.set(xscale="log", yscale="log", xlabel="throughput [samples/s] (point labels: concurrency)",
               ylabel="p99 latency [ms]",
               title=f"{label}: converge serve{peers}")
        ax.legend(fontsize=7, ncol=2, loc="upper center", bbox_to_anchor=(0.5, -0.13))  # below: the curves stay clear
        ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}.png")
    fig.savefig(tmp, dpi=120)
    plt.close(fig)
    os.replace(tmp, path)
    return path
