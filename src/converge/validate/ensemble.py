"""Deep ensembles: K members trained alike but for their seed; the mean and spread of their outputs.

Lakshminarayanan, Pritzel and Blundell, "Simple and scalable predictive
uncertainty estimation using deep ensembles", NeurIPS 2017. Member ``i`` is a
plain :func:`~converge.train.loop.train` run with ``seed = train.seed + i``,
which changes its initial weights, its train/validation split and the order of
its batches. Nothing else differs, so the members disagree where the data did
not pin the function down: their spread is the ensemble's uncertainty.

For every output of the members (a tensor, a ``NamedTuple`` of tensors or a dict
of tensors) the ensemble gives, elementwise over the member axis ``k = 1..K``::

    mean = (1/K) sum_k y_k
    std  = sqrt( sum_k (y_k - mean)^2 / (K - 1) )        (ddof = 1, :data:`SPREAD_DDOF`)

The unbiased (ddof = 1) estimate, as ``torch.std`` and torchani's ensembles use;
with K = 4 it is 1.15 times the ddof = 0 value. It needs K >= 2.

Which outputs: :meth:`EnsembleModel.predict` reduces ``app.serve_predict``, the
physical outputs a user sees (chem: total energy and forces; gw: logit and
signal probability). :meth:`EnsembleModel.predict_forward` reduces ``app.forward``,
the training-space output; beware that it may hold per-member constants (chem:
the energy minus self-energies fitted on each member's own split), which then
enter the spread.

Layout of an ensemble run ``RUN``::

    RUN/ensemble.json       members, seeds, config, and the sha256 of each member's best.pt
    RUN/member-{i}/         a train() run directory; done.json once the member finished
"""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Mapping, NamedTuple, Sequence

import numpy as np
import torch
from torch import nn

from ..contract import App
from ..config import to_dict
from ..data.atomic import atomic_write_bytes, json_bytes, json_round_trip, sha256_file
from ..train.checkpoint import checkpoint_path
from ..train.loop import TrainConfig, TrainResult, load_model, train

ENSEMBLE_FILE = "ensemble.json"
DONE_FILE = "done.json"  # written in a member's directory once its training finished
SPREAD_DDOF = 1  # std over members with K - 1 in the denominator (module docstring)


class EnsembleError(RuntimeError):
    """An ensemble directory is incomplete, or was made with other settings."""


class EnsemblePrediction(NamedTuple):
    """Mean and spread over the members, each with the structure of one member's output (float64)."""

    mean: Any
    std: Any  # elementwise, ddof = 1
    members: Any  # the member outputs stacked on a leading (K, ...) axis


# -- generic reductions over output structures ----------------------------------------
def map_output(fn: Callable[..., torch.Tensor], *outputs: Any) -> Any:
    """Apply ``fn`` field by field to outputs of one structure (tensor, NamedTuple or dict of tensors)."""
    first = outputs[0]
    if isinstance(first, torch.Tensor):
        return fn(*outputs)
    if isinstance(first, Mapping):
        return {k: fn(*(o[k] for o in outputs)) for k in first}
    if isinstance(first, tuple) and hasattr(first, "_fields"):
        return type(first)(*(fn(*fields) for fields in zip(*outputs)))
    raise TypeError(f"cannot reduce an output of type {type(first).__name__}: "
                    "return a tensor, a NamedTuple of tensors or a dict of tensors")


def reduce_members(outputs: Sequence[Any]) -> EnsemblePrediction:
    """Mean and std (ddof = 1) over ``outputs``, one per member, elementwise and in float64."""
    if len(outputs) < 2:
        raise ValueError(f"{len(outputs)} member output(s): a spread needs at least 2 members")

    def stack(*fields: torch.Tensor) -> torch.Tensor:
        return torch.stack([f.detach().to("cpu", torch.float64) for f in fields])  # (K, ...)

    stacked = map_output(stack, *outputs)
    mean = map_output(lambda s: s.mean(0), stacked)
    std = map_output(lambda s: s.std(0, correction=SPREAD_DDOF), stacked)
    return EnsemblePrediction(mean, std, stacked)


def concat_predictions(parts: Sequence[EnsemblePrediction]) -> EnsemblePrediction:
    """Join predictions of consecutive chunks of a batch (the member axis of ``members`` stays first)."""
    mean = map_output(lambda *t: torch.cat(t), *(p.mean for p in parts))
    std = map_output(lambda *t: torch.cat(t), *(p.std for p in parts))
    members = map_output(lambda *t: torch.cat(t, dim=1), *(p.members for p in parts))
    return EnsemblePrediction(mean, std, members)


