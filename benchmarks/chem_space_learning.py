"""Active learning over chemical space: query by committee against random selection at equal DFT calls.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/chem_space_learning.py --out runs/al-chno

The same run as ``converge learn chem --strategy both --set app.molecules=chno_1to4 --set app.level=fast
--initial 48 --budget 96 --rounds 3 --pool 384 --members 3 --test 48 --epochs 300 --batch-size 16``:
candidates are normal-mode conformers of the 97 molecules of ``chno_1to4`` (cheap, no DFT), a
3-member committee scores each pool by its energy spread per atom, and the most disputed 32 per
round are labelled by DFT (B3LYP/6-31G*), against 32 random ones from the same pool. Both are
judged on one held-out set of 48 conformers drawn the same way. Resumes from ``--out``; writes
``benchmarks/results/chem_space_learning.json`` and ``.png``.
"""
from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import torch

from converge.apps.chem import ChemApp, ChemConfig
from converge.bench.artifacts import write_json
from converge.bench.machine import describe_machine
from converge.train.loop import TrainConfig
from converge.validate.active import calls_to_reach, compare_strategies

RESULTS = Path(__file__).parent / "results"
METRICS = ("energy_mae_kcal_mol", "force_mae_kcal_mol_A", "relative_energy_mae_kcal_mol")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("runs/al-chno"))
    ap.add_argument("--results", type=Path, default=RESULTS)
    args = ap.parse_args()
    torch.set_num_threads(1)
    app, cfg = ChemApp(), ChemConfig(molecules="chno_1to4", level="fast")
    tcfg = TrainConfig(epochs=300, batch_size=16, patience=300, checkpoint_every=25)  # as `converge learn` sets it
    result = compare_strategies(app, cfg, args.out, initial=48, budget=96, rounds=3, pool_size=384, seed=0,
                                members=3, n_test=48, train_cfg=tcfg, problem=app.learning_problem(cfg),
                                progress=False)
    curves = {label: [{"dft_calls": h["simulator_calls"], **{m: h.get(m) for m in METRICS}} for h in result[label]]
              for label in ("active", "random")}
    out = {"library": "chno_1to4", "level_of_theory": cfg.level_of_theory, "members": 3, "pool_size": 384,
           "initial": 48, "budget": 96, "rounds": 3, "n_test": 48, "curves": curves}
    for metric in METRICS:
        calls = [c["dft_calls"] for c in curves["active"]]
        target = curves["random"][-1][metric]
        reach = calls_to_reach(calls, [c[metric] for c in curves["active"]], target, interpolate=True)
        out[metric] = {"random_final": target, "active_final": curves["active"][-1][metric],
                       "active_calls_to_reach_random_final": reach,
                       "fraction_of_random_calls": None if reach is None else reach / calls[-1]}
    out["target"] = {"fraction_of_random_calls_at_most": 0.5, "metric": "energy_mae_kcal_mol",
                     "met": bool(out["energy_mae_kcal_mol"]["fraction_of_random_calls"] is not None
                                 and out["energy_mae_kcal_mol"]["fraction_of_random_calls"] <= 0.5)}
    out["machine"] = describe_machine()
    print(write_json(args.results / "chem_space_learning.json", out), file=sys.stderr)
    shutil.copy(args.out / "learning_curve.png", args.results / "chem_space_learning.png")
    for metric in METRICS:
        print(metric, out[metric])
    return 0


if __name__ == "__main__":
    sys.exit(main())
