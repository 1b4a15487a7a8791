"""Settings of the darcy app: the ``[app]``, ``[evaluate]`` and ``[learn]`` tables of a config file."""
from __future__ import annotations

from dataclasses import dataclass

from converge.config import ConfigError

SOLVERS = ("direct", "amg")  # SuperLU factorisation, or pyamg-preconditioned CG (setup counted)
AMG_METHODS = ("smoothed_aggregation", "ruge_stuben")
FACE_MEANS = ("harmonic", "arithmetic")


@dataclass(frozen=True)
class DarcyConfig:
    """The Darcy problem, its simulator and its Fourier neural operator.

    ``-div(k grad u) = forcing`` on the unit square, ``u = 0`` on its boundary, on a
    ``resolution`` x ``resolution`` grid of nodes (boundary included, spacing
    ``h = 1 / (resolution - 1)``). ``k`` is a thresholded Gaussian random field,
    ``k_high`` where the field is >= 0 and ``k_low`` where it is < 0, the field having
    covariance ``(-Laplacian + tau^2)^(-alpha)`` (Li et al. 2021: alpha = 2, tau = 3,
    k in {12, 3}, forcing 1). Units are the problem's own (dimensionless).
    """

    resolution: int = 64  # nodes per side, boundary included
    alpha: float = 2.0  # smoothness of the random field's covariance
    tau: float = 3.0  # inverse length scale of the covariance
    k_high: float = 12.0  # permeability where the field is >= 0
    k_low: float = 3.0  # permeability where the field is < 0
    forcing: float = 1.0  # the constant source f
    face_mean: str = "harmonic"  # face permeability between two nodes (solver.py says why harmonic)
    solver: str = "direct"  # what `simulate` uses: the faster at 64^2 and 128^2 (benchmarks/results/darcy.json)
    amg_method: str = "ruge_stuben"  # pyamg hierarchy when solver = "amg" (faster here than smoothed aggregation)
    amg_tol: float = 1e-10  # relative residual at which the AMG-preconditioned CG stops
    # the Fourier neural operator (model.py)
    width: int = 32  # channels of the spectral layers
    modes: int = 12  # Fourier modes kept per axis
    layers: int = 4  # spectral-convolution layers
    padding: int = 8  # zero padding (nodes) on the high side of each axis: the field is not periodic

    def __post_init__(self) -> None:
        if isinstance(self.resolution, bool) or not isinstance(self.resolution, int) or self.resolution < 4:
            raise ConfigError(f"app.resolution={self.resolution!r}: give the nodes per side as an integer >= 4, "
                              "e.g. 64 (the boundary nodes are included)")
        if not self.alpha > 1:
            raise ConfigError(f"app.alpha={self.alpha}: the covariance (-Laplacian + tau^2)^(-alpha) needs "
                              "alpha > 1 in 2-D for a field with finite variance; the FNO paper uses 2")
        if not self.tau > 0:
            raise ConfigError(f"app.tau={self.tau}: must be > 0 (an inverse length scale); the FNO paper uses 3")
        if not 0 < self.k_low <= self.k_high:
            raise ConfigError(f"app.k_low={self.k_low}, app.k_high={self.k_high}: need 0 < k_low <= k_high, "
                              "e.g. 3 and 12")
        if not self.forcing > 0:
            raise ConfigError(f"app.forcing={self.forcing}: give a positive source, e.g. 1")
        for key, allowed in (("face_mean", FACE_MEANS), ("solver", SOLVERS), ("amg_method", AMG_METHODS)):
            if getattr(self, key) not in allowed:
                raise ConfigError(f"app.{key}={getattr(self, key)!r}: choose one of {', '.join(allowed)}")
        if not 0 < self.amg_tol < 1e-2:
            raise ConfigError(f"app.amg_tol={self.amg_tol}: give a relative residual in (0, 1e-2), e.g. 1e-10")
        for key, least in (("width", 1), ("modes", 1), ("layers", 1), ("padding", 0)):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ConfigError(f"app.{key}={value!r}: must be an integer >= {least}")
        if self.modes > (self.resolution + self.padding) // 2:
            raise ConfigError(f"app.modes={self.modes}: more Fourier modes than a {self.resolution}-node grid "
                              f"(padded by {self.padding}) holds; use at most {(self.resolution + self.padding) // 2}")

    @classmethod
    def tiny(cls) -> "DarcyConfig":
        """16 x 16 nodes and a small operator: tests and smoke runs in seconds."""
        return cls(resolution=16, width=8, modes=4, layers=2, padding=4)


@dataclass(frozen=True)
class DarcyEvalConfig:
    """Settings of ``converge evaluate darcy`` (the ``[evaluate]`` table)."""

    plot_fields: int = 4  # test fields drawn as k / true u / predicted u / error
    timing_fields: int = 8  # test fields each classical solver is timed on
    batch_size: int = 16  # fields per batched FNO call (per field, 16 beat 64 on one CPU core here: cache)
    min_time_s: float = 1.0  # per timed FNO call pattern
    repeats: int = 3  # timings of each method; the best counts (timing.py)

    def __post_init__(self) -> None:
        for key in ("plot_fields", "timing_fields", "batch_size", "repeats"):
            if getattr(self, key) < 1:
                raise ConfigError(f"evaluate.{key}={getattr(self, key)}: must be >= 1")
        if not self.min_time_s > 0:
            raise ConfigError(f"evaluate.min_time_s={self.min_time_s}: must be > 0 seconds, e.g. 1")


@dataclass(frozen=True)
class DarcyLearnConfig:
    """The darcy part of ``converge learn`` (the ``[learn]`` table's app options)."""

    target_error: float = 0.02  # relative L2 error a trusted prediction must stay under (calibration target)

    def __post_init__(self) -> None:
        if not 0 < self.target_error < 1:
            raise ConfigError(f"learn.target_error={self.target_error}: give a relative L2 error in (0, 1), e.g. 0.02")
