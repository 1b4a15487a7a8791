"""Unit conversions, and only those: each constant with its source.

Values are CODATA 2018 (Tiesinga et al., Rev. Mod. Phys. 93, 025010 (2021);
https://physics.nist.gov/cuu/Constants), written out here so that stored data do
not change with the installed SciPy (SciPy >= 1.15 ships CODATA 2022, which
differs from 2018 in the 11th significant digit). Since the 2019 SI redefinition
the electronvolt, Avogadro, Boltzmann and speed-of-light values are exact; the
calorie is the thermochemical one, 4.184 J exactly.

Every function multiplies by a constant, so it takes and returns a Python float,
a NumPy array or a torch tensor alike (dtype and device kept).
"""
from __future__ import annotations

import math
from typing import TypeVar

import numpy as np

# -- CODATA 2018 base values ------------------------------------------------------
HARTREE_J = 4.3597447222071e-18  # Hartree energy E_h [J], CODATA 2018
ELECTRONVOLT_J = 1.602176634e-19  # elementary charge x 1 V [J], exact
BOHR_M = 0.529177210903e-10  # Bohr radius a_0 [m], CODATA 2018
AVOGADRO_PER_MOL = 6.02214076e23  # N_A [1/mol], exact
BOLTZMANN_J_PER_K = 1.380649e-23  # k_B [J/K], exact
ATOMIC_MASS_UNIT_KG = 1.66053906660e-27  # atomic mass constant m_u (1 Da) [kg], CODATA 2018
SPEED_OF_LIGHT_M_PER_S = 299792458.0  # c [m/s], exact
KCAL_J = 4184.0  # thermochemical kilocalorie [J], exact by definition
ANGSTROM_M = 1e-10  # [m], exact

# -- derived conversion factors ---------------------------------------------------
HARTREE_TO_EV = HARTREE_J / ELECTRONVOLT_J  # 27.211386245988 eV per E_h
HARTREE_TO_KCAL_MOL = HARTREE_J * AVOGADRO_PER_MOL / KCAL_J  # 627.509474063 (kcal/mol) per E_h
EV_TO_KCAL_MOL = HARTREE_TO_KCAL_MOL / HARTREE_TO_EV  # 23.0605478 (kcal/mol) per eV
BOHR_TO_ANGSTROM = BOHR_M / ANGSTROM_M  # 0.529177210903 Å per bohr
BOLTZMANN_HARTREE_PER_K = BOLTZMANN_J_PER_K / HARTREE_J  # k_B = 3.166811563e-6 E_h/K
# force constant: 1 mdyn/Å = 1e-8 N / 1e-10 m = 100 N/m = 100 J/m² (Gaussian's unit) -> E_h/Å²
MDYN_PER_ANGSTROM_TO_HARTREE_PER_ANGSTROM2 = 100.0 * ANGSTROM_M**2 / HARTREE_J  # 0.229371
# sqrt(E_h / (Å^2 u)) is an angular frequency [rad/s]; divide by 2 pi c (c in cm/s) for cm^-1
_SQRT_HARTREE_PER_ANGSTROM2_AMU_TO_WAVENUMBER = math.sqrt(
    HARTREE_J / (ANGSTROM_M**2 * ATOMIC_MASS_UNIT_KG)
) / (2.0 * math.pi * SPEED_OF_LIGHT_M_PER_S * 100.0)

T = TypeVar("T")  # float, np.ndarray or torch.Tensor


def hartree_to_kcal_mol(x: T) -> T:
    """Energy E_h -> kcal/mol (also forces E_h/Å -> kcal/mol/Å)."""
    return x * HARTREE_TO_KCAL_MOL  # type: ignore[operator]


def kcal_mol_to_hartree(x: T) -> T:
    """Energy kcal/mol -> E_h (also forces kcal/mol/Å -> E_h/Å)."""
    return x / HARTREE_TO_KCAL_MOL  # type: ignore[operator]


def hartree_to_ev(x: T) -> T:
    """Energy E_h -> eV."""
    return x * HARTREE_TO_EV  # type: ignore[operator]


def ev_to_hartree(x: T) -> T:
    """Energy eV -> E_h."""
    return x / HARTREE_TO_EV  # type: ignore[operator]


def ev_to_kcal_mol(x: T) -> T:
    """Energy eV -> kcal/mol."""
    return x * EV_TO_KCAL_MOL  # type: ignore[operator]


def kcal_mol_to_ev(x: T) -> T:
    """Energy kcal/mol -> eV."""
    return x / EV_TO_KCAL_MOL  # type: ignore[operator]


def bohr_to_angstrom(x: T) -> T:
    """Length bohr -> Å."""
    return x * BOHR_TO_ANGSTROM  # type: ignore[operator]


def angstrom_to_bohr(x: T) -> T:
    """Length Å -> bohr."""
    return x / BOHR_TO_ANGSTROM  # type: ignore[operator]


def hartree_per_bohr_to_hartree_per_angstrom(x: T) -> T:
    """Force or gradient E_h/bohr -> E_h/Å (divide by a_0 in Å)."""
    return x / BOHR_TO_ANGSTROM  # type: ignore[operator]


def hartree_per_angstrom_to_hartree_per_bohr(x: T) -> T:
    """Force or gradient E_h/Å -> E_h/bohr."""
    return x * BOHR_TO_ANGSTROM  # type: ignore[operator]


def hartree_per_bohr2_to_hartree_per_angstrom2(x: T) -> T:
    """Hessian or force constant E_h/bohr² -> E_h/Å²."""
    return x / BOHR_TO_ANGSTROM**2  # type: ignore[operator]


def ev_per_angstrom_to_hartree_per_angstrom(x: T) -> T:
    """Force eV/Å -> E_h/Å."""
    return x / HARTREE_TO_EV  # type: ignore[operator]


def hartree_per_angstrom_to_ev_per_angstrom(x: T) -> T:
    """Force E_h/Å -> eV/Å (ASE's units)."""
    return x * HARTREE_TO_EV  # type: ignore[operator]


def kelvin_to_hartree(temperature: T) -> T:
    """Thermal energy k_B T [E_h] of a temperature [K]."""
    return temperature * BOLTZMANN_HARTREE_PER_K  # type: ignore[operator]


def eigenvalue_to_wavenumber(eigenvalue: np.ndarray | float) -> np.ndarray:
    """Mass-weighted Hessian eigenvalue omega² [E_h/(Å² u)] -> wavenumber [cm^-1].

    ``nu~ = sign(omega²) sqrt(|omega²|) / (2 pi c)``; a negative result stands for
    the imaginary frequency of a negative eigenvalue (the usual convention).
    """
    lam = np.asarray(eigenvalue, dtype=np.float64)
    return np.sign(lam) * np.sqrt(np.abs(lam)) * _SQRT_HARTREE_PER_ANGSTROM2_AMU_TO_WAVENUMBER
