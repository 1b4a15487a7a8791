"""The trained potential as an ASE calculator, and ``converge predict chem``.

``Calculator(run)`` plugs the network into ASE: geometry optimisation, molecular
dynamics, vibrations. ASE works in eV and Å; the model in hartree and Å; the
conversion happens here and only here (``converge.units``). Inputs are checked
before they reach the network: elements it was not trained on, overlapping
atoms and coordinates that look like bohr rather than Å are clear errors, not
silent numbers.
"""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np
import torch
from ase import Atoms
from ase.calculators.calculator import Calculator as ASECalculator
from ase.calculators.calculator import all_changes

from ...train.loop import load_model
from ...units import HARTREE_TO_EV, HARTREE_TO_KCAL_MOL
from .molecules import closest_pair

MIN_DISTANCE_A = 0.5  # Å; closer atoms overlap (the shortest bond, H2, is 0.74 Å)
# Every atom of a covalent CHNO molecule has a neighbour within ~1.5 Å (C-C 1.54, C-H 1.09);
# in bohr these read ~1.9x longer, so a typical nearest-neighbour distance above 1.8 means bohr.
MAX_TYPICAL_NEIGHBOUR_A = 1.8


class InputError(ValueError):
    """A structure the potential must not be asked about; the message says why."""


def check_structure(numbers: Sequence[int], positions: np.ndarray, elements: Sequence[int]) -> None:
    """Refuse unknown elements, wrong shapes, overlapping atoms and bohr-looking coordinates."""
    from ase.data import chemical_symbols

    positions = np.asarray(positions, dtype=float)
    if positions.ndim != 2 or positions.shape != (len(numbers), 3):
        raise InputError(f"positions must be (n_atoms, 3) = ({len(numbers)}, 3) in Å, got {positions.shape}")
    if not np.all(np.isfinite(positions)):
        raise InputError("positions contain NaN or inf")
    unknown = sorted({int(z) for z in numbers} - set(int(e) for e in elements))
    if unknown:
        names = ", ".join(chemical_symbols[z] for z in unknown)
        known = ", ".join(chemical_symbols[int(e)] for e in elements)
        raise InputError(f"element(s) {names} not supported: this potential was trained on {known} only")
    if len(numbers) < 2:
        return
    i, j, d = closest_pair(positions)
    if d < MIN_DISTANCE_A:
        raise InputError(f"atoms {i} and {j} are {d:.3f} Å apart (< {MIN_DISTANCE_A} Å): they overlap")
    dist = np.linalg.norm(positions[:, None] - positions[None], axis=-1) + np.eye(len(numbers)) * 1e9
    if np.median(dist.min(axis=1)) > MAX_TYPICAL_NEIGHBOUR_A:
        raise InputError(f"the median nearest-neighbour distance is {np.median(dist.min(axis=1)):.2f}: "
                         "coordinates must be in Å (these look like bohr: multiply by 0.529177), "
                         "or the molecule has fallen apart")


class Calculator(ASECalculator):
    """ASE calculator for a trained converge chem run: energy [eV] and forces [eV/Å].

    ``dtype=torch.float64`` (default) keeps molecular dynamics energy-conserving;
    float32 is faster for screening.
    """

    implemented_properties = ["energy", "forces"]

    def __init__(self, run: str | Path, which: str = "best", dtype: torch.dtype = torch.float64,
                 device: str = "cpu", **kwargs) -> None:
        super().__init__(**kwargs)
        from .app import ChemApp

        model, self.config = load_model(ChemApp(), Path(run), which, device=device)
        self.model = model.to(dtype)
        self.dtype, self.device = dtype, device
        self.elements = tuple(int(e) for e in self.model.elements)

    def predict(self, numbers: np.ndarray, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Energies (B,) hartree and forces (B, A, 3) hartree/Å for a batch of one molecule's geometries."""
        positions = np.array(positions, dtype=float).reshape(-1, len(numbers), 3)  # a writable copy for torch
        for p in positions:
            check_structure(numbers, p, self.elements)
        species = torch.as_tensor(np.asarray(numbers), dtype=torch.int64, device=self.device).expand(len(positions), -1)
        coords = torch.as_tensor(positions, dtype=self.dtype, device=self.device)
        out = self.model.energies_forces(species, coords)
        return out.energy.double().cpu().numpy(), out.forces.double().cpu().numpy()

    def calculate(self, atoms: Atoms | None = None, properties=("energy",), system_changes=all_changes) -> None:
        super().calculate(atoms, properties, system_changes)
        energy, forces = self.predict(self.atoms.numbers, self.atoms.positions)
        self.results["energy"] = float(energy[0]) * HARTREE_TO_EV
        self.results["forces"] = forces[0] * HARTREE_TO_EV


def predict_file(run: str | Path, path: str | Path, out: str | Path | None = None) -> Path:
    """Energies and forces for every frame of an .xyz/extxyz file, written as extxyz.

    Each frame's ``info`` gets ``energy`` (eV, ASE's unit), ``energy_hartree`` and
    ``energy_kcal_mol``; its arrays get ``forces`` (eV/Å).
    """
    import ase.io
    from ase.calculators.singlepoint import SinglePointCalculator

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file")
    try:
        frames = ase.io.read(path, index=":")
    except Exception as err:  # ASE raises many types for malformed files
        raise InputError(f"{path}: cannot be read as xyz/extxyz ({type(err).__name__}: {err})") from None
    calc = Calculator(run, dtype=torch.float32)
    for k, atoms in enumerate(frames):
        try:
            energy, forces = calc.predict(atoms.numbers, atoms.positions)
        except InputError as err:
            raise InputError(f"{path}, frame {k}: {err}") from None
        atoms.calc = SinglePointCalculator(atoms, energy=float(energy[0]) * HARTREE_TO_EV,
                                           forces=forces[0] * HARTREE_TO_EV)
        atoms.info["energy_hartree"] = float(energy[0])
        atoms.info["energy_kcal_mol"] = float(energy[0]) * HARTREE_TO_KCAL_MOL
    out = Path(out) if out else path.with_name(path.stem + ".predicted.extxyz")
    ase.io.write(out, frames, format="extxyz")
    return out
