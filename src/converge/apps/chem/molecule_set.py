"""The molecules one chem dataset spans, their normal modes, and padding to a common atom count.

``ChemConfig.molecules`` names the set: empty for the one molecule ``ChemConfig.molecule``
(a built-in, an .xyz path or ``smiles:SMILES``), a built-in library (``chno_1to4``, the
closed-shell neutral CHNO molecules with 1-4 heavy atoms; ``chno_5to7``), or a file of
molecules (.smi, .sdf, .xyz; :func:`~.smiles.read_molecules`). A molecule given by SMILES is
embedded by RDKit (ETKDG, seeded) and, as every molecule here, optimised with GFN2-xTB
before its normal modes are taken (:func:`~.sampling.compute_normal_modes`).

Samples of a set are padded to ``n_atoms`` atoms as TorchANI pads them: species -1,
coordinates and forces 0. The model and the losses skip padding atoms, so padding never
changes an energy.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from functools import lru_cache
from pathlib import Path

import numpy as np

from .config import ChemConfig
from .molecules import SYMBOL_OF, Molecule, get_molecule
from .sampling import NormalModes, compute_normal_modes, reference_modes

PAD_SPECIES = -1  # as TorchANI pads species


@lru_cache(maxsize=8)
def _load_set(molecules: str, molecule: str) -> tuple[Molecule, ...]:
    if not molecules:
        return (get_molecule(molecule),)
    from .smiles import LIBRARIES, library, molecule_from_smiles, read_molecules

    if molecules in LIBRARIES:
        return tuple(molecule_from_smiles(smi, name) for name, smi in library(molecules))
    path = Path(molecules)
    if not path.is_file():
        raise ValueError(f"app.molecules={molecules!r}: neither a library ({', '.join(LIBRARIES)}) nor a file of "
                         "molecules (.smi, .sdf, .xyz)")
    found = tuple(mol for _, _, mol in read_molecules(path))
    if not found:
        raise ValueError(f"app.molecules={molecules!r}: the file holds no molecules")
    return found


def molecule_set(cfg: ChemConfig) -> tuple[Molecule, ...]:
    """The molecules of ``cfg``'s dataset, in a fixed order (a sample's ``molecule`` indexes it)."""
    return _load_set(cfg.molecules, cfg.molecule)


def is_multi(cfg: ChemConfig) -> bool:
    """Whether ``cfg`` spans a set of molecules (samples padded, ``molecule`` stored) rather than one."""
    return bool(cfg.molecules)


def n_atoms(cfg: ChemConfig) -> int:
    """Atoms per stored sample: the largest molecule of the set, or ``cfg.max_atoms`` if that is larger."""
    return max(cfg.max_atoms, max(m.n_atoms for m in molecule_set(cfg)))


@lru_cache(maxsize=256)
def _set_modes(molecules: str, molecule: str, index: int) -> NormalModes:
    mol = _load_set(molecules, molecule)[index]
    return compute_normal_modes(mol.symbols, mol.positions, "xtb")


def modes_of(cfg: ChemConfig, index: int) -> NormalModes:
    """Normal modes of molecule ``index`` of the set (GFN2-xTB minimum and Hessian), once per process;
    for one molecule, :func:`~.sampling.reference_modes` (which also offers DFT Hessians)."""
    if not is_multi(cfg):
        return reference_modes(cfg)
    if cfg.hessian != "xtb":
        raise ValueError("app.hessian='dft' is offered for one molecule; a set of molecules uses GFN2-xTB modes")
    return _set_modes(cfg.molecules, cfg.molecule, int(index))


def pad_atoms(array: np.ndarray, n: int, value: float) -> np.ndarray:
    """``array`` (A, ...) padded with ``value`` along its first axis to (n, ...)."""
    array = np.asarray(array)
    if array.shape[0] > n:
        raise ValueError(f"a molecule of {array.shape[0]} atoms does not fit {n} padded atoms")
    pad = np.full((n - array.shape[0], *array.shape[1:]), value, dtype=array.dtype)
    return np.concatenate([array, pad])


def pad_conformers(arrays: Mapping[str, np.ndarray], n: int) -> dict[str, np.ndarray]:
    """Stored conformers (species (N, A), coordinates and forces (N, A, 3), any other per-conformer arrays)
    padded along the atom axis to ``n`` atoms: species with -1, coordinates and forces with 0."""
    out = dict(arrays)
    for key, value in (("species", PAD_SPECIES), ("coordinates", 0.0), ("forces", 0.0)):
        if key in out:
            a = np.asarray(out[key])
            if a.shape[1] > n:
                raise ValueError(f"a molecule of {a.shape[1]} atoms does not fit {n} padded atoms")
            out[key] = np.concatenate([a, np.full((len(a), n - a.shape[1], *a.shape[2:]), value, a.dtype)], axis=1)
    return out


def stack_conformer_sets(sets: Sequence[Mapping[str, np.ndarray]], n: int) -> dict[str, np.ndarray]:
    """Several stored sets of conformers (one molecule each, say) as one, padded to ``n`` atoms, with
    ``molecule`` = the index of each conformer's set."""
    parts = [{**pad_conformers(a, n), "molecule": np.full(len(a["energy"]), k)} for k, a in enumerate(sets)]
    return {key: np.concatenate([part[key] for part in parts]) for key in parts[0]}


def real_atoms(species: np.ndarray) -> np.ndarray:
    """Boolean mask of real (non-padding) atoms, from atomic numbers with 0 or -1 padding."""
    return np.asarray(species) > 0


def padded_energies_forces(species: np.ndarray, coordinates: np.ndarray,
                           energy_forces: Callable[[list[str], np.ndarray], tuple[float, np.ndarray]],
                           error: type[Exception] = ValueError, wrap: str = "") -> tuple[np.ndarray, np.ndarray]:
    """Energies (B,) and forces (B, A, 3) of a padded batch, one ``energy_forces(symbols, positions)`` call per
    structure (float64, hartree and hartree/Å). Padding atoms (species 0 or -1) are left out of the calculation and
    get zero forces. An atomic number without an element here is an ``error`` naming the sample; with ``wrap`` (the
    method's name), so is any failure of ``energy_forces``, else that propagates as raised."""
    species = np.asarray(species, dtype=np.int64)  # (B, A)
    coordinates = np.asarray(coordinates, dtype=np.float64)  # (B, A, 3) Å
    energy = np.zeros(len(species), dtype=np.float64)
    forces = np.zeros(coordinates.shape, dtype=np.float64)
    for b, (z, xyz) in enumerate(zip(species, coordinates)):
        real = z > 0
        unknown = sorted(set(z[real].tolist()) - set(SYMBOL_OF))
        if unknown:
            raise error(f"sample {b}: atomic number(s) {unknown} have no element here; known: {sorted(SYMBOL_OF)}")
        try:
            energy[b], forces[b, real] = energy_forces([SYMBOL_OF[int(k)] for k in z[real]], xyz[real])
        except Exception as err:
            if not wrap:
                raise
            raise error(f"sample {b}: {wrap} failed ({type(err).__name__}: {err})") from None
    return energy, forces
