"""Molecules from SMILES / .smi / .sdf / .xyz, conformer embedding and the built-in libraries."""
from __future__ import annotations

import re

import numpy as np
import pytest
from rdkit import Chem
from rdkit.Chem import AllChem, Descriptors
from scipy.spatial.distance import pdist

from converge.apps.chem import smiles as smiles_module
from converge.apps.chem.molecules import SUPPORTED_ELEMENTS
from converge.apps.chem.smiles import (
    LIBRARIES,
    LIBRARY_HEAVY_ATOMS,
    MOLECULE_FILE_SUFFIXES,
    canonical_smiles,
    check_neutral_closed_shell_chno,
    embed_conformers,
    heavy_atoms,
    library,
    library_paths,
    molecule_from_smiles,
    parse_smi_text,
    parse_smiles,
    read_molecules,
)


def dihedral_degrees(positions: np.ndarray, a: int, b: int, c: int, d: int) -> float:
    """Dihedral angle a-b-c-d [degrees, -180..180] (IUPAC sign convention)."""
    b0, b1, b2 = positions[a] - positions[b], positions[c] - positions[b], positions[d] - positions[c]
    b1 = b1 / np.linalg.norm(b1)
    v, w = b0 - (b0 @ b1) * b1, b2 - (b2 @ b1) * b1
    return float(np.degrees(np.arctan2(np.cross(b1, v) @ w, v @ w)))


def test_dihedral_helper_gives_known_angles_and_fails_on_a_wrong_one():
    trans = np.array([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 1.5], [-1.0, -1.0, 1.5]])
    cis = trans.copy()
    cis[3] = [1.0, 1.0, 1.5]
    assert abs(abs(dihedral_degrees(trans, 0, 1, 2, 3)) - 180.0) < 1e-9
    assert abs(dihedral_degrees(cis, 0, 1, 2, 3)) < 1e-9
    assert abs(dihedral_degrees(cis, 0, 1, 2, 3)) != pytest.approx(180.0)


# --- libraries ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", LIBRARIES)
def test_every_library_entry_is_a_neutral_closed_shell_chno_molecule_in_range(name):
    low, high = LIBRARY_HEAVY_ATOMS[name]
    entries = library(name)
    assert len(entries) >= {"chno_1to4": 70, "chno_1to4_conj": 25, "chno_1to4_ext": 120, "chno_5to7": 24}[name]
    names = [entry_name for entry_name, _ in entries]
    assert len(set(names)) == len(names), "names must be unique"
    assert len({canonical_smiles(s) for _, s in entries}) == len(entries), "no molecule twice"
    counts = set()
    for entry_name, smiles in entries:
        mol = parse_smiles(smiles)
        check_neutral_closed_shell_chno(mol, entry_name)  # raises on charge, radical, element
        assert Chem.GetFormalCharge(mol) == 0 and Descriptors.NumRadicalElectrons(mol) == 0
        assert low <= heavy_atoms(smiles) <= high, (entry_name, smiles)
        counts.add(heavy_atoms(smiles))
        molecule = molecule_from_smiles(smiles, entry_name)
        assert molecule.name == entry_name and set(molecule.symbols) <= set(SUPPORTED_ELEMENTS)
        assert pdist(molecule.positions).min() > 0.9, entry_name  # no overlapping atoms (H-H in H2 is 0.74)
    assert counts == set(range(low, high + 1)), "every heavy-atom count of the range is represented"


def test_libraries_do_not_overlap_and_names_are_unique_across_them():
    small, added, large = library("chno_1to4"), library("chno_1to4_conj"), library("chno_5to7")
    canonical = lambda entries: {canonical_smiles(s) for _, s in entries}  # noqa: E731
    assert not canonical(small) & canonical(large) and not canonical(added) & (canonical(small) | canonical(large))
    names = [n for n, _ in small + added + large]
    assert len(set(names)) == len(names)
    assert library("chno_1to4_ext") == small + added  # the two parts, in order


