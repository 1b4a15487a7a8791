"""Normal-mode sampling (NMS) of off-equilibrium conformers, as in ANI-1.

Pipeline: optimise the starting geometry (GFN2-xTB via tblite, or DFT), take the
Hessian (central finite differences of GFN2-xTB forces, or PySCF's analytic DFT
Hessian), project out the rigid-body motions in mass-weighted coordinates and
diagonalise (:func:`normal_modes_from_hessian`), then draw conformers by
displacing the minimum along all normal modes at once (:func:`sample_conformer`).

The NMS recipe (Smith, Isayev and Roitberg, Chem. Sci. 8, 3192 (2017), Methods;
and the ANI-1 data paper, Sci. Data 4, 170193 (2017)): for the ``N_f`` vibrational
modes of a molecule of ``N_a`` atoms draw coefficients ``c_i >= 0`` with
``sum_i c_i <= 1``; displace along unit-norm Cartesian mode ``d_i`` by

    R_i = ±sqrt(3 c_i N_a k_B T / K_i)        [Å]

with a fair random sign and ``K_i`` the mode's force constant [E_h/Å²]. Mode ``i``
then carries the harmonic energy ``K_i R_i² / 2 = c_i (3 N_a k_B T / 2)``, and
the whole displacement ``sum_i c_i`` times ``3 N_a k_B T / 2``. The papers say
only that the ``c_i`` are uniform and sum to at most 1; we draw the total
``s ~ U(0, 1)`` and split it at ``N_f - 1`` sorted ``U(0, 1)`` points (``c = s x``
flat Dirichlet), as the authors' ``nmstools.py`` does up to a detail (it reuses
the largest of ``N_f`` draws as the end point). Force constants are floored at
its ``minfc = 1e-3 mdyn/Å``. Conformers with two atoms closer than
``min_distance`` are redrawn (nmstools uses element-pair thresholds instead).
"""
from __future__ import annotations

from functools import lru_cache
from typing import Callable, NamedTuple, Sequence

import numpy as np

from ...units import (
    BOLTZMANN_HARTREE_PER_K,
    MDYN_PER_ANGSTROM_TO_HARTREE_PER_ANGSTROM2,
    angstrom_to_bohr,
    eigenvalue_to_wavenumber,
    hartree_per_angstrom_to_ev_per_angstrom,
    hartree_per_bohr_to_hartree_per_angstrom,
    hartree_to_ev,
)
from .config import ChemConfig
from .molecules import ATOMIC_NUMBERS, check_elements, check_geometry, get_molecule

MIN_FORCE_CONSTANT = 1e-3 * MDYN_PER_ANGSTROM_TO_HARTREE_PER_ANGSTROM2  # nmstools' minfc [E_h/Å²]
XTB_FMAX_EV_PER_ANGSTROM = 1e-3  # xTB forces are cheap: optimise tightly for clean low modes
DFT_FMAX_EV_PER_ANGSTROM = 1e-2
HESSIAN_STEP_ANGSTROM = 5e-3  # central-difference step of the xTB Hessian
IMAGINARY_TOLERANCE_CM1 = 30.0  # below -this a mode counts as imaginary (not a minimum)
ForcesFn = Callable[[np.ndarray], tuple[float, np.ndarray]]  # positions Å -> (E_h, E_h/Å)


class EnergyForces(NamedTuple):
    energy_hartree: float
    forces_hartree_per_angstrom: np.ndarray  # (n, 3), F = -dE/dR


class NormalModes(NamedTuple):
    """Harmonic vibrations about a minimum (all arrays read-only); ``m = 3n - 6`` (``3n - 5`` linear)."""

    symbols: tuple[str, ...]
    equilibrium_positions: np.ndarray  # (n, 3) Å
    masses_amu: np.ndarray  # (n,) standard atomic weights (ase.data.atomic_masses)
    hessian: np.ndarray  # (3n, 3n) E_h/Å², atom-major
    frequencies_cm1: np.ndarray  # (m,) ascending; negative = imaginary
    mass_weighted_modes: np.ndarray  # (m, n, 3) orthonormal eigenvectors of M^-1/2 H M^-1/2
    cartesian_modes: np.ndarray  # (m, n, 3) d_i = M^-1/2 e_i / |M^-1/2 e_i|, unit norm
    reduced_masses_amu: np.ndarray  # (m,) mu_i = 1 / |M^-1/2 e_i|²
    force_constants: np.ndarray  # (m,) K_i = d_i^T H d_i = mu_i omega_i², E_h/Å²
    method: str  # "xtb" or "dft"


