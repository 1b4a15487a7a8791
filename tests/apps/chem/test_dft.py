"""The PySCF DFT driver against direct PySCF calls, finite differences and invariances.

Water and hydroxyl in small basis sets keep each test to a few seconds. Tolerances:
- same PySCF code, same settings: energies to 1e-8 E_h (SCF converged to 1e-11);
- forces vs central differences of the energy: 1e-5 E_h/Å. The forces include the
  grid-weight response, so they are the exact derivative of the grid energy; what
  remains is the O(h²) truncation (~1e-7 for h = 1e-3 Å) and the SCF gradient
  convergence (|g| < sqrt(conv_tol) ~ 3e-6);
- rotations: the DFT grid stays fixed in the lab frame, so the energy changes by
  ~1e-6 E_h at grid level 3 (measured 8e-7 for water); translations are exact.
"""
from __future__ import annotations

import numpy as np
import pytest
import scipy.constants as sc
import torch

from converge import units
from converge.apps.chem.config import ChemConfig
from converge.apps.chem.dft import (
    RETRY_LADDER,
    SCFNotConverged,
    build_mole,
    dft_energy_forces,
    dft_hessian,
)

SYMBOLS = ("O", "H", "H")
# a distorted water (Å): off the minimum, so the forces are large and all components nonzero
POSITIONS = np.array([[0.0, 0.0, 0.119], [0.05, 0.80, -0.46], [-0.02, -0.74, -0.50]])
CFG = ChemConfig(level="custom", functional="b3lyp", basis="6-31g", density_fit=False, grid_level=3,
                 scf_conv_tol=1e-11)
BOHR_ANGSTROM = sc.physical_constants["Bohr radius"][0] / sc.angstrom  # independent of converge.units


def direct_pyscf(symbols, positions, xc="b3lyp", basis="6-31g", grid=3, spin=0):
    from pyscf import dft, gto

    mol = gto.M(atom=list(zip(symbols, map(tuple, positions))), basis=basis, unit="Angstrom", spin=spin, verbose=0)
    mf = (dft.RKS if spin == 0 else dft.UKS)(mol)
    mf.xc, mf.grids.level, mf.conv_tol = xc, grid, 1e-11
    energy = mf.kernel()
    grad = mf.nuc_grad_method()
    grad.grid_response = True
    return energy, grad.kernel()


def test_energy_and_forces_equal_a_direct_pyscf_calculation():
    result = dft_energy_forces(SYMBOLS, POSITIONS, CFG)
    energy, gradient = direct_pyscf(SYMBOLS, POSITIONS)
    assert result.converged and result.attempts == 1 and result.n_scf_cycles > 0
    assert result.energy_hartree == pytest.approx(energy, abs=1e-8)
    np.testing.assert_allclose(result.forces_hartree_per_angstrom, -gradient / BOHR_ANGSTROM, atol=1e-7)


def test_open_shell_uses_unrestricted_ks():
    symbols, positions = ("O", "H"), np.array([[0.0, 0.0, 0.0], [0.0, 0.0, 0.97]])  # OH radical, 9 electrons
    assert build_mole(symbols, positions, "sto-3g").spin == 1
    result = dft_energy_forces(symbols, positions, CFG)
    energy, _ = direct_pyscf(symbols, positions, spin=1)
    assert result.energy_hartree == pytest.approx(energy, abs=1e-8)


def test_forces_are_minus_the_energy_gradient_by_central_differences():
    forces = dft_energy_forces(SYMBOLS, POSITIONS, CFG).forces_hartree_per_angstrom
    h = 1e-3  # Å
    for atom, axis in [(0, 2), (1, 1), (2, 0), (2, 2)]:
        plus, minus = POSITIONS.copy(), POSITIONS.copy()
        plus[atom, axis] += h
        minus[atom, axis] -= h
        derivative = (dft_energy_forces(SYMBOLS, plus, CFG).energy_hartree
                      - dft_energy_forces(SYMBOLS, minus, CFG).energy_hartree) / (2 * h)
        assert forces[atom, axis] == pytest.approx(-derivative, abs=1e-5), (atom, axis)
    np.testing.assert_allclose(forces.sum(axis=0), 0.0, atol=1e-10)  # no net force (grid response on)


def test_energy_is_invariant_under_translation_and_rotation():
    base = dft_energy_forces(SYMBOLS, POSITIONS, CFG)
    shifted = dft_energy_forces(SYMBOLS, POSITIONS + np.array([1.7, -2.3, 0.4]), CFG)
    assert shifted.energy_hartree == pytest.approx(base.energy_hartree, abs=1e-9)
    np.testing.assert_allclose(shifted.forces_hartree_per_angstrom, base.forces_hartree_per_angstrom, atol=1e-7)

    from scipy.spatial.transform import Rotation

    rotation = Rotation.from_euler("xyz", [0.3, 1.1, -0.7]).as_matrix()
    rotated = dft_energy_forces(SYMBOLS, POSITIONS @ rotation.T, CFG)
    assert rotated.energy_hartree == pytest.approx(base.energy_hartree, abs=5e-6)  # grid orientation, see top
    np.testing.assert_allclose(rotated.forces_hartree_per_angstrom,
                               base.forces_hartree_per_angstrom @ rotation.T, atol=1e-4)


