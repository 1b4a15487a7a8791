"""The simulator: 2-D steady Darcy flow ``-div(k grad u) = f`` on the unit square, ``u = 0`` on the boundary.

Discretisation: cell-centred finite volumes around the nodes of an n x n grid
(boundary nodes included, ``h = 1 / (n - 1)``), the classic five-point scheme.
The unknowns are the (n - 2)^2 interior nodes; for node (i, j)::

    [ k_E (u_ij - u_i+1,j) + k_W (u_ij - u_i-1,j) + k_N (u_ij - u_i,j+1) + k_S (u_ij - u_i,j-1) ] / h^2 = f_ij

with ``u = 0`` at boundary neighbours (Dirichlet), so ``A`` is symmetric positive
definite (an M-matrix), second-order accurate for smooth k and u.

Face permeability ``k_E`` between nodes a and b: the **harmonic mean**
``2 k_a k_b / (k_a + k_b)`` by default. Two half-cells of permeability k_a and k_b
in series conduct exactly that (flux continuity across the face), so a jump
12 -> 3 lets through the flux of the resistances added, not the arithmetic mean's
7.5, which overstates the flow across every phase boundary of the thresholded
field (Patankar, "Numerical heat transfer and fluid flow", 1980, section 4.2-3).
``face_mean = "arithmetic"`` gives the FNO paper's generator (``solve_gwf.m``:
``(k_a + k_b) / 2``); the two agree where k is constant.

Solvers: ``direct``, a sparse LU factorisation (SuperLU through
``scipy.sparse.linalg.splu``, minimum-degree ordering of ``A^T + A``: the ordering
for a symmetric pattern, 25-35% faster here than the default COLAMD); ``amg``, conjugate gradients
preconditioned by an algebraic multigrid V-cycle (pyamg: smoothed aggregation,
Vanek, Mandel and Brezina 1996, or classical Ruge-Stüben), its hierarchy built for
every field (each k is a new matrix), stopped at relative residual ``tol``.
Which is faster is measured (``benchmarks/darcy.py``): both times count their
setup (factorisation, hierarchy) and the assembly.
"""
from __future__ import annotations

from typing import Callable

import numpy as np
import scipy.sparse as sp
from scipy.sparse.linalg import splu


def face_permeability(k_a: np.ndarray, k_b: np.ndarray, mean: str = "harmonic") -> np.ndarray:
    """Permeability of the faces between nodes a and b, elementwise: ``2 k_a k_b / (k_a + k_b)`` or
    ``(k_a + k_b) / 2`` (module docstring). Raises on a mean it does not know."""
    if mean == "harmonic":
        return 2.0 * k_a * k_b / (k_a + k_b)
    if mean == "arithmetic":
        return 0.5 * (k_a + k_b)
    raise ValueError(f"face mean {mean!r}: choose harmonic or arithmetic")


def assemble_darcy(k: np.ndarray, mean: str = "harmonic") -> sp.csr_matrix:
    """The five-point matrix ``A`` ((n-2)^2 square, CSR, float64) of ``-div(k grad u)`` on the interior nodes
    of the n x n node field ``k`` (rows index x, columns y), with ``u = 0`` on the boundary. Unknown
    ``(i, j)`` (1 <= i, j <= n - 2) has index ``(i - 1) (n - 2) + (j - 1)``."""
    k = np.asarray(k, dtype=np.float64)
    n = k.shape[0]
    if k.ndim != 2 or k.shape[1] != n or n < 3:
        raise ValueError(f"permeability of shape {k.shape}: give a square n x n field with n >= 3")
    if not np.all(np.isfinite(k)) or np.any(k <= 0):
        raise ValueError("permeability must be finite and > 0 everywhere")
    m, inv_h2 = n - 2, float(n - 1) ** 2
    kx = face_permeability(k[:-1, :], k[1:, :], mean)  # (n-1, n): face between (i, j) and (i+1, j)
    ky = face_permeability(k[:, :-1], k[:, 1:], mean)  # (n, n-1): face between (i, j) and (i, j+1)
    k_east, k_west = kx[1:, 1:-1], kx[:-1, 1:-1]  # (m, m) each
    k_north, k_south = ky[1:-1, 1:], ky[1:-1, :-1]
    diagonal = (k_east + k_west + k_north + k_south).ravel() * inv_h2
    along_x = -k_east[:-1, :].ravel() * inv_h2  # couples unknown p with p + m
    along_y = k_north.copy()
    along_y[:, -1] = 0.0  # the last interior node of a row has the boundary as its north neighbour
    along_y = -along_y.ravel()[:-1] * inv_h2  # couples p with p + 1
    return sp.diags([along_x, along_y, diagonal, along_y, along_x], [-m, -1, 0, 1, m], shape=(m * m, m * m),
                     format="csr")