class SamplingError(RuntimeError):
    """No conformer without overlapping atoms was found within the allowed draws."""


def xtb_energy_forces(symbols: Sequence[str], positions: np.ndarray, *, charge: int = 0) -> EnergyForces:
    """GFN2-xTB single point (tblite): energy [E_h] and forces [E_h/Å] at ``positions`` ``(n, 3)`` Å.

    Bannwarth, Ehlert and Grimme, J. Chem. Theory Comput. 15, 1652 (2019); lowest
    spin (``N_electrons mod 2`` unpaired electrons).
    """
    from tblite.interface import Calculator

    check_elements(list(symbols))
    numbers = np.array([ATOMIC_NUMBERS[s] for s in symbols])
    n_unpaired = (int(numbers.sum()) - charge) % 2
    calc = Calculator("GFN2-xTB", numbers, angstrom_to_bohr(np.asarray(positions, dtype=np.float64)),
                      charge=float(charge), uhf=n_unpaired)
    calc.set("verbosity", 0)
    calc.set("accuracy", 0.01)  # tighter SCC than the default 1.0: finite-difference Hessians need clean forces
    result = calc.singlepoint()
    gradient = hartree_per_bohr_to_hartree_per_angstrom(np.array(result.get("gradient")))  # (n, 3)
    return EnergyForces(float(result.get("energy")), -gradient)


def optimize_geometry(
    symbols: Sequence[str], positions: np.ndarray, energy_forces: ForcesFn,
    fmax_ev_per_angstrom: float = XTB_FMAX_EV_PER_ANGSTROM, max_steps: int = 1000, strict: bool = True,
) -> np.ndarray:
    """Minimum [Å] ``(n, 3)`` reached by ASE's BFGS from ``positions`` with ``energy_forces``;
    stops when the largest atomic force is below ``fmax_ev_per_angstrom``. Not there after
    ``max_steps``: a RuntimeError, or with ``strict=False`` the last geometry."""
    def batch(stack: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        energy, forces = energy_forces(stack[0])
        return np.array([energy]), np.asarray(forces)[None]

    final, _, converged, _ = optimize_geometries(symbols, np.asarray(positions)[None], batch, fmax_ev_per_angstrom,
                                                 max_steps)
    if not converged[0] and strict:
        raise RuntimeError(f"geometry optimisation did not reach fmax={fmax_ev_per_angstrom} eV/Å in {max_steps} steps")
    return final[0]


BatchForcesFn = Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]]  # (B, n, 3) Å -> (B,) E_h, (B, n, 3) E_h/Å


