"""Delta learning: the network learns DFT minus a cheap method, and the potential is that method plus the network.

``app.baseline = "gfn2_xtb"``: training targets are the DFT energies and forces minus GFN2-xTB's
(:func:`~.sampling.xtb_energy_forces`, tblite) on the same conformers; every prediction of the run
(:meth:`~.model.ANIPotential.energies_forces`: the ASE calculator, ``converge predict``, ``converge screen``,
``converge evaluate``, OpenMM; and the served model) adds GFN2-xTB's energy and forces to the network's. The
network then only has to learn what the semi-empirical method misses, which is smoother and transfers to
unseen molecules far better than the whole energy does (benchmarks/chem_transfer.py, variant ``delta_xtb``);
each prediction costs one xTB call on the CPU beside the network. Ramakrishnan, Dral, Rupp and von Lilienfeld,
J. Chem. Theory Comput. 11, 2087 (2015) introduced the idea (Delta-ML).
"""
from __future__ import annotations

import numpy as np

from .config import BASELINES
from .molecule_set import padded_energies_forces


class BaselineError(ValueError):
    """The baseline method failed on a structure; the message names the sample and why."""


def xtb_energies_forces(species: np.ndarray, coordinates: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """GFN2-xTB energies (B,) hartree and forces (B, A, 3) hartree/Å of a padded batch: atoms with species <= 0
    are padding, left out of the calculation, with zero force. A failure is a :class:`BaselineError`."""
    from .sampling import xtb_energy_forces

    return padded_energies_forces(species, coordinates, lambda s, xyz: tuple(xtb_energy_forces(s, xyz)),
                                  BaselineError, wrap="GFN2-xTB")


def baseline_energies_forces(baseline: str, species: np.ndarray, coordinates: np.ndarray
                             ) -> tuple[np.ndarray, np.ndarray]:
    """Energies (B,) hartree and forces (B, A, 3) hartree/Å of ``baseline`` (one of :data:`BASELINES` but "")."""
    if baseline == "gfn2_xtb":
        return xtb_energies_forces(species, coordinates)
    raise ValueError(f"baseline={baseline!r}: choose one of {', '.join(b for b in BASELINES if b)}")
