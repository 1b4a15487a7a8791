"""One potential for chemical space: train on small CHNO molecules, test on unseen larger ones.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/chem_transfer.py --out runs/chem-transfer

Training set: normal-mode conformers (300 K, GFN2-xTB modes around the xTB minimum of the
RDKit ETKDG embedding) spread over the library ``chno_1to4_ext`` (closed-shell neutral CHNO
molecules with 1-4 heavy atoms: ``chno_1to4`` and the conjugated chains and small rings it
lacks, ``chno_1to4_conj``; ``--library chno_1to4`` leaves those out), DFT energies and forces
at the ``fast`` level. Test set: ``--test-conformers`` conformers of each of the first
``--test-molecules`` molecules of ``chno_5to7`` (5-7 heavy atoms, none in training), drawn the
same way and labelled at the same level; ``--hot`` more training conformers are drawn at
``--hot-temperature`` (600 K). The potential is a committee of ``--committee`` networks (ANI-1x
element networks on AEVs with the radial cutoff at 4.0 A, ``--aev-preset ani1x_r4``; self-energies
fitted over all training molecules), each trained with the CLI's defaults but
``app.force_weight=1.0`` (``--force-weight``) and its own seed, and judged by its mean on the
unseen molecules: conformer energies relative to each molecule's mean, and forces, beside GFN2-xTB
(its per-element offsets fitted on the test labels: generous to it). Every stage resumes; a larger
``--train`` grows the training set. Writes ``benchmarks/results/chem_transfer.json`` and
``chem_transfer.png``.

The committee's members are independent: ``--member I`` trains member I alone and stops, so two
processes can train members side by side; the plain command then finds them finished.

``--variant NAME --delta gfn2_xtb`` trains the same committee on DFT minus GFN2-xTB (``app.baseline``:
delta learning, :mod:`converge.apps.chem.delta`); its potential is xTB plus the network, and its entry adds
the speed against DFT and the screening rate beside xTB's, since each prediction pays for an xTB call.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

from converge.apps.chem import ChemApp, ChemConfig
from converge.apps.chem.aev import PRESETS
from converge.apps.chem.config import BASELINES
from converge.apps.chem.evaluate import (deviation_from_mean, error_report, far_from_mean, predict,
                                         relative_energy_mae, time_dft, time_surrogate, xtb_baseline)
from converge.apps.chem.screen import ScreenConfig, screen_file
from converge.apps.chem.molecule_set import molecule_set, stack_conformer_sets
from converge.apps.chem.ood import atoms_outside_neighbour_counts, fit_envelope
from converge.apps.chem.smiles import heavy_atoms, library
from converge.bench.artifacts import pyplot, save_figure, write_json
from converge.bench.machine import describe_machine
from converge.data.store import ShardStore
from converge.simulate.runner import SimulateConfig, run_ensemble
from converge.train.loop import TrainConfig, load_model, train
from converge.validate.ensemble import ENSEMBLE_FILE, member_dir, train_ensemble, train_member
from converge.units import hartree_to_kcal_mol

RESULTS = Path(__file__).parent / "results"
TRAIN_LIBRARY, TEST_LIBRARY = "chno_1to4_ext", "chno_5to7"
TRAIN_LIBRARIES = ("chno_1to4", "chno_1to4_ext")  # at most 4 heavy atoms
ANCHORS = {"ani1x_comp6": {"relative_energy_mae_kcal_mol": 1.85, "force_mae_kcal_mol_A": 3.09,
                           "source": "Smith et al., J. Chem. Phys. 148, 241733 (2018): ANI-1x on COMP6, "
                                     "5 million training conformers"}}
TARGETS = {"relative_energy_mae_kcal_mol": 1.5, "force_mae_kcal_mol_A": 3.0}
MAIN = {"hot": 1000, "aev_preset": "ani1x_r4", "committee": 3, "delta": ""}  # the main result's; others are variants
SCREEN_METHODS = (("network", "surrogate"), ("gfn2_xtb", "xtb"), ("dft", "dft"))  # result key, screen --method
FAR_KCAL_MOL = 50.0  # a conformer this far from its molecule's mean energy is no 300 K conformer


def stage_seconds(args: argparse.Namespace, stage: str, seconds: float, computed: bool, grown: bool = False) -> float:
    """Wall seconds of a stage: this call's when it computed anything (added to the earlier calls' when it grew
    or finished a stored dataset, ``grown``), else the first run's (``stages.json``); a run from before that file
    existed is timed by its shard files' modification times (first to last)."""
    path = args.out / "stages.json"
    found = json.loads(path.read_text()) if path.is_file() else {}
    if computed or stage not in found:
        if not computed:
            times = sorted(p.stat().st_mtime for p in (args.out / stage).rglob("*.h5"))
            seconds = times[-1] - times[0] if len(times) > 1 else seconds
        found[stage] = seconds + (found.get(stage, 0.0) if computed and grown else 0.0)
        path.write_text(json.dumps(found, indent=2))
    return float(found[stage])


