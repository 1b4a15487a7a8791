"""Built-in molecules, .xyz reading and the geometry checks, with their error messages."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from scipy.spatial.distance import pdist, squareform

from converge.apps.chem.molecules import (
    Molecule,
    builtin_names,
    check_geometry,
    closest_pair,
    get_molecule,
)

WATER_XYZ = """3
water, a plain xyz comment line
O  0.000000  0.000000  0.119262
H  0.000000  0.763239 -0.477047
H  0.000000 -0.763239 -0.477047
"""


def test_builtins_are_chno_molecules_with_sane_geometries():
    from ase.data import atomic_numbers

    names = builtin_names()
    assert len(names) >= 8
    assert {"water", "methane", "ammonia", "methanol", "ethanol", "formaldehyde", "formic_acid",
            "acetaldehyde", "hydrogen_cyanide"} <= set(names)
    for name in names:
        mol = get_molecule(name)
        assert set(mol.symbols) <= {"H", "C", "N", "O"}, name
        assert mol.positions.shape == (mol.n_atoms, 3)
        np.testing.assert_array_equal(mol.atomic_numbers, [atomic_numbers[s] for s in mol.symbols])
        # every bond is longer than 0.9 Å (H-H in H2 is 0.74; none here) and the molecule is connected
        distances = squareform(pdist(mol.positions))
        assert check_geometry(mol.positions, 0.9, mol.symbols) > 0.9, name
        assert np.all(np.sort(distances, axis=1)[:, 1] < 1.6), name  # each atom has a neighbour within 1.6 Å


def test_water_has_the_g2_geometry():
    water = get_molecule("Water")  # names are case-insensitive
    assert water.symbols == ("O", "H", "H") and water.name == "water" and water.n_electrons == 10
    oh = np.linalg.norm(water.positions[1] - water.positions[0])
    angle = np.degrees(np.arccos(np.dot(water.positions[1] - water.positions[0], water.positions[2] - water.positions[0])
                                 / oh**2))
    assert oh == pytest.approx(0.969, abs=2e-3) and angle == pytest.approx(104.0, abs=0.5)  # MP2/6-31G(d)


def test_formula_is_in_hill_order():
    assert get_molecule("ethanol").formula == "C2H6O"
    assert get_molecule("carbon_dioxide").formula == "CO2"
    assert get_molecule("water").formula == "H2O"
    assert get_molecule("hydrogen_cyanide").formula == "CHN"


def test_positions_are_a_read_only_copy():
    source = np.zeros((2, 3))
    source[1, 2] = 1.0
    mol = Molecule("h2", ("H", "H"), source)
    source[1, 2] = 5.0
    assert mol.positions[1, 2] == 1.0
    with pytest.raises(ValueError):
        mol.positions[0, 0] = 1.0


def test_reads_plain_and_extended_xyz(tmp_path: Path):
    plain = tmp_path / "w.xyz"
    plain.write_text(WATER_XYZ)
    mol = get_molecule(str(plain))
    assert mol.symbols == ("O", "H", "H") and mol.name == "w"
    assert mol.positions[1, 1] == pytest.approx(0.763239)

    import ase.io
    from ase.build import molecule

    atoms = molecule("CH3CH2OH")
    extended = tmp_path / "ethanol.extxyz"
    ase.io.write(extended, atoms, format="extxyz")
    read = get_molecule(extended)
    assert read.symbols == tuple(atoms.get_chemical_symbols())
    np.testing.assert_allclose(read.positions, atoms.positions, atol=1e-8)


def test_unknown_molecule_lists_the_builtins():
    with pytest.raises(ValueError, match=r"unknown molecule 'ethanoll'; built-ins: water, methane.*ethanol"):
        get_molecule("ethanoll")


def test_missing_file_is_a_clear_error(tmp_path: Path):
    with pytest.raises(FileNotFoundError, match="molecule file .*nothere.xyz' not found"):
        get_molecule(str(tmp_path / "nothere.xyz"))


def test_unsupported_element_names_the_element_and_atom(tmp_path: Path):
    path = tmp_path / "chloromethane.xyz"
    path.write_text("5\n\nC 0 0 0\nH 0 0 1.09\nCl 0 1.7 -0.6\nH 1.0 -0.4 -0.4\nH -1.0 -0.4 -0.4\n")
    with pytest.raises(ValueError, match=r"^element Cl \(atom 3\) is not supported; supported: H, C, N, O$"):
        get_molecule(path)


def test_malformed_file_is_a_clear_error(tmp_path: Path):
    path = tmp_path / "broken.xyz"
    path.write_text("3\n\nO 0 0\n")
    with pytest.raises(ValueError, match="could not read molecule file .*broken.xyz"):
        get_molecule(path)


def test_shape_mismatch_is_a_clear_error():
    with pytest.raises(ValueError, match="2 symbols but 3 positions"):
        Molecule("x", ("H", "H"), np.zeros((3, 3)))
    with pytest.raises(ValueError, match=r"shape \(n, 3\)"):
        Molecule("x", ("H", "H"), np.zeros((2, 2)))


def test_closest_pair_matches_scipy_pdist():
    rng = np.random.default_rng(3)
    for _ in range(5):
        positions = rng.uniform(-3, 3, size=(9, 3))
        i, j, distance = closest_pair(positions)
        distances = squareform(pdist(positions)) + np.diag(np.full(9, np.inf))
        assert distance == pytest.approx(distances.min())
        assert i < j and distances[i, j] == pytest.approx(distance)


def test_overlapping_atoms_name_the_pair_and_distance():
    positions = np.array([[0.0, 0.0, 0.0], [0.0, 0.0, 1.1], [0.0, 0.3, 1.2]])
    with pytest.raises(ValueError, match=r"atoms 2 \(C\) and 3 \(H\) are 0\.316 Å apart, closer than min_distance=0\.7"):
        check_geometry(positions, 0.7, ("O", "C", "H"))
    assert check_geometry(positions[:2], 0.7) == pytest.approx(1.1)
