"""The gw app's own subcommands (``App.commands``): ``converge detect gw ...``."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from ...contract import CommandError


def detect(
    strain: Path = typer.Argument(..., help="Strain file in the GWOSC HDF5 layout (strain/Strain, meta/GPSstart)."),
    run: Path = typer.Option(..., "--run", "-r", help="A trained gw run directory."),
    threshold: Optional[float] = typer.Option(None, help="Trigger threshold on the CNN logit "
                                              "(default: the run's FAP 1e-3 threshold from evaluation.json)."),
    stride: float = typer.Option(0.125, help="Seconds between window starts."),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="Triggers JSON (default STRAIN.triggers.json)."),
) -> None:
    """Slide the gw CNN along a strain file: Welch PSD, whitening, triggers (GPS time, score)."""
    from rich.console import Console

    from ...train.checkpoint import CheckpointError
    from .detect import StrainFileError, detect_file

    try:
        result = detect_file(strain, run, threshold=threshold, stride=stride, out=out)
    except (StrainFileError, FileNotFoundError, ValueError, CheckpointError) as err:
        raise CommandError(str(err)) from err
    for trig in result["triggers"]:
        print(f"GPS {trig['gps_time']:.3f}  score {trig['score']:.2f}")
    Console(stderr=True).print(f"{len(result['triggers'])} trigger(s); {result['strain_seconds_per_second']:.0f} s "
                               f"of strain per second; written to {result['out']}")
