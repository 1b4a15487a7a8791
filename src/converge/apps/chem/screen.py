"""``converge screen chem``: a conformer search per molecule with the trained potential, and a trust flag.

For each molecule of a .smi/.sdf/.xyz file: RDKit ETKDG conformers (:func:`~.smiles.embed_conformers`;
one, the given geometry, for .sdf/.xyz), each optimised by ASE's BFGS on the chosen energy
(the surrogate by default, or GFN2-xTB or DFT for comparison), all of a molecule's conformers stepped
together (:func:`~.sampling.optimize_geometries`: the network answers each step for the whole batch in
one call; xTB and DFT take the geometries one by one), then the lowest conformer and
every conformer's energy relative to it. With an ensemble run, the members' energy spread per
atom at the lowest conformer, ``sigma_E / sqrt(N)`` in kcal/mol (ANI's query-by-committee
score), is the trust flag: above the run's calibrated threshold (``calibration.json``) or
``max_spread`` the molecule is untrusted, and ``fallback="dft"`` recomputes its conformer
energies by DFT at the run's level (single points on the optimised geometries). A molecule whose
optimisation fails (an element the run was not trained on, atoms driven onto each other, DFT
without a converged SCF) gets a row with the reason in ``error`` and no energies; the screen goes on
and its summary lists the failures under ``failed``.

Writes ``OUT.csv`` (one row per molecule), ``OUT.sdf`` (the lowest conformers, where SMILES gave
the bonds) and ``OUT.extxyz`` (every optimised conformer, energies in ``info``).
"""
from __future__ import annotations

import csv
import io
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, NamedTuple, Sequence

import numpy as np

from ...config import ConfigError, from_dict
from ...data.atomic import atomic_write_bytes
from ...units import HARTREE_TO_KCAL_MOL
from .config import ChemConfig
from .smiles import MoleculeRecord, embed_conformers, read_molecules

METHODS = ("surrogate", "xtb", "dft")
FALLBACKS = ("", "dft")
EnergyForcesFn = Callable[[Sequence[str], np.ndarray], tuple[float, np.ndarray]]  # hartree, hartree/Å
# symbols, (B, n, 3) Å -> (B,) hartree, (B, n, 3) hartree/Å
BatchEnergyForcesFn = Callable[[Sequence[str], np.ndarray], tuple[np.ndarray, np.ndarray]]


@dataclass(frozen=True)
class ScreenConfig:
    """Settings of ``converge screen chem``."""

    conformers: int = 10  # ETKDG conformers per SMILES (after pruning, up to this many)
    fmax_ev_per_angstrom: float = 0.05  # BFGS stops below this largest force
    max_steps: int = 300  # BFGS steps per conformer at most
    prune_rms: float = 0.5  # Å heavy-atom RMSD: closer embeddings count as one
    seed: int = 0
    method: str = "surrogate"  # the energy the conformers are optimised on: surrogate | xtb | dft
    max_spread: float = 0.0  # kcal/mol per sqrt(atom); 0: the run's calibrated threshold, if it has one
    fallback: str = ""  # "dft": untrusted molecules' conformer energies recomputed by DFT

    def __post_init__(self) -> None:
        if self.conformers < 1 or self.max_steps < 1:
            raise ConfigError(f"conformers={self.conformers}, max_steps={self.max_steps}: give counts >= 1")
        if not self.fmax_ev_per_angstrom > 0 or self.prune_rms < 0 or self.max_spread < 0:
            raise ConfigError("fmax must be > 0 eV/Å, prune_rms and max_spread >= 0")
        if self.method not in METHODS:
            raise ConfigError(f"method={self.method!r}: choose one of {', '.join(METHODS)}")
        if self.fallback not in FALLBACKS:
            raise ConfigError(f"fallback={self.fallback!r}: give dft, or leave it empty to only flag")


