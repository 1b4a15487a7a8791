"""bf16 against fp32 training of the gw CNN, side by side in one run.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/precision.py

Trains each model twice from the same seed on the same data, once under bf16
autocast and once in fp32, and reports training throughput and the final
validation metrics. The apps' default precisions (gw: bf16, chem: fp32) are
chosen from this measurement (the chem potential runs its AEV and networks in
fp32 even under autocast: bf16 cannot resolve the millihartree differences it
learns). Writes ``benchmarks/results/precision.json``.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from converge.apps.gw.app import GWApp
from converge.apps.gw.config import GWConfig
from converge.apps.gw.waveforms import sample_bbh_parameters, whitened_signal
from converge.train.loop import TrainConfig, train

RESULTS = Path(__file__).parent / "results"


def compare(app, cfg, arrays, tcfg: TrainConfig, out: Path, keys: tuple[str, ...]) -> dict:
    row = {}
    for precision in ("fp32", "bf16"):
        t0 = time.perf_counter()
        res = train(app, cfg, TrainConfig(**{**tcfg.__dict__, "precision": precision}), arrays, out / precision,
                    progress=False)
        last = res.history[-1]
        row[precision] = {"seconds": time.perf_counter() - t0,
                          "samples_per_s": float(np.mean([h["samples_per_s"] for h in res.history])),
                          **{k: last[k] for k in keys}}
    row["speedup_bf16"] = row["bf16"]["samples_per_s"] / row["fp32"]["samples_per_s"]
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("runs/precision"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    results = {}
    cfg = GWConfig()
    rng = np.random.default_rng(0)
    signals = np.stack([whitened_signal(cfg, sample_bbh_parameters(cfg, rng)) for _ in range(4000)])
    results["gw"] = compare(GWApp(), cfg, {"signal": signals}, TrainConfig(epochs=4, batch_size=128),
                            args.out / "gw", ("val_loss", "accuracy", "efficiency_fap_1e-2"))
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "precision.json").write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
