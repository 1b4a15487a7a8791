"""The chem app's classical method for ``converge bench surrogate``: a PySCF DFT single point.

Energy and analytic forces (:func:`~.dft.dft_energy_forces`) of each served conformer
(``ChemApp.serving_example``: normal-mode samples of the run's molecule) at the
config's level of theory: the level the network reproduces, so the speed-up is against
what it replaces. DFT has no batch: its per-sample time is the same either way.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Mapping

import numpy as np
import torch

from ...contract import Baseline
from .config import ChemConfig
from .dft import dft_energy_forces
from .molecules import SYMBOL_OF
ACCURACY_KEYS = ("energy_mae_kcal_mol", "energy_rmse_kcal_mol", "force_mae_kcal_mol_A", "hot_energy_mae_kcal_mol",
                 "hot_force_mae_kcal_mol_A", "level_of_theory")


def dft_baseline(cfg: ChemConfig, device: torch.device, quick: bool = False) -> Baseline:
    """DFT at ``cfg.level`` (``quick``: the ``fast`` level), with torch's thread count, on the GPU where there is one."""
    level_cfg = replace(cfg, level="fast") if quick else cfg
    use_gpu = None if device.type == "cuda" else False
    from pyscf import dft, grad, gto  # noqa: F401  imported before the clock starts

    def run(inputs: Mapping[str, torch.Tensor]) -> None:
        species = inputs["species"].cpu().numpy()
        coordinates = inputs["coordinates"].cpu().numpy().astype(np.float64)
        for z, xyz in zip(species, coordinates):
            real = z > 0
            dft_energy_forces([SYMBOL_OF[int(k)] for k in z[real]], xyz[real], level_cfg, use_gpu=use_gpu,
                              threads=torch.get_num_threads())

    return Baseline(f"DFT energy + forces, {level_cfg.level_of_theory} (PySCF)", run, 1,
                    {"molecule": cfg.molecule, "level_of_theory": level_cfg.level_of_theory,
                     "sample": f"one normal-mode conformer of {cfg.molecule} at {cfg.temperature:g} K"})


def error_summary(cfg: ChemConfig, report: Mapping[str, Any]) -> dict[str, Any]:
    """Energy and force errors against DFT: from an evaluation.json, or the molecule's entry of chem.json."""
    if "energy_mae_kcal_mol" not in report:
        report = report.get(cfg.molecule) or {}  # benchmarks/results/chem.json holds one entry per molecule
    if not report:
        return {"note": f"no chem evaluation of {cfg.molecule} found: run `converge evaluate chem`"}
    out = {"molecule": cfg.molecule, **{k: report[k] for k in ACCURACY_KEYS if k in report}}
    if "energy_mae_kcal_mol" in out and "force_mae_kcal_mol_A" in out:
        out["headline"] = (f"{cfg.molecule}: energy MAE {out['energy_mae_kcal_mol']:.3g} kcal/mol, forces "
                           f"{out['force_mae_kcal_mol_A']:.3g} kcal/mol/Å against {out.get('level_of_theory', 'DFT')}")
    return out
