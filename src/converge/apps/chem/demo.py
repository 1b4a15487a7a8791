"""The chem part of ``converge demo``: methanol at the ``fast`` DFT level."""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ase import Atoms
from rich.console import Console
from rich.table import Table

from ...data.store import ShardStore
from ...simulate.runner import SimulateConfig, run_ensemble
from ...train.loop import TrainConfig, train
from .calculator import Calculator
from .config import ChemConfig
from .evaluate import ChemEvalConfig
from .md import nve_drift

console = Console()


@dataclass(frozen=True)
class ChemDemoSize:
    molecule: str = "methanol"
    train_samples: int = 160
    test_samples: int = 40
    epochs: int = 150
    md_ps: float = 0.25


CHEM_QUICK = ChemDemoSize(molecule="water", train_samples=30, test_samples=10, epochs=20, md_ps=0.01)


def run_chem_demo(app: Any, out: Path, size: ChemDemoSize, workers: int) -> dict:
    """DFT ensemble -> train -> evaluate against DFT and GFN2-xTB -> NVE dynamics with the ASE calculator."""
    out.mkdir(parents=True, exist_ok=True)
    cfg = ChemConfig(molecule=size.molecule, level="fast")
    timings: dict[str, float] = {}
    console.rule(f"[bold]chem 1/4 simulate: {size.molecule} conformers by normal-mode sampling, "
                 f"{cfg.level_of_theory} (PySCF)")
    t = time.perf_counter()
    for name, n, seed in (("train", size.train_samples, 1), ("test", size.test_samples, 2)):
        res = run_ensemble(app, cfg, SimulateConfig(samples=n, seed=seed, workers=workers, shard_size=40),
                           out / "data" / name)
        if res.n_failed:
            console.print(f"[yellow]{res.n_failed} DFT calculations failed and were recorded, not stored[/]")
    timings["simulate"] = time.perf_counter() - t
    console.rule("[bold]chem 2/4 train: ANI-1x AEVs, one MLP per element, energies + forces")
    t = time.perf_counter()
    arrays = ShardStore.open(out / "data" / "train").load()
    train(app, cfg, TrainConfig(epochs=size.epochs, batch_size=16, lr=1e-3, patience=size.epochs), arrays,
          out / "run", extra_config={"data": str(out / "data" / "train")})
    timings["train"] = time.perf_counter() - t
    console.rule("[bold]chem 3/4 evaluate: network vs DFT, mean and GFN2-xTB baselines, speed")
    t = time.perf_counter()
    report = app.evaluate(out / "run", out / "data" / "test", out / "run",
                          ev=ChemEvalConfig(n_dft_timing=1))
    timings["evaluate"] = time.perf_counter() - t
    console.rule("[bold]chem 4/4 NVE molecular dynamics with the ASE calculator")
    t = time.perf_counter()
    test = ShardStore.open(out / "data" / "test").load(["species", "coordinates"])
    atoms = Atoms(numbers=test["species"][0], positions=test["coordinates"][0])
    atoms.calc = Calculator(out / "run")
    md = nve_drift(atoms, temperature=300.0, duration_ps=size.md_ps, dt_fs=0.5)
    timings["md"] = time.perf_counter() - t
    table = Table(title=f"converge demo: {size.molecule}, network vs {report['level_of_theory']} "
                        f"({report['n_train']} training conformers)")
    for col in ("method", "energy MAE [kcal/mol]", "force MAE [kcal/mol/Å]"):
        table.add_column(col, justify="right" if "MAE" in col else "left")
    table.add_row("network", f"{report['energy_mae_kcal_mol']:.3f}", f"{report['force_mae_kcal_mol_A']:.3f}")
    for name, b in report["test"]["baselines"].items():
        table.add_row(f"baseline: {name}", f"{b['energy_mae_kcal_mol']:.3f}",
                      f"{b.get('force_mae_kcal_mol_A', float('nan')):.3f}")
    console.print(table)
    sp = report["speed"]
    console.print(f"DFT ({sp['dft_level']}) {sp['dft_seconds_per_conformer']:.2f} s per conformer; network "
                  f"{sp['surrogate_seconds_single'] * 1e3:.2f} ms single, {sp['surrogate_seconds_batched'] * 1e6:.0f} "
                  f"µs batched -> {report['speedup_single']:.0f}x / {report['speedup_batched']:.0f}x faster")
    if "ani_level" in sp:
        ani = sp["ani_level"]
        console.print(f"  (at the ANI-1 level, {ani['dft_level']}, which this network does not reproduce: "
                      f"{ani['dft_seconds_per_conformer']:.2f} s per conformer -> {ani['speedup_single']:.0f}x / "
                      f"{ani['speedup_batched']:.0f}x)")
    console.print(f"NVE {md['duration_ps']} ps at {md['dt_fs']} fs: drift {md['drift_kcal_mol_ps_atom']:.4f} "
                  "kcal/mol/ps/atom")
    console.print("time: " + ", ".join(f"{k} {v:.0f} s" for k, v in timings.items()))
    return {"evaluation": app.summary(report), "nve": md, "timings_s": timings}