def test_library_keeps_triple_bonds_and_known_entries():
    small = dict(library("chno_1to4"))
    assert small["acetylene"] == "C#C" and small["hydrogen_cyanide"] == "C#N"  # '#' is not a comment there
    assert small["water"] == "O" and small["cis_2_butene"] == "C/C=C\\C"
    assert dict(library("chno_5to7"))["benzene"] == "c1ccccc1"


@pytest.mark.parametrize("name", LIBRARIES)
def test_library_files_say_where_their_list_comes_from(name):
    for path in library_paths(name):
        text = "\n".join(line for line in path.read_text().splitlines() if line.startswith("#"))
        assert "Where it comes from" in text and "How it was chosen" in text


def test_unknown_library_lists_the_libraries():
    with pytest.raises(ValueError, match=r"unknown molecule library 'gdb17'; libraries: chno_1to4, chno_1to4_conj, "
                                         r"chno_1to4_ext, chno_5to7"):
        library("gdb17")


def test_library_files_are_read_by_read_molecules():
    (path,) = library_paths("chno_1to4")
    records = read_molecules(path)
    assert [r.name for r in records] == [n for n, _ in library("chno_1to4")]


# --- SMILES ---------------------------------------------------------------------------------


def test_canonical_smiles_and_heavy_atoms_known_values():
    assert canonical_smiles("OCC") == canonical_smiles("C(O)C") == "CCO"
    assert canonical_smiles("C1=CC=CC=C1") == "c1ccccc1"
    assert heavy_atoms("CCO") == 3 and heavy_atoms("c1ccccc1") == 6 and heavy_atoms("[H][H]") == 0
    assert heavy_atoms("C") == 1


def test_hydrogens_are_added_after_the_heavy_atoms():
    methane = molecule_from_smiles("C")
    assert methane.n_atoms == 5 and methane.symbols == ("C", "H", "H", "H", "H")
    ethanol = molecule_from_smiles("CCO")
    assert ethanol.symbols == ("C", "C", "O") + ("H",) * 6 and ethanol.formula == "C2H6O"
    assert ethanol.name == "CCO"  # the canonical SMILES when no name is given
    assert molecule_from_smiles("OCC", name="ethanol").name == "ethanol"


def test_molecule_from_smiles_is_deterministic_for_a_seed():
    first, again = molecule_from_smiles("CCCCO", seed=3), molecule_from_smiles("CCCCO", seed=3)
    np.testing.assert_array_equal(first.positions, again.positions)
    assert first.symbols == again.symbols


def test_ethanol_bond_lengths_are_chemically_sensible():
    # MMFF94 minimum; experiment (microwave r_s): C-C 1.512, C-O 1.431, O-H 0.971, C-H 1.09 Å
    p = molecule_from_smiles("CCO").positions
    length = lambda i, j: float(np.linalg.norm(p[i] - p[j]))  # noqa: E731
    assert 1.50 <= length(0, 1) <= 1.55
    assert 1.40 <= length(1, 2) <= 1.45
    assert 0.95 <= length(2, 8) <= 0.99  # the last hydrogen is on O
    for h in range(3, 8):
        assert 1.08 <= min(length(0, h), length(1, h)) <= 1.11


def test_double_bond_stereochemistry_is_kept():
    for seed in (0, 1):
        cis = molecule_from_smiles("C/C=C\\C", seed=seed).positions
        trans = molecule_from_smiles("C/C=C/C", seed=seed).positions
        assert abs(dihedral_degrees(cis, 0, 1, 2, 3)) < 5.0
        assert abs(dihedral_degrees(trans, 0, 1, 2, 3)) > 175.0


@pytest.mark.parametrize("bad", ["C1CC", "xyz", "C(C", "C=C=C=C=C=C(=O)(=O)"])
def test_invalid_smiles_is_refused(bad):
    with pytest.raises(ValueError, match=rf"invalid SMILES {re.escape(repr(bad))}: RDKit could not parse it"):
        molecule_from_smiles(bad)


def test_empty_smiles_is_refused():
    with pytest.raises(ValueError, match=r"invalid SMILES '': it is empty"):
        parse_smiles("")


