"""Molecules from SMILES, SDF and xyz files, and the built-in SMILES libraries of the chem app.

SMILES become 3-D molecules with RDKit: hydrogens are added, one conformer is
embedded with ETKDG version 3 (Wang, Witek, Landrum and Riniker, J. Chem. Inf.
Model. 60, 2044 (2020)) and relaxed with MMFF94 (Halgren, J. Comput. Chem. 17,
490 (1996)), or with UFF (Rappé et al., J. Am. Chem. Soc. 114, 10024 (1992))
where MMFF94 has no parameters. These are starting geometries only:
:func:`.sampling.compute_normal_modes` re-optimises any of them with GFN2-xTB.

converge models neutral, closed-shell molecules of H, C, N and O, so species
with a formal charge on any atom (ions, zwitterions, and charge-separated Lewis
structures such as nitro groups), radicals and other elements are refused with
a message that says what to give instead.

The libraries (:data:`LIBRARIES`) are plain ``.smi`` files under ``data/``;
each file's header says where its list comes from and how it was chosen.

Positions are in Å. Atoms, lines and SDF records are counted from 1 in messages;
xyz frames from 0, as ``ase.io.read`` indexes them.
"""
from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import numpy as np
from rdkit import Chem
from rdkit.Chem import AllChem, rdMolAlign
from rdkit.rdBase import BlockLogs

from .molecules import SUPPORTED_ELEMENTS, XYZ_SUFFIXES, Molecule

DATA_DIR = Path(__file__).parent / "data"
LIBRARY_HEAVY_ATOMS = {"chno_1to4": (1, 4), "chno_1to4_conj": (3, 4), "chno_1to4_ext": (1, 4),
                       "chno_5to7": (5, 7)}  # library -> (min, max) heavy atoms
LIBRARIES = tuple(LIBRARY_HEAVY_ATOMS)
LIBRARY_PARTS = {"chno_1to4_ext": ("chno_1to4", "chno_1to4_conj")}  # a library made of others, in this order
SMILES_SUFFIXES = (".smi",)
SDF_SUFFIXES = (".sdf",)
MOLECULE_FILE_SUFFIXES = SMILES_SUFFIXES + SDF_SUFFIXES + XYZ_SUFFIXES
FORCE_FIELD_MAX_ITERS = 2000  # MMFF94/UFF steps; ample for <= 50 atoms, and xTB re-optimises anyway
NEUTRAL_CLOSED_SHELL = "converge models neutral closed-shell molecules"


class MoleculeRecord(NamedTuple):
    """One molecule read from a file: its name, its SMILES (``None`` for xyz) and the molecule."""

    name: str
    smiles: str | None
    molecule: Molecule


def parse_smiles(smiles: str) -> Chem.Mol:
    """The sanitised RDKit molecule of ``smiles`` (hydrogens implicit); ``ValueError`` if unparsable."""
    if not isinstance(smiles, str) or not smiles.strip():
        raise ValueError(f"invalid SMILES {smiles!r}: it is empty; give e.g. 'CCO' for ethanol")
    with BlockLogs():  # RDKit's own parse errors go to stderr; ours says the same in the exception
        mol = Chem.MolFromSmiles(smiles.strip())
    if mol is None:
        raise ValueError(
            f"invalid SMILES {smiles!r}: RDKit could not parse it "
            "(check the brackets, ring-closure digits and valences)"
        )
    return mol


