"""``converge predict darcy FILE``: the FNO's pressure for permeability fields in a NumPy file.

Input: ``.npy`` holding one field (n, n) or a stack (N, n, n), or ``.npz`` holding
``permeability`` so shaped; raw permeabilities, rows index x. Output (default
``FILE.predicted.npz`` beside it, written atomically, no pickles): ``permeability``
(N, n, n) float32 as read and ``pressure`` (N, n, n) float32, u on the same nodes.
"""
from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import numpy as np

from converge.config import from_dict
from converge.data.atomic import atomic_write_bytes
from converge.train.loop import load_model

from .config import DarcyConfig
from .evaluate import predict_fields

INPUT_KEY = "permeability"


def read_fields(path: Path) -> np.ndarray:
    """Permeability fields (N, n, n) float32 from a ``.npy`` or ``.npz`` file, with errors that say what to give."""
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file; give a .npy or .npz of permeability fields")
    if path.suffix == ".npy":
        fields = np.load(path, allow_pickle=False)
    elif path.suffix == ".npz":
        with np.load(path, allow_pickle=False) as data:
            if INPUT_KEY not in data:
                raise ValueError(f"{path} holds {sorted(data.files)}; save the fields under {INPUT_KEY!r}")
            fields = data[INPUT_KEY]
    else:
        raise ValueError(f"{path}: give a .npy or .npz file (np.save / np.savez) of permeability fields")
    fields = np.asarray(fields, dtype=np.float32)
    fields = fields[None] if fields.ndim == 2 else fields
    if fields.ndim != 3 or fields.shape[1] != fields.shape[2]:
        raise ValueError(f"{path}: fields of shape {fields.shape}; give (n, n) or (N, n, n)")
    if not np.all(np.isfinite(fields)) or np.any(fields <= 0):
        raise ValueError(f"{path}: permeabilities must be finite and > 0")
    return fields


def predict_file(app: Any, run_dir: Path, path: Path, out: Path | None = None) -> Path:
    """Predict the pressure for every field of ``path`` with the run's best model; returns the file written."""
    model, config = load_model(app, run_dir)
    cfg = from_dict(DarcyConfig, config["app_config"], "app")
    fields = read_fields(path)
    if fields.shape[1] != cfg.resolution:
        raise ValueError(f"{path}: {fields.shape[1]}-node fields, the run serves {cfg.resolution} x {cfg.resolution}")
    pressure = predict_fields(app, model, fields)
    out = out or path.with_name(f"{path.stem}.predicted.npz")
    buffer = io.BytesIO()
    np.savez(buffer, permeability=fields, pressure=pressure.astype(np.float32))
    atomic_write_bytes(out, buffer.getvalue())
    return out
