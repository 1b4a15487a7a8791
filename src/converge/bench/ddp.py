"""Data-parallel training throughput and scaling efficiency over 1..N processes (``converge bench ddp``).

For each process count n of ``processes``, n fresh ranks (Gloo on the CPU, NCCL with
one GPU per rank) train each reference model as the trainer does: DDP, autocast at
the model's precision, gradient clipping, AdamW. The per-rank batch is fixed (weak
scaling: the global batch is n times it). Per (model, n), after warm-up:

- ``step_ms``: the slowest rank's median step; ``samples_per_s`` = n x batch / step;
- ``efficiency`` = samples/s(n) / (n x samples/s(1)): what n devices give over one;
- ``ceiling_samples_per_s``: the same n ranks training at once without communicating,
  and ``efficiency_vs_ceiling`` against it. On a CPU whose cores share caches, memory
  bandwidth and a power budget, n bare processes already run slower than n x one;
  that loss is the hardware's, not DDP's, and the two efficiencies tell them apart;
- ``in_sync``: after the timed DDP steps every parameter is compared across ranks
  (elementwise max - min): data-parallel replicas must stay identical.

The ring all-reduce model (:mod:`converge.bench.scaling_model`) then predicts 8, 64
and 512 GPUs from the one-process step time and the gradient bytes: on a GPU run the
step was measured here; on a CPU run the GPU step is assumed (CPU step / 50, at least
1 ms) and labelled so. Under ``torchrun`` the ranks that exist are measured, with
rank 0 alone as the one-process baseline.

Reference models (:mod:`.reference_training`): each installed app's model on its
``App.synthetic_batch`` at the app's default precision as ``auto`` resolves it (bf16 only
where the hardware has bf16 units), and ``mlp``, a 1 M-parameter MLP: little compute per
gradient byte, the communication-bound case.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from datetime import timedelta
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from ..train.distributed import Ranks, unused_parameters, wrap_model
from .artifacts import finish, pyplot, save_figure, write_results_with_plot
from .collectives import slowest, under_torchrun
from .machine import describe_machine
from .reference_training import (CPU, Case, default_models, make_case, n_params, per_rank_batch, step_seconds,
                                 train_step)
from .scaling_model import PREDICTED_GPUS, Cluster, assumptions, cluster_allreduce_seconds, efficiency, predict
from .server_process import free_port

CPU_TO_GPU = 50.0  # assumed GPU speed-up of a step when no GPU was measured ...
GPU_FLOOR_S = 1e-3  # ... but no less than this: a few dozen kernel launches bound a small model's step


def replicas_spread(model: nn.Module) -> float:
    """Largest elementwise difference of the parameters across ranks (0.0: replicas identical)."""
    flat = torch.cat([p.detach().double().flatten() for p in model.parameters()])
    high, low = flat.clone(), flat.clone()
    dist.all_reduce(high, op=dist.ReduceOp.MAX)
    dist.all_reduce(low, op=dist.ReduceOp.MIN)
    return float((high - low).max())


# -- configuration ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DDPBenchConfig:
    models: tuple[str, ...] = field(default_factory=default_models)  # installed apps' models, then mlp
    processes: tuple[int, ...] = (1, 2)  # each count is one launch of fresh ranks; 1 is the baseline
    device: str = "cpu"  # cpu (Gloo) | cuda (NCCL, one GPU per rank)
    batch: int | None = None  # per rank; None: each model's own (App.bench_batch_size)
    precision: str | None = None  # fp32 | bf16; None: each model's own
    warmup: int = 3
    steps: int = 20
    threads: int = 1  # torch threads per rank
    timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if not self.models or set(self.models) - set(default_models()):
            raise ValueError(f"models={self.models}: choose from {', '.join(default_models())}")
        if not self.processes or min(self.processes) < 1 or 1 not in self.processes:
            raise ValueError(f"processes={self.processes}: give counts >= 1 including 1 (the efficiency "
                             "is against one process)")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device={self.device!r}: cpu (Gloo) or cuda (NCCL)")
        if self.precision not in (None, "fp32", "bf16"):
            raise ValueError(f"precision={self.precision!r}: fp32 or bf16 (fp16 would need a GradScaler)")
        if (self.batch is not None and self.batch < 1) or self.warmup < 0 or self.steps < 1:
            raise ValueError(f"batch={self.batch}, warmup={self.warmup}, steps={self.steps}: need batch >= 1, "
                             "warmup >= 0, steps >= 1")

    @classmethod
    def quick(cls) -> "DDPBenchConfig":
        """Seconds, for tests: the MLP on 1 and 2 Gloo ranks, a few steps."""
        return cls(models=("mlp",), processes=(1, 2), batch=32, warmup=1, steps=3, timeout_s=120.0)


# -- one rank --------------------------------------------------------------------------------------------------------
def measure_model(name: str, ranks: Ranks, device: torch.device, cfg: DDPBenchConfig, single: bool
                  ) -> dict[str, Any]:
    """One model on this launch's ranks (collective); ``single``: also rank 0 alone, the 1-process time."""
    b = cfg.batch or per_rank_batch(name)

    def fresh(ddp: bool) -> tuple[nn.Module, torch.optim.Optimizer, Case]:
        case = make_case(name, b, seed=ranks.rank, device=device, precision=cfg.precision)
        model = case.net
        if ddp:  # as the trainer does: look for unused parameters (chem's N network) only if there are some
            find_unused = bool(unused_parameters(case.net, case.loss, case.batch))  # type: ignore[arg-type]
            model = wrap_model(case.net, ranks, device, shard=False, bucket_cap_mb=25.0, find_unused=find_unused)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-4), case

    def timed(parts: tuple, alone: bool = False) -> float:
        slowest(0.0, device)  # start together
        t = step_seconds(lambda: train_step(*parts), cfg.warmup, cfg.steps, device)
        return t if alone else slowest(t, device)

    plain = fresh(ddp=False)
    out: dict[str, Any] = {"model": name, "processes": ranks.world, "per_rank_batch": b,
                           "precision": plain[2].precision, "params": n_params(plain[0]),
                           "grad_bytes": 4 * n_params(plain[0])}  # fp32 gradients are what DDP all-reduces
    if single:  # rank 0 alone; the others wait at the next collective
        out["one_process_step_ms"] = 1e3 * step_seconds(lambda: train_step(*plain), cfg.warmup, cfg.steps,
                                                        device) if ranks.main else None
    if ranks.world > 1:
        t_alone = timed(plain, alone=True)
        ceiling = torch.tensor([b / t_alone], dtype=torch.float64, device=device)
        dist.all_reduce(ceiling)
        ddp = fresh(ddp=True)
        t_ddp = timed(ddp)
        out.update(step_ms=1e3 * t_ddp, samples_per_s=ranks.world * b / t_ddp,
                   ceiling_samples_per_s=float(ceiling), replicas_max_difference=replicas_spread(ddp[0]))
        out["in_sync"] = out["replicas_max_difference"] == 0.0
    elif ranks.main:
        out.update(step_ms=out["one_process_step_ms"], samples_per_s=b / (out["one_process_step_ms"] / 1e3),
                   ceiling_samples_per_s=None, replicas_max_difference=0.0, in_sync=True)
    return out


