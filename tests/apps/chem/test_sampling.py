"""Normal modes and normal-mode sampling against analytic cases, ASE and the ANI-1 recipe.

GFN2-xTB (tblite) costs ~1 ms per water or ethanol force call, so these run in seconds.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.constants as sc

from converge.apps.chem.config import ChemConfig
from converge.apps.chem.molecules import get_molecule
from converge.apps.chem.smiles import library
from converge.apps.chem.sampling import (
    IMAGINARY_TOLERANCE_CM1,
    SamplingError,
    compute_normal_modes,
    nms_coefficients,
    nms_displacement,
    normal_modes_from_hessian,
    reference_modes,
    rigid_body_basis,
    sample_conformer,
    xtb_energy_forces,
)

K_B_HARTREE = sc.k / sc.physical_constants["Hartree energy"][0]  # independent of converge.units


@pytest.fixture(scope="module")
def water_modes():
    return reference_modes(ChemConfig(molecule="water"))


@pytest.fixture(scope="module")
def ethanol_modes():
    return reference_modes(ChemConfig(molecule="ethanol"))


def test_xtb_forces_are_minus_the_energy_gradient():
    water = get_molecule("water")
    energy, forces = xtb_energy_forces(water.symbols, water.positions)
    assert -6 < energy < -5  # GFN2-xTB water, E_h (-5.07)
    h = 1e-4  # Å; tblite's SCC at accuracy 0.01 leaves ~1e-8 E_h noise -> ~1e-6 E_h/Å here
    for atom, axis in [(0, 2), (1, 1), (2, 2)]:
        plus, minus = water.positions.copy(), water.positions.copy()
        plus[atom, axis] += h
        minus[atom, axis] -= h
        derivative = (xtb_energy_forces(water.symbols, plus)[0] - xtb_energy_forces(water.symbols, minus)[0]) / (2 * h)
        assert forces[atom, axis] == pytest.approx(-derivative, abs=1e-5)


def test_xtb_energy_matches_the_tblite_ase_calculator_in_ev():
    from ase.build import molecule
    from tblite.ase import TBLite

    atoms = molecule("CH3OH")
    atoms.calc = TBLite(method="GFN2-xTB", accuracy=0.01, verbosity=0)
    ev = sc.physical_constants["Hartree energy in eV"][0]
    energy, forces = xtb_energy_forces(tuple(atoms.get_chemical_symbols()), atoms.positions)
    assert energy * ev == pytest.approx(atoms.get_potential_energy(), abs=1e-5)  # ASE's CODATA 2014 eV
    np.testing.assert_allclose(forces * ev, atoms.get_forces(), atol=1e-5)


def test_diatomic_spring_has_the_analytic_frequency():
    # E = k/2 (|r1 - r2| - r0)²: one mode with omega = sqrt(k / mu), mu = m1 m2 / (m1 + m2), that
    # keeps the centre of mass fixed (d ∝ (m2 u, -m1 u)). Along the unit-norm d (Gaussian's convention)
    # the force constant is K = d^T H d = k (m1 + m2)² / (m1² + m2²) and the reduced mass K / omega².
    from ase.data import atomic_masses

    k, m1, m2 = 0.5, atomic_masses[6], atomic_masses[8]  # E_h/Å², u
    u = np.array([0.6, 0.0, 0.8])
    block = k * np.outer(u, u)
    hessian = np.block([[block, -block], [-block, block]])
    modes = normal_modes_from_hessian(("C", "O"), np.array([np.zeros(3), 1.13 * u]), hessian)
    mu = m1 * m2 / (m1 + m2)
    omega = math.sqrt(k * sc.physical_constants["Hartree energy"][0] / (1e-20 * mu * sc.atomic_mass))  # rad/s
    assert len(modes.frequencies_cm1) == 1
    assert modes.frequencies_cm1[0] == pytest.approx(omega / (2 * math.pi * sc.c * 100), rel=1e-8)
    force_constant = k * (m1 + m2) ** 2 / (m1**2 + m2**2)
    assert modes.force_constants[0] == pytest.approx(force_constant, rel=1e-10)
    assert modes.reduced_masses_amu[0] == pytest.approx(force_constant * mu / k, rel=1e-10)
    direction = np.array([m2 * u, -m1 * u]) / math.hypot(m1, m2)
    np.testing.assert_allclose(np.abs(modes.cartesian_modes[0]), np.abs(direction), atol=1e-12)


def test_water_has_three_modes_equal_to_ase_vibrations(water_modes, tmp_path, monkeypatch):
    from ase import Atoms
    from ase.vibrations import Vibrations
    from tblite.ase import TBLite

    assert len(water_modes.frequencies_cm1) == 3 and water_modes.method == "xtb"
    # GFN2-xTB harmonic water: bend ~1540, stretches ~3640-3650 cm^-1. Experiment (harmonic: 1649, 3832,
    # 3943; NIST CCCBDB) lies higher: xTB is fitted to fundamentals, so only a loose physical window is asserted.
    bend, sym, asym = water_modes.frequencies_cm1
    assert 1450 < bend < 1700 and 3500 < sym < asym < 3850
    # an independent pipeline (ASE's finite differences, mass weighting and unit conversion) at the same geometry
    monkeypatch.chdir(tmp_path)
    atoms = Atoms(symbols=list(water_modes.symbols), positions=water_modes.equilibrium_positions,
                  calculator=TBLite(method="GFN2-xTB", accuracy=0.01, verbosity=0))
    vibrations = Vibrations(atoms, delta=0.005, nfree=2)
    vibrations.run()
    ase_frequencies = np.sort(np.real(vibrations.get_frequencies()))[-3:]
    np.testing.assert_allclose(water_modes.frequencies_cm1, ase_frequencies, atol=1.0)  # cm^-1


def test_modes_are_orthonormal_and_free_of_rigid_motion(ethanol_modes):
    m = ethanol_modes
    n = len(m.symbols)
    assert len(m.frequencies_cm1) == 3 * n - 6 and np.all(m.frequencies_cm1 > 100)
    vectors = m.mass_weighted_modes.reshape(len(m.frequencies_cm1), -1)
    np.testing.assert_allclose(vectors @ vectors.T, np.eye(len(vectors)), atol=1e-10)
    rigid = rigid_body_basis(m.equilibrium_positions, m.masses_amu)
    assert rigid.shape == (3 * n, 6)
    np.testing.assert_allclose(vectors @ rigid, 0.0, atol=1e-10)
    np.testing.assert_allclose(np.linalg.norm(m.cartesian_modes.reshape(len(vectors), -1), axis=1), 1.0)
    # K_i = d_i^T H d_i
    d = m.cartesian_modes.reshape(len(vectors), -1)
    np.testing.assert_allclose(np.einsum("ma,ab,mb->m", d, m.hessian, d), m.force_constants, rtol=1e-8)


def test_linear_molecule_keeps_3n_minus_5_modes():
    modes = reference_modes(ChemConfig(molecule="hydrogen_cyanide"))
    assert len(modes.frequencies_cm1) == 4
    assert modes.frequencies_cm1[0] == pytest.approx(modes.frequencies_cm1[1], abs=1.0)  # degenerate bends


def test_reference_modes_are_cached_and_read_only(water_modes):
    assert reference_modes(ChemConfig(molecule="water", temperature=900.0)) is water_modes
    with pytest.raises(ValueError):
        water_modes.equilibrium_positions[0, 0] = 1.0


def test_nms_coefficients_are_nonnegative_and_sum_to_a_uniform_total():
    rng = np.random.default_rng(0)
    totals = np.array([nms_coefficients(21, rng) for _ in range(4000)])  # (4000, 21)
    assert np.all(totals >= 0)
    sums = totals.sum(axis=1)
    assert np.all(sums <= 1.0)
    # s ~ U(0, 1): mean 1/2, std 1/sqrt(12); 5 sigma of the mean of 4000 draws is 0.023
    assert sums.mean() == pytest.approx(0.5, abs=5 / math.sqrt(12 * 4000))


def test_displacement_carries_the_ani1_harmonic_energy(ethanol_modes):
    # 1/2 dx^T H dx = sum_i K_i R_i^2 / 2 = s * 3 N_a k_B T / 2 with s = sum c_i ~ U(0, 1)
    m, temperature = ethanol_modes, 500.0
    ceiling = 1.5 * len(m.symbols) * K_B_HARTREE * temperature
    rng = np.random.default_rng(1)
    fractions = []
    for _ in range(2000):
        dx = nms_displacement(m, temperature, rng).reshape(-1)
        fractions.append(0.5 * dx @ m.hessian @ dx / ceiling)
    fractions = np.array(fractions)
    assert np.all(fractions >= 0) and np.all(fractions <= 1 + 1e-9)
    assert fractions.mean() == pytest.approx(0.5, abs=5 / math.sqrt(12 * 2000))


def test_displacement_grows_as_the_square_root_of_temperature(ethanol_modes):
    cold = nms_displacement(ethanol_modes, 300.0, np.random.default_rng(7))
    hot = nms_displacement(ethanol_modes, 1200.0, np.random.default_rng(7))  # same draws
    np.testing.assert_allclose(hot, 2.0 * cold, rtol=1e-12)


def test_sampled_conformers_keep_atoms_apart_and_spread_with_temperature(ethanol_modes):
    rng = np.random.default_rng(2)
    spread = {}
    for temperature in (100.0, 300.0, 1000.0):
        conformers = np.array([sample_conformer(ethanol_modes, temperature, rng, 0.7) for _ in range(200)])
        pairs = np.linalg.norm(conformers[:, :, None] - conformers[:, None, :], axis=-1)  # (200, n, n)
        pairs[:, np.arange(9), np.arange(9)] = np.inf
        assert pairs.min() >= 0.7
        spread[temperature] = np.sqrt(((conformers - ethanol_modes.equilibrium_positions) ** 2).mean())
    assert spread[100.0] < spread[300.0] < spread[1000.0]
    assert 0.01 < spread[300.0] < 0.3  # Å: thermal vibrations, not dissociation


def test_impossible_min_distance_raises_after_the_allowed_draws(water_modes):
    with pytest.raises(SamplingError, match="5 NMS draws at 300.0 K all had overlapping atoms.*lower app.temperature"):
        sample_conformer(water_modes, 300.0, np.random.default_rng(0), min_distance=1.9, max_tries=5)


def test_error_paths():
    water = get_molecule("water")
    with pytest.raises(ValueError, match="choose 'xtb' or 'dft'"):
        compute_normal_modes(water.symbols, water.positions, method="mp2")
    with pytest.raises(ValueError, match="single atom has no vibrations"):
        normal_modes_from_hessian(("O",), np.zeros((1, 3)), np.zeros((3, 3)))
    with pytest.raises(ValueError, match=r"element Cl \(atom 1\) is not supported"):
        xtb_energy_forces(("Cl", "H"), np.array([[0, 0, 0], [0, 0, 1.3]]))


def test_dft_hessian_modes_of_water():
    cfg = ChemConfig(molecule="water", hessian="dft", level="custom", functional="b3lyp", basis="6-31g",
                     density_fit=True, grid_level=2)
    modes = reference_modes(cfg)
    assert modes.method == "dft" and len(modes.frequencies_cm1) == 3
    # B3LYP/6-31G water: bend ~1620, stretches ~3620 and ~3780 cm^-1 (computed harmonic; loose window)
    bend, sym, asym = modes.frequencies_cm1
    assert 1500 < bend < 1750 and 3450 < sym < asym < 3950


def _springs(positions):
    """A toy potential of springs between every pair of atoms (rest length 1.2 Å): energy [E_h], forces
    [E_h/Å] for a batch of geometries (B, n, 3)."""
    d = positions[:, :, None] - positions[:, None]
    r = np.linalg.norm(d, axis=-1) + np.eye(positions.shape[1])
    stretch = np.where(np.eye(positions.shape[1], dtype=bool), 0.0, r - 1.2)
    energy = 0.05 * (stretch ** 2).sum(axis=(1, 2)) / 2
    forces = -0.1 * ((stretch / r)[..., None] * d).sum(axis=2)
    return energy, forces


def test_batched_bfgs_takes_each_geometrys_own_ase_path_and_asks_once_per_step():
    from ase import Atoms
    from ase.calculators.calculator import Calculator, all_changes
    from ase.optimize import BFGS

    from converge.apps.chem.sampling import optimize_geometries
    from converge.units import hartree_per_angstrom_to_ev_per_angstrom, hartree_to_ev

    class Springs(Calculator):
        implemented_properties = ["energy", "forces"]

        def calculate(self, atoms=None, properties=("energy",), system_changes=all_changes):
            super().calculate(atoms, properties, system_changes)
            e, f = _springs(self.atoms.positions[None])
            self.results = {"energy": hartree_to_ev(e[0]), "forces": hartree_per_angstrom_to_ev_per_angstrom(f[0])}

    rng = np.random.default_rng(3)
    starts = rng.normal(0, 0.8, (4, 5, 3))
    batches = []

    def batch(p):
        batches.append(len(p))
        return _springs(p)

    final, energies, converged, calls = optimize_geometries(["H"] * 5, starts, batch, 0.01, 200)
    assert converged.all() and calls == len(batches) and batches[0] == 4 and batches[-1] < 4  # finished ones drop
    for start, end, energy in zip(starts, final, energies):
        atoms = Atoms("H5", positions=start, calculator=Springs())
        BFGS(atoms, logfile=None).run(fmax=0.01, steps=200)
        np.testing.assert_allclose(end, atoms.positions, atol=1e-10)
        assert energy == pytest.approx(_springs(end[None])[0][0], abs=1e-14)
    # not converged within max_steps: the last geometry, its energy where it stopped, and the flag
    final, energies, converged, calls = optimize_geometries(["H"] * 5, starts, _springs, 1e-9, 3)
    assert not converged.any() and calls == 4
    np.testing.assert_allclose(energies, _springs(final)[0], atol=1e-14)
    with pytest.raises(ValueError, match=r"give \(B, 5, 3\) for 5 atoms"):
        optimize_geometries(["H"] * 5, starts[0], _springs)


def test_a_nearly_free_rotor_leaves_its_saddle():
    """Methyl acetate's ETKDG geometry optimises to a saddle of its acetyl methyl (about 40i cm^-1 in
    GFN2-xTB, forces already below fmax 0.1 A down the mode): the tightened restart reaches the minimum."""
    smiles = dict(library("chno_5to7"))["methyl_acetate"]
    mol = get_molecule(f"smiles:{smiles}")
    modes = compute_normal_modes(mol.symbols, mol.positions, max_restarts=1)
    assert modes.frequencies_cm1[0] > -IMAGINARY_TOLERANCE_CM1
    assert len(modes.frequencies_cm1) == 3 * len(mol.symbols) - 6