@pytest.mark.parametrize(
    "smiles, detail",
    [
        ("[NH4+]", r"net charge \+1, formal charges on atom 1 \(N\+1\)"),
        ("CC(=O)[O-]", r"net charge -1, formal charges on atom 4 \(O-1\)"),
        ("[NH3+]CC(=O)[O-]", r"net charge \+0, formal charges on atom 1 \(N\+1\), atom 5 \(O-1\)"),
    ],
)
def test_charged_species_are_refused(smiles, detail):
    with pytest.raises(ValueError, match=rf"charged species SMILES .*{detail}.*neutral closed-shell"):
        molecule_from_smiles(smiles)
    with pytest.raises(ValueError, match="charged species"):
        embed_conformers(smiles, 2)


@pytest.mark.parametrize("smiles, n_unpaired", [("[CH3]", 1), ("[CH2]", 2), ("C[O]", 1)])
def test_radicals_are_refused(smiles, n_unpaired):
    with pytest.raises(ValueError, match=rf"radical SMILES .*{n_unpaired} unpaired electron.*add the missing hydrogens"):
        molecule_from_smiles(smiles)


@pytest.mark.parametrize("smiles, element", [("CCl", "Cl"), ("C[Si](C)C", "Si"), ("CS", "S")])
def test_unsupported_elements_are_named(smiles, element):
    with pytest.raises(ValueError, match=rf"element {element} \(atom 2\) is not supported; .*H, C, N, O"):
        molecule_from_smiles(smiles)


def test_disconnected_fragments_are_refused():
    with pytest.raises(ValueError, match=r"holds 2 disconnected fragments"):
        molecule_from_smiles("CCO.O")


def test_bad_seed_and_conformer_settings_are_refused():
    with pytest.raises(ValueError, match=r"seed must be a non-negative integer"):
        molecule_from_smiles("C", seed=-1)
    with pytest.raises(ValueError, match=r"n \(the number of conformers to embed\) must be an integer >= 1"):
        embed_conformers("CC", 0)
    with pytest.raises(ValueError, match=r"prune_rms must be >= 0"):
        embed_conformers("CC", 3, prune_rms=-0.1)


def test_failed_embedding_says_what_to_do(monkeypatch):
    monkeypatch.setattr(smiles_module.AllChem, "EmbedMultipleConfs", lambda *args, **kwargs: [])
    with pytest.raises(ValueError, match=r"ETKDG could not embed SMILES 'CCO' in 3-D \(seed=0\); try another seed"):
        molecule_from_smiles("CCO")


# --- conformers -----------------------------------------------------------------------------


def test_flexible_molecules_give_distinct_conformers_sorted_by_energy():
    butane = embed_conformers("CCCC", 30)
    torsions = [dihedral_degrees(p, 0, 1, 2, 3) for p in butane]
    assert len(butane) >= 2
    assert abs(torsions[0]) > 170.0  # anti, the MMFF94 minimum, first
    assert any(50.0 < abs(t) < 80.0 for t in torsions[1:])  # gauche
    assert len(embed_conformers("CCCCCCC", 30)) > len(butane)  # heptane has more rotors
    assert all(p.shape == (14, 3) for p in butane)
    assert molecule_from_smiles("CCCC").symbols == ("C",) * 4 + ("H",) * 10  # the same atom order


def test_conformers_are_apart_by_at_least_prune_rms():
    from rdkit.Chem import rdMolAlign

    conformers = embed_conformers("CCCCO", 30, prune_rms=0.5)
    heavy = Chem.MolFromSmiles("CCCCO")
    for positions in conformers:
        conformer = Chem.Conformer(heavy.GetNumAtoms())
        for k in range(heavy.GetNumAtoms()):
            conformer.SetAtomPosition(k, positions[k].tolist())
        heavy.AddConformer(conformer, assignId=True)
    for i in range(len(conformers)):
        for j in range(i):
            assert rdMolAlign.GetBestRMS(heavy, heavy, i, j) >= 0.5