def rank_main(rank: int, world: int, init_method: str, cfg: DDPBenchConfig, single: bool,
              out_path: str | None = None, local_rank: int | None = None) -> list[dict[str, Any]] | None:
    """Join the group and measure every model; rank 0 returns (and writes to ``out_path``) the rows.

    The rows are written before the group is torn down: Gloo's teardown after DDP has
    aborted a rank in its C++ threads once the work was done.
    """
    torch.set_num_threads(cfg.threads)
    device = CPU
    if cfg.device == "cuda":
        device = torch.device("cuda", (rank if local_rank is None else local_rank) % torch.cuda.device_count())
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cfg.device == "cuda" else "gloo", init_method=init_method, rank=rank,
                            world_size=world, timeout=timedelta(seconds=cfg.timeout_s))
    ranks = Ranks(rank, world)
    rows = [measure_model(name, ranks, device, cfg, single) for name in cfg.models]
    if ranks.main and out_path:
        Path(out_path).write_text(json.dumps(rows))
    slowest(0.0, device)
    dist.destroy_process_group()
    return rows if ranks.main else None


def _spawned_rank(rank: int, world: int, port: int, cfg: DDPBenchConfig, out_path: str) -> None:
    rank_main(rank, world, f"tcp://127.0.0.1:{port}", cfg, single=world == 1, out_path=out_path)


