"""Trust the surrogate: active learning against random sampling, and the spread off the training data.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/trust.py --out runs/trust          # ~70 min a seed, one core
    # faster: one process per seed (--seeds 0, --seeds 1, ...) into the same --out, then the line above
    # again: every stage resumes, so it only gathers the seeds (a minute)
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/trust.py --quick --out /tmp/trust  # ~1-2 min, smoke test

Setting (chem app, methanol, DFT at the ``fast`` level, B3LYP/6-31G*): every
candidate is a normal-mode-sampled conformer at 150, 300, 600 or 1200 K
(``--temperatures``). The candidate sampler is cheap and mostly yields
near-equilibrium conformers: shares 8:4:2:1 from cold to hot (``--shares``), for
the initial set and every pool alike. The surrogate must answer over the whole
range, so the held-out DFT test set (``--test`` conformers a seed, the same for
both strategies) takes every temperature in equal shares. That is the case
active learning is for (ANI-1x was tested on COMP6, not on its own sampler's
output): random picks follow the sampler, query by committee looks for what it
rarely makes. ``test_mae_candidate_weighted`` also reports the error weighted as
the candidates were; ``--shares 1,1,1,1`` draws the candidates like the test set
(session 3 measured that: a tie at 40 calls).

For each of ``--seeds``, both strategies start from the same ``--initial`` DFT
conformers (round 0 is computed once and shared) and, over ``--rounds`` rounds,
label ``--budget`` more, a round at a time, from fresh pools of ``--pool``
conformers: the ensemble's highest energy spread per sqrt(atom) (query by
committee, as ANI-1x; with ``--diversity`` a pick closer than that fraction of
the pool's median distance in interatomic distances to an earlier pick of the
round is skipped), or random ones. After each round a fresh ``--members``-model
ensemble is tested on the seed's test set. Curves are averaged over the seeds;
``calls_to_reach_random_final`` is where the mean active curve, interpolated
linearly between rounds, reaches the mean random curve's final error. Then each
seed's last active ensemble's spread on its test set (in distribution) is set
against its spread on much hotter conformers and on a molecule it never saw,
beside what the out-of-distribution check says about each.

DFT takes about 0.5 s a conformer here. Members write a checkpoint every
``--checkpoint-every`` epochs: a write (~40 ms) costs four epochs on these small
sets, and writing every epoch made checkpoints 70% of the training time.

Writes ``benchmarks/results/trust.json`` and ``trust_learning_curve.png`` (with
``--quick``, ``OUT/trust.json`` and ``OUT/learning_curve.png`` only). Every stage resumes.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from converge.apps.chem import ChemApp, ChemConfig
from converge.data.atomic import atomic_write_bytes, json_bytes
from converge.data.store import ShardStore
from converge.train.loop import TrainConfig
from converge.units import hartree_to_kcal_mol
from converge.validate.active import compare_strategies, median_distance, round_dir
from converge.validate.curves import calls_to_reach, mean_curve
from converge.serve.fallback import OOD, TrustConfig, TrustGate
from converge.serve.protocol import DATATYPES, ValidationError, check_inputs
from converge.serve.registry import load_served_model
from converge.validate.calibration import load_calibration
from converge.apps.chem.learning import ChemLearning, chem_spread
from converge.validate.ensemble import load_ensemble
from converge.apps.chem.ood import check_batch, load_envelope

RESULTS = Path(__file__).parent / "results"
STRATEGIES = ("active", "random")


def spread_on(ensemble, envelope, inputs: dict[str, np.ndarray]) -> dict:
    """Energy spread per atom (kcal/mol) of the ensemble on ``inputs``, and the share the OOD check flags."""
    spread = chem_spread(ensemble.predict(inputs), inputs["species"])
    per_atom = hartree_to_kcal_mol(spread.energy_std_per_atom.numpy())
    flagged = [bool(r) for r in check_batch(envelope, inputs["species"], inputs["coordinates"])]
    return {"n": len(per_atom), "mean_energy_spread_per_atom_kcal_mol": float(per_atom.mean()),
            "median_energy_spread_per_atom_kcal_mol": float(np.median(per_atom)),
            "mean_force_spread_kcal_mol_A": float(hartree_to_kcal_mol(spread.force_spread.numpy()).mean()),
            "ood_flagged_fraction": float(np.mean(flagged))}


def gate_routing(ensemble_dir: Path, sets: dict[str, dict], max_uncertainty: float) -> dict:
    """What trust-gated serving does with each input set: the share its gate sends to DFT, and why.

    The ensemble is loaded as ``converge serve`` loads it and each sample is judged by the
    server's own :class:`TrustGate` (spread above ``max_uncertainty``, or outside the
    training distribution); under ``--fallback simulator`` those samples are answered by DFT.
    """
    model = load_served_model(ensemble_dir, name="trust")
    gate = TrustGate.build(model, TrustConfig(max_uncertainty=max_uncertainty))
    out = {}
    for name, inputs in sets.items():
        x = {s.name: np.asarray(inputs[s.name], dtype=DATATYPES[s.datatype]) for s in model.inputs}
        try:
            check_inputs(x, model.inputs)
        except ValidationError as err:  # the server refuses such a request (HTTP 400) before the model or gate
            out[name] = {"routed_to_simulator_fraction": None, "refused_by_signature": str(err)}
            continue
        reasons = gate.judge(x, model.predict(x))
        out[name] = {"routed_to_simulator_fraction": float(np.mean([bool(r) for r in reasons])),
                     "by_spread_fraction": float(np.mean([any(not m.startswith(OOD) for m in r) for r in reasons])),
                     "by_ood_check_fraction": float(np.mean([any(m.startswith(OOD) for m in r) for r in reasons]))}
    gate.close()
    return out


def out_of_distribution(app: ChemApp, cfg: ChemConfig, problem: ChemLearning, ensemble_dir: Path,
                        test_inputs: dict, args) -> dict:
    """Spread in distribution (the test set) against much hotter conformers and molecules never trained on,
    and the serving gate on each at the limit the run's calibration chose (its energy-spread threshold per
    sqrt(atoms))."""
    ensemble, envelope = load_ensemble(app, ensemble_dir), load_envelope(ensemble_dir)
    hot = ChemLearning(app, cfg, temperatures=(args.ood_temperature,))
    sets = {"in_distribution": test_inputs,
            f"hot_{args.ood_temperature:g}K": hot.inputs(hot.draw(11, args.n_ood))}
    for molecule in args.unseen_molecule.split(","):
        other_cfg = ChemConfig(molecule=molecule, level=cfg.level, hidden=cfg.hidden)
        other = ChemLearning(app, other_cfg, temperatures=problem.temperatures)
        sets[f"unseen_{molecule}"] = other.inputs(other.draw(12, args.n_ood))
    report = {name: spread_on(ensemble, envelope, inputs) for name, inputs in sets.items()}
    # calibration.json's threshold is on the molecule's energy spread; the gate's score is per sqrt(atoms)
    limit = load_calibration(ensemble_dir)["threshold"] / np.sqrt(test_inputs["species"].shape[1])
    for name, routing in gate_routing(ensemble_dir, sets, limit).items():
        report[name].update(routing)
    return {**report, "gate_max_uncertainty_kcal_mol_per_sqrt_atom": float(limit)}


def summarise(curves: list[list[dict]], problem: ChemLearning) -> dict:
    """One strategy's curves over the seeds: the seed means, and each seed's values.

    ``test_mae_candidate_weighted`` weighs the per-temperature test errors by the candidate
    sampler's shares: the error on conformers distributed as the pools were.
    """
    keys = {"test_mae": "energy_mae_kcal_mol", "test_force_mae": "force_mae_kcal_mol_A",
            "mean_spread": "mean_energy_spread_kcal_mol"}
    calls, _ = mean_curve(curves, keys["test_mae"])
    out: dict = {"dft_calls": [int(c) for c in calls]}
    for name, metric in keys.items():
        out[name] = mean_curve(curves, metric)[1]
        out[f"{name}_by_seed"] = [[h[metric] for h in curve] for curve in curves]
    out["test_mae_by_temperature"] = [
        {t: float(np.mean([curve[r]["energy_mae_by_temperature"][t] for curve in curves]))
         for t in curves[0][r]["energy_mae_by_temperature"]} for r in range(len(calls))]
    weights = dict(zip((f"{t:g}" for t in problem.temperatures), problem.shares or [1.0] * len(problem.temperatures)))
    out["test_mae_candidate_weighted"] = [sum(weights[t] * mae for t, mae in row.items()) / sum(weights.values())
                                          for row in out["test_mae_by_temperature"]]
    out["spearman_spread_error"] = mean_curve([[h["calibration"] | {"simulator_calls": h["simulator_calls"]}
                                                for h in curve] for curve in curves], "spearman")[1]
    return out


def mean_over_seeds(reports: list[dict]) -> dict:
    """Field-by-field mean of the seeds' spread reports (same names)."""
    def mean(values: list) -> Any:  # numbers averaged; anything else (a refusal, None) as the first seed has it
        return float(np.mean(values)) if all(isinstance(v, (int, float)) for v in values) else values[0]

    return {name: {k: mean([r[name][k] for r in reports]) for k in reports[0][name]}
            if isinstance(reports[0][name], dict) else mean([r[name] for r in reports])
            for name in reports[0]}


