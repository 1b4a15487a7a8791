"""The generic training loop: AdamW, one-cycle schedule, autocast, checkpoints, DDP/FSDP.

``train(app, app_cfg, cfg, arrays, run_dir)`` knows nothing of the science: the
app supplies the model, the batch sources, the loss and the metrics. Each epoch
ends with validation, a JSON line in ``metrics.jsonl`` and TensorBoard scalars;
every ``checkpoint_every`` epochs (and at the run's end) an atomic ``last.pt`` is
written, with ``best.pt`` (the model and state of the best epoch so far, kept in
memory between writes) when the monitored metric improved since the last write.
``resume=True`` continues from ``last.pt`` at the next epoch with every RNG
restored, so the resumed run sees the same batches an uninterrupted one would; a
kill between writes loses at most ``checkpoint_every - 1`` epochs. Writing a
checkpoint costs ~40 ms for the chem model here (serialise, fsync, verify), four
times an epoch on a small active-learning set: those runs write every 25.

Under ``torchrun`` every rank calls ``train`` with the same arguments: the model
trains data-parallel (DDP) or, with ``cfg.shard``, fully sharded (FSDP2, with
``last.dcp/`` sharded checkpoints), each optimizer step still consuming
``batch_size`` samples in all (:mod:`converge.train.distributed`). Rank 0 writes
every file; checkpoints hold the unwrapped model, so a run resumes on any number
of ranks and its model loads in one process.
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

from ..contract import App, BatchSource
from ..config import ConfigError, to_dict
from ..data.atomic import atomic_write_bytes
from .checkpoint import (CheckpointError, checkpoint_path, load_checkpoint, load_sharded_checkpoint,
                         load_sharded_model, remove_checkpoints, rng_state, save_checkpoint, save_sharded_checkpoint,
                         set_rng_state, sharded_path)
from .distributed import (BatchForward, Ranks, StepPlan, all_reduce_sum, barrier, broadcast_from_main,
                          gradient_sync, plan_steps, process_group, rank_batches, unused_parameters, wrap_model)
from .precision import resolve_precision
from .distributed import resolve_device  # noqa: F401 (imported from here by converge.serve)

PRECISIONS = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass(frozen=True)
class TrainConfig:
    """Settings of ``converge train`` (the ``[train]`` table)."""

    epochs: int = 8
    batch_size: int = 64  # samples per optimizer step, all ranks and accumulation steps together
    lr: float = 2e-3
    weight_decay: float = 1e-4
    warmup_fraction: float = 0.1
    grad_clip: float = 1.0
    precision: str = "auto"  # the app's measured default (gw: bf16, chem: fp32); fp32 where bf16 is emulated
    device: str = "auto"
    val_fraction: float = 0.1
    patience: int = 0  # epochs without a better validation metric before stopping; 0: never stop early
    seed: int = 0
    bucket_cap_mb: float = 25.0  # DDP gradient bucket size (PyTorch's default)
    grad_accum_steps: int = 1  # micro-steps per optimizer step; gradients are synchronised on the last only
    shard: bool = False  # FSDP2: shard parameters, gradients and optimizer state over the ranks
    checkpoint_every: int = 1  # epochs between checkpoint writes (and always the run's last epoch)

    def stops_early(self, bad_epochs: int) -> bool:
        """Whether ``bad_epochs`` epochs without improvement end the run (never with ``patience=0``)."""
        return self.patience > 0 and bad_epochs >= self.patience

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
        if self.patience < 0:
            raise ConfigError(f"train.patience={self.patience}: give epochs >= 1, or 0 to never stop early")
        if not self.bucket_cap_mb > 0:
            raise ConfigError(f"train.bucket_cap_mb={self.bucket_cap_mb}: must be > 0 MB (DDP's gradient "
                              "bucket size; PyTorch's default is 25)")
        if self.grad_accum_steps < 1:
            raise ConfigError(f"train.grad_accum_steps={self.grad_accum_steps}: must be >= 1 (1: no accumulation)")
        if self.batch_size % self.grad_accum_steps:
            raise ConfigError(f"train.batch_size={self.batch_size} is not divisible by train.grad_accum_steps="
                              f"{self.grad_accum_steps}: each optimizer step is split into equal micro-batches; "
                              f"use a batch size that is a multiple of {self.grad_accum_steps}")
        if self.checkpoint_every < 1:
            raise ConfigError(f"train.checkpoint_every={self.checkpoint_every}: must be >= 1 (1: every epoch)")
        if self.shard and self.checkpoint_every != 1:
            raise ConfigError(f"train.checkpoint_every={self.checkpoint_every} with train.shard=true: sharded runs "
                              "write their checkpoints every epoch; leave checkpoint_every at 1")
        if self.shard and self.precision == "fp16":
            raise ConfigError("train.shard=true with train.precision='fp16': fp16's gradient scaler is not "
                              "supported on sharded parameters; use bf16 or fp32, or train without --shard")


@dataclass
class TrainResult:
    best_epoch: int
    best_value: float
    epochs_run: int
    stopped_early: bool
    seconds: float
    samples_seen: int
    history: list[dict[str, Any]] = field(default_factory=list)


def autocast_context(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    """bf16/fp16 autocast on ``device``; fp32 runs without autocast."""
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=PRECISIONS[precision])


def to_device(batch: Mapping[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def evaluate_source(
    app: App, app_cfg: Any, net: torch.nn.Module, source: BatchSource, cfg: TrainConfig, device: torch.device
) -> dict[str, float]:
    """Loss and app metrics over a whole (fixed) source; ``net(batch)`` gives the app's output."""
    net.eval()
    outputs, batches, losses, counts = [], [], [], []
    # Apps whose outputs are derivatives (forces = -dE/dr) need autograd at inference.
    grad_mode = torch.enable_grad() if app.grad_at_inference else torch.inference_mode()
    with grad_mode, autocast_context(device, cfg.precision):
        for batch in source.batches(0, cfg.batch_size):
            batch = to_device(batch, device)
            out = detach_output(net(batch))
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
    follow: Any = None,
) -> TrainResult:
    """Train ``app``'s model on stored ``arrays``; checkpoints and logs go to ``run_dir``.

    ``stop_after`` ends the run after that many epochs in this call, as a kill
    between epochs would (the schedule still spans ``cfg.epochs``). ``follow`` (a
    :class:`~converge.data.follow.DatasetFollower`) takes in the shards written
    since, at each epoch start, while the ensemble is still running; the
    learning-rate schedule is sized for the finished dataset.
    """
    with process_group(cfg.device, cfg.shard) as (ranks, device):
        cfg = replace(cfg, precision=resolve_precision(cfg.precision, app.default_precision, device))
        if follow is not None and (ranks.world > 1 or cfg.shard):
            raise ConfigError("--follow trains in one process: leave out --nproc and --shard (or train on the "
                              "finished dataset with them)")
        return _train(app, app_cfg, cfg, arrays, Path(run_dir), resume, progress, extra_config, stop_after,
                      ranks, device, follow)