def launch(world: int, cfg: DDPBenchConfig) -> list[dict[str, Any]]:
    """``world`` fresh spawned ranks; rank 0's rows. A rank dying after the rows were written is reported."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch) / "rank0.json"
        try:
            mp.start_processes(_spawned_rank, args=(world, free_port(), cfg, str(out)), nprocs=world,
                               start_method="spawn")
        except mp.ProcessExitedException as err:
            if not out.is_file():
                raise
            print(f"  ({world} ranks: one exited abnormally after the results were written: {err})", file=sys.stderr)
        return json.loads(out.read_text())


# -- the benchmark ---------------------------------------------------------------------------------------------------
def run_ddp_benchmark(cfg: DDPBenchConfig = DDPBenchConfig(), progress: bool = False) -> dict[str, Any] | None:
    """Every (model, process count); under torchrun the ranks that exist. None on torchrun's other ranks."""
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device cuda but CUDA is not available; use --device cpu (Gloo)")
    t0 = time.perf_counter()
    if under_torchrun():
        world = int(os.environ["WORLD_SIZE"])
        cfg = replace(cfg, processes=(1, world) if world > 1 else (1,))
        rows = rank_main(int(os.environ["RANK"]), world, "env://", cfg, single=True,
                         local_rank=int(os.environ.get("LOCAL_RANK", "0")))
        if rows is None:
            return None
        launches = {1: [{**r, "step_ms": r["one_process_step_ms"], "processes": 1,
                         "samples_per_s": r["per_rank_batch"] / (r["one_process_step_ms"] / 1e3),
                         "ceiling_samples_per_s": None, "replicas_max_difference": 0.0, "in_sync": True}
                        for r in rows]}
        if world > 1:
            launches[world] = rows
    else:
        if cfg.device == "cuda" and max(cfg.processes) > torch.cuda.device_count():
            raise ValueError(f"processes up to {max(cfg.processes)} but {torch.cuda.device_count()} GPU(s): "
                             "NCCL needs one GPU per rank")
        launches = {}
        for n in sorted(cfg.processes):
            if progress:
                print(f"  {n} process(es): {', '.join(cfg.models)} ...", file=sys.stderr, flush=True)
            launches[n] = launch(n, cfg)
    rows = add_efficiencies([r for n in sorted(launches) for r in launches[n]])
    return {"backend": "nccl" if cfg.device == "cuda" else "gloo", "device": cfg.device,
            "launcher": "torchrun" if under_torchrun() else "torch.multiprocessing.spawn",
            "config": asdict(cfg), "rows": rows, "summary": summarize(rows),
            "scaling_model": model_predictions(rows, cfg.device), "all_in_sync": all(r["in_sync"] for r in rows),
            "notes": notes(cfg), "seconds": time.perf_counter() - t0, "machine": describe_machine()}


def add_efficiencies(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each row's efficiency against its model's one-process row, and against its own ceiling."""
    single = {r["model"]: r["samples_per_s"] for r in rows if r["processes"] == 1}
    for r in rows:
        r["efficiency"] = r["samples_per_s"] / (r["processes"] * single[r["model"]])
        r["efficiency_vs_ceiling"] = (r["samples_per_s"] / r["ceiling_samples_per_s"]
                                      if r["ceiling_samples_per_s"] else None)
    return rows


def summarize(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """By model: samples/s and efficiency by process count."""
    out: dict[str, Any] = {}
    for r in rows:
        m = out.setdefault(r["model"], {"samples_per_s": {}, "efficiency": {}, "efficiency_vs_ceiling": {}})
        for key in m:
            m[key][str(r["processes"])] = r[key]
    return out


def model_predictions(rows: Sequence[dict[str, Any]], device: str) -> dict[str, Any]:
    """The ring all-reduce model at 8..512 GPUs from each model's one-process step and gradient bytes."""
    cluster, models = Cluster(), {}
    for r in rows:
        if r["processes"] != 1:
            continue
        step_s = r["step_ms"] / 1e3 if device == "cuda" else max(r["step_ms"] / 1e3 / CPU_TO_GPU, GPU_FLOOR_S)
        models[r["model"]] = {"gpu_step_ms": 1e3 * step_s, "grad_bytes": r["grad_bytes"],
                              "predictions": predict(step_s, r["grad_bytes"], cluster)}
    source = ("measured here (one GPU, this run)" if device == "cuda" else
              f"ASSUMED: CPU step time / {CPU_TO_GPU:g}, at least {GPU_FLOOR_S * 1e3:g} ms (no GPU was measured)")
    return {"assumptions": assumptions(cluster, source, {r["model"]: r["per_rank_batch"] for r in rows}),
            "models": models}


def notes(cfg: DDPBenchConfig) -> list[str]:
    out = []
    if cfg.device == "cpu" and max(cfg.processes) * cfg.threads > (os.cpu_count() or 1):
        out.append(f"up to {max(cfg.processes)} ranks x {cfg.threads} thread(s) on {os.cpu_count()} CPUs: ranks "
                   "share cores, so efficiency falls for want of cores, not of bandwidth")
    return out


def plot_ddp(result: dict[str, Any], path: str | Path) -> Path:
    """Samples/s by process count against ideal and ceiling; measured and modelled efficiency."""
    plt = pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.6))
    summary, model = result["summary"], result["scaling_model"]
    for k, (name, s) in enumerate(summary.items()):
        n = np.array([int(x) for x in s["samples_per_s"]])
        ax1.plot(n, list(s["samples_per_s"].values()), "o-", color=f"C{k}", label=f"{name}: DDP")
        ax1.plot(n, n * s["samples_per_s"]["1"], ":", color=f"C{k}", label=f"{name}: n x 1 process")
        ceil = [(int(x), v) for x, v in s["samples_per_s"].items() if s["efficiency_vs_ceiling"][x] is not None]
        if ceil:
            ax1.plot([x for x, _ in ceil], [v / s["efficiency_vs_ceiling"][str(x)] for x, v in ceil], "s",
                     mfc="none", color=f"C{k}", label=f"{name}: ceiling (no communication)")
        ax2.plot(n, list(s["efficiency"].values()), "o", color=f"C{k}", label=f"{name}: measured")
        m = model["models"].get(name)
        if m:
            gpus = np.array([2 ** j for j in range(0, 10)])
            eff = [efficiency(m["gpu_step_ms"] / 1e3, cluster_allreduce_seconds(int(g), m["grad_bytes"], Cluster()),
                              True) for g in gpus]
            ax2.plot(gpus, eff, "-", color=f"C{k}", alpha=0.6, label=f"{name}: ring model, overlap")
    ax1.set(yscale="log", xlabel="processes", ylabel="samples / s",
            title=f"{result['backend']} DDP on {result['device']}, per-rank batch fixed")
    assumed = ", GPU steps assumed" if "ASSUMED" in model["assumptions"]["gpu_step"] else ""
    ax2.set(xscale="log", xlabel="processes (measured) / GPUs (modelled)", ylabel="scaling efficiency",
            ylim=(0, 1.1), title=f"measured; ring model to {PREDICTED_GPUS[-1]} GPUs{assumed}")
    for ax in (ax1, ax2):
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    return save_figure(fig, path)


