"""The generic training loop: AdamW, one-cycle schedule, autocast, checkpoints.

``train(app, app_cfg, cfg, arrays, run_dir)`` knows nothing of the science: the
app supplies the model, the batch sources, the loss and the metrics. Each epoch
ends with validation, a JSON line in ``metrics.jsonl``, TensorBoard scalars and
an atomic ``last.pt`` (and ``best.pt`` when the monitored metric improved).
``resume=True`` continues from ``last.pt`` at the next epoch with every RNG
restored, so the resumed run sees the same batches an uninterrupted one would.
"""
from __future__ import annotations

import contextlib
import json
import math
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import torch

from ..apps.base import App, BatchSource
from ..config import ConfigError, to_dict
from ..data.atomic import atomic_write_bytes
from .checkpoint import CheckpointError, load_checkpoint, rng_state, save_checkpoint, set_rng_state

PRECISIONS = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass(frozen=True)
class TrainConfig:
    """Settings of ``converge train`` (the ``[train]`` table)."""

    epochs: int = 8
    batch_size: int = 64
    lr: float = 2e-3
    weight_decay: float = 1e-4
    warmup_fraction: float = 0.1
    grad_clip: float = 1.0
    precision: str = "auto"  # the app's measured default (gw: bf16, chem: fp32)
    device: str = "auto"
    val_fraction: float = 0.1
    patience: int = 4
    seed: int = 0

    def __post_init__(self) -> None:
        if self.epochs < 1:
            raise ConfigError(f"train.epochs={self.epochs}: must be >= 1")
        if self.batch_size < 1:
            raise ConfigError(f"train.batch_size={self.batch_size}: must be >= 1")
        if not self.lr > 0:
            raise ConfigError(f"train.lr={self.lr}: must be > 0, e.g. 0.001")
        if self.precision != "auto" and self.precision not in PRECISIONS:
            raise ConfigError(f"train.precision={self.precision!r}: choose one of auto, bf16, fp16, fp32")
        if self.device not in ("auto", "cpu") and not self.device.startswith("cuda"):
            raise ConfigError(f"train.device={self.device!r}: use auto, cpu, cuda or cuda:N")
        if not 0 < self.val_fraction < 1:
            raise ConfigError(f"train.val_fraction={self.val_fraction}: must be strictly between 0 and 1")
        if not 0 <= self.warmup_fraction < 1:
            raise ConfigError(f"train.warmup_fraction={self.warmup_fraction}: must be in [0, 1)")
        if self.patience < 1:
            raise ConfigError(f"train.patience={self.patience}: must be >= 1")


@dataclass
class TrainResult:
    best_epoch: int
    best_value: float
    epochs_run: int
    stopped_early: bool
    seconds: float
    samples_seen: int
    history: list[dict[str, Any]] = field(default_factory=list)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def autocast_context(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    """bf16/fp16 autocast on ``device``; fp32 runs without autocast."""
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=PRECISIONS[precision])