# -- the model ------------------------------------------------------------------------
class EnsembleModel(nn.Module):
    """K trained members of one app; :meth:`predict` gives their mean and spread."""

    def __init__(self, app: App, members: Sequence[nn.Module], config: Mapping[str, Any] | None = None) -> None:
        super().__init__()
        if len(members) < 2:
            raise ValueError(f"an ensemble needs at least 2 members to have a spread, got {len(members)}")
        self.app = app
        self.members = nn.ModuleList(members)
        self.config = dict(config or {})

    def __len__(self) -> int:
        return len(self.members)

    def predict(self, inputs: Mapping[str, torch.Tensor | np.ndarray], batch_size: int = 1024) -> EnsemblePrediction:
        """Mean and spread of ``app.serve_predict`` outputs (dict by name) on ``inputs`` (batch axis first)."""
        tensors = {k: torch.as_tensor(np.asarray(v)) if not isinstance(v, torch.Tensor) else v
                   for k, v in inputs.items()}
        n = len(next(iter(tensors.values()))) if tensors else 0
        if n == 0:
            raise ValueError("no inputs to predict: give at least one sample (batch axis first)")
        parts = []
        for start in range(0, n, batch_size):
            chunk = {k: v[start : start + batch_size] for k, v in tensors.items()}
            with torch.inference_mode():
                parts.append(self.reduce(chunk))
        return parts[0] if len(parts) == 1 else concat_predictions(parts)

    def reduce(self, inputs: Mapping[str, torch.Tensor]) -> EnsemblePrediction:
        """Mean and spread of every member's ``app.serve_predict`` on one batch, in the caller's grad mode."""
        return reduce_members([self.app.serve_predict(m.eval(), inputs) for m in self.members])

    def predict_forward(self, batch: Mapping[str, torch.Tensor],
                        transform: Callable[[torch.Tensor], torch.Tensor] | None = None) -> EnsemblePrediction:
        """Mean and spread of ``app.forward`` on a training-style batch; ``transform`` (e.g.
        ``torch.sigmoid`` on gw logits) is applied to every field of each member first."""
        grad_mode = torch.enable_grad() if self.app.grad_at_inference else torch.inference_mode()
        outputs = []
        with grad_mode:
            for member in self.members:
                out = self.app.forward(member.eval(), batch)
                outputs.append(map_output(lambda t: (transform(t) if transform else t).detach(), out))
        return reduce_members(outputs)


# -- training ------------------------------------------------------------------------
def member_dir(run_dir: Path, index: int) -> Path:
    return Path(run_dir) / f"member-{index}"


def member_config(train_cfg: TrainConfig, index: int) -> TrainConfig:
    """Member ``index`` trains with ``seed + index``: its own initial weights, split and batch order."""
    return replace(train_cfg, seed=train_cfg.seed + index)


def _identity(app: App, app_cfg: Any, train_cfg: TrainConfig) -> dict[str, Any]:
    return json_round_trip({"app": app.name, "app_config": to_dict(app_cfg), "train": to_dict(train_cfg)})


def _check_same(found: Mapping[str, Any], wanted: Mapping[str, Any], where: Path) -> None:
    differ = [k for k in wanted if found.get(k) != wanted[k]]
    if differ:
        raise EnsembleError(f"{where} was made with a different {', '.join(differ)}; "
                            "train the ensemble into a new directory, or delete this one to start over")


def member_finished(app: App, app_cfg: Any, train_cfg: TrainConfig, run_dir: Path, index: int) -> bool:
    """Whether member ``index`` finished training with exactly these settings (its ``done.json``)."""
    done = member_dir(run_dir, index) / DONE_FILE
    if not done.is_file():
        return False
    _check_same(json.loads(done.read_text()), _identity(app, app_cfg, member_config(train_cfg, index)), done)
    return True


def _training_finished(result: TrainResult, cfg: TrainConfig) -> bool:
    last_epoch = result.history[-1]["epoch"] if result.history else -1
    return result.stopped_early or last_epoch + 1 >= cfg.epochs


