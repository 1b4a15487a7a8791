"""The network potential against DFT on held-out (and hot) conformers.

Errors: energy MAE/RMSE (kcal/mol) and force-component MAE (kcal/mol/Å) against
the DFT labels, beside two baselines: predicting the training mean energy, and
GFN2-xTB (tblite) with its mean offset from DFT removed. Speed: DFT per
conformer against the surrogate's energy+forces per conformer, single and
batched, timed in the same run on this machine.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ...config import ConfigError, from_dict, to_dict
from ...data.atomic import atomic_write_bytes
from ...data.store import ShardStore
from ...train.loop import load_model
from ...units import hartree_to_kcal_mol
from .config import LEVELS, ChemConfig
from .delta import xtb_energies_forces
from .dft import dft_energy_forces


@dataclass(frozen=True)
class ChemEvalConfig:
    """Settings of ``converge evaluate chem`` (the ``[evaluate]`` table)."""

    hot_data: str = ""  # a dataset sampled at a higher temperature than training ("" = none)
    timing_level: str = ""  # the DFT level timed against the surrogate ("": the run's own, the level it reproduces)
    ani_timing: bool = True  # also time DFT at the ANI-1 level (wB97X/6-31G(d)), reported on a line of its own
    n_dft_timing: int = 2  # conformers timed with DFT
    batch_size: int = 256
    xtb_baseline: bool = True

    def __post_init__(self) -> None:
        if self.timing_level and self.timing_level not in LEVELS:
            raise ConfigError(f"evaluate.timing_level={self.timing_level!r}: choose one of {', '.join(LEVELS)}")
        if self.n_dft_timing < 1:
            raise ConfigError(f"evaluate.n_dft_timing={self.n_dft_timing}: must be >= 1")


def predict(model: torch.nn.Module, species: np.ndarray, coordinates: np.ndarray,
            batch_size: int = 256) -> tuple[np.ndarray, np.ndarray]:
    """Total energies (N,) hartree and forces (N, A, 3) hartree/Å from the surrogate."""
    energies, forces = [], []
    for i in range(0, len(species), batch_size):
        s = torch.from_numpy(species[i : i + batch_size])
        c = torch.from_numpy(coordinates[i : i + batch_size]).to(model.energy_scale.dtype)
        out = model.energies_forces(s, c)
        energies.append(out.energy.double().numpy())
        forces.append(out.forces.double().numpy())
    return np.concatenate(energies), np.concatenate(forces)


def error_report(e_pred: np.ndarray, f_pred: np.ndarray | None, e_ref: np.ndarray,
                 f_ref: np.ndarray, real: np.ndarray | None = None) -> dict[str, float]:
    """MAE/RMSE of energies (kcal/mol) and MAE of the force components (kcal/mol/Å) of the ``real`` atoms
    ((N, A) mask; default all: padding atoms of a mixed set carry no force)."""
    de = hartree_to_kcal_mol(e_pred - e_ref)
    out = {"energy_mae_kcal_mol": float(np.abs(de).mean()), "energy_rmse_kcal_mol": float(np.sqrt((de**2).mean()))}
    if f_pred is not None:
        df = np.abs(hartree_to_kcal_mol(f_pred - f_ref))
        out["force_mae_kcal_mol_A"] = float(df[real].mean() if real is not None else df.mean())
    return out


def relative_energy_mae(e_pred: np.ndarray, e_ref: np.ndarray, molecule: np.ndarray) -> float:
    """MAE (kcal/mol) of conformer energies relative to their molecule's mean energy:
    ``|(E_pred - <E_pred>_m) - (E_ref - <E_ref>_m)|`` averaged over conformers, ``m`` the molecule of each.

    What a conformer search needs (which conformer is lower, by how much), free of any per-molecule
    offset; compare COMP6's conformer energy differences (Smith et al., J. Chem. Phys. 148, 241733 (2018)).
    """
    err = np.asarray(e_pred, dtype=np.float64) - np.asarray(e_ref, dtype=np.float64)
    groups = np.unique(molecule, return_inverse=True)[1]
    mean_err = np.bincount(groups, weights=err) / np.bincount(groups)
    return float(np.abs(hartree_to_kcal_mol(err - mean_err[groups])).mean())


def far_from_mean(e_ref: np.ndarray, molecule: np.ndarray, threshold_kcal_mol: float) -> np.ndarray:
    """Per conformer: does its molecule have any reference energy more than ``threshold_kcal_mol`` from the
    molecule's mean? (bool, same length as ``e_ref``; energies hartree.)

    Normal-mode sampling displaces atoms along straight lines. On a nearly free rotor, whose force
    constant sits at the sampler's floor, that can land a "300 K" conformer 100-200 kcal/mol up. This
    marks the molecules such conformers belong to, so that errors can be split by them.
    """
    groups = np.unique(molecule, return_inverse=True)[1]
    far = np.zeros(groups.max() + 1, dtype=bool)
    np.logical_or.at(far, groups, deviation_from_mean(e_ref, molecule) > threshold_kcal_mol)
    return far[groups]


def deviation_from_mean(e_ref: np.ndarray, molecule: np.ndarray) -> np.ndarray:
    """|E - <E>_m| in kcal/mol per conformer, ``m`` its molecule (energies hartree)."""
    e = hartree_to_kcal_mol(np.asarray(e_ref, dtype=np.float64))
    groups = np.unique(molecule, return_inverse=True)[1]
    return np.abs(e - (np.bincount(groups, weights=e) / np.bincount(groups))[groups])


def xtb_baseline(arrays: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """GFN2-xTB energies (N,) hartree, shifted by per-element offsets fitted to the DFT labels of this set (least
    squares on the element counts: generous to xTB; one molecule: its mean offset), and forces (N, A, 3) hartree/Å."""
    from .model import element_counts

    energy, forces = xtb_energies_forces(arrays["species"], arrays["coordinates"])
    counts = element_counts(arrays["species"])
    offsets, *_ = np.linalg.lstsq(counts, arrays["energy"] - energy, rcond=None)
    return energy + counts @ offsets, forces


def evaluate_set(model, arrays: dict[str, np.ndarray], train_mean: float, batch_size: int,
                 xtb: bool) -> tuple[dict[str, Any], np.ndarray]:
    """Errors of the surrogate and the baselines on one set; returns (report, predicted energies).

    Energies absolute and relative to each molecule's mean (:func:`relative_energy_mae`; ``molecule``
    array of a set, else one molecule); forces over the real atoms only.
    """
    e_ref, f_ref = arrays["energy"], arrays["forces"]
    real = arrays["species"] > 0
    molecule = arrays.get("molecule", np.zeros(len(e_ref), dtype=np.int64))
    e_pred, f_pred = predict(model, arrays["species"], arrays["coordinates"], batch_size)
    report: dict[str, Any] = {"n": int(len(e_ref)), "n_molecules": int(len(np.unique(molecule))),
                              **error_report(e_pred, f_pred, e_ref, f_ref, real),
                              "relative_energy_mae_kcal_mol": relative_energy_mae(e_pred, e_ref, molecule),
                              "baselines": {"mean": error_report(np.full_like(e_ref, train_mean), None, e_ref, f_ref)}}
    if xtb:
        e_x, f_x = xtb_baseline(arrays)
        report["baselines"]["gfn2_xtb"] = {**error_report(e_x, f_x, e_ref, f_ref, real),
                                           "relative_energy_mae_kcal_mol": relative_energy_mae(e_x, e_ref, molecule)}
    return report, e_pred


def get_molecule_symbols(numbers: np.ndarray) -> list[str]:
    from ase.data import chemical_symbols

    return [chemical_symbols[int(z)] for z in numbers]


def time_surrogate(model, species: np.ndarray, coordinates: np.ndarray, batch: int, repeats: int = 5) -> float:
    """Seconds per conformer for energy+forces at a given batch size (best of ``repeats``)."""
    s = torch.from_numpy(np.repeat(species[:1], batch, axis=0))
    c = torch.from_numpy(np.repeat(coordinates[:1], batch, axis=0)).to(model.energy_scale.dtype)
    model.energies_forces(s, c)  # warm-up
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        model.energies_forces(s, c)
        best = min(best, time.perf_counter() - t0)
    return best / batch


def time_dft(cfg: ChemConfig, species: np.ndarray, coordinates: np.ndarray, level: str, n: int) -> float:
    """Mean seconds per conformer of DFT energy+forces at ``level`` (one thread) over the first ``n`` conformers
    (species (N, A) with padding, coordinates (N, A, 3) Å), after one untimed warm-up call, as the surrogate gets."""
    dft_cfg = replace(cfg, level=level)

    def one(z: np.ndarray, xyz: np.ndarray) -> None:
        real = z > 0
        dft_energy_forces(get_molecule_symbols(z[real]), xyz[real], dft_cfg, threads=1)

    one(species[0], coordinates[0])
    n = min(n, len(coordinates))
    t0 = time.perf_counter()
    for z, xyz in zip(species[:n], coordinates[:n]):
        one(z, xyz)
    return (time.perf_counter() - t0) / n


def evaluate_run(app, run_dir: Path, data_dir: Path, out_dir: Path, ev: ChemEvalConfig | None = None,
                 progress: bool = True) -> dict[str, Any]:
    ev = ev or ChemEvalConfig()
    model, config = load_model(app, run_dir)
    cfg = from_dict(ChemConfig, config["app_config"], "app")
    train_data = Path(config.get("data", ""))
    sets = {"test": Path(data_dir)} | ({"hot": Path(ev.hot_data)} if ev.hot_data else {})
    loaded = {name: ShardStore.open(path).load() for name, path in sets.items()}
    train_mean = float(ShardStore.open(train_data).load(["energy"])["energy"].mean()) if train_data.is_dir() \
        else float(loaded["test"]["energy"].mean())
    report: dict[str, Any] = {"molecule": cfg.molecules or cfg.molecule, "level_of_theory": cfg.level_of_theory,
                              "n_train": config.get("n_train_samples"), "evaluate_config": to_dict(ev), "run": str(run_dir)}
    predictions = {}
    for name, arrays in loaded.items():
        report[name], predictions[name] = evaluate_set(model, arrays, train_mean, ev.batch_size, ev.xtb_baseline)
    test = loaded["test"]
    single = time_surrogate(model, test["species"], test["coordinates"], 1)
    batched = time_surrogate(model, test["species"], test["coordinates"], ev.batch_size)
    level = ev.timing_level or cfg.level
    dft = time_dft(cfg, test["species"], test["coordinates"], level, ev.n_dft_timing)
    report["speed"] = {"dft_seconds_per_conformer": dft, "dft_level": replace(cfg, level=level).level_of_theory,
                       "surrogate_seconds_single": single, "surrogate_seconds_batched": batched,
                       "batch_size": ev.batch_size, "threads": torch.get_num_threads(),
                       "note": "DFT after one warm-up call, mean over the timed conformers; the surrogate after "
                               "one warm-up call, best of 5; same thread count"}
    report["speedup_single"] = dft / single
    report["speedup_batched"] = dft / batched
    if ev.ani_timing and level != "ani":  # the level of ANI-1, which the network does not reproduce: labelled apart
        ani = time_dft(cfg, test["species"], test["coordinates"], "ani", ev.n_dft_timing)
        report["speed"]["ani_level"] = {"dft_level": replace(cfg, level="ani").level_of_theory,
                                        "dft_seconds_per_conformer": ani, "speedup_single": ani / single,
                                        "speedup_batched": ani / batched,
                                        "note": "not the level this network was trained on"}
    for key in ("energy_mae_kcal_mol", "energy_rmse_kcal_mol", "force_mae_kcal_mol_A", "relative_energy_mae_kcal_mol"):
        report[key] = report["test"][key]
    if "hot" in report:
        report["hot_energy_mae_kcal_mol"] = report["hot"]["energy_mae_kcal_mol"]
        report["hot_force_mae_kcal_mol_A"] = report["hot"]["force_mae_kcal_mol_A"]
    out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(out_dir / "evaluation.json", json.dumps(report, indent=2).encode())
    plot_parity(loaded, predictions, report, out_dir)
    return report


def plot_parity(loaded, predictions, report, out_dir: Path) -> None:
    """``parity.png``: surrogate against DFT energies, and the error against the energy above the minimum."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    e_min = min(float(a["energy"].min()) for a in loaded.values())
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4.2))
    for (name, arrays), color in zip(loaded.items(), ("tab:blue", "tab:red")):
        ref = hartree_to_kcal_mol(arrays["energy"] - e_min)
        pred = hartree_to_kcal_mol(predictions[name] - e_min)
        mae = report[name]["energy_mae_kcal_mol"]
        ax1.scatter(ref, pred, s=6, color=color, alpha=0.6, label=f"{name} (MAE {mae:.2f} kcal/mol)")
        ax2.scatter(ref, pred - ref, s=6, color=color, alpha=0.6, label=name)
    lim = ax1.get_xlim()
    ax1.plot(lim, lim, "k--", lw=0.8)
    ax1.set(xlabel="DFT energy above minimum [kcal/mol]", ylabel="network [kcal/mol]",
            title=f"{report['molecule']}: {report['level_of_theory']}")
    ax2.axhline(0, color="k", lw=0.8)
    ax2.set(xlabel="DFT energy above minimum [kcal/mol]", ylabel="network - DFT [kcal/mol]",
            title="error against energy above the minimum")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out_dir / "parity.png", dpi=120)
    plt.close(fig)