def simulate_train(args: argparse.Namespace, hot: bool = False) -> tuple[Path, float]:
    """The training conformers at ``--temperature`` (or the ``--hot`` ones at ``--hot-temperature``)."""
    temperature, n, folder = ((args.hot_temperature, args.hot, hot_dir(args)) if hot else
                              (args.temperature, args.train, train_dir(args)))
    cfg = ChemConfig(molecules=args.library, level=args.level, temperature=temperature)
    t0 = time.perf_counter()
    res = run_ensemble(ChemApp(), cfg, SimulateConfig(samples=n, seed=12 if hot else 11, workers=args.workers,
                                                      shard_size=20), folder, progress=True)
    if res.n_failed:
        print(f"{folder.name}: {res.n_failed} DFT failures recorded: {res.failures[:3]}", file=sys.stderr)
    return folder, stage_seconds(args, folder.name, time.perf_counter() - t0, res.shards_computed > 0,
                                 grown=res.shards_skipped > 0)


def hot_entry(args: argparse.Namespace) -> dict | None:
    """The ``--hot`` conformers as the result file records them (None without)."""
    return {"n_conformers": args.hot, "temperature_K": args.hot_temperature} if args.hot else None


def hot_dir(args: argparse.Namespace) -> Path:
    """The ``--hot`` conformers of ``--library`` at ``--hot-temperature``."""
    return library_folder(args, f"train-{args.hot_temperature:g}K")


def training_stores(args: argparse.Namespace) -> list[ShardStore]:
    """The training data: the conformers at ``--temperature``, and the ``--hot`` ones if asked for."""
    return [ShardStore.open(train_dir(args))] + ([ShardStore.open(hot_dir(args))] if args.hot else [])


def library_folder(args: argparse.Namespace, stem: str) -> Path:
    """``STEM`` for chno_1to4 (the first library made), else ``STEM-LIBRARY``, under ``--out``."""
    return args.out / (stem if args.library == "chno_1to4" else f"{stem}-{args.library}")


def train_dir(args: argparse.Namespace) -> Path:
    """The training dataset of ``--library``."""
    return library_folder(args, "train")


def run_dir(args: argparse.Namespace) -> Path:
    """The run of ``--library``, or ``run-VARIANT`` for ``--variant``."""
    return args.out / f"run-{args.variant}" if args.variant else library_folder(args, "run")


def test_molecules(args: argparse.Namespace) -> list[tuple[str, str]]:
    return library(TEST_LIBRARY)[: args.test_molecules]


def labelled_test_molecules(args: argparse.Namespace) -> list[tuple[str, str]]:
    """The test molecules with at least one DFT-labelled conformer (:func:`unlabelled_test_molecules`: the rest)."""
    return [(name, smiles) for name, smiles in test_molecules(args) if len(ShardStore.open(args.out / "test" / name))]


def unlabelled_test_molecules(args: argparse.Namespace) -> list[dict]:
    """The test molecules whose every conformer failed, with the first failure's message."""
    out = []
    for name, _ in test_molecules(args):
        store = ShardStore.open(args.out / "test" / name)
        if not len(store):
            out.append({"molecule": name, "error": store.failures()[0]["error"] if store.failures() else "no samples"})
    return out


def simulate_test(args: argparse.Namespace) -> float:
    t0, computed, stored = time.perf_counter(), False, 0
    for k, (name, smiles) in enumerate(test_molecules(args)):
        stored += (args.out / "test" / name / "manifest.json").is_file()
        cfg = ChemConfig(molecule=f"smiles:{smiles}", level=args.level, temperature=args.temperature)
        res = run_ensemble(ChemApp(), cfg, SimulateConfig(samples=args.test_conformers, seed=1000 + k,
                                                          workers=args.workers, shard_size=args.test_conformers),
                           args.out / "test" / name, progress=False)
        print(f"test {k + 1}/{args.test_molecules} {name}: {res.n_ok} conformers", file=sys.stderr)
        computed = computed or res.shards_computed > 0
    return stage_seconds(args, "test", time.perf_counter() - t0, computed, grown=stored > 0)  # finished a stored set


