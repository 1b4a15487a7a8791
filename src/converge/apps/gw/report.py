"""The gw app's sections of ``converge report``: CNN against matched filtering (``gw.json``)."""
from __future__ import annotations

from typing import Any, Mapping

from ...contract import ReportSection
from ...tables import Table, fmt


def evaluation_tables(r: Mapping[str, Any]) -> list[Table]:
    snrs = ("6", "8", "10", "12")
    rows = []
    for method in ("cnn", "matched_filter"):
        for fap, by_snr in r[method]["efficiency"].items():
            rows.append([method, fap, *(fmt(by_snr.get(s)) for s in snrs)])
    speed = [[m, fmt(r[m]["seconds_per_strain_second"])] for m in ("cnn", "matched_filter")]
    speed.append(["speed-up (matched filter / CNN)", fmt(r.get("speedup"))])
    return [Table(f"detection efficiency, {r.get('n_noise')} noise windows, {r.get('n_templates')} templates",
                  ["method", "FAP per window", *(f"SNR {s}" for s in snrs)], rows),
            Table(f"compute seconds per second of strain ({r.get('threads')} thread(s))", ["method", "seconds"],
                  speed)]


SECTIONS = [ReportSection("gw", "gw: CNN against matched filtering", ("gw",), "the detection CNN against the template "
                          "bank on the same fixed test windows (converge evaluate gw).", evaluation_tables)]