def test_conformers_are_deterministic_and_rigid_molecules_give_at_least_one():
    first, again = embed_conformers("CCOCC", 10, seed=2), embed_conformers("CCOCC", 10, seed=2)
    assert len(first) == len(again)
    for a, b in zip(first, again):
        np.testing.assert_array_equal(a, b)
    assert len(embed_conformers("c1ccccc1", 10)) == 1
    for rigid in ("C", "O", "C#N", "C1CC1", "c1ccncc1"):
        assert 1 <= len(embed_conformers(rigid, 5)) <= 5
    assert len(embed_conformers("CCCCC", 20, prune_rms=0.0)) == 20  # 0 keeps every conformer


# --- files ----------------------------------------------------------------------------------


def test_parse_smi_text_known_entries():
    text = "# header\n\nC#C acetylene\n  CCO   ethyl alcohol \nO\n#C skipped\n"
    assert parse_smi_text(text) == [(3, "C#C", "acetylene"), (4, "CCO", "ethyl alcohol"), (5, "O", None)]


def test_read_smi(tmp_path):
    path = tmp_path / "mols.smi"
    path.write_text("# my molecules\n\nC#C acetylene\nOCC ethanol\nO\n")
    records = read_molecules(path)
    assert [r.name for r in records] == ["acetylene", "ethanol", "O"]
    assert [r.smiles for r in records] == ["C#C", "CCO", "O"]
    assert records[1].molecule.n_atoms == 9 and records[0].molecule.n_atoms == 4
    name, smiles, molecule = records[2]  # a plain tuple as well
    assert (name, smiles, molecule.formula) == ("O", "O", "H2O")


@pytest.mark.parametrize(
    "line, message",
    [
        ("C1CC ring", r"line 3: invalid SMILES 'C1CC'"),
        ("[NH4+] ammonium", r"line 3: charged species SMILES '\[NH4\+\]'"),
        ("[CH3] methyl", r"line 3: radical SMILES '\[CH3\]'"),
        ("CCl chloromethane", r"line 3: SMILES 'CCl': element Cl \(atom 2\)"),
        ("CC water", r"line 3: name 'water' is already used on line 2"),
    ],
)
def test_read_smi_errors_give_the_line(tmp_path, line, message):
    path = tmp_path / "bad.smi"
    path.write_text(f"# header\nO water\n{line}\n")
    with pytest.raises(ValueError, match=rf"bad\.smi, {message}"):
        read_molecules(path)


def _embedded(smiles: str, name: str = "") -> Chem.Mol:
    """A 3-D RDKit molecule of ``smiles`` with explicit hydrogens, titled ``name``."""
    mol = Chem.AddHs(Chem.MolFromSmiles(smiles))
    params = AllChem.ETKDGv3()
    params.randomSeed = 7
    AllChem.EmbedMolecule(mol, params)
    mol.SetProp("_Name", name)
    return mol


def _write_sdf(path, mols) -> None:
    writer = Chem.SDWriter(str(path))
    for mol in mols:
        writer.write(mol)
    writer.close()


def test_read_sdf_uses_the_coordinates_as_given(tmp_path):
    ethanol, water = _embedded("CCO", "ethanol"), _embedded("O")
    path = tmp_path / "given.sdf"
    _write_sdf(path, [ethanol, water])
    records = read_molecules(path)
    assert [r.name for r in records] == ["ethanol", "given_2"]  # untitled: stem and record number
    assert [r.smiles for r in records] == ["CCO", "O"]
    np.testing.assert_allclose(records[0].molecule.positions, ethanol.GetConformer().GetPositions(), atol=1e-4)
    assert records[0].molecule.symbols == tuple(a.GetSymbol() for a in ethanol.GetAtoms())