def test_unconverged_scf_raises_with_every_attempt_listed():
    cfg = ChemConfig(level="custom", functional="b3lyp", basis="sto-3g", density_fit=False, max_scf_cycles=1)
    with pytest.raises(SCFNotConverged, match="after 5 attempts.*level shift.*'atom'.*'huckel'.*Newton") as err:
        dft_energy_forces(SYMBOLS, POSITIONS, cfg)
    assert len(err.value.attempts) == len(RETRY_LADDER) == 5


def test_scf_that_only_the_newton_solver_converges_gives_the_converged_answer():
    # 3 DIIS cycles are too few for water at 1e-9; the Newton solver, started from the
    # density the DIIS attempts reached, converges within 3 macro iterations.
    slow = ChemConfig(level="custom", functional="b3lyp", basis="sto-3g", density_fit=False, max_scf_cycles=3)
    normal = ChemConfig(level="custom", functional="b3lyp", basis="sto-3g", density_fit=False)
    retried = dft_energy_forces(SYMBOLS, POSITIONS, slow)
    reference = dft_energy_forces(SYMBOLS, POSITIONS, normal)
    assert retried.attempts == 5 and reference.attempts == 1
    assert retried.n_scf_cycles > reference.n_scf_cycles
    assert retried.energy_hartree == pytest.approx(reference.energy_hartree, abs=1e-8)
    np.testing.assert_allclose(retried.forces_hartree_per_angstrom, reference.forces_hartree_per_angstrom, atol=1e-5)


def test_density_fitting_changes_the_energy_only_slightly():
    exact = dft_energy_forces(SYMBOLS, POSITIONS, CFG).energy_hartree
    fitted = dft_energy_forces(SYMBOLS, POSITIONS, ChemConfig(
        level="custom", functional="b3lyp", basis="6-31g", density_fit=True, grid_level=3)).energy_hartree
    assert 0 < abs(fitted - exact) < 1e-4  # the auxiliary-basis error of DF-J/K is ~1e-5 E_h for water


def test_analytic_hessian_matches_finite_differences_of_forces():
    cfg = ChemConfig(level="custom", functional="b3lyp", basis="sto-3g", density_fit=False, grid_level=3,
                     scf_conv_tol=1e-11)
    hessian = dft_hessian(SYMBOLS, POSITIONS, cfg)  # (9, 9) E_h/Å²
    assert hessian.shape == (9, 9)
    h = 1e-3
    for column in (2, 4, 6):  # O z, H1 y, H2 x
        plus, minus = POSITIONS.copy().reshape(-1), POSITIONS.copy().reshape(-1)
        plus[column] += h
        minus[column] -= h
        f_plus = dft_energy_forces(SYMBOLS, plus.reshape(3, 3), cfg).forces_hartree_per_angstrom.reshape(-1)
        f_minus = dft_energy_forces(SYMBOLS, minus.reshape(3, 3), cfg).forces_hartree_per_angstrom.reshape(-1)
        # tolerance: the analytic Hessian leaves out the grid-weight response (~1e-4 at grid level 3)
        np.testing.assert_allclose(hessian[:, column], -(f_plus - f_minus) / (2 * h), atol=2e-3)


def test_unsupported_element_is_a_clear_error():
    with pytest.raises(ValueError, match=r"element Cl \(atom 2\) is not supported; supported: H, C, N, O"):
        dft_energy_forces(("H", "Cl"), np.array([[0, 0, 0], [0, 0, 1.3]]), CFG)


# -- the unit conversions the driver relies on (converge.units) ---------------------
def test_unit_constants_agree_with_scipy_and_ase():
    import ase.units

    hartree_j = sc.physical_constants["Hartree energy"][0]
    assert units.HARTREE_TO_EV == pytest.approx(sc.physical_constants["Hartree energy in eV"][0], rel=1e-9)
    assert units.HARTREE_TO_KCAL_MOL == pytest.approx(hartree_j * sc.N_A / 4184.0, rel=1e-9)
    assert units.BOHR_TO_ANGSTROM == pytest.approx(BOHR_ANGSTROM, rel=1e-9)
    assert units.BOLTZMANN_HARTREE_PER_K == pytest.approx(sc.k / hartree_j, rel=1e-9)
    # ASE uses CODATA 2014: agreement to its ~1e-8 differences only
    assert units.HARTREE_TO_KCAL_MOL == pytest.approx(ase.units.Hartree / (ase.units.kcal / ase.units.mol), rel=1e-7)
    assert units.EV_TO_KCAL_MOL == pytest.approx(1 / (ase.units.kcal / ase.units.mol), rel=1e-7)


def test_unit_functions_accept_floats_arrays_and_tensors_and_round_trip():
    assert units.hartree_to_kcal_mol(1.0) == units.HARTREE_TO_KCAL_MOL
    array = np.array([0.5, -2.0])
    np.testing.assert_allclose(units.kcal_mol_to_hartree(units.hartree_to_kcal_mol(array)), array, rtol=1e-15)
    tensor = torch.tensor([1.0, 3.0], dtype=torch.float64)
    out = units.hartree_per_bohr_to_hartree_per_angstrom(tensor)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.float64
    torch.testing.assert_close(out, tensor / BOHR_ANGSTROM)
    assert units.ev_to_kcal_mol(units.hartree_to_ev(1.0)) == pytest.approx(units.HARTREE_TO_KCAL_MOL, rel=1e-14)
    # 1 mdyn/Å = 100 N/m; in E_h/Å²
    assert units.MDYN_PER_ANGSTROM_TO_HARTREE_PER_ANGSTROM2 == pytest.approx(100 * 1e-20 / 4.3597447222071e-18)
