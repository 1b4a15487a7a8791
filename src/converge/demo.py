"""``converge demo``: each app end to end on small defaults (``App.demo``).

A plain ``converge demo`` runs the apps that declare ``demo_by_default`` (the two
reference apps: about ten minutes on two CPU cores together); ``--app NAME`` runs
any installed app's demo, a third party's included. ``--quick`` is a smoke test of
a minute or two.
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Sequence

from rich.console import Console

from .contract import app_classes, load_app
from .data.atomic import atomic_write_bytes

console = Console()


def default_demo_apps() -> tuple[str, ...]:
    """The installed apps that are part of a plain ``converge demo``, by name."""
    return tuple(name for name, cls in app_classes()[0].items() if cls.demo_by_default)


def run_demo(out: Path, quick: bool = False, workers: int = 2, apps: Sequence[str] | None = None) -> dict:
    """The demo of each app in ``apps`` (default :func:`default_demo_apps`) into ``OUT/NAME``; a summary per app
    in ``OUT/summary.json``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    summary = {}
    for name in apps or default_demo_apps():
        summary[name] = load_app(name).demo(out / name, quick=quick, workers=workers)
    summary["seconds"] = time.perf_counter() - t0
    atomic_write_bytes(out / "summary.json", json.dumps(summary, indent=2).encode())
    console.print(f"\n[bold]demo finished in {summary['seconds'] / 60:.1f} min[/]; everything is in {out}/")
    return summary
