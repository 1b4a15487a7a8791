"""Molecules of the chem app: built-in CHNO starting geometries, .xyz files, geometry checks.

Built-in geometries are those of ASE's G2 collection (``ase.build.molecule``),
MP2(full)/6-31G(d) minima of the G2 test set (Curtiss, Raghavachari, Redfern and
Pople, J. Chem. Phys. 106, 1063 (1997)); they ship with ASE, so nothing is
downloaded. They are starting points: :mod:`.sampling` re-optimises them at the
level that computes the normal modes.

Positions are in Å. Atoms are counted from 1 in error messages, as in an .xyz file.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

SUPPORTED_ELEMENTS = ("H", "C", "N", "O")  # the elements ANI-1 covers
ATOMIC_NUMBERS = {"H": 1, "C": 6, "N": 7, "O": 8}
SYMBOL_OF = {z: symbol for symbol, z in ATOMIC_NUMBERS.items()}  # atomic number -> element

# built-in name -> key of the G2 collection in ase.build.molecule
BUILTIN_G2_KEYS = {
    "water": "H2O",
    "methane": "CH4",
    "ammonia": "NH3",
    "methanol": "CH3OH",
    "ethanol": "CH3CH2OH",
    "formaldehyde": "H2CO",
    "formic_acid": "HCOOH",
    "acetaldehyde": "CH3CHO",
    "hydrogen_cyanide": "HCN",
    "acetonitrile": "CH3CN",
    "methylamine": "H3CNH2",
    "acetic_acid": "CH3COOH",
    "acetamide": "CH3CONH2",
    "dimethyl_ether": "CH3OCH3",
    "ethylene": "C2H4",
    "carbon_dioxide": "CO2",
}
XYZ_SUFFIXES = (".xyz", ".extxyz")
SMILES_PREFIX = "smiles:"  # get_molecule("smiles:CCO"): a molecule given by SMILES


@dataclass(frozen=True, eq=False)
class Molecule:
    """A neutral molecule: element symbols and positions [Å], shape ``(n, 3)`` (read-only)."""

    name: str
    symbols: tuple[str, ...]
    positions: np.ndarray

    def __post_init__(self) -> None:
        positions = np.array(self.positions, dtype=np.float64)  # a private copy
        if positions.ndim != 2 or positions.shape[1] != 3:
            raise ValueError(f"molecule {self.name!r}: positions must have shape (n, 3), got {positions.shape}")
        if len(self.symbols) != len(positions):
            raise ValueError(
                f"molecule {self.name!r}: {len(self.symbols)} symbols but {len(positions)} positions"
            )
        if not np.all(np.isfinite(positions)):
            raise ValueError(f"molecule {self.name!r}: positions contain NaN or infinity")
        check_elements(self.symbols)
        positions.setflags(write=False)
        object.__setattr__(self, "symbols", tuple(self.symbols))
        object.__setattr__(self, "positions", positions)

    @property
    def atomic_numbers(self) -> np.ndarray:
        """Atomic numbers Z, shape ``(n,)``, int64."""
        return np.array([ATOMIC_NUMBERS[s] for s in self.symbols], dtype=np.int64)

    @property
    def n_atoms(self) -> int:
        return len(self.symbols)

    @property
    def formula(self) -> str:
        return hill_formula(self.symbols)

    @property
    def n_electrons(self) -> int:
        """Electrons of the neutral molecule, ``sum(Z)``."""
        return int(self.atomic_numbers.sum())


def check_elements(symbols: tuple[str, ...] | list[str]) -> None:
    """Raise ``ValueError`` naming the first element outside H, C, N, O and its atom (from 1)."""
    for k, symbol in enumerate(symbols):
        if symbol not in SUPPORTED_ELEMENTS:
            raise ValueError(
                f"element {symbol} (atom {k + 1}) is not supported; supported: {', '.join(SUPPORTED_ELEMENTS)}"
            )


def hill_formula(symbols: Sequence[str]) -> str:
    """Chemical formula in Hill order (C, H, then alphabetical), e.g. ``C2H6O``."""
    counts = Counter(symbols)
    if "C" in counts:
        order = ["C"] + (["H"] if "H" in counts else []) + sorted(s for s in counts if s not in ("C", "H"))
    else:
        order = sorted(counts)
    return "".join(s + (str(counts[s]) if counts[s] > 1 else "") for s in order)


def builtin_names() -> tuple[str, ...]:
    """Names :func:`get_molecule` knows without a file."""
    return tuple(BUILTIN_G2_KEYS)


def builtin_molecule(name: str) -> Molecule:
    """A built-in molecule by name (see :data:`BUILTIN_G2_KEYS`), G2 geometry."""
    from ase.build import molecule as g2_molecule

    key = BUILTIN_G2_KEYS.get(name.lower())
    if key is None:
        raise ValueError(
            f"unknown molecule {name!r}; built-ins: {', '.join(builtin_names())}; "
            f"or give a path to an {' / '.join(XYZ_SUFFIXES)} file"
        )
    atoms = g2_molecule(key)
    return Molecule(name.lower(), tuple(atoms.get_chemical_symbols()), atoms.get_positions())


def read_molecule(path: str | Path) -> Molecule:
    """The first structure of an .xyz or extended-xyz file (positions in Å), via ``ase.io.read``."""
    import ase.io

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"molecule file {str(path)!r} not found")
    try:
        atoms = ase.io.read(path, index=0, format="extxyz")  # extxyz reads plain xyz as well
    except Exception as err:  # ASE raises several types for malformed files
        raise ValueError(f"could not read molecule file {str(path)!r} as (ext)xyz: {err}") from err
    if len(atoms) == 0:
        raise ValueError(f"molecule file {str(path)!r} holds no atoms")
    return Molecule(path.stem, tuple(atoms.get_chemical_symbols()), atoms.get_positions())


def get_molecule(name_or_path: str | Path) -> Molecule:
    """A built-in molecule by name, or the molecule in an .xyz / extxyz file.

    A string that names a built-in is the built-in; ``smiles:SMILES`` is embedded by RDKit
    (:func:`~.smiles.molecule_from_smiles`); anything else is treated as a path if it ends
    in .xyz / .extxyz or names an existing file.
    """
    text = str(name_or_path)
    if not isinstance(name_or_path, Path) and text.startswith(SMILES_PREFIX):
        from .smiles import molecule_from_smiles

        return molecule_from_smiles(text[len(SMILES_PREFIX):])
    if not isinstance(name_or_path, Path) and text.lower() in BUILTIN_G2_KEYS:
        return builtin_molecule(text)
    if isinstance(name_or_path, Path) or text.lower().endswith(XYZ_SUFFIXES) or Path(text).is_file():
        return read_molecule(text)
    return builtin_molecule(text)  # raises the 'unknown molecule' error listing the built-ins


def closest_pair(positions: np.ndarray) -> tuple[int, int, float]:
    """Indices ``(i, j)`` (from 0, ``i < j``) and distance [Å] of the closest pair of atoms.

    ``positions``: ``(n, 3)`` Å with ``n >= 2``.
    """
    positions = np.asarray(positions, dtype=np.float64)
    if positions.ndim != 2 or positions.shape[1] != 3 or len(positions) < 2:
        raise ValueError(f"need positions of shape (n >= 2, 3), got {positions.shape}")
    distances = np.linalg.norm(positions[:, None, :] - positions[None, :, :], axis=-1)  # (n, n)
    distances[np.diag_indices(len(positions))] = np.inf
    i, j = np.unravel_index(int(np.argmin(distances)), distances.shape)
    i, j = min(i, j), max(i, j)
    return int(i), int(j), float(distances[i, j])


def check_geometry(
    positions: np.ndarray, min_distance: float, symbols: tuple[str, ...] | None = None
) -> float:
    """Raise ``ValueError`` if two atoms are closer than ``min_distance`` [Å]; else return
    the smallest interatomic distance [Å]. The message names the closest pair (from 1)."""
    if len(positions) < 2:
        return float("inf")
    i, j, distance = closest_pair(positions)
    if distance < min_distance:
        label_i = f"{i + 1} ({symbols[i]})" if symbols else f"{i + 1}"
        label_j = f"{j + 1} ({symbols[j]})" if symbols else f"{j + 1}"
        raise ValueError(
            f"atoms {label_i} and {label_j} are {distance:.3f} Å apart, closer than "
            f"min_distance={min_distance} Å (overlapping atoms)"
        )
    return distance
