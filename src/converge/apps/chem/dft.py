"""Kohn-Sham DFT energies, forces and Hessians with PySCF (optionally gpu4pyscf).

The level of theory is ``cfg.theory`` = (functional, basis, density fitting, grid
level) of a :class:`~.config.ChemConfig`. Closed-shell molecules use restricted KS
(RKS); an odd electron count uses unrestricted KS (UKS) with the lowest spin
(a doublet). Energies are in hartree, positions in Å, forces ``F = -dE/dR`` in
E_h/Å (PySCF's gradients are E_h/bohr and are converted with
:func:`converge.units.hartree_per_bohr_to_hartree_per_angstrom`).

Forces include the response of the integration-grid weights to the nuclear
positions (``grid_response = True``), so they are the exact derivatives of the
energy PySCF computes on its grid; without it, at grid level 1, forces and
finite-difference derivatives of the energy differ by ~1e-4 E_h/Å. The grid is
not rotated with the molecule, so the energy changes by up to ~3e-5 E_h (grid
level 1) to ~1e-6 E_h (level 3) under a rotation; translations are exact.

An SCF that does not converge is never returned: :func:`converged_scf` walks
:data:`RETRY_LADDER` (DIIS from PySCF's default guess, with a level shift, from
other initial guesses, then the second-order Newton solver) and raises
:class:`SCFNotConverged` listing the attempts if none converges.

References: Sun et al., "Recent developments in the PySCF program package",
J. Chem. Phys. 153, 024109 (2020); analytic KS gradients and Hessians as
implemented in ``pyscf.grad`` / ``pyscf.hessian``.
"""
from __future__ import annotations

import warnings
from contextlib import nullcontext
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, NamedTuple, Sequence

import numpy as np

from ...units import hartree_per_bohr2_to_hartree_per_angstrom2, hartree_per_bohr_to_hartree_per_angstrom
from .config import ChemConfig
from .molecules import ATOMIC_NUMBERS, check_elements, hill_formula


class DFTResult(NamedTuple):
    """One converged DFT single point."""

    energy_hartree: float
    forces_hartree_per_angstrom: np.ndarray  # (n, 3), F = -dE/dR
    n_scf_cycles: int  # SCF iterations of all attempts together (the cost)
    attempts: int  # rungs of RETRY_LADDER tried, 1 if the first converged
    converged: bool  # always True: unconverged SCFs raise SCFNotConverged


@dataclass(frozen=True)
class SCFAttempt:
    """One rung of the SCF retry ladder.

    ``level_shift`` [E_h] raises the virtual orbital energies during the
    iterations (damps charge sloshing; the converged density is unchanged);
    ``init_guess`` is a PySCF initial guess; ``second_order`` runs the Newton
    (SOSCF) solver starting from the density the previous attempt reached.
    """

    label: str
    init_guess: str = "minao"
    level_shift: float = 0.0
    second_order: bool = False


RETRY_LADDER: tuple[SCFAttempt, ...] = (
    SCFAttempt("DIIS from the 'minao' guess"),
    SCFAttempt("DIIS with a 0.3 E_h level shift", level_shift=0.3),
    SCFAttempt("DIIS from the 'atom' guess", init_guess="atom"),
    SCFAttempt("DIIS from the 'huckel' guess", init_guess="huckel"),
    SCFAttempt("second-order (Newton) solver", second_order=True),
)


class SCFNotConverged(RuntimeError):
    """No rung of the retry ladder converged; ``attempts`` lists what was tried."""

    def __init__(self, description: str, attempts: Sequence[str]) -> None:
        self.attempts = tuple(attempts)
        tried = "; ".join(f"{k + 1}. {a}" for k, a in enumerate(self.attempts))
        super().__init__(
            f"SCF did not converge for {description} after {len(self.attempts)} attempts ({tried}). "
            "Check the geometry for overlapping atoms, or raise app.max_scf_cycles / loosen app.scf_conv_tol."
        )


@lru_cache(maxsize=1)
def gpu_available() -> bool:
    """True when ``cupy`` and ``gpu4pyscf`` import and a CUDA device is visible."""
    try:
        import cupy
        import gpu4pyscf  # noqa: F401

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # ImportError, or CUDA runtime errors without a driver
        return False


def build_mole(symbols: Sequence[str], positions_angstrom: np.ndarray, basis: str, charge: int = 0):
    """A built PySCF ``Mole``: positions in Å, lowest spin (``2S = N_electrons mod 2``), quiet."""
    from pyscf import gto

    check_elements(list(symbols))
    positions = np.asarray(positions_angstrom, dtype=np.float64)
    if positions.shape != (len(symbols), 3):
        raise ValueError(f"positions must have shape ({len(symbols)}, 3), got {positions.shape}")
    n_electrons = sum(ATOMIC_NUMBERS[s] for s in symbols) - charge
    mol = gto.Mole()
    mol.atom = [(s, tuple(p)) for s, p in zip(symbols, positions)]
    mol.basis = basis
    mol.charge = charge
    mol.spin = n_electrons % 2
    mol.verbose = 0
    mol.build(unit="Angstrom")
    return mol


