"""Settings of the chem app (the ``[app]`` table of a config file)."""
from __future__ import annotations

from dataclasses import dataclass

from ...config import ConfigError

LEVELS = ("fast", "ani", "custom")
HESSIAN_METHODS = ("xtb", "dft")
AEV_PRESETS = ("ani1x", "ani2x", "ani1x_r4")  # the constants of each: aev.py
BASELINES = ("", "gfn2_xtb")  # what the network is trained on top of: nothing, or GFN2-xTB (delta.py)


@dataclass(frozen=True)
class ChemConfig:
    """DFT level, conformer sampling and network settings of the chem app.

    Lengths in Å, energies in hartree (stored) and kcal/mol (reported),
    temperatures in K. ``level`` picks a named level of theory:

    - ``fast``: B3LYP/6-31G* with density fitting and grid level 1 (demos, CI);
    - ``ani``:  ωB97X/6-31G(d), the level of ANI-1 (no density fitting);
    - ``custom``: ``functional``, ``basis``, ``density_fit`` and ``grid_level`` as given.
    """

    molecule: str = "ethanol"  # a built-in name, a path to an .xyz / extxyz file, or smiles:SMILES
    molecules: str = ""  # a set instead: a library (chno_1to4, chno_5to7) or a .smi/.sdf/.xyz file (molecule_set.py)
    max_atoms: int = 0  # atoms per stored sample of a set: its largest molecule, or this if larger
    level: str = "fast"
    functional: str = "b3lyp"
    basis: str = "6-31g*"
    density_fit: bool = True
    grid_level: int = 1
    scf_conv_tol: float = 1e-9
    max_scf_cycles: int = 100
    temperature: float = 300.0  # K, normal-mode sampling temperature
    hessian: str = "xtb"  # GFN2-xTB (tblite) or DFT Hessian for the normal modes
    min_distance: float = 0.7  # Å; conformers with a closer pair of atoms are rejected
    # network (ANI-style): hidden layer widths of each element's MLP
    hidden: tuple[int, ...] = (160, 128, 96)
    aev_preset: str = "ani1x"
    force_weight: float = 0.1  # loss = MSE(E) + force_weight * MSE(F), in kcal/mol units
    # "gfn2_xtb": the network learns DFT minus GFN2-xTB and the potential is xTB plus the network (delta.py)
    baseline: str = ""

    def __post_init__(self) -> None:
        if self.level not in LEVELS:
            raise ConfigError(f"app.level={self.level!r}: choose one of {', '.join(LEVELS)}")
        if self.hessian not in HESSIAN_METHODS:
            raise ConfigError(f"app.hessian={self.hessian!r}: choose one of {', '.join(HESSIAN_METHODS)}")
        if not self.temperature > 0:
            raise ConfigError(f"app.temperature={self.temperature}: must be > 0 K")
        if not 0 < self.min_distance < 2:
            raise ConfigError(f"app.min_distance={self.min_distance}: give a distance in Å between 0 and 2")
        if self.grid_level not in range(0, 10):
            raise ConfigError(f"app.grid_level={self.grid_level}: PySCF grid levels run from 0 to 9")
        if not self.hidden or min(self.hidden) < 1:
            raise ConfigError(f"app.hidden={self.hidden}: give positive layer widths, e.g. [160, 128, 96]")
        if self.max_atoms < 0:
            raise ConfigError(f"app.max_atoms={self.max_atoms}: give a number of atoms >= 0 (0: the largest molecule)")
        if self.aev_preset not in AEV_PRESETS:
            raise ConfigError(f"app.aev_preset={self.aev_preset!r}: choose one of {', '.join(AEV_PRESETS)}")
        if self.baseline not in BASELINES:
            raise ConfigError(f"app.baseline={self.baseline!r}: choose \"\" (the network alone) or "
                              f"{', '.join(b for b in BASELINES if b)} (delta learning on top of it)")
        if self.force_weight < 0:
            raise ConfigError(f"app.force_weight={self.force_weight}: must be >= 0")

    @property
    def theory(self) -> tuple[str, str, bool, int]:
        """(functional, basis, density fitting, grid level) the level resolves to."""
        if self.level == "fast":
            return ("b3lyp", "6-31g*", True, 1)
        if self.level == "ani":
            return ("wb97x", "6-31g(d)", False, 3)
        return (self.functional, self.basis, self.density_fit, self.grid_level)

    @property
    def level_of_theory(self) -> str:
        functional, basis, df, grid = self.theory
        return f"{functional.upper()}/{basis}" + (" (density fitting)" if df else "") + f", grid {grid}"