def test_read_sdf_errors_name_the_record(tmp_path):
    path = tmp_path / "bad.sdf"
    _write_sdf(path, [_embedded("O", "water"), _embedded("CC(=O)[O-]", "acetate")])
    with pytest.raises(ValueError, match=r"charged species .*bad\.sdf, record 2: net charge -1"):
        read_molecules(path)

    _write_sdf(path, [_embedded("O", "water"), _embedded("C[Si](C)C", "tms")])
    with pytest.raises(ValueError, match=r"bad\.sdf, record 2: element Si \(atom 2\) is not supported"):
        read_molecules(path)

    flat = Chem.AddHs(Chem.MolFromSmiles("CCO"))
    AllChem.Compute2DCoords(flat)
    _write_sdf(path, [flat])
    with pytest.raises(ValueError, match=r"bad\.sdf, record 1 has no 3-D coordinates"):
        read_molecules(path)

    no_hydrogens = Chem.MolFromSmiles("CCO")
    AllChem.EmbedMolecule(no_hydrogens, randomSeed=1)
    _write_sdf(path, [_embedded("O"), no_hydrogens])
    with pytest.raises(ValueError, match=r"record 2: atom 1 \(C\) has 3 implicit hydrogen\(s\) without coordinates"):
        read_molecules(path)

    good = Chem.MolToMolBlock(_embedded("O", "water"))
    broken = good.replace(" O ", " Xx", 1)
    path.write_text(good + "$$$$\n" + broken + "$$$$\n")
    with pytest.raises(ValueError, match=r"bad\.sdf, record 2: RDKit could not read it"):
        read_molecules(path)


def test_read_sdf_radical_is_refused(tmp_path):
    methyl = Chem.AddHs(Chem.MolFromSmiles("[CH3]"))
    AllChem.EmbedMolecule(methyl, randomSeed=1)
    path = tmp_path / "radical.sdf"
    _write_sdf(path, [methyl])
    with pytest.raises(ValueError, match=r"radical .*radical\.sdf, record 1: 1 unpaired electron"):
        read_molecules(path)


def test_read_xyz_frames(tmp_path):
    import ase.io
    from ase.build import molecule as g2_molecule

    path = tmp_path / "traj.xyz"
    water, methane = g2_molecule("H2O"), g2_molecule("CH4")
    ase.io.write(path, [water, methane, water], format="extxyz")
    records = read_molecules(path)
    assert [r.name for r in records] == ["traj_0", "traj_1", "traj_2"]
    assert all(r.smiles is None for r in records)
    assert [r.molecule.formula for r in records] == ["H2O", "CH4", "H2O"]
    np.testing.assert_allclose(records[1].molecule.positions, methane.get_positions())

    single = tmp_path / "water.xyz"
    ase.io.write(single, water, format="xyz")
    assert [r.name for r in read_molecules(single)] == ["water"]


def test_read_xyz_errors_name_the_frame(tmp_path):
    import ase.io
    from ase.build import molecule as g2_molecule

    path = tmp_path / "mixed.extxyz"
    ase.io.write(path, [g2_molecule("H2O"), g2_molecule("CH3Cl")], format="extxyz")
    with pytest.raises(ValueError, match=r"mixed\.extxyz, frame 1: element Cl \(atom 2\) is not supported"):
        read_molecules(path)
    garbage = tmp_path / "garbage.xyz"
    garbage.write_text("three\nnot a count\nO 0 0 0\n")
    with pytest.raises(ValueError, match=r"could not read .*garbage\.xyz as \(ext\)xyz"):
        read_molecules(garbage)


def test_unknown_suffix_lists_the_accepted_ones(tmp_path):
    path = tmp_path / "mols.csv"
    path.write_text("CCO,ethanol\n")
    with pytest.raises(ValueError, match=r"unknown molecule file type '\.csv' .*accepted: \.smi, \.sdf, \.xyz, \.extxyz"):
        read_molecules(path)
    assert MOLECULE_FILE_SUFFIXES == (".smi", ".sdf", ".xyz", ".extxyz")


def test_missing_file_names_the_path(tmp_path):
    path = tmp_path / "nowhere.smi"
    with pytest.raises(FileNotFoundError, match=r"molecule file '.*nowhere\.smi' not found"):
        read_molecules(path)


@pytest.mark.parametrize("suffix", [".smi", ".sdf", ".xyz"])
def test_empty_files_are_refused(tmp_path, suffix):
    path = tmp_path / f"empty{suffix}"
    path.write_text("# nothing here\n" if suffix == ".smi" else "")
    with pytest.raises(ValueError, match=r"holds no molecules"):
        read_molecules(path)
