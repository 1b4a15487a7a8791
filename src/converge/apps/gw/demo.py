"""The gw part of ``converge demo``: simulate (train and test sets) -> train -> evaluate
against matched filtering -> detect injections in a generated GWOSC-format strain file."""
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


QUICK = DemoSize(train_samples=200, test_samples=40, epochs=2, n_noise=1000, n_per_snr=40, faps=(1e-2,),
                 strain_seconds=32.0, injections=2)


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
    for name in ("efficiency.png", "roc.png"):
        shutil.copy(out / "run" / name, out / name)
    summary = _summarise(report, det, placed, tres, timings, size)
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