def check_neutral_closed_shell_chno(mol: Chem.Mol, label: str) -> None:
    """Raise ``ValueError`` unless every atom of ``mol`` is H, C, N or O, none carries a formal
    charge and none has unpaired electrons. ``label`` names the molecule in the message."""
    for atom in mol.GetAtoms():
        if atom.GetSymbol() not in SUPPORTED_ELEMENTS:
            raise ValueError(
                f"{label}: element {atom.GetSymbol()} (atom {atom.GetIdx() + 1}) is not supported; "
                f"converge's chem app covers {', '.join(SUPPORTED_ELEMENTS)} only"
            )
    charged = [atom for atom in mol.GetAtoms() if atom.GetFormalCharge() != 0]
    if charged:
        listed = ", ".join(f"atom {a.GetIdx() + 1} ({a.GetSymbol()}{a.GetFormalCharge():+d})" for a in charged)
        raise ValueError(
            f"charged species {label}: net charge {Chem.GetFormalCharge(mol):+d}, formal charges on "
            f"{listed}; {NEUTRAL_CLOSED_SHELL}: give the neutral form (e.g. 'CC(=O)O', not 'CC(=O)[O-]')"
        )
    radicals = [atom for atom in mol.GetAtoms() if atom.GetNumRadicalElectrons() > 0]
    if radicals:
        listed = ", ".join(f"atom {a.GetIdx() + 1} ({a.GetSymbol()})" for a in radicals)
        n_unpaired = sum(a.GetNumRadicalElectrons() for a in radicals)
        raise ValueError(
            f"radical {label}: {n_unpaired} unpaired electron(s) on {listed}; {NEUTRAL_CLOSED_SHELL}: "
            "add the missing hydrogens (e.g. 'C', not '[CH3]')"
        )


def canonical_smiles(smiles: str) -> str:
    """RDKit's canonical isomeric SMILES of ``smiles`` (hydrogens implicit), e.g. ``'OCC'`` -> ``'CCO'``."""
    return Chem.MolToSmiles(parse_smiles(smiles))


def heavy_atoms(smiles: str) -> int:
    """Number of non-hydrogen atoms in ``smiles``, e.g. 3 for ethanol ``'CCO'``."""
    return parse_smiles(smiles).GetNumHeavyAtoms()


def _checked_molecule_with_hydrogens(smiles: str) -> tuple[Chem.Mol, str]:
    """``smiles`` parsed, checked (one neutral closed-shell CHNO molecule), with explicit
    hydrogens appended after the heavy atoms; and its canonical SMILES."""
    mol = parse_smiles(smiles)
    label = f"SMILES {smiles!r}"
    check_neutral_closed_shell_chno(mol, label)
    n_fragments = len(Chem.GetMolFrags(mol))
    if n_fragments > 1:
        raise ValueError(
            f"{label} holds {n_fragments} disconnected fragments ('.'); give one molecule per "
            "SMILES, or a complex with 3-D coordinates in an .sdf or .xyz file"
        )
    return Chem.AddHs(mol), Chem.MolToSmiles(mol)


def _etkdg_parameters(seed: int, prune_rms: float, random_coords: bool) -> AllChem.EmbedParameters:
    """ETKDGv3 settings: deterministic for ``seed``, single-threaded, pruning at ``prune_rms`` Å
    heavy-atom RMSD (negative: no pruning).

    Sequential seeds (conformer ``i`` drawn with seed ``seed + i``): without them RDKit
    2026.09 draws every conformer of ``randomSeed=0`` identically (30 all-anti pentanes).
    """
    params = AllChem.ETKDGv3()
    params.randomSeed = seed
    params.enableSequentialRandomSeeds = True
    params.pruneRmsThresh = prune_rms
    params.useRandomCoords = random_coords
    params.numThreads = 1
    return params


