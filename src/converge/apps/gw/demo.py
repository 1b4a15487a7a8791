"""The gw part of ``converge demo``: simulate (train and test sets) -> train -> evaluate
against matched filtering -> detect injections in a generated GWOSC-format strain file -> the
two-detector searches (coherent CNN and matched filter, with time-slid background) on a small slice."""
from __future__ import annotations

import multiprocessing
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

from ...data.store import ShardStore
from ...simulate.runner import SimulateConfig, run_ensemble
from ...train.loop import TrainConfig, train
from .config import GWConfig
from .detect import detect_file
from .evaluate import GWEvalConfig, fill_matched_filter_cache
from .strainfile import make_injection_strain, write_strain
from .waveforms import sample_bbh_parameters

console = Console()


@dataclass(frozen=True)
class DemoSize:
    train_samples: int = 8000
    test_samples: int = 300
    epochs: int = 10
    n_noise: int = 10_000
    n_per_snr: int = 200
    faps: tuple[float, ...] = (1e-2, 1e-3)
    strain_seconds: float = 64.0
    injections: int = 4
    network_samples: int = 2000  # two-detector (MLGWSC-1 DS1) training waveforms
    network_epochs: int = 3
    network_seconds: float = 128.0  # the two-detector slice searched
    network_slides: int = 20


QUICK = DemoSize(train_samples=200, test_samples=40, epochs=2, n_noise=1000, n_per_snr=40, faps=(1e-2,),
                 strain_seconds=32.0, injections=2, network_samples=64, network_epochs=1, network_seconds=96.0,
                 network_slides=5)


def run_gw_demo(app: Any, out: Path, size: DemoSize, workers: int) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    cfg = GWConfig()
    timings: dict[str, float] = {}
    t = time.perf_counter()
    console.rule("[bold]gw 1/4 simulate: IMRPhenomD waveforms, whitened by the aLIGO design PSD")
    for name, n, seed in (("train", size.train_samples, 1), ("test", size.test_samples, 2)):
        result = run_ensemble(app, cfg, SimulateConfig(samples=n, seed=seed, workers=workers, shard_size=250),
                              out / "data" / name)
        if result.n_failed:
            raise RuntimeError(f"{result.n_failed} simulations failed: {result.failures[:3]}")
    timings["simulate"] = time.perf_counter() - t
    console.rule("[bold]gw 2/4 train: 1D CNN, fresh noise every epoch, SNR curriculum")
    t = time.perf_counter()
    ev = GWEvalConfig(n_noise=size.n_noise, n_per_snr=size.n_per_snr, faps=size.faps)
    # The matched filter needs no network: it scores the test windows on the other core while the CNN
    # trains; evaluate reuses those scores and recomputes only the windows it times side by side.
    bank_pass = multiprocessing.get_context("spawn").Process(
        target=fill_matched_filter_cache, args=(cfg, out / "data" / "test", ev, False), daemon=True)
    bank_pass.start()
    try:
        arrays = ShardStore.open(out / "data" / "train").load()
        tcfg = TrainConfig(epochs=size.epochs, patience=size.epochs)
        tres = train(app, cfg, tcfg, arrays, out / "run", extra_config={"data": str(out / "data" / "train")})
    except BaseException:
        bank_pass.terminate()
        raise
    timings["train"] = time.perf_counter() - t
    console.rule("[bold]gw 3/4 evaluate: CNN vs matched-filter template bank on the same windows")
    t = time.perf_counter()  # includes waiting for the matched-filter pass
    bank_pass.join()
    if bank_pass.exitcode != 0:
        console.print(f"the background matched-filter pass exited with {bank_pass.exitcode}; evaluate scores "
                      "the windows itself")
    report = app.evaluate(out / "run", out / "data" / "test", out / "run", ev=ev)
    timings["evaluate"] = time.perf_counter() - t
    console.rule("[bold]gw 4/4 detect: injections in a GWOSC-format strain file")
    t = time.perf_counter()
    rng = np.random.default_rng(7)
    gps0 = 1_000_000_000.0
    spacing = (size.strain_seconds - 8.0) / size.injections
    injections = [{**sample_bbh_parameters(cfg, rng), "gps_time": gps0 + 4.0 + spacing * (i + 0.5), "snr": 20.0}
                  for i in range(size.injections)]
    strain, placed = make_injection_strain(cfg, size.strain_seconds, injections, seed=11, gps_start=gps0)
    write_strain(out / "strain.hdf5", strain)
    fap_key = f"{min(size.faps):.0e}"
    det = detect_file(out / "strain.hdf5", out / "run", threshold=report["cnn"]["thresholds"][fap_key],
                      out=out / "triggers.json")
    timings["detect"] = time.perf_counter() - t
    console.rule("[bold]gw 5/5 search: two detectors (H1, L1), coherent CNN and matched filter, time slides")
    t = time.perf_counter()
    network = run_network_search(app, out / "network", size)
    timings["network_search"] = time.perf_counter() - t
    for name in ("efficiency.png", "roc.png"):
        shutil.copy(out / "run" / name, out / name)
    summary = {**_summarise(report, det, placed, tres, timings, size), "network_search": network}
    console.print(f"\nplots: {out / 'efficiency.png'}, {out / 'roc.png'}; report: {out / 'run' / 'evaluation.json'}")
    return summary