def load_test(args: argparse.Namespace, n_atoms: int) -> dict[str, np.ndarray]:
    """The test molecules' conformers, padded to ``n_atoms`` atoms, with the molecule index of each."""
    keys = ["species", "coordinates", "energy", "forces"]
    return stack_conformer_sets([ShardStore.open(args.out / "test" / name).load(keys)
                                 for name, _ in labelled_test_molecules(args)], n_atoms)


def molecule_errors(arrays: dict, e_pred: np.ndarray, f_pred: np.ndarray, names: list[str]) -> dict:
    """Each test molecule's relative-energy and force MAE under one method's energies and forces."""
    out = {}
    for k, name in enumerate(names):
        sel = arrays["molecule"] == k
        errors = test_errors({key: value[sel] for key, value in arrays.items()}, e_pred[sel], f_pred[sel])
        out[name] = {key: errors[key] for key in TARGETS}
    return out


def per_molecule(arrays, e_pred, f_pred, e_xtb, f_xtb, names) -> list[dict]:
    network, xtb = molecule_errors(arrays, e_pred, f_pred, names), molecule_errors(arrays, e_xtb, f_xtb, names)
    rows = []
    for k, name in enumerate(names):
        sel = arrays["molecule"] == k
        relative = hartree_to_kcal_mol(arrays["energy"][sel] - arrays["energy"][sel].mean())
        n_atoms = int((arrays["species"][sel][0] > 0).sum())
        rows.append({"molecule": name, "n_conformers": int(sel.sum()), "n_atoms": n_atoms,
                     "dft_relative_energy_range_kcal_mol": [float(relative.min()), float(relative.max())],
                     "network": network[name], "gfn2_xtb": xtb[name]})
    return rows


def split_far_from_mean(arrays, names, predictions: dict[str, tuple[np.ndarray, np.ndarray]],
                        threshold: float = FAR_KCAL_MOL) -> dict:
    """The errors of each method (name -> energies, forces) on the molecules with a conformer more than
    ``threshold`` kcal/mol from their mean (:func:`far_from_mean`) and on the others: how much of the error
    the sampler's far conformers carry."""
    far = far_from_mean(arrays["energy"], arrays["molecule"], threshold)
    beyond = deviation_from_mean(arrays["energy"], arrays["molecule"]) > threshold
    out = {"threshold_kcal_mol": threshold, "n_conformers_beyond": int(beyond.sum()),
           "molecules": sorted({names[k] for k in arrays["molecule"][far]}, key=names.index)}
    for label, sel in (("those_molecules", far), ("the_others", ~far)):
        if not sel.any():  # no molecule on this side: no errors to give
            out[label] = {"n_molecules": 0}
            continue
        part = {key: value[sel] for key, value in arrays.items()}
        out[label] = {"n_molecules": int(len(np.unique(part["molecule"]))),
                      **{method: test_errors(part, e_pred[sel], f_pred[sel])
                         for method, (e_pred, f_pred) in predictions.items()}}
    return out


def neighbour_coverage(stores: list[ShardStore], arrays: dict, names: list[str],
                       cutoffs: tuple[float, ...] = (3.5, 4.0, 5.2)) -> dict:
    """The share of test atoms (overall and per molecule) with more or fewer neighbours within each cutoff (Å) than
    any training atom of their element had (:func:`fit_envelope`): AEV features outside the training range. 3.5 Å
    is ANI-1x's angular cutoff, 5.2 Å its radial one, 4.0 Å the ``ani1x_r4`` preset's."""
    parts = [store.load(["species", "coordinates"]) for store in stores]
    species = np.concatenate([p["species"] for p in parts])
    coordinates = np.concatenate([p["coordinates"] for p in parts])
    real = arrays["species"] > 0
    out = {"cutoffs_A": list(cutoffs), "share_of_test_atoms_outside": {}, "per_molecule": {}}
    for cutoff in cutoffs:
        outside = atoms_outside_neighbour_counts(fit_envelope(species, coordinates, cutoff=cutoff),
                                                 arrays["species"], arrays["coordinates"])
        out["share_of_test_atoms_outside"][f"{cutoff:.1f}"] = float(outside[real].mean())
        for k, name in enumerate(names):
            sel = arrays["molecule"] == k
            out["per_molecule"].setdefault(name, {})[f"{cutoff:.1f}"] = float(outside[sel][real[sel]].mean())
    return out


