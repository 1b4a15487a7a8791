"""NVE molecular dynamics with the surrogate, and its energy drift.

A network potential whose forces are the exact gradient of its energy conserves
the total energy in velocity-Verlet dynamics up to the integrator's O(dt^2)
fluctuation; a drift means non-conservative or non-smooth forces. The drift is
the slope of a least-squares line through the total energy against time.
"""
from __future__ import annotations

from typing import Any

import numpy as np
from ase import Atoms, units
from ase.md.velocitydistribution import MaxwellBoltzmannDistribution, Stationary, ZeroRotation
from ase.md.verlet import VelocityVerlet

from ...units import EV_TO_KCAL_MOL


def nve_drift(atoms: Atoms, temperature: float = 300.0, duration_ps: float = 1.0, dt_fs: float = 0.5,
              seed: int = 0) -> dict[str, Any]:
    """Run NVE from Maxwell-Boltzmann velocities at ``temperature`` K with ``atoms.calc``.

    Returns the drift (kcal/mol per ps per atom, slope of E_total(t)), the RMS
    fluctuation of E_total (kcal/mol), and the mean kinetic temperature.
    """
    if atoms.calc is None:
        raise ValueError("attach a calculator first, e.g. atoms.calc = converge.apps.chem.Calculator(run)")
    calc, atoms = atoms.calc, atoms.copy()
    atoms.calc = calc
    MaxwellBoltzmannDistribution(atoms, temperature_K=temperature, rng=np.random.default_rng(seed))
    Stationary(atoms)
    ZeroRotation(atoms)
    steps = int(round(duration_ps * 1000 / dt_fs))
    dyn = VelocityVerlet(atoms, timestep=dt_fs * units.fs)
    times, totals, temps = [], [], []

    def record() -> None:
        times.append(dyn.get_number_of_steps() * dt_fs / 1000.0)  # ps
        totals.append(atoms.get_total_energy() * EV_TO_KCAL_MOL)
        temps.append(atoms.get_temperature())

    dyn.attach(record, interval=1)
    dyn.run(steps)
    t, e = np.asarray(times), np.asarray(totals)
    slope = float(np.polyfit(t, e, 1)[0])  # kcal/mol per ps
    return {"drift_kcal_mol_ps_atom": abs(slope) / len(atoms), "drift_kcal_mol_ps": slope,
            "fluctuation_rms_kcal_mol": float(np.std(e - np.polyval(np.polyfit(t, e, 1), t))),
            "mean_temperature_K": float(np.mean(temps)), "steps": steps, "dt_fs": dt_fs,
            "duration_ps": duration_ps, "n_atoms": len(atoms)}