def optimize_geometries(
    symbols: Sequence[str], positions: np.ndarray, energy_forces: BatchForcesFn,
    fmax_ev_per_angstrom: float = XTB_FMAX_EV_PER_ANGSTROM, max_steps: int = 1000,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """ASE's BFGS from each of ``positions`` ``(B, n, 3)`` [Å] of one molecule, all stepped together, so that
    every step asks ``energy_forces`` once for the batch of geometries still moving (a network answers a batch
    in about the time of one geometry). Each optimiser is ASE's own, fed the forces of its geometry, so each
    path is the one ``BFGS(atoms).run(fmax, steps)`` takes. Returns the final geometries ``(B, n, 3)``, their
    energies ``(B,)`` [E_h], whether each reached ``fmax`` within ``max_steps``, and the number of calls."""
    from ase import Atoms
    from ase.calculators.singlepoint import SinglePointCalculator
    from ase.optimize import BFGS

    positions = np.array(positions, dtype=np.float64)
    if positions.ndim != 3 or positions.shape[1:] != (len(symbols), 3):
        raise ValueError(f"positions of shape {positions.shape}: give (B, {len(symbols)}, 3) for {len(symbols)} atoms")
    atoms = [Atoms(symbols=list(symbols), positions=p) for p in positions]
    optimizers = [BFGS(a, logfile=None) for a in atoms]
    for opt in optimizers:
        opt.fmax = fmax_ev_per_angstrom  # what run(fmax=...) sets before its first check
    energies = np.full(len(atoms), np.nan)
    converged = np.zeros(len(atoms), dtype=bool)
    moving, calls = list(range(len(atoms))), 0
    for step in range(max_steps + 1):
        energy, forces = energy_forces(np.stack([atoms[i].positions for i in moving]))
        calls += 1
        still = []
        for k, i in enumerate(moving):
            f_ev = hartree_per_angstrom_to_ev_per_angstrom(np.asarray(forces[k]))
            atoms[i].calc = SinglePointCalculator(atoms[i], energy=hartree_to_ev(float(energy[k])), forces=f_ev)
            energies[i] = float(energy[k])
            if optimizers[i].converged():
                converged[i] = True
            elif step < max_steps:
                optimizers[i].step()
                still.append(i)
        if not still:  # at max_steps nothing steps: every geometry's energy is where it stopped
            break
        moving = still
    return np.stack([a.positions for a in atoms]), energies, converged, calls


def finite_difference_hessian(
    positions: np.ndarray, energy_forces: ForcesFn, step: float = HESSIAN_STEP_ANGSTROM
) -> np.ndarray:
    """Hessian ``H_ab = -(F_b(R + h e_a) - F_b(R - h e_a)) / 2h`` [E_h/Å²], ``(3n, 3n)``,
    symmetrised; ``6n`` force calls. Error O(h²) from anharmonicity."""
    positions = np.asarray(positions, dtype=np.float64)
    flat = positions.reshape(-1)
    hessian = np.empty((flat.size, flat.size))
    for a in range(flat.size):
        plus, minus = flat.copy(), flat.copy()
        plus[a] += step
        minus[a] -= step
        f_plus = energy_forces(plus.reshape(positions.shape))[1].reshape(-1)
        f_minus = energy_forces(minus.reshape(positions.shape))[1].reshape(-1)
        hessian[a] = -(f_plus - f_minus) / (2.0 * step)
    return 0.5 * (hessian + hessian.T)


def rigid_body_basis(positions: np.ndarray, masses: np.ndarray, rtol: float = 1e-6) -> np.ndarray:
    """Orthonormal basis ``(3n, r)`` of rigid translations and rotations in mass-weighted
    coordinates ``q = M^1/2 x``: ``sqrt(m_i) e_a`` and ``sqrt(m_i) (e_a x (x_i - x_com))``.
    ``r = 6``, or 5 for a linear molecule (its rotation about the axis vanishes)."""
    sqrt_m = np.sqrt(np.asarray(masses, dtype=np.float64))[:, None]  # (n, 1)
    centred = positions - np.average(positions, axis=0, weights=masses)  # (n, 3)
    vectors = []
    for axis in np.eye(3):
        vectors.append((sqrt_m * axis[None, :]).reshape(-1))  # translation
        vectors.append((sqrt_m * np.cross(axis, centred)).reshape(-1))  # rotation
    u, s, _ = np.linalg.svd(np.array(vectors).T, full_matrices=False)  # (3n, 6)
    return u[:, s > rtol * s.max()]


def normal_modes_from_hessian(
    symbols: Sequence[str], positions: np.ndarray, hessian: np.ndarray, method: str = ""
) -> NormalModes:
    """Normal modes of Cartesian ``hessian`` [E_h/Å²] ``(3n, 3n)`` at ``positions`` [Å].

    Diagonalises ``M^-1/2 H M^-1/2`` on the complement of :func:`rigid_body_basis`
    (Wilson, Decius and Cross, *Molecular Vibrations*, 1955, ch. 2), so exactly
    ``3n - 6`` (``3n - 5``) modes remain with eigenvalues ``omega_i²`` [E_h/(Å² u)].
    """
    from ase.data import atomic_masses

    n = len(symbols)
    if n < 2:
        raise ValueError("a single atom has no vibrations: give a molecule of at least 2 atoms")
    positions = np.array(positions, dtype=np.float64)
    masses = np.array([atomic_masses[ATOMIC_NUMBERS[s]] for s in symbols])  # (n,) u
    inv_sqrt_m = np.repeat(masses, 3) ** -0.5  # (3n,)
    mass_weighted = hessian * inv_sqrt_m[:, None] * inv_sqrt_m[None, :]
    rigid = rigid_body_basis(positions, masses)  # (3n, r)
    complement = np.linalg.svd(rigid, full_matrices=True)[0][:, rigid.shape[1]:]  # (3n, m)
    eigenvalues, vectors = np.linalg.eigh(complement.T @ mass_weighted @ complement)
    modes_mw = (complement @ vectors).T  # (m, 3n)
    cartesian = modes_mw * inv_sqrt_m[None, :]  # (m, 3n)
    reduced_masses = 1.0 / np.sum(cartesian**2, axis=1)  # (m,)
    cartesian = cartesian * np.sqrt(reduced_masses)[:, None]
    arrays = dict(
        equilibrium_positions=positions, masses_amu=masses, hessian=np.array(hessian, dtype=np.float64),
        frequencies_cm1=eigenvalue_to_wavenumber(eigenvalues),
        mass_weighted_modes=modes_mw.reshape(-1, n, 3), cartesian_modes=cartesian.reshape(-1, n, 3),
        reduced_masses_amu=reduced_masses, force_constants=reduced_masses * eigenvalues,
    )
    for array in arrays.values():
        array.setflags(write=False)
    return NormalModes(symbols=tuple(symbols), method=method, **arrays)


def compute_normal_modes(
    symbols: Sequence[str], positions: np.ndarray, method: str = "xtb", dft_cfg: ChemConfig | None = None,
    max_restarts: int = 3,
) -> NormalModes:
    """Optimise ``positions`` [Å] and return the normal modes at the minimum.

    ``method="xtb"``: GFN2-xTB minimum and finite-difference Hessian. ``"dft"``: GFN2-xTB
    pre-optimisation, then DFT at ``dft_cfg.theory`` (minimum and analytic Hessian).
    Landing on a saddle point (a mode below ``-IMAGINARY_TOLERANCE_CM1``), it steps
    0.1 Å down that mode and re-optimises, up to ``max_restarts`` times, each time with a
    GFN2-xTB ``fmax`` ten times tighter. A nearly free rotor (methyl acetate's acetyl
    methyl, a barrier of 0.03 kcal/mol in GFN2-xTB) has forces below the first ``fmax``
    that far from its saddle, so BFGS would stop where it starts.
    """
    if method not in ("xtb", "dft"):
        raise ValueError(f"hessian method {method!r}: choose 'xtb' or 'dft'")
    if method == "dft" and dft_cfg is None:
        raise ValueError("method='dft' needs dft_cfg, the ChemConfig giving the level of theory")
    symbols = tuple(symbols)

    def xtb(pos: np.ndarray) -> EnergyForces:
        return xtb_energy_forces(symbols, pos)

    def dft(pos: np.ndarray) -> tuple[float, np.ndarray]:
        from .dft import dft_energy_forces

        result = dft_energy_forces(symbols, pos, dft_cfg)
        return result.energy_hartree, result.forces_hartree_per_angstrom

    positions = np.asarray(positions, dtype=np.float64)
    for restart in range(max_restarts + 1):
        positions = optimize_geometry(symbols, positions, xtb, XTB_FMAX_EV_PER_ANGSTROM / 10**restart)
        if method == "xtb":
            hessian = finite_difference_hessian(positions, xtb)
        else:
            from .dft import dft_hessian

            positions = optimize_geometry(symbols, positions, dft, DFT_FMAX_EV_PER_ANGSTROM)
            hessian = dft_hessian(symbols, positions, dft_cfg)
        modes = normal_modes_from_hessian(symbols, positions, hessian, method)
        if modes.frequencies_cm1[0] > -IMAGINARY_TOLERANCE_CM1:
            return modes
        positions = positions + 0.1 * modes.cartesian_modes[0]  # off the saddle, downhill
    raise RuntimeError(
        f"no minimum found: after {max_restarts} restarts a mode is still imaginary "
        f"({-modes.frequencies_cm1[0]:.0f}i cm^-1); start from a better geometry"
    )


@lru_cache(maxsize=16)
def _cached_modes(molecule: str, method: str, dft_cfg: ChemConfig | None) -> NormalModes:
    mol = get_molecule(molecule)
    return compute_normal_modes(mol.symbols, mol.positions, method, dft_cfg)


def reference_modes(cfg: ChemConfig) -> NormalModes:
    """Normal modes of ``cfg.molecule`` by ``cfg.hessian``, computed once per process.

    Cached on (molecule, method, and for DFT the level of theory and SCF settings),
    so every conformer task of a worker reuses them; a file read by path is not
    re-read if it changes.
    """
    if cfg.hessian == "xtb":
        return _cached_modes(cfg.molecule, "xtb", None)
    functional, basis, density_fit, grid_level = cfg.theory
    dft_cfg = ChemConfig(
        molecule=cfg.molecule, level="custom", functional=functional, basis=basis, density_fit=density_fit,
        grid_level=grid_level, scf_conv_tol=cfg.scf_conv_tol, max_scf_cycles=cfg.max_scf_cycles, hessian="dft",
    )
    return _cached_modes(cfg.molecule, "dft", dft_cfg)


def nms_coefficients(n_modes: int, rng: np.random.Generator) -> np.ndarray:
    """Coefficients ``c`` ``(n_modes,)``, ``c_i >= 0``, ``sum c = s ~ U(0, 1)``: ``s`` times the
    spacings of ``n_modes - 1`` sorted ``U(0, 1)`` points (flat Dirichlet; module docstring)."""
    total = rng.uniform()
    cuts = np.sort(rng.uniform(size=n_modes - 1))
    return total * np.diff(np.concatenate(([0.0], cuts, [1.0])))


def nms_displacement(modes: NormalModes, temperature: float, rng: np.random.Generator) -> np.ndarray:
    """One NMS displacement ``sum_i R_i d_i`` [Å] ``(n, 3)`` with ``R_i = ±sqrt(3 c_i N_a k_B T / K_i)``,
    ``T`` in K, ``K_i`` floored at :data:`MIN_FORCE_CONSTANT` (module docstring)."""
    if not temperature > 0:
        raise ValueError(f"temperature={temperature}: must be > 0 K")
    n_atoms = len(modes.symbols)
    c = nms_coefficients(len(modes.force_constants), rng)  # (m,)
    force_constants = np.maximum(modes.force_constants, MIN_FORCE_CONSTANT)  # (m,) E_h/Å²
    signs = rng.choice((-1.0, 1.0), size=c.shape)
    amplitudes = signs * np.sqrt(3.0 * c * n_atoms * BOLTZMANN_HARTREE_PER_K * temperature / force_constants)
    return np.einsum("m,mnk->nk", amplitudes, modes.cartesian_modes)  # (n, 3) Å


def sample_conformer(
    modes: NormalModes, temperature: float, rng: np.random.Generator, min_distance: float, max_tries: int = 100
) -> np.ndarray:
    """An NMS conformer [Å] ``(n, 3)`` with no two atoms closer than ``min_distance`` [Å].

    Draws :func:`nms_displacement` until the geometry passes, at most ``max_tries``
    times, then raises :class:`SamplingError`.
    """
    last_error = ""
    for _ in range(max_tries):
        positions = modes.equilibrium_positions + nms_displacement(modes, temperature, rng)
        try:
            check_geometry(positions, min_distance, modes.symbols)
            return positions
        except ValueError as err:
            last_error = str(err)
    raise SamplingError(
        f"{max_tries} NMS draws at {temperature} K all had overlapping atoms (last: {last_error}); "
        "lower app.temperature or app.min_distance"
    )