def plot(rows: list[dict], path: Path) -> Path:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(13, 0.28 * len(rows) + 1.8), sharey=True)
    y = np.arange(len(rows))
    for ax, key, unit, target in ((axes[0], "relative_energy_mae_kcal_mol", "kcal/mol", 1.5),
                                  (axes[1], "force_mae_kcal_mol_A", "kcal/mol/Å", 3.0)):
        ax.barh(y - 0.2, [r["network"][key] for r in rows], 0.4, label="network", color="tab:blue")
        ax.barh(y + 0.2, [r["gfn2_xtb"][key] for r in rows], 0.4, label="GFN2-xTB", color="tab:orange")
        ax.axvline(target, color="k", ls="--", lw=0.8, label=f"target {target}")
        ax.set(xlabel=f"{key.replace('_kcal_mol_A', '').replace('_kcal_mol', '').replace('_', ' ')} [{unit}]")
        ax.grid(alpha=0.3, axis="x")
        ax.legend(fontsize=8)
    axes[0].set_yticks(y, [f"{r['molecule']} ({r['n_atoms']} atoms)" for r in rows], fontsize=8)
    axes[0].invert_yaxis()
    fig.suptitle("unseen molecules (5-7 heavy atoms): network trained on 1-4 heavy atoms, against GFN2-xTB")
    fig.tight_layout()
    return save_figure(fig, path)


def finished_history(run: Path, epochs: int) -> list[dict] | None:
    """The epochs of a finished training run in ``run`` (``converge train chem --data TRAIN --out RUN`` gives the
    same run), or None if it has not finished."""
    path = run / "metrics.jsonl"
    if not (run / "best.pt").is_file() or not path.is_file():
        return None
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    return lines if len(lines) >= epochs else None


def speed(cfg: ChemConfig, models: list, arrays: dict[str, np.ndarray], n_dft: int) -> dict:
    """DFT at the trained level against the committee's energy+forces (its members one after another, as trained:
    float32) on the test conformers, one thread each."""
    single = [time_surrogate(m, arrays["species"], arrays["coordinates"], 1) for m in models]
    batched = [time_surrogate(m, arrays["species"], arrays["coordinates"], 256) for m in models]
    order = np.random.default_rng(0).permutation(len(arrays["energy"]))[:n_dft]  # across the test molecules
    dft = time_dft(cfg, arrays["species"][order], arrays["coordinates"][order], cfg.level, n_dft)
    return {"dft_level": cfg.level_of_theory, "dft_seconds_per_conformer": dft, "n_dft_timed": n_dft,
            "networks": len(models), "surrogate_seconds_single": sum(single), "surrogate_seconds_batched": sum(batched),
            "batch_size": 256, "speedup_single": dft / sum(single), "speedup_batched": dft / sum(batched),
            "one_network_seconds_single": single[0], "one_network_seconds_batched": batched[0],
            "threads": torch.get_num_threads()}


def test_set(args: argparse.Namespace) -> tuple[list[str], dict]:
    """The test molecules' names and their DFT arrays, padded to the largest."""
    names = [name for name, _ in labelled_test_molecules(args)]
    n_atoms = max(ShardStore.open(args.out / "test" / n).load(["species"])["species"].shape[1] for n in names)
    return names, load_test(args, n_atoms)


def run_predictions(app, run: Path, arrays: dict) -> tuple[np.ndarray, np.ndarray]:
    """The run's energies and forces on ``arrays`` (float64; a delta run's include its baseline's)."""
    model, _ = load_model(app, run)
    return predict(model.double(), arrays["species"], arrays["coordinates"])


def member_runs(run: Path) -> list[Path]:
    """The training runs of ``run``: its members if it is an ensemble run, else itself."""
    if (run / ENSEMBLE_FILE).is_file():
        return [run / name for name in json.loads((run / ENSEMBLE_FILE).read_text())["member_dirs"]]
    return [run]


def committee_predictions(app, runs: list[Path], arrays: dict) -> tuple[np.ndarray, np.ndarray, list]:
    """The mean energies and forces of ``runs`` on ``arrays`` (float64), and each run's own."""
    predictions = [run_predictions(app, run, arrays) for run in runs]
    return (np.mean([e for e, _ in predictions], axis=0), np.mean([f for _, f in predictions], axis=0), predictions)