def _train(app: App, app_cfg: Any, cfg: TrainConfig, arrays: Mapping[str, np.ndarray], run_dir: Path, resume: bool,
           progress: bool, extra_config: Mapping[str, Any] | None, stop_after: int | None, ranks: Ranks,
           device: torch.device, follow: Any = None) -> TrainResult:
    if ranks.main:
        run_dir.mkdir(parents=True, exist_ok=True)
    config = {"app": app.name, "app_config": to_dict(app_cfg), "train": to_dict(cfg), **(extra_config or {})}
    torch.manual_seed(cfg.seed)
    np.random.seed(cfg.seed % 2**32)
    model = app.make_model(app_cfg).to(device)
    train_src, val_src = app.make_datasets(app_cfg, arrays, cfg.seed, cfg.val_fraction)
    config["n_train_samples"], config["n_val_samples"] = len(train_src), len(val_src)
    plan = plan_steps(len(train_src), cfg.batch_size, ranks.world, cfg.grad_accum_steps)
    ckpt = _resume_state(run_dir, cfg, config) if resume else None
    if ckpt is None:
        app.fit_to_data(model, train_src)  # e.g. per-element self-energies; restored from the checkpoint on resume
    elif not cfg.shard:
        model.load_state_dict(ckpt["model"])
    net = BatchForward(app, model)
    find_unused = False
    if ranks.world > 1 and not cfg.shard:
        probe = to_device(next(iter(val_src.batches(0, plan.micro_batch))), device)
        find_unused = bool(unused_parameters(net, lambda out, b: app.loss(app_cfg, out, b), probe))
    wrapped = wrap_model(net, ranks, device, shard=cfg.shard, bucket_cap_mb=cfg.bucket_cap_mb,
                         find_unused=find_unused)
    optimizer = torch.optim.AdamW(wrapped.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    planned = plan  # a followed dataset grows: size the schedule for the finished one
    if follow is not None:
        stored = len(next(iter(arrays.values())))  # a source may count windows, not stored samples
        final = max(len(train_src), math.ceil(len(train_src) * follow.planned_samples / max(stored, 1)))
        planned = plan_steps(final, cfg.batch_size, ranks.world, cfg.grad_accum_steps)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=cfg.lr, total_steps=cfg.epochs * planned.optimizer_steps,
        pct_start=max(cfg.warmup_fraction, 1e-3), anneal_strategy="cos",
    )
    scaler = torch.amp.GradScaler(device.type, enabled=cfg.precision == "fp16")
    start_epoch, best_value, best_epoch, bad_epochs, samples_seen = 0, None, -1, 0, 0
    history: list[dict[str, Any]] = []
    if ckpt is not None:
        if cfg.shard:
            load_sharded_checkpoint(run_dir / "last.dcp", wrapped, optimizer)
        else:
            optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        scaler.load_state_dict(ckpt["scaler"])
        set_rng_state(ckpt["rng"])
        start_epoch = ckpt["epoch"] + 1
        best_value, best_epoch, bad_epochs = ckpt["best_value"], ckpt["best_epoch"], ckpt["bad_epochs"]
        samples_seen = ckpt["samples_seen"]
        if ranks.main:
            history = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
            history = [h for h in history if h["epoch"] < start_epoch]
        history = broadcast_from_main(history)
    writer, best_payload = None, None  # best_payload: the best epoch's state, not yet written
    if ranks.main:
        if ckpt is None:
            remove_checkpoints(run_dir)  # a fresh run in an old folder: no stale best or last
        atomic_write_bytes(run_dir / "config.json", json.dumps(config, indent=2, sort_keys=True).encode())
        # Rewrite the log to exactly the finished epochs (a kill may have left a later line).
        atomic_write_bytes(run_dir / "metrics.jsonl", "".join(json.dumps(h) + "\n" for h in history).encode())
        writer = _tensorboard(run_dir)
    t0, stopped_early, epochs_run = time.perf_counter(), False, 0
    with _progress(progress and ranks.main) as bar:
        for epoch in range(start_epoch, cfg.epochs):
            if cfg.stops_early(bad_epochs):
                stopped_early = True
                break
            if stop_after is not None and epoch - start_epoch >= stop_after:
                break
            if follow is not None and (grown := follow.refresh()) is not None:
                train_src, val_src = app.make_datasets(app_cfg, grown, cfg.seed, cfg.val_fraction)
                plan = plan_steps(len(train_src), cfg.batch_size, ranks.world, cfg.grad_accum_steps)
                bad_epochs = 0  # new data: patience starts again
            app.on_epoch_start(train_src, epoch, cfg.epochs)
            task = bar.add_task(f"epoch {epoch + 1}/{cfg.epochs}", total=plan.optimizer_steps, info="") if bar else 0
            on_step = (lambda mean, task=task: bar.update(task, advance=1, info=f"loss {mean:.4f}")) if bar else None
            t_epoch = time.perf_counter()
            loss_sum, n_sum = _train_epoch(app, app_cfg, cfg, wrapped, train_src, epoch, plan, ranks, device,
                                           optimizer, scheduler, scaler, on_step)
            loss_sum, n_sum = all_reduce_sum([loss_sum, n_sum], device)
            samples_seen += int(n_sum)
            epochs_run += 1
            train_seconds = time.perf_counter() - t_epoch
            record = {"epoch": epoch, "train_loss": loss_sum / max(n_sum, 1), "lr": scheduler.get_last_lr()[0],
                      "samples_per_s": n_sum / train_seconds, "samples_seen": samples_seen,
                      "n_train_samples": len(train_src)}
            if ranks.main or cfg.shard:  # a sharded model's forward needs every rank
                record.update(evaluate_source(app, app_cfg, net, val_src, cfg, device))
            record = broadcast_from_main(record)  # every rank takes rank 0's decisions
            value = record[app.monitor.name]
            improved = app.monitor.better(value, best_value)
            if improved:
                best_value, best_epoch, bad_epochs = value, epoch, 0
            else:
                bad_epochs += 1
            record["seconds"] = time.perf_counter() - t_epoch
            history.append(record)
            if ranks.main:  # the line before the checkpoint: a kill between them leaves a later line, which the
                _log_epoch(run_dir, writer, record)  # resume drops, never a checkpoint with its line missing
            meta = {"scheduler": scheduler.state_dict(), "scaler": scaler.state_dict(), "rng": rng_state(),
                    "epoch": epoch, "best_value": best_value, "best_epoch": best_epoch,
                    "bad_epochs": bad_epochs, "samples_seen": samples_seen, "config": config}
            last_epoch = (epoch + 1 >= cfg.epochs or cfg.stops_early(bad_epochs)
                          or (stop_after is not None and epoch + 1 - start_epoch >= stop_after))
            write = last_epoch or (epoch + 1) % cfg.checkpoint_every == 0
            if cfg.shard:
                save_sharded_checkpoint(run_dir / "last.dcp", wrapped, optimizer, meta, ranks.main,
                                        also=run_dir / "best.dcp" if improved else None)
            elif ranks.main:
                if improved:  # a copy: the live tensors change with the next step
                    best_payload = {"model": {k: v.detach().clone() for k, v in model.state_dict().items()},
                                    **meta}
                if write:
                    if best_payload is not None:
                        save_checkpoint(run_dir / "best.pt", best_payload)
                        best_payload = None
                    save_checkpoint(run_dir / "last.pt",
                                    {"model": model.state_dict(), "optimizer": optimizer.state_dict(), **meta})
            if bar:
                bar.update(task, info=f"loss {record['train_loss']:.4f}  {app.monitor.name} {value:.4f}"
                           + ("  *best*" if improved else ""))
    if writer:
        writer.close()
    finished = stopped_early or start_epoch + epochs_run >= cfg.epochs
    if cfg.shard and finished and ranks.main:
        _write_consolidated(app, app_cfg, run_dir)
    barrier()
    return TrainResult(best_epoch=best_epoch, best_value=float(best_value if best_value is not None else math.nan),
                       epochs_run=epochs_run, stopped_early=stopped_early,
                       seconds=time.perf_counter() - t0, samples_seen=samples_seen, history=history)


