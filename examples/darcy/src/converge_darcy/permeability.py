"""Permeability fields: thresholded Gaussian random fields, as in the FNO paper's Darcy data.

Li et al., "Fourier neural operator for parametric partial differential
equations", ICLR 2021, section 5.2: ``k = psi(mu)``, ``mu ~ N(0, (-Laplacian + 9 I)^(-2))``
with zero Neumann boundary conditions on the Laplacian, ``psi(x) = 12`` for
``x >= 0`` and ``3`` for ``x < 0``. Sampled spectrally, as their generator
(``GRF.m`` of the FNO repository) does: on the cosine basis
``cos(pi k1 x) cos(pi k2 y)`` (the Neumann Laplacian's eigenfunctions, eigenvalues
``pi^2 (k1^2 + k2^2)``) with independent standard normal coefficients scaled by
the square root of the covariance's eigenvalues, then an inverse DCT on the grid.
"""
from __future__ import annotations

import numpy as np
from scipy.fft import idctn


def grf_sqrt_eigenvalues(n: int, alpha: float, tau: float) -> np.ndarray:
    """Square roots of the covariance's eigenvalues on the first n x n cosine modes, (n, n).

    ``tau^(alpha - 1) (pi^2 (k1^2 + k2^2) + tau^2)^(-alpha / 2)``, k1, k2 = 0..n-1; the
    prefactor ``tau^(alpha - 1)`` (GRF.m's) makes the field's variance of order one.
    The constant mode (0, 0) is set to zero: the field has zero mean over the square.
    """
    k1, k2 = np.meshgrid(np.arange(n), np.arange(n), indexing="ij")
    coef = tau ** (alpha - 1) * (np.pi**2 * (k1**2 + k2**2) + tau**2) ** (-alpha / 2)
    coef[0, 0] = 0.0
    return coef


def gaussian_random_field(n: int, alpha: float, tau: float, rng: np.random.Generator) -> np.ndarray:
    """One draw of ``N(0, (-Laplacian + tau^2)^(-alpha))`` on an n x n grid of the unit square, (n, n) float64.

    Rows index x, columns y. ``rng`` supplies the n^2 standard normal coefficients.
    """
    xi = rng.standard_normal((n, n))
    return idctn(n * grf_sqrt_eigenvalues(n, alpha, tau) * xi, type=2, norm="ortho")


def threshold_permeability(field: np.ndarray, k_high: float, k_low: float) -> np.ndarray:
    """``k_high`` where ``field >= 0``, ``k_low`` where it is negative: a two-phase medium, same shape."""
    return np.where(np.asarray(field) >= 0, k_high, k_low)


def sample_permeability(n: int, alpha: float, tau: float, k_high: float, k_low: float, seed: int) -> np.ndarray:
    """The permeability field of one seed, (n, n) float64: the same seed gives the same field."""
    rng = np.random.default_rng(int(seed))
    return threshold_permeability(gaussian_random_field(n, alpha, tau, rng), k_high, k_low)