def make_ks(mol, cfg: ChemConfig, attempt: SCFAttempt = RETRY_LADDER[0], use_gpu: bool = False):
    """An unconverged KS object for ``mol`` at ``cfg.theory`` with the settings of ``attempt``."""
    from pyscf import dft

    functional, _, density_fit, grid_level = cfg.theory
    mf = dft.RKS(mol) if mol.spin == 0 else dft.UKS(mol)
    mf.xc = functional
    mf.grids.level = grid_level
    mf.conv_tol = cfg.scf_conv_tol
    mf.max_cycle = cfg.max_scf_cycles
    mf.init_guess = attempt.init_guess
    mf.level_shift = attempt.level_shift
    mf.verbose = 0
    if density_fit:
        mf = mf.density_fit()
    if use_gpu:
        mf = mf.to_gpu()
    return mf


def _count_cycles(counter: list[int]):
    def callback(_: dict[str, Any]) -> None:
        counter[0] += 1

    return callback


def converged_scf(
    mol,
    cfg: ChemConfig,
    ladder: Sequence[SCFAttempt] = RETRY_LADDER,
    use_gpu: bool = False,
) -> tuple[Any, int, int]:
    """Run the SCF, walking ``ladder`` until one attempt converges.

    Returns ``(mf, n_scf_cycles, attempts)``: the converged KS object, SCF
    iterations of all attempts together, and how many attempts ran. Raises
    :class:`SCFNotConverged` if none converges.
    """
    total_cycles = 0
    tried: list[str] = []
    last = None
    for attempt in ladder:
        mf = make_ks(mol, cfg, attempt, use_gpu)
        if attempt.second_order:
            dm0 = last.make_rdm1() if last is not None and last.mo_coeff is not None else None
            with warnings.catch_warnings():  # PySCF's Newton solver calls its own deprecated helper
                warnings.simplefilter("ignore", DeprecationWarning)
                mf = mf.newton()
        counter = [0]
        mf.callback = _count_cycles(counter)  # the Newton solver does not set mf.cycles
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            mf.kernel(dm0=dm0) if attempt.second_order else mf.kernel()
        total_cycles += counter[0] or int(getattr(mf, "cycles", 0))
        tried.append(f"{attempt.label} (max {cfg.max_scf_cycles} cycles)")
        if mf.converged:
            return mf, total_cycles, len(tried)
        last = mf
    symbols = [mol.atom_pure_symbol(k) for k in range(mol.natm)]
    raise SCFNotConverged(f"{hill_formula(symbols)} at {cfg.level_of_theory}", tried)


def _to_numpy(x) -> np.ndarray:
    return np.asarray(x.get() if hasattr(x, "get") else x, dtype=np.float64)  # cupy -> numpy


def _resolve_gpu(use_gpu: bool | None) -> bool:
    if use_gpu is None:
        return gpu_available()
    if use_gpu and not gpu_available():
        raise RuntimeError("use_gpu=True but cupy/gpu4pyscf or a CUDA device is missing")
    return use_gpu


def dft_energy_forces(
    symbols: Sequence[str],
    positions_angstrom: np.ndarray,
    cfg: ChemConfig,
    *,
    charge: int = 0,
    use_gpu: bool | None = None,
    threads: int | None = None,
) -> DFTResult:
    """Converged KS-DFT energy [E_h] and forces ``F = -dE/dR`` [E_h/Å] at ``cfg.theory``.

    ``positions_angstrom``: ``(n, 3)`` Å. ``use_gpu``: None picks gpu4pyscf when
    :func:`gpu_available`, else CPU PySCF. ``threads``: OpenMP threads PySCF may use
    for this call (None keeps the process setting, e.g. ``OMP_NUM_THREADS=1`` in
    ensemble workers). Raises :class:`SCFNotConverged` rather than return an
    unconverged energy.
    """
    from pyscf import lib

    gpu = _resolve_gpu(use_gpu)
    with lib.with_omp_threads(threads) if threads else nullcontext():
        mol = build_mole(symbols, positions_angstrom, cfg.theory[1], charge)
        mf, n_cycles, attempts = converged_scf(mol, cfg, use_gpu=gpu)
        gradient_method = mf.nuc_grad_method()
        gradient_method.verbose = 0
        gradient_method.grid_response = True  # exact derivative of the grid energy (module docstring)
        gradient = _to_numpy(gradient_method.kernel())  # (n, 3) E_h/bohr
    return DFTResult(
        energy_hartree=float(_to_numpy(mf.e_tot)),
        forces_hartree_per_angstrom=-hartree_per_bohr_to_hartree_per_angstrom(gradient),
        n_scf_cycles=n_cycles,
        attempts=attempts,
        converged=True,
    )


def dft_hessian(
    symbols: Sequence[str],
    positions_angstrom: np.ndarray,
    cfg: ChemConfig,
    *,
    charge: int = 0,
    threads: int | None = None,
) -> np.ndarray:
    """Analytic KS-DFT Hessian ``d²E/dR_a dR_b`` [E_h/Å²], shape ``(3n, 3n)``, atom-major
    (row ``3 i + x``). CPU PySCF (``mf.Hessian()``); no grid-weight response."""
    from pyscf import lib

    with lib.with_omp_threads(threads) if threads else nullcontext():
        mol = build_mole(symbols, positions_angstrom, cfg.theory[1], charge)
        mf, _, _ = converged_scf(mol, cfg, use_gpu=False)
        hessian_method = mf.Hessian()
        hessian_method.verbose = 0
        blocks = np.asarray(hessian_method.kernel())  # (n, n, 3, 3) E_h/bohr²
    n = len(symbols)
    hessian = blocks.transpose(0, 2, 1, 3).reshape(3 * n, 3 * n)
    return hartree_per_bohr2_to_hartree_per_angstrom2(0.5 * (hessian + hessian.T))