def _train_epoch(app: App, app_cfg: Any, cfg: TrainConfig, model: torch.nn.Module, source: BatchSource, epoch: int,
                 plan: StepPlan, ranks: Ranks, device: torch.device, optimizer: torch.optim.Optimizer,
                 scheduler: Any, scaler: torch.amp.GradScaler, on_step: Any) -> tuple[float, int]:
    """One epoch of optimizer steps; returns this rank's (sum of sample losses, samples)."""
    model.train()
    optimizer.zero_grad(set_to_none=True)
    loss_sum, n_sum = torch.zeros((), dtype=torch.float64, device=device), 0
    for k, (batch, weight) in enumerate(rank_batches(source, epoch, plan, ranks)):
        step_ends = (k + 1) % plan.accum == 0 or k + 1 == plan.micro_steps
        batch = to_device(batch, device)
        with gradient_sync(model, enabled=step_ends):  # DDP all-reduces on the step's last micro-batch only
            with autocast_context(device, cfg.precision):
                loss = app.loss(app_cfg, model(batch), batch)
            scaler.scale(loss if weight == 1 else loss * weight).backward()
        if weight:
            n = len(next(iter(batch.values())))
            loss_sum, n_sum = loss_sum + loss.detach().double() * n, n_sum + n
        if step_ends:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            if scheduler.last_epoch < scheduler.total_steps:  # a followed dataset may outgrow its estimate
                scheduler.step()
            if on_step:
                on_step(float(loss_sum) / max(n_sum, 1))
    return float(loss_sum), n_sum


