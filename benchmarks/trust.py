"""Trust the surrogate: active learning against random sampling, and the spread off the training data.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/trust.py --out runs/trust          # ~15-20 min, 2 cores
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/trust.py --quick --out /tmp/trust  # ~1-2 min, smoke test

For the chem app (methanol, DFT at the ``fast`` level): both strategies start from
the same ``--initial`` DFT conformers and, over ``--rounds`` rounds, label
``--budget`` more from the same pools of ``--pool`` normal-mode conformers
(300 K and 600 K): the ensemble's highest disagreement (query by committee), or
random ones. After each round a fresh ``--members``-model ensemble is tested on
the same held-out DFT set (same temperatures). Then the last active ensemble's
spread on the held-out set (in distribution) is set against its spread on much
hotter conformers and on a molecule it never saw, beside what the
out-of-distribution check says about each.

Writes ``benchmarks/results/trust.json`` and ``trust_learning_curve.png`` (with
``--quick``, ``OUT/trust.json`` and ``OUT/learning_curve.png`` only). Every stage resumes.
"""
from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import numpy as np
import torch

from converge.apps.chem import ChemApp, ChemConfig
from converge.data.atomic import atomic_write_bytes, json_bytes
from converge.data.store import ShardStore
from converge.train.loop import TrainConfig
from converge.units import hartree_to_kcal_mol
from converge.validate.active import compare_strategies, round_dir
from converge.validate.calibration import load_calibration
from converge.validate.chem_learning import ChemLearning, chem_spread
from converge.validate.ensemble import load_ensemble
from converge.validate.ood import check_batch, load_envelope

RESULTS = Path(__file__).parent / "results"


def spread_on(ensemble, envelope, inputs: dict[str, np.ndarray]) -> dict:
    """Energy spread per atom (kcal/mol) of the ensemble on ``inputs``, and the share the OOD check flags."""
    spread = chem_spread(ensemble.predict(inputs), inputs["species"])
    per_atom = hartree_to_kcal_mol(spread.energy_std_per_atom.numpy())
    flagged = [bool(r) for r in check_batch(envelope, inputs["species"], inputs["coordinates"])]
    return {"n": len(per_atom), "mean_energy_spread_per_atom_kcal_mol": float(per_atom.mean()),
            "median_energy_spread_per_atom_kcal_mol": float(np.median(per_atom)),
            "mean_force_spread_kcal_mol_A": float(hartree_to_kcal_mol(spread.force_spread.numpy()).mean()),
            "ood_flagged_fraction": float(np.mean(flagged))}


def out_of_distribution(app: ChemApp, cfg: ChemConfig, ensemble_dir: Path, test_inputs: dict, args) -> dict:
    """Spread in distribution (the test set) against much hotter conformers and an unseen molecule."""
    ensemble, envelope = load_ensemble(app, ensemble_dir), load_envelope(ensemble_dir)
    hot = ChemLearning(app, cfg, temperatures=(args.ood_temperature,))
    other_cfg = ChemConfig(molecule=args.unseen_molecule, level=cfg.level, hidden=cfg.hidden)
    other = ChemLearning(app, other_cfg, temperatures=cfg_temperatures(cfg))
    return {
        "in_distribution": spread_on(ensemble, envelope, test_inputs),
        f"hot_{args.ood_temperature:g}K": spread_on(ensemble, envelope, hot.inputs(hot.draw(11, args.n_ood))),
        f"unseen_{args.unseen_molecule}": spread_on(ensemble, envelope, other.inputs(other.draw(12, args.n_ood))),
    }


def cfg_temperatures(cfg: ChemConfig) -> tuple[float, float]:
    return (cfg.temperature, 2 * cfg.temperature)


