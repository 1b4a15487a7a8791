"""The reference models of the training benchmarks, and one timed training step as the trainer takes it.

A model is an installed app's (its default config's model, loss and ``App.synthetic_batch``;
gw: the detection CNN on whitened-noise windows, chem: the ANI potential on displaced
geometries, energies and forces by double backward), trained at the app's default
precision as ``--precision auto`` resolves it (bf16 only where the hardware has bf16
units); or ``mlp``: a 512-1024-512-1 GELU MLP (1.05 M parameters), little compute per
gradient byte, the communication-bound case.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from ..train.distributed import BatchForward, gradient_sync
from ..train.loop import autocast_context
from ..train.precision import resolve_precision

MLP = "mlp"
MLP_BATCH = 256  # per rank
CPU = torch.device("cpu")


def app_models() -> tuple[str, ...]:
    """The installed apps that give a synthetic training batch (``App.synthetic_batch``), by name."""
    from ..contract import app_classes

    return tuple(name for name, cls in app_classes()[0].items() if cls.provides("synthetic_batch"))


def default_models() -> tuple[str, ...]:
    """Every app model, then the MLP."""
    return (*app_models(), MLP)


def per_rank_batch(name: str) -> int:
    """Samples per rank and step: the app's ``bench_batch_size``, or :data:`MLP_BATCH`."""
    from ..contract import load_app

    return MLP_BATCH if name == MLP else load_app(name).bench_batch_size


@dataclass
class Case:
    """A reference model, its loss and one per-rank batch, on ``device``."""

    net: nn.Module  # net(batch) -> output
    loss: Callable[[Any, dict], torch.Tensor]
    batch: dict[str, torch.Tensor]
    precision: str
    device: torch.device = field(default=CPU)


class MLPOnBatch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(512, 1024), nn.GELU(), nn.Linear(1024, 512), nn.GELU(), nn.Linear(512, 1))

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.mlp(batch["input"]).squeeze(-1)  # (B,)


def make_case(name: str, batch_size: int, seed: int, device: torch.device = CPU, precision: str | None = None
              ) -> Case:
    """The model of app ``name`` (or ``mlp``), with the same initial weights on every rank, and a batch drawn
    with ``seed``."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(seed)
    if name == MLP:
        batch = {"input": torch.randn(batch_size, 512, generator=g), "target": torch.randn(batch_size, generator=g)}
        net, loss, own = MLPOnBatch(), (lambda out, b: (out - b["target"]).pow(2).mean()), "fp32"
    else:
        from ..contract import load_app

        try:
            app = load_app(name)
        except KeyError:
            raise ValueError(f"unknown model {name!r}; choose from {', '.join(default_models())}") from None
        cfg = app.config_cls()
        batch = app.synthetic_batch(cfg, batch_size, g)
        net, own = BatchForward(app, app.make_model(cfg)), app.default_precision
        loss = lambda out, b: app.loss(cfg, out, b)  # noqa: E731
    precision = precision or resolve_precision("auto", own, device)  # own: the app's default; fp32 if bf16 is emulated
    return Case(net.to(device), loss, {k: v.to(device) for k, v in batch.items()}, precision, device)


def n_params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, case: Case, sync: bool = True,
               accum: int = 1, allreduce_after: bool = False) -> None:
    """One optimizer step of ``accum`` micro-steps; ``allreduce_after``: no overlap, one flat all-reduce."""
    for k in range(accum):
        last = k == accum - 1
        with gradient_sync(model, sync and last and not allreduce_after):
            with autocast_context(case.device, case.precision):
                loss = case.loss(model(case.batch), case.batch)
            (loss / accum).backward()
    if allreduce_after:
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        flat = torch.cat([g.flatten() for g in grads])
        dist.all_reduce(flat)
        flat /= dist.get_world_size()
        offset = 0
        for grad in grads:
            grad.copy_(flat[offset:offset + grad.numel()].view_as(grad))
            offset += grad.numel()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def step_seconds(step: Callable[[], None], warmup: int, steps: int, device: torch.device = CPU) -> float:
    """Median seconds per call after ``warmup`` calls (each call waited for on a GPU)."""
    wait = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(warmup):
        step()
    wait()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        wait()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)