def interior_rhs(forcing: float | np.ndarray, n: int) -> np.ndarray:
    """The right-hand side ((n-2)^2,) float64: a constant source, or an n x n node field's interior values."""
    f = np.asarray(forcing, dtype=np.float64)
    if f.ndim == 0:
        return np.full((n - 2) ** 2, float(f))
    if f.shape != (n, n):
        raise ValueError(f"forcing of shape {f.shape}: give a number or an {n} x {n} node field")
    return f[1:-1, 1:-1].ravel().copy()


def with_boundary(interior: np.ndarray, n: int) -> np.ndarray:
    """The n x n node field of interior values ((n-2)^2,) with ``u = 0`` on the boundary."""
    u = np.zeros((n, n), dtype=np.float64)
    u[1:-1, 1:-1] = np.asarray(interior).reshape(n - 2, n - 2)
    return u


def solve_direct(a: sp.spmatrix, b: np.ndarray) -> np.ndarray:
    """``A^-1 b`` by sparse LU (SuperLU, minimum degree on ``A^T + A``); the factorisation is part of the call."""
    return splu(a.tocsc(), permc_spec="MMD_AT_PLUS_A").solve(b)


def solve_amg(a: sp.spmatrix, b: np.ndarray, method: str = "ruge_stuben", tol: float = 1e-10) -> np.ndarray:
    """``A^-1 b`` by CG preconditioned with a pyamg V-cycle, hierarchy built in the call, to relative residual
    ``||b - A x|| / ||b|| <= tol``. Raises if CG did not get there in 200 iterations."""
    import pyamg

    builders = {"smoothed_aggregation": pyamg.smoothed_aggregation_solver, "ruge_stuben": pyamg.ruge_stuben_solver}
    if method not in builders:
        raise ValueError(f"AMG method {method!r}: choose one of {', '.join(builders)}")
    hierarchy = builders[method](sp.csr_matrix(a))
    residuals: list[float] = []
    x = hierarchy.solve(b, tol=tol, accel="cg", maxiter=200, residuals=residuals)
    if residuals[-1] > tol * max(residuals[0], np.linalg.norm(b)) * 1.0001:
        raise RuntimeError(f"pyamg ({method}) stopped at relative residual {residuals[-1] / residuals[0]:.2e} > "
                           f"{tol:.0e} after {len(residuals) - 1} iterations")
    return x


def linear_solver(name: str, amg_method: str = "ruge_stuben",
                  amg_tol: float = 1e-10) -> Callable[[sp.spmatrix, np.ndarray], np.ndarray]:
    """The solve of ``name`` ("direct" or "amg") as ``solve(A, b) -> x``."""
    if name == "direct":
        return solve_direct
    if name == "amg":
        return lambda a, b: solve_amg(a, b, amg_method, amg_tol)
    raise ValueError(f"solver {name!r}: choose direct or amg")


def solve_darcy(k: np.ndarray, forcing: float | np.ndarray = 1.0, solver: str = "direct", mean: str = "harmonic",
                amg_method: str = "ruge_stuben", amg_tol: float = 1e-10) -> np.ndarray:
    """The pressure ``u`` (n, n) float64 of ``-div(k grad u) = forcing``, ``u = 0`` on the boundary: assemble,
    then solve (module docstring). ``k``: (n, n) node permeabilities, rows index x."""
    n = np.asarray(k).shape[0]
    a = assemble_darcy(k, mean)
    x = linear_solver(solver, amg_method, amg_tol)(a, interior_rhs(forcing, n))
    return with_boundary(x, n)
