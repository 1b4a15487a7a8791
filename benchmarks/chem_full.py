"""Full chem run: ANI-style potential against DFT for two molecules, with timings and NVE drift.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/chem_full.py --out runs/chem-full

For each molecule: DFT ensembles at the ``fast`` level (train at 300 K, held-out
test at 300 K, "hot" conformers at 600 K), training on energies and forces,
evaluation against DFT (with the predict-the-mean and GFN2-xTB baselines), DFT
at the ANI-1 level (ωB97X/6-31G(d)) timed against the surrogate in the same run,
and 1 ps of NVE dynamics at 0.5 fs with the ASE calculator. Writes
``benchmarks/results/chem.json`` and the parity plots. Every stage resumes.
"""
from __future__ import annotations

import argparse
import json
import shutil
import time
from dataclasses import replace
from pathlib import Path

import torch

from converge.apps.chem import Calculator, ChemApp, ChemConfig
from converge.apps.chem.evaluate import ChemEvalConfig
from converge.apps.chem.md import nve_drift
from converge.apps.chem.molecules import get_molecule
from converge.data.store import ShardStore
from converge.simulate.runner import SimulateConfig, run_ensemble
from converge.train.loop import TrainConfig, train

RESULTS = Path(__file__).parent / "results"


def run_molecule(name: str, args: argparse.Namespace) -> dict:
    app, root = ChemApp(), args.out / name
    cfg = ChemConfig(molecule=name, level="fast", temperature=300.0)
    hot_cfg = replace(cfg, temperature=args.hot_temperature)
    t0 = time.perf_counter()
    sets = (("train", cfg, args.train, 1), ("test", cfg, args.test, 2), ("hot", hot_cfg, args.test, 3))
    for split, c, n, seed in sets:
        res = run_ensemble(app, c, SimulateConfig(samples=n, seed=seed, workers=args.workers, shard_size=40),
                           root / split)
        if res.n_failed:
            print(f"{name} {split}: {res.n_failed} DFT failures recorded: {res.failures[:3]}")
    simulate_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    arrays = ShardStore.open(root / "train").load()
    tcfg = TrainConfig(epochs=args.epochs, batch_size=args.batch_size, lr=args.lr, patience=args.epochs)
    result = train(app, cfg, tcfg, arrays, root / "run", resume=(root / "run" / "last.pt").exists(),
                   extra_config={"data": str(root / "train")})
    train_s = time.perf_counter() - t0
    ev = ChemEvalConfig(hot_data=str(root / "hot"), n_dft_timing=args.n_dft_timing)  # the trained level, and ANI apart
    report = app.evaluate(root / "run", root / "test", root / "run", ev=ev)
    atoms = get_molecule(name)
    from ase import Atoms

    mol = Atoms(list(atoms.symbols), positions=ShardStore.open(root / "test").load(["coordinates"])["coordinates"][0])
    mol.calc = Calculator(root / "run")
    md = nve_drift(mol, temperature=300.0, duration_ps=1.0, dt_fs=0.5)
    shutil.copy(root / "run" / "parity.png", RESULTS / f"chem_{name}_parity.png")
    return {
        "energy_mae_kcal_mol": report["energy_mae_kcal_mol"], "energy_rmse_kcal_mol": report["energy_rmse_kcal_mol"],
        "force_mae_kcal_mol_A": report["force_mae_kcal_mol_A"],
        "hot_energy_mae_kcal_mol": report["hot_energy_mae_kcal_mol"],
        "hot_force_mae_kcal_mol_A": report["hot_force_mae_kcal_mol_A"],
        "n_train": report["n_train"], "n_test": report["test"]["n"], "n_hot": report["hot"]["n"],
        "level_of_theory": report["level_of_theory"], "hot_temperature_K": args.hot_temperature,
        "speedup_batched": report["speedup_batched"], "speedup_single": report["speedup_single"],
        "speed": report["speed"], "baselines": report["test"]["baselines"],
        "hot_baselines": report["hot"]["baselines"],
        "nve_drift_kcal_mol_ps_atom": md["drift_kcal_mol_ps_atom"], "nve": md,
        "seconds": {"simulate": simulate_s, "train": train_s, "train_epochs": len(result.history)},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("runs/chem-full"))
    ap.add_argument("--molecules", nargs="+", default=["ethanol", "methanol"])
    ap.add_argument("--train", type=int, default=320)
    ap.add_argument("--test", type=int, default=80)
    ap.add_argument("--hot-temperature", type=float, default=600.0)
    ap.add_argument("--epochs", type=int, default=300)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--n-dft-timing", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(1)
    RESULTS.mkdir(parents=True, exist_ok=True)
    results = {name: run_molecule(name, args) for name in args.molecules}
    (RESULTS / "chem.json").write_text(json.dumps(results, indent=2))
    for name, r in results.items():
        print(f"{name}: E MAE {r['energy_mae_kcal_mol']:.3f} kcal/mol, F MAE {r['force_mae_kcal_mol_A']:.3f} "
              f"kcal/mol/Å, hot E MAE {r['hot_energy_mae_kcal_mol']:.3f}, speed-up batched "
              f"{r['speedup_batched']:.0f}x single {r['speedup_single']:.0f}x, NVE drift "
              f"{r['nve_drift_kcal_mol_ps_atom']:.4f} kcal/mol/ps/atom (n_train {r['n_train']})")


if __name__ == "__main__":
    main()