def to_device(batch: Mapping[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def evaluate_source(
    app: App, app_cfg: Any, model: torch.nn.Module, source: BatchSource, cfg: TrainConfig, device: torch.device
) -> dict[str, float]:
    """Loss and app metrics of ``model`` over a whole (fixed) source."""
    model.eval()
    outputs, batches, losses, counts = [], [], [], []
    # Apps whose outputs are derivatives (forces = -dE/dr) need autograd at inference.
    grad_mode = torch.enable_grad() if app.grad_at_inference else torch.inference_mode()
    with grad_mode, autocast_context(device, cfg.precision):
        for batch in source.batches(0, cfg.batch_size):
            batch = to_device(batch, device)
            out = detach_output(app.forward(model, batch))
            n = len(next(iter(batch.values())))
            losses.append(float(app.loss(app_cfg, out, batch)) * n)
            counts.append(n)
            outputs.append(detach_output(out, cpu=True))
            batches.append({k: v.cpu() for k, v in batch.items() if k != "input"})
    merged = {k: torch.cat([b[k] for b in batches]) for k in batches[0]}
    metrics = app.metrics(concat_outputs(outputs), merged)
    return {"val_loss": sum(losses) / sum(counts), **metrics}


def detach_output(out: Any, cpu: bool = False) -> Any:
    """Detach a tensor or a NamedTuple of tensors (optionally moving it to the CPU)."""
    if isinstance(out, torch.Tensor):
        out = out.detach()
        return out.cpu() if cpu else out
    return type(out)(*(detach_output(o, cpu) for o in out))


def concat_outputs(outputs: list[Any]) -> Any:
    """Concatenate per-batch outputs (tensors, or NamedTuples of tensors) along the batch axis."""
    if isinstance(outputs[0], torch.Tensor):
        return torch.cat(outputs)
    return type(outputs[0])(*(torch.cat(parts) for parts in zip(*outputs)))


def _progress(enabled: bool):
    if not enabled:
        return contextlib.nullcontext(None)
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TextColumn("{task.fields[info]}"), TimeRemainingColumn(), transient=False)


def train(
    app: App,
    app_cfg: Any,
    cfg: TrainConfig,
    arrays: Mapping[str, np.ndarray],
    run_dir: Path,
    resume: bool = False,
    progress: bool = True,
    extra_config: Mapping[str, Any] | None = None,
    stop_after: int | None = None,
) -> TrainResult:
    """Train ``app``'s model on stored ``arrays``; checkpoints and logs go to ``run_dir``.

    ``stop_after`` ends the run after that many epochs in this call, as a kill
    between epochs would (the schedule still spans ``cfg.epochs``).
    """
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    if cfg.precision == "auto":
        cfg = replace(cfg, precision=app.default_precision)
    device = resolve_device(cfg.device)
    config = {"app": app.name, "app_config": to_dict(app_cfg), "train": to_dict(cfg), **(extra_config or {})}
    torch.manual_seed(cfg.seed)
    np.random.seed(cfg.seed % 2**32)
    model = app.make_model(app_cfg).to(device)
    train_src, val_src = app.make_datasets(app_cfg, arrays, cfg.seed, cfg.val_fraction)
    config["n_train_samples"], config["n_val_samples"] = len(train_src), len(val_src)
    if not resume:
        app.fit_to_data(model, train_src)  # e.g. per-element self-energies; restored from the checkpoint on resume
    steps_per_epoch = math.ceil(len(train_src) / cfg.batch_size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=cfg.lr, total_steps=cfg.epochs * steps_per_epoch,
        pct_start=max(cfg.warmup_fraction, 1e-3), anneal_strategy="cos",
    )
    scaler = torch.amp.GradScaler(device.type, enabled=cfg.precision == "fp16")
    start_epoch, best_value, best_epoch, bad_epochs, samples_seen = 0, None, -1, 0, 0
    history: list[dict[str, Any]] = []
    if resume:
        ckpt = load_checkpoint(run_dir / "last.pt")
        saved = ckpt["config"]
        for key in ("app", "app_config"):
            if saved.get(key) != config.get(key):
                raise CheckpointError(f"--resume: {run_dir} was trained with a different {key}; use a new --out")
        if saved["train"]["epochs"] != cfg.epochs:
            raise CheckpointError(f"--resume continues the same learning-rate schedule: the run was started with "
                                  f"--epochs {saved['train']['epochs']}, not {cfg.epochs}")
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        scaler.load_state_dict(ckpt["scaler"])
        set_rng_state(ckpt["rng"])
        start_epoch = ckpt["epoch"] + 1
        best_value, best_epoch, bad_epochs = ckpt["best_value"], ckpt["best_epoch"], ckpt["bad_epochs"]
        samples_seen = ckpt["samples_seen"]
        history = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
        history = [h for h in history if h["epoch"] < start_epoch]
    atomic_write_bytes(run_dir / "config.json", json.dumps(config, indent=2, sort_keys=True).encode())
    # Rewrite the log to exactly the finished epochs (a kill may have left a later line).
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(h) + "\n" for h in history))
    writer = _tensorboard(run_dir)
    t0, stopped_early, epochs_run = time.perf_counter(), False, 0
    with _progress(progress) as bar:
        for epoch in range(start_epoch, cfg.epochs):
            if bad_epochs >= cfg.patience:
                stopped_early = True
                break
            if stop_after is not None and epoch - start_epoch >= stop_after:
                break
            app.on_epoch_start(train_src, epoch, cfg.epochs)
            task = bar.add_task(f"epoch {epoch + 1}/{cfg.epochs}", total=steps_per_epoch, info="") if bar else None
            model.train()
            t_epoch, loss_sum, n_sum = time.perf_counter(), 0.0, 0
            for batch in train_src.batches(epoch, cfg.batch_size):
                batch = to_device(batch, device)
                with autocast_context(device, cfg.precision):
                    loss = app.loss(app_cfg, app.forward(model, batch), batch)
                optimizer.zero_grad(set_to_none=True)
                scaler.scale(loss).backward()
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
                scaler.step(optimizer)
                scaler.update()
                scheduler.step()
                n = len(next(iter(batch.values())))
                loss_sum, n_sum = loss_sum + float(loss.detach()) * n, n_sum + n
                if bar:
                    bar.update(task, advance=1, info=f"loss {loss_sum / n_sum:.4f}")
            samples_seen += n_sum
            epochs_run += 1
            train_seconds = time.perf_counter() - t_epoch
            record = {"epoch": epoch, "train_loss": loss_sum / max(n_sum, 1), "lr": scheduler.get_last_lr()[0],
                      "samples_per_s": n_sum / train_seconds, "samples_seen": samples_seen,
                      **evaluate_source(app, app_cfg, model, val_src, cfg, device)}
            value = record[app.monitor.name]
            improved = app.monitor.better(value, best_value)
            if improved:
                best_value, best_epoch, bad_epochs = value, epoch, 0
            else:
                bad_epochs += 1
            record["seconds"] = time.perf_counter() - t_epoch
            history.append(record)
            payload = {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                       "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict(), "rng": rng_state(),
                       "epoch": epoch, "best_value": best_value, "best_epoch": best_epoch,
                       "bad_epochs": bad_epochs, "samples_seen": samples_seen, "config": config}
            if improved:
                save_checkpoint(run_dir / "best.pt", payload)
            save_checkpoint(run_dir / "last.pt", payload)
            with open(run_dir / "metrics.jsonl", "a") as f:
                f.write(json.dumps(record) + "\n")
            if writer:
                for key, val in record.items():
                    if isinstance(val, (int, float)) and key != "epoch":
                        writer.add_scalar(key, val, epoch)
                writer.flush()
            if bar:
                bar.update(task, info=f"loss {record['train_loss']:.4f}  {app.monitor.name} {value:.4f}"
                           + ("  *best*" if improved else ""))
    if writer:
        writer.close()
    return TrainResult(best_epoch=best_epoch, best_value=float(best_value if best_value is not None else math.nan),
                       epochs_run=epochs_run, stopped_early=stopped_early,
                       seconds=time.perf_counter() - t0, samples_seen=samples_seen, history=history)


def _tensorboard(run_dir: Path):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # tensorboard is a dependency; a broken install only loses the events
        return None
    return SummaryWriter(log_dir=str(run_dir / "tensorboard"))


def load_model(app: App, run_dir: Path, which: str = "best", device: str = "cpu") -> tuple[torch.nn.Module, dict]:
    """The trained model of a run (eval mode) and the run's config."""
    ckpt = load_checkpoint(Path(run_dir) / f"{which}.pt")
    config = ckpt["config"]
    if config["app"] != app.name:
        raise CheckpointError(f"{run_dir} holds a {config['app']!r} model, not {app.name!r}")
    from ..config import from_dict

    app_cfg = from_dict(app.config_cls, config["app_config"], "app")
    model = app.make_model(app_cfg)
    model.load_state_dict(ckpt["model"])
    return model.to(device).eval(), config