def write_results(result: dict[str, Any], out_dir: str | Path, stem: str = "ddp") -> tuple[Path, Path]:
    """``OUT/STEM.json`` and ``OUT/STEM.png``, each written atomically."""
    return write_results_with_plot(result, out_dir, stem, plot_ddp)


def parse_counts(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"--processes {text!r}: give comma-separated counts, e.g. 1,2,4") from None


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m converge.bench.ddp [--processes 1,2] [--models APP,...,mlp] [--device cpu|cuda] [--out DIR]``."""
    parser = argparse.ArgumentParser(prog="converge bench ddp", description=__doc__.split("\n\n")[0],
                                     epilog="Under torchrun: the ranks that exist, with rank 0 alone as the "
                                            "1-process baseline (--processes is ignored).")
    parser.add_argument("--processes", default=None, help="process counts, e.g. 1,2,4 (default 1,2 on CPU; "
                                                          "1,2,4,... up to every GPU on cuda)")
    parser.add_argument("--models", default=None, help="comma-separated, from the installed apps and mlp "
                                                      f"(default: {','.join(default_models())})")
    parser.add_argument("--device", default="cpu", help="cpu (Gloo) | cuda (NCCL)")
    parser.add_argument("--batch", type=int, default=None, help="per-rank batch (default: each app's "
                                                                   "bench_batch_size, mlp 256)")
    parser.add_argument("--precision", default=None, help="fp32 | bf16 (default: each model's own)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per measurement (median)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--out", type=Path, default=Path("."), help="where STEM.json and STEM.png go")
    parser.add_argument("--stem", default="ddp", help="file name stem, e.g. ddp_gpu")
    args = parser.parse_args(argv)
    try:
        if args.processes:
            processes = parse_counts(args.processes)
        elif args.device == "cuda" and torch.cuda.is_available():
            processes = tuple(2 ** k for k in range(8) if 2 ** k <= torch.cuda.device_count())
        else:
            processes = (1, 2)
        models = tuple(m.strip() for m in args.models.split(",")) if args.models else default_models()
        cfg = DDPBenchConfig(models=models, processes=processes,
                             device=args.device, batch=args.batch, precision=args.precision, warmup=args.warmup,
                             steps=args.steps, threads=args.threads)
        result = run_ddp_benchmark(cfg, progress=True)
    except (ValueError, RuntimeError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if result is None:  # a torchrun rank other than 0
        return 0
    return finish(result, write_results(result, args.out, args.stem), result["all_in_sync"], "REPLICAS DIVERGED")


if __name__ == "__main__":
    sys.exit(main())
