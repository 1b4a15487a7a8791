"""The chem app's sections of ``converge report``: the potential against DFT (``chem.json``) and trust
(``trust.json``: active learning and the ensemble spread, benchmarks/trust.py)."""
from __future__ import annotations

from typing import Any, Mapping

from ...contract import ReportSection
from ...tables import Table, fmt, percent


def trust_tables(r: Mapping[str, Any]) -> list[Table]:
    """Learning curves (test energy MAE against DFT calls) and the ensemble spread in and out of distribution."""
    curve = [[name, *(fmt(e) for e in r[name]["test_mae"])] for name in ("active", "random")]
    rows = [[k, fmt(v.get("mean_energy_spread_per_atom_kcal_mol")), percent(v.get("ood_flagged_fraction")),
             percent(v.get("routed_to_simulator_fraction"))]
            for k, v in r["spread"].items() if isinstance(v, dict) and "mean_energy_spread_per_atom_kcal_mol" in v]
    return [Table("test energy MAE (kcal/mol) by DFT calls", ["strategy", *map(str, r["active"]["dft_calls"])],
                  curve),
            Table("ensemble spread per atom (kcal/mol)", ["inputs", "spread", "flagged out of distribution",
                                                          "routed to DFT by the serving gate"], rows),
            Table("target: active reaches random's final error with <= 50% of its DFT calls",
                  ["random's final MAE", "active's calls to reach it", "of random's calls", "met"],
                  [[fmt(r["random"]["test_mae"][-1]), fmt(r["active"].get("calls_to_reach_random_final")),
                    percent(r["active"].get("fraction_of_random_calls")), fmt(r.get("target", {}).get("met"))]])]


def evaluation_tables(r: Mapping[str, Any]) -> list[Table]:
    rows = []
    for molecule, rep in r.items():
        xtb = rep.get("baselines", {}).get("gfn2_xtb", {})
        speed = rep.get("speed", {})
        rows.append([molecule, rep.get("level_of_theory"), fmt(rep.get("energy_mae_kcal_mol")),
                     fmt(rep.get("force_mae_kcal_mol_A")), fmt(rep.get("hot_energy_mae_kcal_mol")),
                     fmt(xtb.get("energy_mae_kcal_mol")), fmt(speed.get("dft_seconds_per_conformer")),
                     speed.get("dft_level", ""), fmt(rep.get("speedup_single")), fmt(rep.get("speedup_batched"))])
    return [Table("ANI potential against DFT (energies kcal/mol, forces kcal/mol/A)",
                  ["molecule", "trained on", "energy MAE", "force MAE", "hot energy MAE", "GFN2-xTB energy MAE",
                   "DFT s/conformer", "timed level", "speed-up single", "speed-up batched"], rows)]


SECTIONS = [
    ReportSection("chem", "chem: network potential against DFT", ("chem",), "energy and force errors against DFT, "
                  "beside GFN2-xTB, and the speed-up (converge evaluate chem).", evaluation_tables),
    ReportSection("trust", "Trust: active learning and uncertainty", ("trust",), "query by committee against random "
                  "sampling at equal DFT calls, and the ensemble spread off the training data (benchmarks/trust.py).",
                  trust_tables),
]
