"""The chem app's own subcommands (``App.commands``): ``converge screen chem ...``."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from ...contract import CommandError


def screen(
    molecules: Path = typer.Argument(..., help="Molecules to screen: .smi (SMILES [name] per line), .sdf or .xyz."),
    run: Optional[Path] = typer.Option(None, "--run", "-r", help="A trained chem run (an ensemble run adds the "
                                       "trust flag); its level of theory is the fallback's."),
    out: Path = typer.Option(..., "--out", "-o", help="OUT.csv (a row per molecule), OUT.sdf (lowest conformers), "
                             "OUT.extxyz (every optimised conformer)."),
    conformers: int = typer.Option(10, help="RDKit ETKDG conformers per SMILES (after pruning, up to this many)."),
    method: str = typer.Option("surrogate", help="Energy the conformers are optimised on: surrogate, xtb (GFN2-xTB) "
                               "or dft (the run's level), for comparison."),
    max_spread: float = typer.Option(0.0, help="Untrusted above this ensemble spread, kcal/mol per sqrt(atom) "
                                     "(0: the run's calibrated threshold, if it has one)."),
    fallback: str = typer.Option("", help="dft: untrusted molecules' conformer energies recomputed by DFT."),
    fmax: float = typer.Option(0.05, help="BFGS stops below this largest force, eV/Å."),
    seed: int = typer.Option(0, help="Seed of the conformer embedding."),
) -> None:
    """Conformer search per molecule with the trained potential: the lowest conformer, relative conformer
    energies, the ensemble spread as a trust flag, and molecules per second."""
    from ...config import ConfigError
    from ...train.checkpoint import CheckpointError
    from .calculator import InputError
    from .screen import ScreenConfig, screen_file

    try:
        cfg = ScreenConfig(conformers=conformers, method=method, max_spread=max_spread, fallback=fallback,
                           fmax_ev_per_angstrom=fmax, seed=seed)
        summary = screen_file(run, molecules, out, cfg)
    except (ConfigError, ValueError, FileNotFoundError, CheckpointError, InputError) as err:
        raise CommandError(str(err)) from err
    print(json.dumps(summary, indent=2))