def selection_spacing(run: Path, problem: ChemLearning, rounds: int) -> dict:
    """How far apart one round's picks lie (interatomic-distance space, Å) beside the pool's median distance."""
    nearest, median = [], []
    for r in range(1, rounds + 1):
        selection = json.loads((round_dir(run, r) / "selection.json").read_text())
        d = problem.descriptors(problem.inputs(selection["pool"]))
        picked = d[selection["selected"]]
        pairs = np.linalg.norm(picked[:, None] - picked[None], axis=-1)[np.triu_indices(len(picked), 1)]
        nearest.append(float(pairs.min()))
        median.append(median_distance(d))
    return {"closest_pair_of_picks_A": nearest, "pool_median_distance_A": median}


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, key, label in ((axes[0], "test_mae", "test energy MAE (kcal/mol)"),
                           (axes[1], "test_force_mae", "test force MAE (kcal/mol/Å)")):
        for name, color in zip(STRATEGIES, ("C0", "C1")):
            r = results[name]
            for seed_curve in r[f"{key}_by_seed"]:
                ax.plot(r["dft_calls"], seed_curve, "-", color=color, alpha=0.25, lw=1)
            ax.plot(r["dft_calls"], r[key], "o-", color=color, lw=2,
                    label=f"{'active (query by committee)' if name == 'active' else 'random'}, "
                          f"mean of {len(r[f'{key}_by_seed'])} seeds")
        ax.set(xlabel="DFT calls (training data)", ylabel=label, yscale="log")
        ax.grid(alpha=0.3, which="both")
    final, reach = results["random"]["test_mae"][-1], results["active"]["calls_to_reach_random_final"]
    axes[0].axhline(final, color="C1", ls="--", lw=1)
    if reach is not None:
        axes[0].axvline(reach, color="C0", ls=":", lw=1)
        axes[0].set_title(f"active reaches random's final {final:.2f} kcal/mol at {reach:.1f} calls", fontsize=10)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("runs/trust"))
    ap.add_argument("--molecule", default="methanol")
    ap.add_argument("--initial", type=int, default=8)
    ap.add_argument("--budget", type=int, default=72)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--pool", type=int, default=1024)
    ap.add_argument("--members", type=int, default=4)
    ap.add_argument("--test", type=int, default=48)
    ap.add_argument("--epochs", type=int, default=300)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--checkpoint-every", type=int, default=25,
                    help="epochs between a member's checkpoint writes (a write costs ~4 epochs here)")
    ap.add_argument("--seeds", default="0,1,2", help="comma-separated; the same seeds for both strategies")
    ap.add_argument("--diversity", type=float, default=0.3,
                    help="qbc batch diversity as a fraction of the pool's median distance (0: plain top-k)")
    ap.add_argument("--temperatures", default="150,300,600,1200", help="pool and test temperatures in K")
    ap.add_argument("--shares", default="8,4,2,1",
                    help="the candidate sampler's shares of --temperatures (initial set and pools); the test set "
                         "takes every temperature alike. 1,1,1,1: candidates drawn like the test set")
    ap.add_argument("--ood-temperature", type=float, default=2400.0)
    ap.add_argument("--unseen-molecule", default="ethanol,ethylene",
                    help="comma-separated molecules never trained on (ethylene has methanol's 6 atoms, so a server "
                         "of the methanol run takes it; ethanol's 9 it refuses)")
    ap.add_argument("--n-ood", type=int, default=64)
    ap.add_argument("--quick", action="store_true", help="a minute-long smoke run; results stay under --out")
    args = ap.parse_args()
    if args.quick:
        args.initial, args.budget, args.rounds, args.pool, args.members, args.seeds = 6, 4, 2, 64, 2, "0,1"
        args.test, args.epochs, args.n_ood = 6, 3, 8
    seeds = [int(x) for x in args.seeds.split(",")]
    torch.set_num_threads(1)
    app, cfg = ChemApp(), ChemConfig(molecule=args.molecule, level="fast")
    train_cfg = TrainConfig(epochs=args.epochs, batch_size=args.batch_size, lr=args.lr, patience=args.epochs,
                            precision="fp32", checkpoint_every=args.checkpoint_every)
    shares = tuple(float(w) for w in args.shares.split(","))
    problem = ChemLearning(app, cfg, temperatures=tuple(float(t) for t in args.temperatures.split(",")),
                           shares=shares)
    t0 = time.perf_counter()
    runs = {}
    for seed in seeds:
        runs[seed] = compare_strategies(
            app, cfg, args.out / f"seed-{seed}", initial=args.initial, budget=args.budget, rounds=args.rounds,
            pool_size=args.pool, seed=seed, members=args.members, n_test=args.test, diversity=args.diversity,
            train_cfg=train_cfg, progress=False, problem=problem)
    learn_s = time.perf_counter() - t0
    results: dict = {name: summarise([runs[s][name] for s in seeds], problem) for name in STRATEGIES}
    final_random = results["random"]["test_mae"][-1]
    reach = calls_to_reach(results["active"]["dft_calls"], results["active"]["test_mae"], final_random,
                           interpolate=True)
    results["active"].update({
        "calls_to_reach_random_final": reach,
        "calls_to_reach_random_final_rule": "seed-mean curves; linear interpolation between rounds",
        "calls_to_reach_random_final_measured_round": calls_to_reach(
            results["active"]["dft_calls"], results["active"]["test_mae"], final_random),
        "calls_to_reach_random_final_by_seed": [calls_to_reach(
            results["active"]["dft_calls"], a, r[-1], interpolate=True)
            for a, r in zip(results["active"]["test_mae_by_seed"], results["random"]["test_mae_by_seed"])],
        "fraction_of_random_calls": None if reach is None else reach / results["random"]["dft_calls"][-1],
        "selection_spacing_by_seed": [selection_spacing(args.out / f"seed-{s}" / "active", problem, args.rounds)
                                      for s in seeds],
    })
    results["target"] = {"rule": "active reaches random's final error with <= 50% of its DFT calls",
                         "met": reach is not None and reach <= 0.5 * results["random"]["dft_calls"][-1]}
    ood, calibration = [], {}
    for seed in seeds:
        final = {name: round_dir(args.out / f"seed-{seed}" / name, args.rounds) / "ensemble" for name in STRATEGIES}
        test = ShardStore.open(args.out / f"seed-{seed}" / "test").load(["species", "coordinates"])
        ood.append(out_of_distribution(app, cfg, problem, final["active"], test, args))
        calibration[str(seed)] = {name: {k: v for k, v in load_calibration(path).items() if k != "binned"}
                                  for name, path in final.items()}
    results["spread"] = {**mean_over_seeds(ood), "by_seed": ood, "ensemble": "each seed's last active ensemble"}
    results["calibration"] = calibration
    results["settings"] = {
        "molecule": args.molecule, "level_of_theory": cfg.level_of_theory, "temperatures_K": list(problem.temperatures),
        "candidate_shares": list(shares),
        "pool_and_test_distribution": "normal-mode conformers; candidates (initial set, pools) in candidate_shares "
                                      "per temperature, the test set in equal shares",
        "checkpoint_every": args.checkpoint_every,
        "initial": args.initial, "budget": args.budget, "rounds": args.rounds, "calls_per_round": args.budget // args.rounds,
        "pool_size": args.pool, "members": args.members, "n_test_per_seed": args.test, "epochs": args.epochs,
        "batch_size": args.batch_size, "lr": args.lr, "seeds": seeds, "diversity": args.diversity,
        "disagreement": "ensemble energy std / sqrt(atoms) (ANI-1x)", "ood_temperature_K": args.ood_temperature,
        "unseen_molecule": args.unseen_molecule, "quick": args.quick}
    results["seconds"] = {"learning": learn_s, "total": time.perf_counter() - t0, "threads": torch.get_num_threads()}
    target = args.out if args.quick else RESULTS
    target.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(target / "trust.json", json_bytes(results))
    plot(results, args.out / "learning_curve.png")
    if not args.quick:
        plot(results, RESULTS / "trust_learning_curve.png")
    r = results["random"]
    for name in STRATEGIES:
        print(f"{name:6s} calls {results[name]['dft_calls']} energy MAE "
              + " ".join(f"{v:.3f}" for v in results[name]["test_mae"]))
    print(f"active reaches random's final {r['test_mae'][-1]:.3f} kcal/mol after {reach} calls "
          f"(random: {r['dft_calls'][-1]}); target met: {results['target']['met']}")
    for name, s in results["spread"].items():
        if isinstance(s, dict) and "n" in s:
            print(f"spread per atom {name}: {s['mean_energy_spread_per_atom_kcal_mol']:.3f} kcal/mol, "
                  f"flagged by the OOD check: {s['ood_flagged_fraction']:.0%}, "
                  "served: " + (f"{s['routed_to_simulator_fraction']:.0%} routed to DFT by the gate"
                                if s["routed_to_simulator_fraction"] is not None
                                else f"refused (HTTP 400: {s['refused_by_signature']})"))
    print(json.dumps(results["seconds"]))


if __name__ == "__main__":
    main()
