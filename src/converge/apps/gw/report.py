"""The gw app's sections of ``converge report``: CNN against matched filtering on windows (``gw.json``) and the
two-detector searches on MLGWSC-1 dataset 1 (``mlgwsc.json``)."""
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


def mlgwsc_tables(r: Mapping[str, Any]) -> list[Table]:
    ds1 = r["ds1"]
    fars = ("1", "10", "100")
    size = (f"{ds1['foreground_s'] / 3600:.3g} h foreground, {ds1['background_s'] / 86400:.3g} days of background"
            + (" (reduced size)" if ds1.get("reduced_size") else ""))
    rows = []
    for method, label in (("cnn", "coherent CNN"), ("matched_filter", "matched filter (ours)")):
        d, e = ds1[method]["sensitive_distance_mpc"], ds1[method]["sensitive_distance_error_mpc"]
        rows.append([label, *(f"{d[f]:.0f} ± {e[f]:.0f}" if d.get(f) else fmt(d.get(f)) for f in fars)])
    for name, figures in ds1.get("published", {}).items():
        rows.append([f"{name} (published, a month)", *(f"{figures[f]:.0f}" if f in figures else fmt(None)
                                                         for f in fars)])
    compute, latency = ds1["compute"], ds1["latency_ms"]
    speed = [["CNN", fmt(compute["cnn_s_per_strain_s"]), fmt(latency["cnn"]["p50"]), fmt(latency["cnn"]["p99"])],
             ["matched filter", fmt(compute["mf_s_per_strain_s"]), fmt(latency["matched_filter"]["p50"]),
              fmt(latency["matched_filter"]["p99"])],
             ["speed-up (matched filter / CNN)", fmt(compute["speedup"]), "", ""]]
    return [Table(f"MLGWSC-1 DS1 sensitive distance [Mpc] by false alarms per month; {size}",
                  ["search", *(f"{f}/month" for f in fars)], rows),
            Table("compute (seconds per strain second, one thread) and --follow latency [ms]",
                  ["search", "s per strain s", "latency p50", "latency p99"], speed)]


SECTIONS = [ReportSection("gw", "gw: CNN against matched filtering", ("gw",), "the detection CNN against the template "
                          "bank on the same fixed test windows (converge evaluate gw).", evaluation_tables),
            ReportSection("gw-mlgwsc", "gw: two-detector searches on MLGWSC-1", ("mlgwsc",),
                          "converge search gw over the challenge's own dataset-1 files, the coherent CNN beside the "
                          "matched-filter search, scored by the challenge's evaluate.py (benchmarks/mlgwsc.py).",
                          mlgwsc_tables)]
