"""The reference models of the training benchmarks, and one timed training step as the trainer takes it.

Each trains at its app's default precision as ``--precision auto`` resolves it (bf16 for
gw only where the hardware has bf16 units). ``gw``: the detection CNN (default GWConfig),
on whitened-noise windows; ``chem``: the ANI potential (default ChemConfig: ethanol), fp32, energies and forces (double
backward), on G2 geometries displaced by 0.03 Å Gaussian noise with zero labels (labels
change no timing); ``mlp``: a 512-1024-512-1 GELU MLP (1.05 M parameters): little
compute per gradient byte, the communication-bound case.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from ..train.distributed import BatchForward, gradient_sync
from ..train.loop import autocast_context
from ..train.precision import resolve_precision

MODELS = ("gw", "chem", "mlp")
PER_RANK_BATCH = {"gw": 64, "chem": 32, "mlp": 256}
CPU = torch.device("cpu")


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
    """The model (same initial weights on every rank) and a batch drawn with ``seed``."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(seed)
    if name == "gw":
        from ..apps.gw.app import GWApp
        from ..apps.gw.config import GWConfig

        app, cfg = GWApp(), GWConfig()
        batch = {"input": torch.randn(batch_size, cfg.window_samples, generator=g),
                 "label": (torch.rand(batch_size, generator=g) < 0.5).float(), "snr": torch.zeros(batch_size)}
        net, loss, own = BatchForward(app, app.make_model(cfg)), (lambda out, b: app.loss(cfg, out, b)), "bf16"
    elif name == "chem":
        from ..apps.chem import ChemApp
        from ..apps.chem.config import ChemConfig
        from ..apps.chem.molecules import get_molecule

        app, cfg = ChemApp(), ChemConfig()
        mol = get_molecule(cfg.molecule)
        r0 = torch.tensor(np.array(mol.positions), dtype=torch.float64)  # (A, 3) Å
        coords = r0 + 0.03 * torch.randn(batch_size, *r0.shape, generator=g, dtype=torch.float64)  # (B, A, 3)
        batch = {"species": torch.as_tensor(mol.atomic_numbers).repeat(batch_size, 1), "coordinates": coords,
                 "energy_residual": torch.zeros(batch_size, dtype=torch.float64), "forces": torch.zeros_like(coords)}
        net, loss, own = BatchForward(app, app.make_model(cfg)), (lambda out, b: app.loss(cfg, out, b)), "fp32"
    elif name == "mlp":
        batch = {"input": torch.randn(batch_size, 512, generator=g), "target": torch.randn(batch_size, generator=g)}
        net, loss, own = MLPOnBatch(), (lambda out, b: (out - b["target"]).pow(2).mean()), "fp32"
    else:
        raise ValueError(f"unknown model {name!r}; choose from {', '.join(MODELS)}")
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