def _resume_state(run_dir: Path, cfg: TrainConfig, config: Mapping[str, Any]) -> dict[str, Any]:
    """The last checkpoint (only its metadata for a sharded one), checked against this run's config."""
    sharded = sharded_path(run_dir / "last.dcp")
    if cfg.shard and sharded is None and (run_dir / "last.pt").is_file():
        raise CheckpointError(f"--resume: {run_dir} was trained without --shard (it holds last.pt, not "
                              "last.dcp/); resume without --shard")
    if not cfg.shard and sharded is not None:
        raise CheckpointError(f"--resume: {run_dir} was trained with --shard (it holds last.dcp/); "
                              "resume with --shard")
    ckpt = load_checkpoint((sharded or run_dir / "last.dcp") / "meta.pt" if cfg.shard else run_dir / "last.pt")
    saved = ckpt["config"]
    for key in ("app", "app_config"):
        if saved.get(key) != config.get(key):
            raise CheckpointError(f"--resume: {run_dir} was trained with a different {key}; use a new --out")
    for key, flag in (("epochs", "--epochs"), ("batch_size", "--batch-size")):
        if saved["train"][key] != getattr(cfg, key):
            raise CheckpointError(f"--resume continues the same learning-rate schedule: the run was started with "
                                  f"{flag} {saved['train'][key]}, not {getattr(cfg, key)}")
    return ckpt


