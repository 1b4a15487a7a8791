"""``converge demo --app darcy``: simulate -> train -> evaluate on small defaults, a few minutes on one core.

The same stages as a user's commands (``converge simulate darcy``, ``converge
train darcy``, ``converge evaluate darcy``), through their Python API. The
training settings are :func:`demo_train_config` (the benchmark's, with fewer
epochs: ``examples/darcy/benchmarks/darcy.py`` gives the full figures).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from converge.data.atomic import atomic_write_bytes, json_bytes, json_round_trip
from converge.data.store import ShardStore
from converge.simulate.runner import SimulateConfig, run_ensemble
from converge.train.loop import TrainConfig, train

from .config import DarcyConfig, DarcyEvalConfig

TRAIN_SEED, TEST_SEED = 1, 2  # dataset seeds: the test fields never share a seed stream with training


@dataclass(frozen=True)
class DarcyDemoSize:
    train_solves: int = 600
    test_solves: int = 100
    epochs: int = 12
    batch_size: int = 10
    resolution: int = 64


QUICK = DarcyDemoSize(train_solves=48, test_solves=16, epochs=2, batch_size=8, resolution=16)


def demo_train_config(size: DarcyDemoSize) -> TrainConfig:
    """The demo's training settings: every epoch counted (patience = epochs), one process, fp32."""
    return TrainConfig(epochs=size.epochs, batch_size=size.batch_size, patience=size.epochs, precision="fp32",
                       device="cpu")


def run_demo(app: Any, out: Path, quick: bool = False, workers: int = 2) -> dict[str, Any]:
    """Simulate train and test sets, train the FNO, evaluate it against the solver; ``out/summary.json``."""
    size = QUICK if quick else DarcyDemoSize()
    cfg = DarcyConfig.tiny() if quick else DarcyConfig(resolution=size.resolution)
    out.mkdir(parents=True, exist_ok=True)
    seconds: dict[str, float] = {}
    t0 = time.perf_counter()
    for name, n, seed in (("train", size.train_solves, TRAIN_SEED), ("test", size.test_solves, TEST_SEED)):
        result = run_ensemble(app, cfg, SimulateConfig(samples=n, seed=seed, workers=workers, shard_size=100),
                              out / "data" / name, progress=not quick)
        if result.n_failed:
            raise RuntimeError(f"{result.n_failed} darcy solves failed: {result.failures[:3]}")
    seconds["simulate"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    arrays = ShardStore.open(out / "data" / "train").load()
    run = out / "run"
    train(app, cfg, demo_train_config(size), arrays, run, resume=(run / "last.pt").is_file(), progress=not quick,
          extra_config={"data": str(out / "data" / "train")})
    seconds["train"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    ev = DarcyEvalConfig(plot_fields=2 if quick else 4, timing_fields=2 if quick else 8, batch_size=8 if quick else 16,
                         min_time_s=0.05 if quick else 1.0)
    report = app.evaluate(run, out / "data" / "test", run, ev=ev)
    seconds["evaluate"] = time.perf_counter() - t0
    summary = {**app.summary(report), "seconds": seconds, "run": str(run)}
    atomic_write_bytes(out / "summary.json", json_bytes(json_round_trip(summary)))
    return summary