def summarise(curve: list[dict]) -> dict:
    return {"dft_calls": [h["simulator_calls"] for h in curve],
            "test_mae": [h["energy_mae_kcal_mol"] for h in curve],
            "test_force_mae": [h["force_mae_kcal_mol_A"] for h in curve],
            "mean_spread": [h["mean_energy_spread_kcal_mol"] for h in curve],
            "test_mae_by_temperature": [h["energy_mae_by_temperature"] for h in curve],
            "spearman_spread_error": [h["calibration"]["spearman"] for h in curve]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("runs/trust"))
    ap.add_argument("--molecule", default="methanol")
    ap.add_argument("--initial", type=int, default=16)
    ap.add_argument("--budget", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--pool", type=int, default=1024)
    ap.add_argument("--members", type=int, default=4)
    ap.add_argument("--test", type=int, default=48)
    ap.add_argument("--epochs", type=int, default=300)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--temperatures", default="", help="pool and test temperatures in K, e.g. 300,600,1200 "
                    "(default: T and 2T of the app config, 300 and 600)")
    ap.add_argument("--ood-temperature", type=float, default=1800.0)
    ap.add_argument("--unseen-molecule", default="ethanol")
    ap.add_argument("--n-ood", type=int, default=64)
    ap.add_argument("--quick", action="store_true", help="a minute-long smoke run; results stay under --out")
    args = ap.parse_args()
    if args.quick:
        args.initial, args.budget, args.rounds, args.pool, args.members = 6, 4, 2, 64, 2
        args.test, args.epochs, args.n_ood = 6, 3, 8
    torch.set_num_threads(1)
    app, cfg = ChemApp(), ChemConfig(molecule=args.molecule, level="fast")
    train_cfg = TrainConfig(epochs=args.epochs, batch_size=args.batch_size, lr=args.lr, patience=args.epochs,
                            precision="fp32")
    temperatures = tuple(float(t) for t in args.temperatures.split(",")) if args.temperatures else None
    problem = ChemLearning(app, cfg, temperatures=temperatures)
    t0 = time.perf_counter()
    curves = compare_strategies(app, cfg, args.out, initial=args.initial, budget=args.budget, rounds=args.rounds,
                                pool_size=args.pool, seed=args.seed, members=args.members, n_test=args.test,
                                train_cfg=train_cfg, progress=False, problem=problem)
    learn_s = time.perf_counter() - t0
    final = {label: round_dir(args.out / label, args.rounds) / "ensemble" for label in ("active", "random")}
    test = ShardStore.open(args.out / "test").load(["species", "coordinates"])
    ood = out_of_distribution(app, cfg, final["active"], test, args)
    results = {
        "settings": {"molecule": args.molecule, "level_of_theory": cfg.level_of_theory,
                     "temperatures_K": list(problem.temperatures), "initial": args.initial, "budget": args.budget,
                     "rounds": args.rounds, "pool_size": args.pool, "members": args.members, "n_test": args.test,
                     "epochs": args.epochs, "batch_size": args.batch_size, "lr": args.lr, "seed": args.seed,
                     "quick": args.quick},
        "active": {**summarise(curves["active"]), "calls_to_reach_random_final": curves["calls_to_reach_random_final"]},
        "random": summarise(curves["random"]),
        "spread": ood,
        "calibration": {label: {k: v for k, v in load_calibration(path).items() if k != "binned"}
                        for label, path in final.items()},
        "seconds": {"learning": learn_s, "total": time.perf_counter() - t0, "threads": torch.get_num_threads()},
    }
    target = args.out if args.quick else RESULTS
    target.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(target / "trust.json", json_bytes(results))
    if not args.quick:
        shutil.copy(args.out / "learning_curve.png", RESULTS / "trust_learning_curve.png")
    a, r = results["active"], results["random"]
    print(f"test energy MAE after {a['dft_calls'][-1]} DFT calls: active {a['test_mae'][-1]:.3f}, "
          f"random {r['test_mae'][-1]:.3f} kcal/mol; active reaches random's final error after "
          f"{a['calls_to_reach_random_final']} calls")
    for name, s in ood.items():
        print(f"spread per atom {name}: {s['mean_energy_spread_per_atom_kcal_mol']:.3f} kcal/mol, "
              f"flagged by the OOD check: {s['ood_flagged_fraction']:.0%}")
    print(json.dumps(results["seconds"]))


if __name__ == "__main__":
    main()
