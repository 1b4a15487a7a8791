"""Active learning over chemical space, judged as ANI-1x's was: on larger molecules than any it chose from.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/chem_transfer_learning.py

This needs the data of benchmarks/chem_transfer.py (``runs/chem-transfer``; ``--until simulate`` is enough):
- its 2,500 DFT-labelled normal-mode conformers of the 126 molecules of ``chno_1to4_ext`` are the labelled pool
  (the defaults, 250 + 3 x 750, use every row: a pool with DFT failures needs a smaller ``--pool``);
- its 10 conformers of each of 24 unseen molecules with 5-7 heavy atoms are the held-out set (a molecule whose
  every conformer failed DFT is left out, as there).

Query by committee (3 members, energy spread per atom) and random selection start from the same 250 random
conformers. In each of 3 rounds, each takes 250 more from the round's own 750 candidates: disjoint slices of one
permutation, the same for both (:mod:`converge.validate.pooled`). Each ends with 1,000 DFT labels. A label is
revealed only when a strategy chooses its conformer, so the DFT calls are the labels used.

Members train with ``converge train chem``'s defaults and ``app.force_weight=1``, as in chem_transfer.py. Both
strategies are judged by their committee's mean on the unseen molecules:
- conformer energies relative to each molecule's mean;
- forces;
- absolute energies.

Outputs:
- writes ``benchmarks/results/chem_transfer_learning.json`` and ``.png``;
- resumes from ``--out`` round by round;
- ``--strategy active|random`` runs one strategy alone. The two share round 0, so start random once active's
  round 0 has finished.
- ``--variant NAME --delta gfn2_xtb`` runs both strategies with members trained on DFT minus GFN2-xTB
  (``app.baseline``, delta learning), judged as xTB plus the committee; left out of ``seeds``.
- ``--variant NAME --seed S [--diversity D]`` runs the same comparison with another seed (initial set, pools,
  members; the test set stays) or with batch diversity, in ``--out``/NAME, and adds its figures under
  ``variants.NAME`` of the JSON, leaving the main result as it is. ``seeds`` there lists every plain run's
  (no diversity) fraction of random's calls by seed, and their mean.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

from converge.apps.chem import ChemApp, ChemConfig
from converge.apps.chem.config import BASELINES
from converge.apps.chem.molecule_set import pad_conformers, stack_conformer_sets
from converge.apps.chem.smiles import heavy_atoms, library
from converge.bench.artifacts import write_json
from converge.bench.machine import describe_machine
from converge.data.store import ShardStore
from converge.train.loop import TrainConfig
from converge.validate.active import compare_strategies, round_dir, run_active_learning, share_initial_round
from converge.validate.curves import plot_learning_curves, reach_random_final, summarise_seeds
from converge.validate.pooled import PooledProblem

RESULTS = Path(__file__).parent / "results"
POOL_LIBRARY, TEST_LIBRARY = "chno_1to4_ext", "chno_5to7"
METRICS = ("force_mae_kcal_mol_A", "relative_energy_mae_kcal_mol", "energy_mae_kcal_mol")
SCHEMA = ("species", "coordinates", "energy", "forces", "molecule")
TARGET_FRACTION = 0.5


def labelled_sets(transfer: Path, n_test_molecules: int) -> tuple[dict, dict, list[str], list[str], str]:
    """chem_transfer.py's training conformers (the pool) and test conformers (molecule = index in the list of
    labelled test molecules), padded to one atom count; the labelled and the unlabelled test molecules (every
    conformer failed DFT, as chem_transfer.py leaves them out); and the pool's DFT level (``app.level``)."""
    train = transfer / f"train-{POOL_LIBRARY}"
    names = [name for name, _ in library(TEST_LIBRARY)[:n_test_molecules]]
    missing = [str(p) for p in [train, *(transfer / "test" / n for n in names)] if not (p / "manifest.json").is_file()]
    if missing:
        raise SystemExit(f"no labelled data at {', '.join(missing[:3])}: run benchmarks/chem_transfer.py "
                         f"--out {transfer} --until simulate first")
    store = ShardStore.open(train)
    pool = store.load(list(SCHEMA))
    stores = {n: ShardStore.open(transfer / "test" / n) for n in names}
    labelled = [n for n in names if len(stores[n])]
    if not labelled:
        raise SystemExit(f"no test molecule under {transfer / 'test'} has a DFT-labelled conformer")
    tests = [stores[n].load(list(SCHEMA[:4])) for n in labelled]
    n_atoms = max(a["species"].shape[1] for a in [pool, *tests])
    return (pad_conformers(pool, n_atoms), stack_conformer_sets(tests, n_atoms), labelled,
            [n for n in names if n not in labelled], store.manifest["app_config"]["level"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--transfer", type=Path, default=Path("runs/chem-transfer"),
                    help="chem_transfer.py's --out (its labelled training and test conformers)")
    ap.add_argument("--out", type=Path, default=Path("runs/al-transfer"))
    ap.add_argument("--strategy", choices=("both", "active", "random"), default="both")
    ap.add_argument("--initial", type=int, default=250)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--pool", type=int, default=750, help="candidates offered per round")
    ap.add_argument("--budget", type=int, default=750, help="labels added over all rounds")
    ap.add_argument("--members", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0, help="with --variant: the seed of the initial set, pools and "
                    "members")
    ap.add_argument("--diversity", type=float, default=0.0, help="with --variant: qbc batch diversity (a fraction of "
                    "the pool's median distance; 0 is plain top-k)")
    ap.add_argument("--delta", choices=BASELINES, default="", help="with --variant: app.baseline of every member "
                    "(gfn2_xtb: trained on DFT minus GFN2-xTB, judged as xTB plus the committee)")
    ap.add_argument("--variant", default="", help="a name: run in OUT/NAME and add the figures under variants.NAME")
    ap.add_argument("--test-molecules", type=int, default=24, help="first N of chno_5to7, as chem_transfer.py")
    ap.add_argument("--results", type=Path, default=RESULTS)
    args = ap.parse_args()
    if not args.variant and (args.seed or args.diversity or args.delta):
        ap.error("--seed, --diversity and --delta need --variant NAME (the main result is seed 0, plain top-k, "
                 "the network alone)")
    path = args.results / "chem_transfer_learning.json"
    if args.variant and args.strategy == "both" and not path.is_file():
        ap.error(f"{path} is missing: run without --variant first (the main result, seed 0)")
    out_dir = args.out / args.variant if args.variant else args.out
    torch.set_num_threads(1)
    pool, test, names, unlabelled, level = labelled_sets(args.transfer, args.test_molecules)
    app = ChemApp()
    cfg = ChemConfig(molecules=POOL_LIBRARY, level=level, force_weight=1.0, max_atoms=pool["species"].shape[1],
                     baseline=args.delta)
    problem = PooledProblem(app.learning_problem(cfg), pool, test, curve_metrics=METRICS, note={
        "pool": f"{args.transfer}/train-{POOL_LIBRARY}", "test": f"{args.transfer}/test: {len(names)} molecules"})
    tcfg = TrainConfig(**{**app.train_defaults, "seed": args.seed})  # `converge train chem`'s, as chem_transfer.py
    common = dict(initial=args.initial, budget=args.budget, rounds=args.rounds, pool_size=args.pool, seed=args.seed,
                  members=args.members, n_test=len(test["energy"]), diversity=args.diversity, train_cfg=tcfg,
                  problem=problem)
    if args.strategy != "both":
        if args.strategy == "random" and not (round_dir(out_dir / "active", 0) / "metrics.json").is_file():
            raise SystemExit(f"random shares active's round 0: run --strategy active until "
                             f"{round_dir(out_dir / 'active', 0)}/metrics.json exists")
        if args.strategy == "random":
            share_initial_round(out_dir / "active", out_dir / "random", "random")
        run_active_learning(app, cfg, out_dir / args.strategy, strategy="qbc" if args.strategy == "active"
                            else "random", test_dir=out_dir / "test", **common)
        return 0
    result = compare_strategies(app, cfg, out_dir, **common)
    curves = {label: result[label] for label in ("active", "random")}
    out = {"pool": {"library": POOL_LIBRARY, "n_conformers": int(len(pool["energy"])),
                    "n_molecules": int(len(np.unique(pool["molecule"]))),
                    "max_heavy_atoms": max(heavy_atoms(smiles) for _, smiles in library(POOL_LIBRARY)),
                    "level_of_theory": cfg.level_of_theory, "source": problem.settings["pool"]},
           "test": {"library": TEST_LIBRARY, "n_molecules": len(names), "molecules": names,
                    "n_conformers": int(len(test["energy"])), "unlabelled": unlabelled},
           "settings": {k: getattr(args, k) for k in ("initial", "rounds", "pool", "budget", "members", "seed",
                                                       "diversity", "delta")},
           "train_config": {k: getattr(tcfg, k) for k in ("epochs", "batch_size", "lr", "patience")},
           "judged_by": "the committee's mean on the unseen test molecules (both strategies)",
           "curves": {label: [{"dft_calls": h["simulator_calls"], **{m: h[m] for m in METRICS},
                               "train_seconds": h["seconds"]["train_and_test"]} for h in curve]
                      for label, curve in curves.items()}}
    for metric in METRICS:
        out[metric] = reach_random_final(curves, metric)
    out["target"] = {"fraction_of_random_calls_at_most": TARGET_FRACTION, "met": {
        m: out[m]["fraction_of_random_calls"] is not None and out[m]["fraction_of_random_calls"] <= TARGET_FRACTION
        for m in METRICS}}
    transfer_json = args.results / "chem_transfer.json"
    transfer = json.loads(transfer_json.read_text()) if transfer_json.is_file() else {}
    if (transfer.get("train", {}).get("n_conformers") == len(pool["energy"]) and not transfer["train"].get("hot")
            and transfer.get("test", {}).get("molecules") == names):  # one network on all the pool, for scale
        out["one_network_on_the_whole_pool"] = {m: transfer["network"][m] for m in METRICS}
    out["machine"] = describe_machine()
    print(json.dumps({m: out[m] for m in METRICS}, indent=1))
    earlier = json.loads(path.read_text()) if path.is_file() else {}
    if args.variant:
        written = {**earlier, "variants": {**earlier.get("variants", {}), args.variant: out}}
    else:
        written = {**out, "variants": earlier.get("variants", {})}
        plot_learning_curves(curves, METRICS, args.results / "chem_transfer_learning.png")
    print("written", write_json(path, summarise_seeds(written, METRICS)), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