def _summarise(report, det, placed, tres, timings, size) -> dict:
    table = Table(title="converge demo: CNN vs matched filter (detection efficiency per window)")
    table.add_column("FAP")
    table.add_column("SNR")
    table.add_column("CNN", justify="right")
    table.add_column("matched filter", justify="right")
    for fap in report["cnn"]["efficiency"]:
        for snr in ("6", "8", "10"):
            table.add_row(fap, snr, f"{report['cnn']['efficiency'][fap][snr]:.3f}",
                          f"{report['matched_filter']['efficiency'][fap][snr]:.3f}")
    console.print(table)
    cnn_s, mf_s = report["cnn"]["seconds_per_strain_second"], report["matched_filter"]["seconds_per_strain_second"]
    console.print(f"compute per second of strain: CNN {cnn_s * 1e3:.3f} ms, matched filter ({report['n_templates']} "
                  f"templates) {mf_s * 1e3:.2f} ms -> CNN {report['speedup']:.0f}x faster (same CPU, one run)")
    found = []
    for inj in placed:
        near = [t for t in det["triggers"] if abs(t["gps_time"] - inj["gps_time"]) < 0.5]
        found.append(bool(near))
        console.print(f"injection GPS {inj['gps_time']:.2f} (SNR {inj['snr']:.1f}, m1={inj['mass1']:.0f}, "
                      f"m2={inj['mass2']:.0f}): " + (f"found, score {near[0]['score']:.1f}" if near else "missed"))
    false = [t for t in det["triggers"] if all(abs(t["gps_time"] - i["gps_time"]) >= 0.5 for i in placed)]
    console.print(f"{len(false)} other trigger(s); detection ran at {det['strain_seconds_per_second']:.0f} s of "
                  "strain per second")
    console.print("time: " + ", ".join(f"{k} {v:.0f} s" for k, v in timings.items()))
    return {"efficiency": {m: report[m]["efficiency"] for m in ("cnn", "matched_filter")},
            "speedup": report["speedup"], "n_templates": report["n_templates"], "injections_found": found,
            "other_triggers": len(false), "timings_s": timings, "samples_seen": tres.samples_seen,
            "size": size.__dict__}


def run_network_search(app: Any, out: Path, size: DemoSize) -> dict:
    """MLGWSC-1 DS1 physics on a small slice: a coherent CNN trained briefly, both searches over a foreground with
    loud injections and a noise-only background slid ``network_slides`` times; each injection's FAR."""
    from .datafile import write_mlgwsc1
    from .events import read_events
    from .mfsearch import search_matched_filter
    from .search import SearchConfig, add_far, search_cnn
    from .strainfile import make_network_strain

    out.mkdir(parents=True, exist_ok=True)
    cfg = GWConfig.mlgwsc1(1)
    rng = np.random.default_rng(17)
    gps0, n_inj = 1_238_166_018.0, 3
    spacing = (size.network_seconds - 40.0) / n_inj
    injections = [{**sample_bbh_parameters(cfg, rng), "gps_time": gps0 + 20.0 + spacing * (i + 0.5), "snr": 16.0}
                  for i in range(n_inj)]
    fg, placed = make_network_strain(cfg, size.network_seconds, injections, seed=21, gps_start=gps0)
    bg, _ = make_network_strain(cfg, size.network_seconds, [], seed=22, gps_start=gps0)
    write_mlgwsc1(out / "fg.hdf", [(gps0, fg)], cfg.sample_rate)
    write_mlgwsc1(out / "bg.hdf", [(gps0, bg)], cfg.sample_rate)
    result = run_ensemble(app, cfg, SimulateConfig(samples=size.network_samples, seed=3, workers=1, shard_size=500),
                          out / "train", progress=False)
    if result.n_failed:
        raise RuntimeError(f"{result.n_failed} simulations failed: {result.failures[:3]}")
    train(app, cfg, TrainConfig(epochs=size.network_epochs, patience=size.network_epochs),
          ShardStore.open(out / "train").load(), out / "run", progress=False)
    found = {}
    for method in ("cnn", "matched_filter"):
        for kind, slides in (("bg", size.network_slides), ("fg", 0)):
            target, search = out / f"{method}_{kind}.hdf", SearchConfig(slides=slides)
            if method == "cnn":
                summary = search_cnn(out / "run", out / f"{kind}.hdf", target, search, progress=False)
            else:
                summary = search_matched_filter(cfg, out / f"{kind}.hdf", target, search, cache_dir=out / "cache",
                                                progress=False)
        add_far(out / f"{method}_fg.hdf", out / f"{method}_bg.hdf")
        events, _ = read_events(out / f"{method}_fg.hdf")
        found[method] = []
        for inj in placed:
            near = np.flatnonzero(np.abs(events["time"] - inj["gps_time"]) <= events["var"])
            best = near[np.argmax(events["stat"][near])] if len(near) else None
            found[method].append(None if best is None else float(events["far_per_year"][best]))
        found[method + "_s_per_strain_s"] = summary["seconds_per_strain_second"]
    table = Table(title=f"two-detector search, {size.network_seconds:g} s foreground, "
                        f"{size.network_slides * size.network_seconds / 3600:.2g} h of slid background")
    for column in ("injection (network SNR 16)", "CNN: FAR per year", "matched filter: FAR per year"):
        table.add_column(column)
    for inj, c, m in zip(placed, found["cnn"], found["matched_filter"]):
        table.add_row(f"GPS {inj['gps_time']:.1f}, {inj['mass1']:.0f}+{inj['mass2']:.0f} Msun",
                      "missed" if c is None else f"{c:.3g}", "missed" if m is None else f"{m:.3g}")
    console.print(table)
    console.print("a FAR of 0 is below 1 / background; the MLGWSC-1 benchmark at full size: benchmarks/mlgwsc.py")
    return {"far_per_year": found, "injections": [{k: inj[k] for k in ("gps_time", "mass1", "mass2", "snr")}
                                                 for inj in placed]}
