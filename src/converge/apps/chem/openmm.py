"""The trained potential in OpenMM, through OpenMM-ML's plug-in group ``openmmml.potentials``.

converge registers the potential ``converge`` (pyproject entry point), so that::

    from openmmml import MLPotential
    potential = MLPotential("converge", run="runs/ethanol")
    system = potential.createSystem(topology)         # every atom, or createMixedSystem(...) for a region

builds an OpenMM ``System`` whose force is the run's network. It goes through OpenMM-ML's own
ASE path (``openmmml.models.asepotential``, a ``PythonForce`` calling the converge ASE
:class:`~.calculator.Calculator` in eV and Å), so units and atom order are handled by the
library's code, not by a copy. ``MLPotential("ase").createSystem(topology,
calculator=Calculator(run))`` is the same thing spelled by hand.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable

from openmmml.mlpotential import MLPotentialImpl, MLPotentialImplFactory


class ConvergePotentialImplFactory(MLPotentialImplFactory):
    """Creates :class:`ConvergePotentialImpl` for ``MLPotential("converge", run=RUN)``."""

    def createImpl(self, name: str, run: str | Path | None = None, **args: Any) -> MLPotentialImpl:
        if run is None:
            raise ValueError('MLPotential("converge") needs the trained run: MLPotential("converge", run="runs/x")')
        return ConvergePotentialImpl(name, Path(run), args)


class ConvergePotentialImpl(MLPotentialImpl):
    """Adds the run's potential to a System as OpenMM-ML's ASE potential with the converge calculator."""

    def __init__(self, name: str, run: Path, options: dict[str, Any]) -> None:
        self.name, self.run, self.options = name, run, options

    def addForces(self, topology: Any, system: Any, atoms: Iterable[int] | None, forceGroup: int,
                  **args: Any) -> None:
        import torch
        from openmmml.models.asepotential import ASEPotentialImpl

        from .calculator import Calculator

        calculator = Calculator(self.run, dtype=self.options.get("dtype", torch.float64))
        ASEPotentialImpl(self.name).addForces(topology, system, atoms, forceGroup, calculator=calculator, **args)
