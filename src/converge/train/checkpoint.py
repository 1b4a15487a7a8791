"""Checkpoints: written atomically, loaded without unpickling arbitrary objects.

A checkpoint holds the unwrapped model, optimizer, scheduler, grad scaler, every
RNG state, the epoch it finished, the best monitored value so far and the
resolved config that made it. It is written to a temporary file, fsynced,
re-loaded to verify, then renamed over the old one: a run killed at any moment
leaves either the previous checkpoint or the new one, never half of one.

A sharded (FSDP) run writes ``NAME.dcp/`` instead: a torch.distributed.checkpoint
directory, each rank writing its shards, plus ``meta.pt`` (everything but the
model and optimizer, written by rank 0). It is loadable on any number of ranks,
and by :func:`load_sharded_model` in a single process. The directory is written
as ``.NAME.dcp.tmp`` and renamed into place once complete; the previous version
is moved to ``.NAME.dcp.old`` for the instant between the two renames and used
if a kill lands there.
"""
from __future__ import annotations

import hashlib
import os
import random
import shutil
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

CHECKPOINT_VERSION = 1


class CheckpointError(RuntimeError):
    """A checkpoint is missing, truncated or from something else."""


def rng_state() -> dict[str, Any]:
    """Every RNG the training loop touches, in weights-only-loadable types."""
    # Python's Mersenne Twister state as one tensor: a list of 625 ints took the weights-only unpickler ~10 ms.
    state = {"torch": torch.get_rng_state(), "python": torch.tensor(random.getstate()[1], dtype=torch.int64),
             "python_gauss": random.getstate()[2]}
    np_state = np.random.get_state()
    state["numpy"] = torch.from_numpy(np_state[1].astype(np.int64))
    state["numpy_pos"] = int(np_state[2])
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()  # this process's device only (one GPU per rank)
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    python = state["python"]  # a tensor; a list in checkpoints written before 2026-12
    random.setstate((3, tuple(int(x) for x in (python.tolist() if torch.is_tensor(python) else python)),
                     state["python_gauss"]))
    np.random.set_state(("MT19937", state["numpy"].numpy().astype(np.uint32), state["numpy_pos"], 0, 0.0))
    if "cuda" in state and torch.cuda.is_available():
        cuda = state["cuda"]
        if isinstance(cuda, (list, tuple)):  # checkpoints before DDP held every device's state
            cuda = cuda[min(torch.cuda.current_device(), len(cuda) - 1)]
        torch.cuda.set_rng_state(cuda)


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
    _fsync_dir(path.parent)
    return digest


def _fsync_dir(path: Path) -> None:
    dir_fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


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


def sharded_path(path: Path) -> Path | None:
    """The complete ``NAME.dcp`` directory at ``path``, or its previous version if a kill fell between renames."""
    path = Path(path)
    for candidate in (path, path.with_name(f".{path.name}.old")):
        if (candidate / "meta.pt").is_file() and (candidate / ".metadata").is_file():
            return candidate
    return None


def checkpoint_path(run_dir: Path, which: str) -> Path:
    """``RUN/which.dcp`` of a sharded run (the latest state), else ``RUN/which.pt``."""
    return sharded_path(Path(run_dir) / f"{which}.dcp") or Path(run_dir) / f"{which}.pt"


def remove_checkpoints(run_dir: Path) -> None:
    """Delete a run folder's best and last checkpoints of both kinds (a fresh run starts over)."""
    for which in ("last", "best"):
        (Path(run_dir) / f"{which}.pt").unlink(missing_ok=True)
        for name in (f"{which}.dcp", f".{which}.dcp.old", f".{which}.dcp.tmp"):
            shutil.rmtree(Path(run_dir) / name, ignore_errors=True)


def _replace_dir(src: Path, dst: Path) -> None:
    old = dst.with_name(f".{dst.name}.old")
    if dst.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(dst, old)
    os.replace(src, dst)
    _fsync_dir(dst.parent)
    shutil.rmtree(old, ignore_errors=True)


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)  # best and last share their files
    except OSError:
        shutil.copy2(src, dst)


def save_sharded_checkpoint(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                            meta: dict[str, Any], main: bool, also: Path | None = None) -> None:
    """Write ``model``'s and ``optimizer``'s shards and ``meta`` into the directory ``path`` (every rank calls it).

    ``also`` (e.g. ``best.dcp``) gets the same checkpoint by hard links. Needs a
    file system every rank sees, as torch.distributed.checkpoint does.
    """
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    if main:
        shutil.rmtree(tmp, ignore_errors=True)  # left by a killed run
    dist.barrier()
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=tmp)
    if main:
        save_checkpoint(tmp / "meta.pt", meta)
        if sharded_path(tmp) != tmp:
            raise CheckpointError(f"{tmp}: the sharded checkpoint is incomplete after writing")
        dcp.FileSystemReader(tmp).read_metadata()  # verify before replacing: the index of every shard parses
        if also is not None:
            also_tmp = also.with_name(f".{also.name}.tmp")
            shutil.rmtree(also_tmp, ignore_errors=True)
            shutil.copytree(tmp, also_tmp, copy_function=_link_or_copy)
            _replace_dir(also_tmp, also)
        _replace_dir(tmp, path)
    dist.barrier()


def load_sharded_checkpoint(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Load a ``.dcp`` checkpoint into a (sharded or not) model and its optimizer; returns ``meta``.

    Every rank calls it; the number of ranks need not be the one that wrote it.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

    found = sharded_path(path)
    if found is None:
        raise CheckpointError(f"no sharded checkpoint at {path}")
    meta = load_checkpoint(found / "meta.pt")
    model_state, optim_state = get_state_dict(model, optimizer)
    stored = dcp.FileSystemReader(found).read_metadata().state_dict_metadata
    missing = [key for key in model_state if f"model.{key}" not in stored]
    if missing:
        raise CheckpointError(f"{found} lacks {len(missing)} of the model's tensors (e.g. {missing[0]}): "
                              "it holds another model")
    # A parameter that never had a gradient (e.g. the chem network of an element the data lack) has no state.
    with_state = {key.rsplit(".", 1)[0] for key in stored if key.startswith("optim.state.")}
    optim_state["state"] = {k: v for k, v in optim_state["state"].items() if f"optim.state.{k}" in with_state}
    try:
        dcp.load({"model": model_state, "optim": optim_state}, checkpoint_id=found)
    except Exception as err:  # DCP raises a CheckpointException wrapping each rank's error
        raise CheckpointError(f"sharded checkpoint {found} cannot be loaded ({type(err).__name__}: {err})") from None
    # not strict: the stateless parameters above; the model's tensors were all checked present
    set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optim_state,
                   options=StateDictOptions(strict=False))
    return meta


def load_sharded_model(path: Path, model: torch.nn.Module) -> dict[str, Any]:
    """Gather a ``.dcp`` checkpoint's full model into ``model`` in this process alone; returns ``meta``.

    The keys carry the ``model.`` prefix of :class:`converge.train.distributed.BatchForward`.
    """
    import torch.distributed.checkpoint as dcp

    found = sharded_path(path)
    if found is None:
        raise CheckpointError(f"no sharded checkpoint at {path}")
    meta = load_checkpoint(found / "meta.pt")
    state = {f"model.{k}": v for k, v in model.state_dict().items()}  # views: loaded in place
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "torch.distributed is disabled")  # one process is the intent
            dcp.load({"model": state}, checkpoint_id=found, no_dist=True)
    except Exception as err:
        raise CheckpointError(f"sharded checkpoint {found} does not hold this model "
                              f"({type(err).__name__}: {err})") from None
    return meta