class ScreenRow(NamedTuple):
    name: str
    smiles: str
    n_atoms: int
    n_conformers: int
    lowest_energy_hartree: float
    relative_energies_kcal_mol: list[float]  # of each optimised conformer, lowest first
    spread_kcal_mol_per_sqrt_atom: float | None
    trusted: bool | None
    source: str  # what the reported energies come from: surrogate, xtb, dft
    seconds: float
    error: str = ""  # why the molecule has no result (its optimisation failed); the screen goes on


def starting_geometries(record: MoleculeRecord, cfg: ScreenConfig) -> list[np.ndarray]:
    """ETKDG conformers of a SMILES record, or its one given geometry (.sdf/.xyz without SMILES)."""
    if record.smiles:
        return embed_conformers(record.smiles, cfg.conformers, seed=cfg.seed, prune_rms=cfg.prune_rms)
    return [np.asarray(record.molecule.positions)]


def optimise(symbols: Sequence[str], starts: Sequence[np.ndarray], energy_forces: BatchEnergyForcesFn,
             cfg: ScreenConfig) -> tuple[np.ndarray, np.ndarray]:
    """The BFGS minima [Å] ``(B, n, 3)`` from ``starts`` and their energies [hartree], all stepped together; a
    conformer that does not reach ``fmax`` in ``max_steps`` keeps its last geometry (the conformer search
    ranks it all the same)."""
    from .sampling import optimize_geometries

    final, energies, _, _ = optimize_geometries(symbols, np.stack(starts), lambda p: energy_forces(symbols, p),
                                                cfg.fmax_ev_per_angstrom, cfg.max_steps)
    return final, energies


