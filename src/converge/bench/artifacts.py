"""Writing benchmark results: JSON and PNG, each atomically (temp file -> verify -> rename).

Every benchmark of :mod:`converge.bench` returns a plain dict; :func:`write_json`
stores it (strict JSON: a NaN or an infinity is an error, not a silent ``NaN``
token a browser cannot parse) and :func:`save_figure` a Matplotlib figure.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any, Callable

from ..data.atomic import atomic_write_bytes


def write_json(path: str | Path, result: Any) -> Path:
    """``result`` as indented strict JSON at ``path`` (parents made), written atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, (json.dumps(result, indent=2, allow_nan=False) + "\n").encode())
    return path


def save_figure(fig: Any, path: str | Path, dpi: int = 120) -> Path:
    """Save a Matplotlib figure as PNG at ``path`` atomically and close it."""
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}.png")
    try:
        fig.savefig(tmp, dpi=dpi)
        os.replace(tmp, path)
    finally:
        plt.close(fig)
        tmp.unlink(missing_ok=True)
    return path


def pyplot():
    """``matplotlib.pyplot`` on the non-interactive Agg backend (benchmarks run headless)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def write_results_with_plot(result: dict[str, Any], out_dir: str | Path, stem: str,
                            plot: Callable[[dict[str, Any], Path], Path]) -> tuple[Path, Path]:
    """``OUT/STEM.json`` and ``OUT/STEM.png`` (drawn by ``plot``), each written atomically."""
    out_dir = Path(out_dir)
    return write_json(out_dir / f"{stem}.json", result), plot(result, out_dir / f"{stem}.png")


def finish(result: dict[str, Any], paths: tuple[Path, ...], ok: bool, failure: str) -> int:
    """A benchmark command's end: its summary on stdout, what it wrote (or ``failure``) on stderr, the exit code."""
    print(json.dumps(result["summary"], indent=2))
    print("written " + " and ".join(map(str, paths)) + ("" if ok else f"; {failure}"), file=sys.stderr)
    return 0 if ok else 1