def run_configs(runs: list[Path]) -> dict[Path, dict | None]:
    """Each run's ``config.json`` (None where it has none)."""
    return {r: json.loads((r / "config.json").read_text()) if (r / "config.json").is_file() else None for r in runs}


def member_errors(arrays: dict, configs: dict[Path, dict], predictions: list, root: Path) -> list[dict]:
    """Each member's own errors on the test set, with its seed and training-set size (``configs``: run -> its
    config.json, in the order of ``predictions``)."""
    out = []
    for (run, config), (e, f) in zip(configs.items(), predictions):
        out.append({"run": str(run.relative_to(root)), "seed": config["train"]["seed"],
                    "n_conformers": config["n_train_samples"] + config["n_val_samples"], **test_errors(arrays, e, f)})
    return out


def test_predictions(args: argparse.Namespace, app, run: Path) -> tuple[list[str], dict, np.ndarray, np.ndarray, list]:
    """The test molecules' names, their padded DFT arrays, the run's (its committee's mean) energies and forces on
    them (float64), and each member's errors (empty for one network)."""
    names, arrays = test_set(args)
    runs = member_runs(run)
    e_pred, f_pred, predictions = committee_predictions(app, runs, arrays)
    return names, arrays, e_pred, f_pred, member_errors(arrays, run_configs(runs), predictions, args.out) if len(runs) > 1 else []


def test_errors(arrays: dict[str, np.ndarray], e_pred: np.ndarray, f_pred: np.ndarray) -> dict:
    return {"relative_energy_mae_kcal_mol": relative_energy_mae(e_pred, arrays["energy"], arrays["molecule"]),
            **error_report(e_pred, f_pred, arrays["energy"], arrays["forces"], arrays["species"] > 0)}


def write_variant(args: argparse.Namespace, entry: dict) -> int:
    """Put ``entry`` under ``variants`` of chem_transfer.json (replacing one of the same name)."""
    path = args.results / "chem_transfer.json"
    previous = json.loads(path.read_text())
    previous["variants"] = [v for v in previous.get("variants", []) if v["variant"] != entry["variant"]] + [entry]
    print(json.dumps(entry, indent=1))
    print("written", write_json(path, previous), file=sys.stderr)
    return 0


def ensemble_variant(args: argparse.Namespace, app, runs: list[Path]) -> int:
    """The committee of ``runs`` (finished trainings on the same test set): its mean energies and forces there."""
    configs = run_configs(runs)
    unfinished = [str(r) for r, c in configs.items() if c is None or finished_history(r, c["train"]["epochs"]) is None]
    if len(runs) < 2 or unfinished:
        why = f"not finished: {', '.join(unfinished)}" if unfinished else "one given"
        raise SystemExit(f"--members: give two or more finished runs ({why})")
    _, arrays = test_set(args)
    e_pred, f_pred, predictions = committee_predictions(app, runs, arrays)
    members = member_errors(arrays, configs, predictions, args.out)
    sizes = {m["n_conformers"] for m in members}  # each member's own data: the command line's --hot is not theirs
    return write_variant(args, {"variant": args.variant, "library": args.library,
                                "n_conformers": sizes.pop() if len(sizes) == 1 else sorted(sizes), "members": members,
                                **test_errors(arrays, e_pred, f_pred),
                                "gfn2_xtb": test_errors(arrays, *xtb_baseline(arrays))})  # this test set's, side by side



def screen_methods(args: argparse.Namespace, run: Path, n_molecules: int, conformers: int, methods, tag: str) -> dict:
    """Molecules per second of a conformer search (embedding, optimisation, ranking) by each of ``methods`` on the
    first ``n_molecules`` test molecules with ``conformers`` ETKDG conformers each, back to back."""
    path = args.out / f"screen{tag}.smi"
    chosen = test_molecules(args)[:n_molecules]
    path.write_text("".join(f"{smiles} {name}\n" for name, smiles in chosen))
    out = {"molecules": [name for name, _ in chosen], "conformers_per_molecule": conformers}
    for label, method in methods:
        cfg = ScreenConfig(conformers=conformers, method=method)
        summary = screen_file(run, path, args.out / f"screen{tag}-{method}", cfg, progress=False)
        out[label] = {k: summary[k] for k in ("molecules_per_second", "seconds", "level_of_theory")}
        print(f"screen{tag} {label}: {summary['molecules_per_second']:.3g} molecules/s", file=sys.stderr)
    return out