def train_member(app: App, app_cfg: Any, train_cfg: TrainConfig, arrays: Mapping[str, np.ndarray],
                 run_dir: str | Path, index: int, progress: bool = False,
                 extra_config: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Train member ``index`` of the ensemble in ``run_dir`` (skipped if finished, resumed if interrupted) and
    return its ``done.json``. Members are independent, so separate processes or jobs may train them side by side;
    :func:`train_ensemble` then finds them finished and writes ``ensemble.json``."""
    run_dir = Path(run_dir)
    directory, cfg = member_dir(run_dir, index), member_config(train_cfg, index)
    if not member_finished(app, app_cfg, train_cfg, run_dir, index):
        resume = (directory / "last.pt").is_file() or (directory / "last.dcp").is_dir()
        result = train(app, app_cfg, cfg, arrays, directory, resume=resume, progress=progress,
                       extra_config={**(extra_config or {}), "ensemble_member": index})
        if not _training_finished(result, cfg):
            raise EnsembleError(f"member {index} stopped before its last epoch; rerun to resume it")
        record = {**_identity(app, app_cfg, cfg), "best_epoch": result.best_epoch,
                  "best_value": result.best_value, "epochs": len(result.history)}
        atomic_write_bytes(directory / DONE_FILE, json_bytes(record))
    return json.loads((directory / DONE_FILE).read_text())


def train_ensemble(
    app: App,
    app_cfg: Any,
    train_cfg: TrainConfig,
    arrays: Mapping[str, np.ndarray],
    run_dir: str | Path,
    members: int = 5,
    progress: bool = False,
    extra_config: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Train ``members`` models into ``run_dir/member-{i}/``; returns the ensemble's record.

    Resumable: a finished member (``done.json`` with the same settings) is skipped,
    an interrupted one (``last.pt`` but no ``done.json``) continues with
    ``resume=True``. Asking for more members later adds them. ``ensemble.json``
    is written atomically once all are done, with each member's ``best.pt`` hash.
    """
    if members < 2:
        raise ValueError(f"members={members}: an ensemble needs at least 2 members to have a spread")
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    identity = _identity(app, app_cfg, train_cfg)
    if (run_dir / ENSEMBLE_FILE).is_file():
        _check_same(json.loads((run_dir / ENSEMBLE_FILE).read_text()), identity, run_dir / ENSEMBLE_FILE)
    summaries = [train_member(app, app_cfg, train_cfg, arrays, run_dir, i, progress, extra_config)
                 for i in range(members)]
    record = {**identity, "members": members, "spread_ddof": SPREAD_DDOF, **json_round_trip(dict(extra_config or {})),
              "member_dirs": [member_dir(run_dir, i).name for i in range(members)],
              "seeds": [member_config(train_cfg, i).seed for i in range(members)],
              "best_values": [s["best_value"] for s in summaries],
              "checkpoints": {member_dir(run_dir, i).name: _checkpoint_hash(member_dir(run_dir, i))
                              for i in range(members)}}
    atomic_write_bytes(run_dir / ENSEMBLE_FILE, json_bytes(record))
    return record


def _checkpoint_hash(directory: Path) -> str | None:
    path = checkpoint_path(directory, "best")
    return sha256_file(path) if path.is_file() else None  # a sharded run's best.dcp/ is a directory


def load_ensemble(app: App, run_dir: str | Path, which: str = "best", device: str = "cpu") -> EnsembleModel:
    """The members of an ensemble run (eval mode); a member whose ``best.pt`` changed since is refused."""
    run_dir = Path(run_dir)
    path = run_dir / ENSEMBLE_FILE
    if not path.is_file():
        raise EnsembleError(f"{run_dir} holds no {ENSEMBLE_FILE}: train it with train_ensemble "
                            "(`converge train --ensemble K`) first, or rerun it to finish")
    record = json.loads(path.read_text())
    if record["app"] != app.name:
        raise EnsembleError(f"{run_dir} holds a {record['app']!r} ensemble, not {app.name!r}")
    models = []
    for name in record["member_dirs"]:
        expected = record["checkpoints"].get(name)
        if which == "best" and expected is not None and _checkpoint_hash(run_dir / name) != expected:
            raise EnsembleError(f"{run_dir / name}: best.pt differs from the one recorded in {ENSEMBLE_FILE} "
                                "(retrained or damaged); rerun train_ensemble to record it again")
        models.append(load_model(app, run_dir / name, which, device)[0])
    return EnsembleModel(app, models, record)
