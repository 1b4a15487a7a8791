"""converge-darcy: 2-D Darcy flow as a converge app, an installable package of its own.

``-div(k grad u) = 1`` on the unit square with ``u = 0`` on the boundary, k a
thresholded Gaussian random field (Li et al., ICLR 2021); a sparse solver as
the simulator and a Fourier neural operator as the surrogate. Registered under
the ``converge.apps`` entry-point group as ``darcy`` (see ``pyproject.toml``).
"""
from .app import DarcyApp
from .config import DarcyConfig, DarcyEvalConfig, DarcyLearnConfig

__all__ = ["DarcyApp", "DarcyConfig", "DarcyEvalConfig", "DarcyLearnConfig"]
