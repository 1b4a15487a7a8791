"""bf16 against fp32, training and inference of both reference models, side by side in one run.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/precision.py

Trains each model twice from the same seed on the same data, once under bf16
autocast and once in fp32, and reports training throughput and the final
validation metrics. Then times inference of the trained full-size runs (when
``--gw-run`` / ``--chem-run`` exist) under both precisions on the same inputs,
with how far the bf16 outputs move (gw: logits; chem: energies and forces
against the DFT labels of the test set). The apps' default precisions (gw: bf16, chem: fp32) are
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


def timed(fn, min_s: float = 1.0) -> float:
    """Seconds per call of ``fn`` (after one warm-up), over at least ``min_s``."""
    fn()
    n, t0 = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - t0) < min_s or n < 3:
        fn()
        n += 1
    return elapsed / n


def inference_row(app, run: Path, inputs: dict, outputs, per: int) -> dict:
    """fp32 and bf16 time per sample of a trained run's ``serve_predict`` on ``inputs``, and the output shift."""
    from converge.train.loop import autocast_context, load_model

    model, _ = load_model(app, run)
    grad = torch.enable_grad() if app.grad_at_inference else torch.inference_mode()
    row, out = {}, {}
    for precision in ("fp32", "bf16"):
        def call():
            with grad, autocast_context(torch.device("cpu"), precision):
                return app.serve_predict(model, inputs)
        out[precision] = call()
        row[precision] = {"seconds_per_sample": timed(call) / per, **outputs(out[precision])}
    row["speedup_bf16"] = row["fp32"]["seconds_per_sample"] / row["bf16"]["seconds_per_sample"]
    row["max_abs_output_change"] = {k: float((out["bf16"][k].double() - out["fp32"][k].double()).abs().max())
                                    for k in out["fp32"]}
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("runs/precision"))
    ap.add_argument("--chem-data", type=Path, default=Path("runs/chem-full/ethanol/train"))
    ap.add_argument("--chem-test", type=Path, default=Path("runs/chem-full/ethanol/test"))
    ap.add_argument("--gw-run", type=Path, default=Path("runs/gw-v2/run"))
    ap.add_argument("--chem-run", type=Path, default=Path("runs/chem-full/ethanol/run"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    results = {}
    cfg = GWConfig()
    rng = np.random.default_rng(0)
    signals = np.stack([whitened_signal(cfg, sample_bbh_parameters(cfg, rng)) for _ in range(4000)])
    results["gw"] = compare(GWApp(), cfg, {"signal": signals}, TrainConfig(epochs=4, batch_size=128),
                            args.out / "gw", ("val_loss", "accuracy", "efficiency_fap_1e-2"))
    if args.chem_data.is_dir():
        from converge.apps.chem.app import ChemApp
        from converge.config import from_dict
        from converge.data.store import ShardStore

        chem, store = ChemApp(), ShardStore.open(args.chem_data)
        chem_cfg = from_dict(chem.config_cls, store.manifest["app_config"], "app")
        results["chem"] = compare(chem, chem_cfg, store.load(), TrainConfig(epochs=60, batch_size=16),
                                  args.out / "chem", ("val_loss", "energy_mae_kcal_mol", "force_mae_kcal_mol_A"))
    results["inference"] = {}
    if args.gw_run.is_dir():
        from converge.apps.gw.pipeline import whitened_noise

        x = whitened_noise(GWConfig(), 512, torch.Generator().manual_seed(0))
        results["inference"]["gw"] = inference_row(GWApp(), args.gw_run, {"strain": x}, lambda o: {}, 512)
    if args.chem_run.is_dir() and args.chem_test.is_dir():
        from converge.apps.chem.app import ChemApp
        from converge.data.store import ShardStore
        from converge.units import hartree_to_kcal_mol

        test = ShardStore.open(args.chem_test).load()
        inputs = {"species": torch.from_numpy(test["species"]),
                  "coordinates": torch.from_numpy(test["coordinates"].astype(np.float32))}

        def errors(o):
            return {"energy_mae_kcal_mol": float(np.mean(np.abs(hartree_to_kcal_mol(o["energy"].double().numpy()
                                                                                    - test["energy"])))),
                    "force_mae_kcal_mol_A": float(np.mean(np.abs(hartree_to_kcal_mol(
                        o["forces"].double().numpy() - test["forces"]))))}
        results["inference"]["chem"] = inference_row(ChemApp(), args.chem_run, inputs, errors, len(test["energy"]))
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "precision.json").write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
