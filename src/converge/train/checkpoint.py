"""Checkpoints: written atomically, loaded without unpickling arbitrary objects.

A checkpoint holds the unwrapped model, optimizer, scheduler, grad scaler, every
RNG state, the epoch it finished, the best monitored value so far and the
resolved config that made it. It is written to a temporary file, fsynced,
re-loaded to verify, then renamed over the old one: a run killed at any moment
leaves either the previous checkpoint or the new one, never half of one.
"""
from __future__ import annotations

import hashlib
import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

CHECKPOINT_VERSION = 1


class CheckpointError(RuntimeError):
    """A checkpoint is missing, truncated or from something else."""


def rng_state() -> dict[str, Any]:
    """Every RNG the training loop touches, in weights-only-loadable types."""
    state = {"torch": torch.get_rng_state(), "python": list(random.getstate()[1]), "python_gauss": random.getstate()[2]}
    np_state = np.random.get_state()
    state["numpy"] = torch.from_numpy(np_state[1].astype(np.int64))
    state["numpy_pos"] = int(np_state[2])
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate((3, tuple(state["python"]), state["python_gauss"]))
    np.random.set_state(("MT19937", state["numpy"].numpy().astype(np.uint32), state["numpy_pos"], 0, 0.0))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(path: Path, payload: dict[str, Any]) -> str:
    """Write ``payload`` atomically to ``path``; returns the file's sha256."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    payload = {"version": CHECKPOINT_VERSION, **payload}
    with open(tmp, "wb") as f:
        torch.save(payload, f)
        f.flush()
        os.fsync(f.fileno())
    try:
        torch.load(tmp, map_location="cpu", weights_only=True)  # verify before replacing
        digest = hashlib.sha256(tmp.read_bytes()).hexdigest()
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return digest


def load_checkpoint(path: Path) -> dict[str, Any]:
    """Load a checkpoint with ``weights_only=True``; clear errors when it is bad."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"no checkpoint at {path}")
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # truncated or foreign files raise many different types
        raise CheckpointError(f"checkpoint {path} cannot be read ({type(err).__name__}: {err}); "
                              "it is corrupt or not a converge checkpoint") from None
    if not isinstance(payload, dict) or payload.get("version") != CHECKPOINT_VERSION:
        raise CheckpointError(f"{path} is not a converge checkpoint (version {CHECKPOINT_VERSION})")
    return payload