def one_by_one(energy_forces: EnergyForcesFn) -> BatchEnergyForcesFn:
    """A batch function that asks ``energy_forces`` for each geometry in turn (xTB, DFT)."""
    def batch(symbols: Sequence[str], positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        results = [energy_forces(symbols, p) for p in positions]
        return np.array([e for e, _ in results]), np.stack([f for _, f in results])

    return batch


def relative_kcal(energies: Sequence[float]) -> list[float]:
    """Energies [hartree] relative to their minimum, kcal/mol, sorted ascending."""
    e = np.sort(np.asarray(energies, dtype=np.float64))
    return [float(x) for x in (e - e[0]) * HARTREE_TO_KCAL_MOL]


# -- energies ------------------------------------------------------------------------------------
def surrogate_energy_forces(run: Path) -> tuple[BatchEnergyForcesFn, ChemConfig]:
    """The run's potential (float64), or member 0 of an ensemble run, as a batch energy/forces function; and
    the run's app config."""
    from .calculator import Calculator
    from .molecules import ATOMIC_NUMBERS

    calc = Calculator(run / "member-0" if is_ensemble(run) else run)

    def energy_forces(symbols: Sequence[str], positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return calc.predict(np.array([ATOMIC_NUMBERS[s] for s in symbols]), positions)

    return energy_forces, from_dict(ChemConfig, calc.config["app_config"], "app")


def reference_energy_forces(method: str, cfg: ChemConfig) -> EnergyForcesFn:
    """GFN2-xTB, or DFT at ``cfg``'s level, as an energy/forces function (hartree, hartree/Å)."""
    if method == "xtb":
        from .sampling import xtb_energy_forces

        return lambda symbols, positions: tuple(xtb_energy_forces(symbols, positions))  # type: ignore[return-value]
    from .dft import dft_energy_forces

    def dft(symbols: Sequence[str], positions: np.ndarray) -> tuple[float, np.ndarray]:
        result = dft_energy_forces(list(symbols), positions, cfg, threads=1)
        return result.energy_hartree, result.forces_hartree_per_angstrom

    return dft


def is_ensemble(run: Path) -> bool:
    from ...validate.ensemble import ENSEMBLE_FILE

    return (Path(run) / ENSEMBLE_FILE).is_file()


def trust_limit(run: Path, cfg: ScreenConfig) -> float | None:
    """The spread above which a molecule is untrusted: ``max_spread``, else the run's calibrated threshold."""
    if cfg.max_spread > 0:
        return cfg.max_spread
    path = Path(run) / "calibration.json"
    if path.is_file():
        threshold = json.loads(path.read_text()).get("threshold")
        return float(threshold) if threshold else None
    return None


def ensemble_spread(ensemble: Any, symbols: Sequence[str], positions: np.ndarray) -> float:
    """``sigma_E / sqrt(N)`` of the members' energies at one geometry, kcal/mol."""
    from .molecules import ATOMIC_NUMBERS

    z = np.array([[ATOMIC_NUMBERS[s] for s in symbols]], dtype=np.int64)
    prediction = ensemble.predict({"species": z, "coordinates": np.asarray(positions, dtype=np.float32)[None]})
    return float(prediction.std["energy"].reshape(-1)[0] * HARTREE_TO_KCAL_MOL / np.sqrt(len(symbols)))


# -- the screen ----------------------------------------------------------------------------------
def screen_record(record: MoleculeRecord, energy_forces: BatchEnergyForcesFn, cfg: ScreenConfig, source: str,
                  ensemble: Any = None, limit: float | None = None,
                  fallback: EnergyForcesFn | None = None) -> tuple[ScreenRow, list[np.ndarray], list[float]]:
    """One molecule: its optimised conformers [Å] and their energies [hartree], lowest first, and its row."""
    from .calculator import InputError
    from .delta import BaselineError
    from .dft import SCFNotConverged

    t0 = time.perf_counter()
    symbols = record.molecule.symbols
    try:
        final, found = optimise(symbols, starting_geometries(record, cfg), energy_forces, cfg)
    except (InputError, SCFNotConverged, BaselineError) as e:  # atoms the run was not trained on, a collapsed
        # geometry, no SCF (DFT, or the xTB under a delta run)
        row = ScreenRow(record.name, record.smiles or "", len(symbols), 0, float("nan"), [], None, False, source,
                        time.perf_counter() - t0, f"{type(e).__name__}: {e}")
        return row, [], []
    order = np.argsort(found, kind="stable")
    geometries, energies = [final[k] for k in order], [float(found[k]) for k in order]
    spread = ensemble_spread(ensemble, symbols, geometries[0]) if ensemble is not None else None
    trusted = None if spread is None or limit is None else bool(spread <= limit)
    if trusted is False and fallback is not None:
        energies = [fallback(symbols, p)[0] for p in geometries]
        order = np.argsort(energies)
        geometries, energies, source = [geometries[k] for k in order], [energies[k] for k in order], "dft"
    row = ScreenRow(record.name, record.smiles or "", len(symbols), len(geometries), float(energies[0]),
                    relative_kcal(energies), spread, trusted, source, time.perf_counter() - t0)
    return row, geometries, energies


def screen_file(run: str | Path | None, path: str | Path, out: str | Path, cfg: ScreenConfig = ScreenConfig(),
                progress: bool = True) -> dict[str, Any]:
    """Screen every molecule of ``path``; writes ``OUT.csv``, ``OUT.sdf``, ``OUT.extxyz``; returns the summary.

    ``run`` is the trained run (needed for ``method="surrogate"``; its level of theory is DFT's).
    """
    records = read_molecules(path)
    if run is None and (cfg.method == "surrogate" or cfg.fallback):
        raise ConfigError(f"method={cfg.method}{', fallback=' + cfg.fallback if cfg.fallback else ''} needs a "
                          "trained run: give --run RUN")
    app_cfg, ensemble, limit, fallback = ChemConfig(), None, None, None
    surrogate = None
    if run is not None:
        run = Path(run)
        surrogate, app_cfg = surrogate_energy_forces(run)
        if is_ensemble(run):
            from ...validate.ensemble import load_ensemble
            from .app import ChemApp

            ensemble, limit = load_ensemble(ChemApp(), run), trust_limit(run, cfg)
        if cfg.fallback == "dft":
            fallback = reference_energy_forces("dft", app_cfg)
    energy_forces = surrogate if cfg.method == "surrogate" else one_by_one(reference_energy_forces(cfg.method,
                                                                                                  app_cfg))
    import ase.optimize  # noqa: F401 - its import (a second, scipy.optimize with it) is not the screen's time

    rows, frames = [], []
    t0 = time.perf_counter()
    from rich.progress import Progress

    with Progress(disable=not progress, transient=True) as bar:
        task = bar.add_task(f"screening {len(records)} molecules ({cfg.method})", total=len(records))
        for record in records:
            row, geometries, energies = screen_record(record, energy_forces, cfg, cfg.method, ensemble, limit,
                                                      fallback)
            rows.append(row)
            frames.append((record, geometries, energies))
            bar.advance(task)
    seconds = time.perf_counter() - t0
    out = Path(out)
    write_outputs(out, rows, frames, cfg.method)
    return {"molecules": len(rows), "seconds": seconds, "molecules_per_second": len(rows) / seconds,
            "method": cfg.method, "level_of_theory": app_cfg.level_of_theory if cfg.method != "xtb" else "GFN2-xTB",
            "untrusted": sum(r.trusted is False for r in rows),
            "failed": {r.name: r.error for r in rows if r.error}, "csv": str(out.with_suffix(".csv")),
            "sdf": str(out.with_suffix(".sdf")), "extxyz": str(out.with_suffix(".extxyz"))}


def write_outputs(out: Path, rows: Sequence[ScreenRow], frames: Sequence[tuple], method: str) -> None:
    """``OUT.csv``, ``OUT.extxyz`` (every optimised conformer) and ``OUT.sdf`` (lowest conformers), atomically."""
    import ase.io
    from ase import Atoms

    text = io.StringIO()
    writer = csv.writer(text)
    writer.writerow(ScreenRow._fields)
    for r in rows:
        writer.writerow([*r[:5], ";".join(f"{e:.3f}" for e in r.relative_energies_kcal_mol),
                         "" if r.spread_kcal_mol_per_sqrt_atom is None else f"{r.spread_kcal_mol_per_sqrt_atom:.4f}",
                         "" if r.trusted is None else r.trusted, r.source, f"{r.seconds:.3f}", r.error])
    atomic_write_bytes(out.with_suffix(".csv"), text.getvalue().encode())
    xyz = io.StringIO()
    for record, geometries, energies in frames:
        for k, (positions, energy) in enumerate(zip(geometries, energies)):
            atoms = Atoms(symbols=list(record.molecule.symbols), positions=positions)
            atoms.info.update(name=record.name, conformer=k, energy_hartree=float(energy), method=method,
                              relative_kcal_mol=float((energy - energies[0]) * HARTREE_TO_KCAL_MOL))
            ase.io.write(xyz, atoms, format="extxyz")
    atomic_write_bytes(out.with_suffix(".extxyz"), xyz.getvalue().encode())
    atomic_write_bytes(out.with_suffix(".sdf"), lowest_conformers_sdf(frames).encode())


def lowest_conformers_sdf(frames: Sequence[tuple]) -> str:
    """An SDF block per molecule given by SMILES: its bonds from RDKit, coordinates of its lowest conformer."""
    from rdkit import Chem
    from rdkit.Geometry import Point3D

    text = io.StringIO()
    for record, geometries, energies in frames:
        if not record.smiles or not geometries:  # no SMILES bonds, or no result
            continue
        mol = Chem.AddHs(Chem.MolFromSmiles(record.smiles))
        conf = Chem.Conformer(mol.GetNumAtoms())
        for i, (x, y, z) in enumerate(geometries[0]):
            conf.SetAtomPosition(i, Point3D(float(x), float(y), float(z)))
        mol.AddConformer(conf, assignId=True)
        mol.SetProp("_Name", record.name)
        mol.SetProp("energy_hartree", f"{energies[0]:.10f}")
        text.write(Chem.MolToMolBlock(mol) + "$$$$\n")
    return text.getvalue()