def _write_consolidated(app: App, app_cfg: Any, run_dir: Path) -> None:
    """``best.pt`` and ``last.pt`` (model and config) gathered from a sharded run's ``.dcp`` checkpoints."""
    for which in ("best", "last"):
        if sharded_path(run_dir / f"{which}.dcp") is None:
            continue
        model = app.make_model(app_cfg)
        meta = load_sharded_model(run_dir / f"{which}.dcp", model)
        save_checkpoint(run_dir / f"{which}.pt", {"model": model.state_dict(), "config": meta["config"],
                                                  "epoch": meta["epoch"], "consolidated_from": f"{which}.dcp"})


def _log_epoch(run_dir: Path, writer: Any, record: Mapping[str, Any]) -> None:
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write(json.dumps(record) + "\n")
    if writer:
        for key, val in record.items():
            if isinstance(val, (int, float)) and key != "epoch":
                writer.add_scalar(key, val, record["epoch"])
        writer.flush()


def _tensorboard(run_dir: Path):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # tensorboard is a dependency; a broken install only loses the events
        return None
    return SummaryWriter(log_dir=str(run_dir / "tensorboard"))


def load_model(app: App, run_dir: Path, which: str = "best", device: str = "cpu") -> tuple[torch.nn.Module, dict]:
    """The trained model of a run (eval mode) and the run's config; a sharded run's is gathered here."""
    from ..config import from_dict

    path = checkpoint_path(Path(run_dir), which)
    sharded = path.suffix == ".dcp" or path.name.endswith(".dcp.old")
    ckpt = load_checkpoint(path / "meta.pt" if sharded else path)
    config = ckpt["config"]
    if config["app"] != app.name:
        raise CheckpointError(f"{run_dir} holds a {config['app']!r} model, not {app.name!r}")
    app_cfg = from_dict(app.config_cls, config["app_config"], "app")
    model = app.make_model(app_cfg)
    if sharded:
        load_sharded_model(path, model)
    else:
        model.load_state_dict(ckpt["model"])
    return model.to(device).eval(), config