def _embed(mol: Chem.Mol, n: int, seed: int, prune_rms: float, label: str) -> list[int]:
    """Embed up to ``n`` conformers into ``mol`` in place; ids of those embedded.

    ETKDG starts from distance-geometry eigenvectors; where that fails (strained or
    crowded molecules) it is retried from random coordinates, as RDKit's docs advise.
    """
    if not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer (ETKDG's randomSeed), got {seed!r}")
    for random_coords in (False, True):
        ids = list(AllChem.EmbedMultipleConfs(mol, n, _etkdg_parameters(int(seed), prune_rms, random_coords)))
        if ids:
            return ids
    raise ValueError(
        f"RDKit's ETKDG could not embed {label} in 3-D (seed={seed}); try another seed, or give "
        "3-D coordinates in an .sdf or .xyz file"
    )


def relax_with_force_field(mol: Chem.Mol, max_iters: int = FORCE_FIELD_MAX_ITERS) -> list[float] | None:
    """Relax every conformer of ``mol`` in place with MMFF94, or UFF where MMFF94 lacks parameters.

    Returns the force-field energies [kcal/mol] per conformer, or ``None`` (geometry left
    as embedded) if neither force field has parameters for ``mol``.
    """
    if AllChem.MMFFHasAllMoleculeParams(mol):
        results = AllChem.MMFFOptimizeMoleculeConfs(mol, numThreads=1, maxIters=max_iters, mmffVariant="MMFF94")
    elif AllChem.UFFHasAllMoleculeParams(mol):
        results = AllChem.UFFOptimizeMoleculeConfs(mol, numThreads=1, maxIters=max_iters)
    else:
        return None
    return [float(energy) for _not_converged, energy in results]


def _positions(mol: Chem.Mol, conf_id: int) -> np.ndarray:
    """Positions [Å], shape ``(n_atoms, 3)``, of conformer ``conf_id``."""
    return np.array(mol.GetConformer(conf_id).GetPositions(), dtype=np.float64)


def molecule_from_smiles(smiles: str, name: str | None = None, seed: int = 0) -> Molecule:
    """A 3-D molecule from ``smiles``: hydrogens added, one ETKDGv3 conformer (``randomSeed=seed``,
    so the same seed gives the same geometry), relaxed with MMFF94 (UFF where MMFF94 lacks
    parameters). Atoms in SMILES order, then the hydrogens; positions in Å.

    ``name`` defaults to the canonical SMILES. Raises ``ValueError`` for an invalid SMILES, a
    charged species, a radical, an element other than H, C, N, O, or several fragments.
    """
    mol, canonical = _checked_molecule_with_hydrogens(smiles)
    conf_id = _embed(mol, 1, seed, -1.0, f"SMILES {smiles!r}")[0]
    relax_with_force_field(mol)
    symbols = tuple(atom.GetSymbol() for atom in mol.GetAtoms())
    return Molecule(name or canonical, symbols, _positions(mol, conf_id))


def _heavy_atom_rmsd(heavy: Chem.Mol, i: int, j: int) -> float:
    """Heavy-atom RMSD [Å] of conformers ``i`` and ``j`` of ``heavy`` after the best rigid and
    symmetry-equivalent alignment (moves conformer ``i`` of ``heavy``)."""
    if heavy.GetNumAtoms() < 2:
        return 0.0
    return float(rdMolAlign.GetBestRMS(heavy, heavy, i, j, numThreads=1))


def embed_conformers(
    smiles: str, n: int, seed: int = 0, prune_rms: float = 0.5, relax: bool = True
) -> list[np.ndarray]:
    """Up to ``n`` distinct 3-D conformers of ``smiles`` for a conformer search.

    Each is an ``(n_atoms, 3)`` array [Å] in the atom order of :func:`molecule_from_smiles`.
    ETKDGv3 (seeded, deterministic) embeds ``n`` conformers and drops those within
    ``prune_rms`` Å heavy-atom RMSD of another (symmetry-aware, as RDKit's
    ``pruneRmsThresh``); with ``relax`` they are relaxed with MMFF94 (or UFF), pruned again,
    since several may fall into one minimum, and sorted by force-field energy, lowest first.
    Conformers that differ only in hydrogen positions (e.g. ethanol's OH rotamers) count as one.
    """
    if not isinstance(n, (int, np.integer)) or n < 1:
        raise ValueError(f"n (the number of conformers to embed) must be an integer >= 1, got {n!r}")
    if not prune_rms >= 0:
        raise ValueError(f"prune_rms must be >= 0 Å (0 keeps every conformer), got {prune_rms!r}")
    mol, _ = _checked_molecule_with_hydrogens(smiles)
    ids = _embed(mol, int(n), seed, float(prune_rms), f"SMILES {smiles!r}")
    energies = relax_with_force_field(mol) if relax else None
    if energies is not None:
        ids = sorted(ids, key=lambda conf_id: energies[conf_id])
        heavy = Chem.RemoveHs(mol)  # keeps the conformers, heavy atoms only
        kept: list[int] = []
        for conf_id in ids:
            if all(_heavy_atom_rmsd(heavy, conf_id, other) >= prune_rms for other in kept):
                kept.append(conf_id)
        ids = kept
    return [_positions(mol, conf_id) for conf_id in ids]


def parse_smi_text(text: str) -> list[tuple[int, str, str | None]]:
    """The ``(line number from 1, SMILES, name or None)`` of each entry of a .smi text.

    One ``SMILES [name]`` per line, separated by white space (the name may contain spaces);
    blank lines and lines starting with ``#`` are skipped. A ``#`` later in a line is kept:
    it is SMILES' triple bond (``C#C``).
    """
    entries = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        fields = line.split(None, 1)
        if fields and not fields[0].startswith("#"):
            entries.append((lineno, fields[0], fields[1].strip() if len(fields) > 1 else None))
    return entries


def _read_smi(path: Path) -> list[MoleculeRecord]:
    """Every molecule of a .smi file, embedded by :func:`molecule_from_smiles` (seed 0)."""
    records, first_line_of = [], {}
    for lineno, smiles, name in parse_smi_text(path.read_text()):
        try:
            molecule = molecule_from_smiles(smiles, name)
        except ValueError as err:
            raise ValueError(f"{path}, line {lineno}: {err}") from err
        if molecule.name in first_line_of:
            raise ValueError(
                f"{path}, line {lineno}: name {molecule.name!r} is already used on line "
                f"{first_line_of[molecule.name]}; give each molecule its own name"
            )
        first_line_of[molecule.name] = lineno
        records.append(MoleculeRecord(molecule.name, canonical_smiles(smiles), molecule))
    return records


def _molecule_from_sdf_record(mol: Chem.Mol, name: str, label: str) -> Molecule:
    """The molecule of one SDF record read with explicit hydrogens; its 3-D coordinates as given."""
    check_neutral_closed_shell_chno(mol, label)
    if mol.GetNumConformers() == 0 or not mol.GetConformer().Is3D():
        raise ValueError(
            f"{label} has no 3-D coordinates (a 2-D drawing); write it in 3-D, e.g. RDKit's "
            "AllChem.EmbedMolecule, or give the SMILES in a .smi file"
        )
    implicit = [atom for atom in mol.GetAtoms() if atom.GetTotalNumHs() > 0]
    if implicit:
        atom = implicit[0]
        raise ValueError(
            f"{label}: atom {atom.GetIdx() + 1} ({atom.GetSymbol()}) has {atom.GetTotalNumHs()} implicit "
            "hydrogen(s) without coordinates; write the file with explicit hydrogens "
            "(RDKit: Chem.AddHs(mol, addCoords=True)), or give the SMILES in a .smi file"
        )
    symbols = tuple(atom.GetSymbol() for atom in mol.GetAtoms())
    return Molecule(name, symbols, _positions(mol, mol.GetConformer().GetId()))


def _read_sdf(path: Path) -> list[MoleculeRecord]:
    """Every record of an .sdf file; a record's name is its title line, else ``<stem>_<record>``.
    Records of one molecule (e.g. its conformers) may share a name."""
    records = []
    if not path.read_bytes().strip():
        return records  # RDKit raises OSError on an empty file; read_molecules says it is empty
    with BlockLogs():
        supplier = Chem.SDMolSupplier(str(path), removeHs=False, sanitize=True)
        for index, mol in enumerate(supplier, start=1):
            label = f"{path}, record {index}"
            if mol is None:
                raise ValueError(
                    f"{label}: RDKit could not read it (malformed block, unknown element or bad "
                    "valence); fix or remove the record"
                )
            title = mol.GetProp("_Name").strip() if mol.HasProp("_Name") else ""
            molecule = _molecule_from_sdf_record(mol, title or f"{path.stem}_{index}", label)
            records.append(MoleculeRecord(molecule.name, Chem.MolToSmiles(Chem.RemoveHs(mol)), molecule))
    return records


def _read_xyz(path: Path) -> list[MoleculeRecord]:
    """Every frame of an .xyz / extended-xyz file (``ase.io.read(index=':')``); named after the
    file's stem, with ``_<frame from 0>`` appended when the file holds several frames."""
    import ase.io

    try:
        frames = ase.io.read(path, index=":", format="extxyz")  # extxyz reads plain xyz as well
    except Exception as err:  # ASE raises several types for malformed files
        raise ValueError(f"could not read {path} as (ext)xyz: {err}") from err
    records = []
    for k, atoms in enumerate(frames):
        name = path.stem if len(frames) == 1 else f"{path.stem}_{k}"
        try:
            molecule = Molecule(name, tuple(atoms.get_chemical_symbols()), atoms.get_positions())
        except ValueError as err:
            raise ValueError(f"{path}, frame {k}: {err}") from err
        records.append(MoleculeRecord(name, None, molecule))
    return records


def read_molecules(path: str | Path) -> list[MoleculeRecord]:
    """Every molecule in a .smi, .sdf, .xyz or .extxyz file, as ``(name, smiles, molecule)``.

    - .smi: one ``SMILES [name]`` per line ('#' comments and blank lines skipped), embedded
      by :func:`molecule_from_smiles`; unnamed entries are named by canonical SMILES;
      names must be unique. Errors give the line number.
    - .sdf: each record with explicit hydrogens and 3-D coordinates, used as given; the same
      charge, radical and element checks. Errors give the record number (from 1).
    - .xyz / .extxyz: every frame; no SMILES (``None``).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"molecule file {str(path)!r} not found")
    suffix = path.suffix.lower()
    if suffix in SMILES_SUFFIXES:
        records = _read_smi(path)
    elif suffix in SDF_SUFFIXES:
        records = _read_sdf(path)
    elif suffix in XYZ_SUFFIXES:
        records = _read_xyz(path)
    else:
        raise ValueError(
            f"unknown molecule file type {path.suffix!r} of {str(path)!r}; accepted: "
            f"{', '.join(MOLECULE_FILE_SUFFIXES)}"
        )
    if not records:
        raise ValueError(f"molecule file {str(path)!r} holds no molecules")
    return records


def library_paths(name: str) -> list[Path]:
    """The .smi files of the built-in library ``name`` (one of :data:`LIBRARIES`), in order: its own, or those
    of its parts (:data:`LIBRARY_PARTS`)."""
    if name not in LIBRARY_HEAVY_ATOMS:
        raise ValueError(
            f"unknown molecule library {name!r}; libraries: {', '.join(LIBRARIES)}; "
            f"or give a {' / '.join(MOLECULE_FILE_SUFFIXES)} file"
        )
    return [DATA_DIR / f"{part}.smi" for part in LIBRARY_PARTS.get(name, (name,))]


def library(name: str) -> list[tuple[str, str]]:
    """The ``(name, SMILES)`` pairs of the built-in library ``name``, in file order.

    ``"chno_1to4"``: neutral closed-shell CHNO molecules with 1-4 heavy atoms (training);
    ``"chno_1to4_conj"``: the 3-4 heavy-atom conjugated chains and small rings chno_1to4 lacks;
    ``"chno_1to4_ext"``: the two together; ``"chno_5to7"``: 5-7 heavy atoms, none in the
    others (transfer test). Sources and choice are in each file's header; heavy-atom ranges in
    :data:`LIBRARY_HEAVY_ATOMS`.
    """
    return [(entry_name or canonical_smiles(smiles), smiles) for path in library_paths(name)
            for _, smiles, entry_name in parse_smi_text(path.read_text())]