def screening(args: argparse.Namespace, run: Path) -> dict:
    """The conformer search on the network, GFN2-xTB and DFT on the same few molecules in one run; then the network
    and xTB alone on more molecules and conformers (``larger``), where DFT would take hours."""
    out = screen_methods(args, run, args.screen_molecules, args.screen_conformers, SCREEN_METHODS, "")
    out["network_over_dft"] = out["network"]["molecules_per_second"] / out["dft"]["molecules_per_second"]
    out["network_over_xtb"] = out["network"]["molecules_per_second"] / out["gfn2_xtb"]["molecules_per_second"]
    larger = screen_methods(args, run, args.screen_larger_molecules, args.screen_larger_conformers, SCREEN_METHODS[:2],
                            "-larger")
    larger["network_over_xtb"] = larger["network"]["molecules_per_second"] / larger["gfn2_xtb"]["molecules_per_second"]
    out["larger"] = larger
    out["optimiser"] = ("ASE BFGS per conformer, fmax 0.05 eV/A; the network steps all of a molecule's conformers "
                        "together (one batched call per step), xTB and DFT take them one by one")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("runs/chem-transfer"))
    ap.add_argument("--library", choices=TRAIN_LIBRARIES, default=TRAIN_LIBRARY,
                    help="training molecules (chno_1to4_ext: chno_1to4 and the conjugated chains it lacks)")
    ap.add_argument("--train", type=int, default=2500, help="training conformers (DFT calls) over --library")
    ap.add_argument("--test-molecules", type=int, default=24, help="first N molecules of chno_5to7")
    ap.add_argument("--test-conformers", type=int, default=10, help="conformers per test molecule")
    ap.add_argument("--level", default="fast", help="DFT level of training and test labels")
    ap.add_argument("--temperature", type=float, default=300.0, help="normal-mode sampling temperature, K")
    ap.add_argument("--hot", type=int, default=MAIN["hot"], help="this many more training conformers (DFT calls) "
                    "over --library at --hot-temperature (0: none)")
    ap.add_argument("--hot-temperature", type=float, default=600.0, help="temperature of the --hot conformers, K")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=None, help="training epochs (default: the CLI's)")
    ap.add_argument("--batch-size", type=int, default=None)
    ap.add_argument("--n-dft-timing", type=int, default=4, help="test conformers timed with DFT")
    ap.add_argument("--screen-molecules", type=int, default=2, help="test molecules screened by all three methods")
    ap.add_argument("--screen-conformers", type=int, default=2, help="ETKDG conformers per screened molecule")
    ap.add_argument("--screen-larger-molecules", type=int, default=8, help="screened by the network and xTB")
    ap.add_argument("--screen-larger-conformers", type=int, default=10)
    ap.add_argument("--until", choices=("simulate", "train", "all"), default="all")
    ap.add_argument("--force-weight", type=float, default=1.0,
                    help="app.force_weight of the training (the app's default, 0.1, is for one molecule; over "
                         "chemical space 1.0 did better: see the fw variants in chem_transfer.json)")
    ap.add_argument("--aev-preset", default=MAIN["aev_preset"], choices=PRESETS,
                    help="app.aev_preset of the training (ani1x_r4: the radial cutoff at 4.0 Å; aev.py)")
    ap.add_argument("--committee", type=int, default=MAIN["committee"], help="networks trained with seeds SEED, "
                    "SEED+1, ... (an ensemble run, member-I/ under the run); their mean is judged (1: one network)")
    ap.add_argument("--member", type=int, default=None, help="train only this member of the committee and stop "
                    "(run members side by side in separate processes, then the plain command)")
    ap.add_argument("--delta", choices=BASELINES, default=MAIN["delta"],
                    help="with --variant: app.baseline of the training: gfn2_xtb trains the networks on DFT minus "
                         "GFN2-xTB and predicts xTB plus the network (delta learning; each prediction then costs an "
                         "xTB call too)")
    ap.add_argument("--seed", type=int, default=0, help="training seed (initial weights, batches, split)")
    ap.add_argument("--members", default="", help="with --variant: no training; the mean prediction of these "
                                                  "finished runs (comma-separated folder names under --out)")
    ap.add_argument("--variant", default="", help="train another run (runs/.../run-VARIANT) on the same data and add "
                    "its accuracy on the test set under 'variants' in chem_transfer.json")
    ap.add_argument("--only-screening", action="store_true", help="rerun only the screening of a finished run and "
                    "replace its entry in chem_transfer.json")
    ap.add_argument("--results", type=Path, default=RESULTS)
    args = ap.parse_args()
    if args.members and not args.variant:
        ap.error("--members needs --variant NAME (the ensemble's entry under variants)")
    changed = [f"--{k.replace('_', '-')} {getattr(args, k)}" for k, v in MAIN.items() if getattr(args, k) != v]
    if changed and not args.variant and args.results == RESULTS:  # elsewhere (--results): a trial of the pipeline
        ap.error(f"{', '.join(changed)} trains a variant, not the main result (--hot {MAIN['hot']} --aev-preset "
                 f"{MAIN['aev_preset']} --committee {MAIN['committee']}): give --variant NAME, a name of its own")
    if args.committee < 1:
        ap.error(f"--committee {args.committee}: give 1 (one network) or more")
    if args.member is not None and not (args.committee >= 2 and 0 <= args.member < args.committee):
        ap.error(f"--member {args.member}: give 0 to {args.committee - 1} of a --committee of 2 or more")
    torch.set_num_threads(1)
    _, train_sim_s = simulate_train(args)
    hot_sim_s = simulate_train(args, hot=True)[1] if args.hot else 0.0
    test_sim_s = simulate_test(args)
    if args.until == "simulate":
        return 0
    app = ChemApp()
    stores = training_stores(args)
    n_train = sum(map(len, stores))
    cfg = ChemConfig(molecules=args.library, level=args.level, temperature=args.temperature,
                     force_weight=args.force_weight, aev_preset=args.aev_preset, baseline=args.delta)
    overrides = {k: v for k, v in (("epochs", args.epochs), ("batch_size", args.batch_size)) if v is not None}
    overrides["seed"] = args.seed
    tcfg = TrainConfig(**{**app.train_defaults, **overrides})  # what `converge train chem` uses, unless overridden
    run = run_dir(args)
    if args.members:
        return ensemble_variant(args, app, [args.out / m.strip() for m in args.members.split(",") if m.strip()])
    extra = {"data": str(train_dir(args)), **({"hot_data": str(hot_dir(args))} if args.hot else {})}

    def training_arrays() -> dict[str, np.ndarray]:
        parts = [store.load() for store in stores]
        return {key: np.concatenate([part[key] for part in parts]) for key in parts[0]}

    if args.committee == 1:
        history = finished_history(run, tcfg.epochs)
        if history is None:  # train, or resume an interrupted run
            history = train(app, cfg, tcfg, training_arrays(), run, resume=(run / "last.pt").exists(),
                            extra_config=extra).history
        histories = [history]
    elif args.member is not None:  # one member; the plain command records the ensemble once all have finished
        done = train_member(app, cfg, tcfg, training_arrays(), run, args.member, progress=True, extra_config=extra)
        print(f"member {args.member} of {run}: best epoch {done['best_epoch']}, {done['epochs']} epochs",
              file=sys.stderr)
        return 0
    else:
        finished = (run / ENSEMBLE_FILE).is_file() and json.loads((run / ENSEMBLE_FILE).read_text())["members"] == \
            args.committee
        if not finished:  # trains the members not yet finished, one after another
            train_ensemble(app, cfg, tcfg, training_arrays(), run, members=args.committee, progress=True,
                           extra_config=extra)
        histories = [finished_history(member_dir(run, i), 0) for i in range(args.committee)]  # all finished above
    train_s = sum(h["seconds"] for hist in histories for h in hist)
    if args.until == "train":
        return 0
    if args.variant:  # the same data and test set, another training: its accuracy beside the main result
        names, arrays, e_pred, f_pred, members = test_predictions(args, app, run)
        entry = {"variant": args.variant, "library": args.library, "force_weight": cfg.force_weight,
                 "hidden": list(cfg.hidden), "aev_preset": cfg.aev_preset, "committee": args.committee,
                 "baseline": cfg.baseline or None,
                 "train_config": {k: getattr(tcfg, k) for k in ("epochs", "batch_size", "lr", "weight_decay", "seed")},
                 "n_conformers": n_train, "hot": hot_entry(args), "epochs_run": min(map(len, histories)),
                 "train_wall_s": train_s,
                 **test_errors(arrays, e_pred, f_pred), **({"members": members} if members else {}),
                 "per_molecule": molecule_errors(arrays, e_pred, f_pred, names),
                 "neighbour_coverage": neighbour_coverage(stores, arrays, names)}
        if cfg.baseline:  # its every prediction costs an xTB call: how much of the speed-up is left
            entry["speed"] = {**speed(cfg, [load_model(app, r)[0] for r in member_runs(run)], arrays,
                                      args.n_dft_timing),
                              "note": "each member's time includes its own GFN2-xTB call (the committee's sum "
                                      "counts xTB once per member)"}
            entry["screening"] = screen_methods(args, run, args.screen_larger_molecules, args.screen_larger_conformers,
                                                SCREEN_METHODS[:2], f"-{args.variant}")
        return write_variant(args, entry)
    if args.only_screening:
        path = args.results / "chem_transfer.json"
        previous = json.loads(path.read_text())
        previous["screening"] = screening(args, run)
        print(json.dumps(previous["screening"], indent=1))
        print("written", write_json(path, previous), file=sys.stderr)
        return 0
    names, arrays, e_pred, f_pred, members = test_predictions(args, app, run)
    t0 = time.perf_counter()
    e_xtb, f_xtb = xtb_baseline(arrays)
    xtb_s = time.perf_counter() - t0
    rows = per_molecule(arrays, e_pred, f_pred, e_xtb, f_xtb, names)
    train_mols = molecule_set(cfg)
    result_json = {
        "train": {"library": args.library, "n_molecules": len(train_mols),
                  "max_heavy_atoms": max(heavy_atoms(s) for _, s in library(args.library)),
                  "n_conformers": n_train, "dft_calls": sum(s.n_samples for s in stores),
                  "level_of_theory": cfg.level_of_theory, "temperature_K": args.temperature, "hot": hot_entry(args),
                  "simulate_wall_s": train_sim_s + hot_sim_s, "train_wall_s": train_s,
                  "aev_preset": cfg.aev_preset, "committee": args.committee,
                  "seeds": list(range(args.seed, args.seed + args.committee)),
                  "epochs_run": min(map(len, histories)),
                  "best_epoch": [1 + min(range(len(h)), key=lambda k: h[k][app.monitor.name]) for h in histories],
                  "train_config": {k: getattr(tcfg, k) for k in ("epochs", "batch_size", "lr", "patience")}},
        "test": {"library": TEST_LIBRARY, "n_molecules": len(names), "molecules": names,
                 "min_heavy_atoms": min(heavy_atoms(s) for _, s in labelled_test_molecules(args)),
                 "max_heavy_atoms": max(heavy_atoms(s) for _, s in labelled_test_molecules(args)),
                 "unlabelled": unlabelled_test_molecules(args),
                 "conformers_per_molecule": args.test_conformers, "n_conformers": int(len(arrays["energy"])),
                 "simulate_wall_s": test_sim_s, "level_of_theory": cfg.level_of_theory,
                 "overlap_with_train": sorted(set(names) & {m.name for m in train_mols})},
        "network": {**test_errors(arrays, e_pred, f_pred), "force_weight": cfg.force_weight,
                    "committee": args.committee, **({"members": members} if members else {})},
        "gfn2_xtb": {**test_errors(arrays, e_xtb, f_xtb), "wall_s": xtb_s,
                     "note": "absolute energies after per-element offsets fitted on the test labels"},
        "speed": speed(cfg, [load_model(app, r)[0] for r in member_runs(run)], arrays, args.n_dft_timing),
        "screening": screening(args, run),
        "neighbour_coverage": neighbour_coverage(stores, arrays, names),
        "far_from_mean": split_far_from_mean(arrays, names, {"network": (e_pred, f_pred), "gfn2_xtb": (e_xtb, f_xtb)}),
        "per_molecule": rows, "anchors": ANCHORS, "targets": TARGETS, "machine": describe_machine(),
    }
    result_json["level_of_theory"] = cfg.level_of_theory
    earlier = args.results / "chem_transfer.json"  # other trainings on this data or an earlier one stay beside it
    result_json["variants"] = json.loads(earlier.read_text()).get("variants", []) if earlier.is_file() else []
    result_json["targets_met"] = {
        key: result_json["network"][key] <= limit for key, limit in TARGETS.items()} | {
        f"better_than_xtb_{key}": result_json["network"][key] < result_json["gfn2_xtb"][key] for key in TARGETS}
    print(json.dumps({k: result_json[k] for k in ("network", "gfn2_xtb", "targets_met")}, indent=2))
    print("written", write_json(args.results / "chem_transfer.json", result_json),
          plot(rows, args.results / "chem_transfer.png"), file=sys.stderr)
    print(f"energy spread of the test set: {hartree_to_kcal_mol(np.ptp(arrays['energy'])):.0f} kcal/mol",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
