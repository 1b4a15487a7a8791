"""Active learning over chemical space: query by committee against random selection at equal DFT calls.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/chem_space_learning.py --out runs/al-chno

The same run as ``converge learn chem --strategy both --set app.molecules=chno_1to4 --set app.level=fast
--initial 48 --budget 96 --rounds 3 --pool 384 --members 3 --test 48 --epochs 300 --batch-size 16``:
candidates are normal-mode conformers of the 97 molecules of ``chno_1to4`` (cheap, no DFT), a
3-member committee scores each pool by its energy spread per atom, and the most disputed 32 per
round are labelled by DFT (B3LYP/6-31G*), against 32 random ones from the same pool. Both are
judged on one held-out set of 48 conformers drawn the same way. Resumes from ``--out``; writes
``benchmarks/results/chem_space_learning.json`` and ``.png``.

``--variant NAME --seed S [--diversity D]`` runs the same comparison with another seed (initial set,
pools, held-out set, members) or with batch diversity, in ``--out``/NAME, and adds its figures under
``variants.NAME`` of the JSON, leaving the main result as it is; ``seeds`` there summarises every
plain run (no diversity) by seed.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch

from converge.apps.chem import ChemApp, ChemConfig
from converge.bench.artifacts import write_json
from converge.bench.machine import describe_machine
from converge.train.loop import TrainConfig
from converge.validate.active import compare_strategies
from converge.validate.curves import reach_random_final, summarise_seeds

RESULTS = Path(__file__).parent / "results"
METRICS = ("energy_mae_kcal_mol", "force_mae_kcal_mol_A", "relative_energy_mae_kcal_mol")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("runs/al-chno"))
    ap.add_argument("--results", type=Path, default=RESULTS)
    ap.add_argument("--variant", default="", help="a name: run in OUT/NAME and add the figures under variants.NAME")
    ap.add_argument("--seed", type=int, default=0, help="with --variant: the seed of sets, pools and members")
    ap.add_argument("--diversity", type=float, default=0.0, help="with --variant: qbc batch diversity (a fraction "
                    "of the pool's median distance; 0 is plain top-k)")
    args = ap.parse_args()
    if not args.variant and (args.seed or args.diversity):
        ap.error("--seed and --diversity need --variant NAME (the main result is seed 0, plain top-k)")
    torch.set_num_threads(1)
    app, cfg = ChemApp(), ChemConfig(molecules="chno_1to4", level="fast")
    tcfg = TrainConfig(epochs=300, batch_size=16, patience=300, checkpoint_every=25)  # as `converge learn` sets it
    out_dir = args.out / args.variant if args.variant else args.out
    result = compare_strategies(app, cfg, out_dir, initial=48, budget=96, rounds=3, pool_size=384, seed=args.seed,
                                members=3, n_test=48, train_cfg=tcfg, problem=app.learning_problem(cfg),
                                progress=False, diversity=args.diversity)
    curves = {label: [{"dft_calls": h["simulator_calls"], **{m: h.get(m) for m in METRICS}} for h in result[label]]
              for label in ("active", "random")}
    out = {"library": "chno_1to4", "level_of_theory": cfg.level_of_theory, "members": 3, "pool_size": 384,
           "initial": 48, "budget": 96, "rounds": 3, "n_test": 48, "seed": args.seed, "diversity": args.diversity,
           "curves": curves}
    for metric in METRICS:
        out[metric] = reach_random_final({label: result[label] for label in ("active", "random")}, metric)
    out["target"] = {"fraction_of_random_calls_at_most": 0.5, "metric": "energy_mae_kcal_mol",
                     "met": bool(out["energy_mae_kcal_mol"]["fraction_of_random_calls"] is not None
                                 and out["energy_mae_kcal_mol"]["fraction_of_random_calls"] <= 0.5)}
    out["machine"] = describe_machine()
    path = args.results / "chem_space_learning.json"
    if args.variant:
        if not path.is_file():
            sys.exit(f"{path} is missing: run without --variant first (the main result, seed 0)")
        written = json.loads(path.read_text())
        written.setdefault("variants", {})[args.variant] = out
    else:
        old = json.loads(path.read_text()) if path.is_file() else {}
        written = {**out, "variants": old.get("variants", {})}
        shutil.copy(out_dir / "learning_curve.png", args.results / "chem_space_learning.png")
    print(write_json(path, summarise_seeds(written, METRICS)), file=sys.stderr)
    for metric in METRICS:
        print(metric, out[metric])
    return 0


if __name__ == "__main__":
    sys.exit(main())
