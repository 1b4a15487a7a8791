"""Data-parallel training on the CPU with Gloo, measured, and a model of it on 8 to 512 GPUs.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/scale_ddp.py           # full run (minutes on 2 cores)
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/scale_ddp.py --quick   # smoke run, written under runs/

Reference models (one training step: forward, loss, backward, gradient clip, AdamW; the apps' precisions):
- ``gw``: the gw app's DetectionCNN (default GWConfig), bf16 autocast where the CPU has bf16 units (else fp32),
  whitened-noise windows;
- ``chem``: the chem app's ANIPotential (default ChemConfig: ethanol, 160-128-96 networks), fp32, energies
  and forces (double backward), on G2 ethanol geometries displaced by 0.03 Å Gaussian noise with
  synthetic labels (labels change no timing; a DFT dataset would only cost minutes to make);
- ``mlp``: a 512-1024-512-1 GELU MLP (1.05 M parameters) on random data: little compute per
  gradient byte, the communication-bound case.

Measured, in one launch of 2 processes (per-rank batch fixed, so the global batch doubles):
samples/s in 1 process, in 2 DDP processes, and the bare ceiling (2 processes training at
once without communicating); the all-reduce share of a DDP step, both exposed
(1 - t(no_sync) / t(sync)) and busy (the time a DDP comm hook sees all-reduces in
flight, over the step time); what bucket size (1, 25, 100 MB), gradient accumulation
(1 or 4 micro-steps per synchronisation) and overlap (DDP's bucketed all-reduce during
the backward against one all-reduce after it) buy; Gloo all-reduce times over message
sizes, fitted as t = alpha + bytes / beta.

The scaling model predicts the efficiency t_compute / t_step at 8, 64 and 512 GPUs
with a hierarchical ring all-reduce (NVLink ring in a node, rings of 2(n-1)/n * bytes / bw + 2(n-1) * alpha
across nodes over InfiniBand; fp32 gradients),
in two forms: no overlap (t_step = t_compute + t_allreduce) and overlap with the
backward, taken as 2/3 of the compute (t_step = t_compute/3 + max(2 t_compute/3,
t_allreduce)). It is checked against the measured 2-process Gloo efficiency first.
Merges the keys "ddp" and "scaling_model" into benchmarks/results/scale.json and
draws benchmarks/results/scale_ddp.png.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from converge.bench.reference_training import (Case, default_models, make_case, n_params, per_rank_batch,
                                               step_seconds, train_step)
from converge.bench.scaling_model import Cluster, assumptions, cluster_allreduce_seconds, efficiency, predict
from converge.bench.server_process import free_port
from converge.data.atomic import atomic_write_bytes
from converge.train.distributed import Ranks, unused_parameters, wrap_model

RESULTS = Path(__file__).parent / "results"
CPU = torch.device("cpu")


class AllreduceClock:
    """A DDP comm hook that all-reduces (averaging) and records each bucket's (start, end) times."""

    def __init__(self) -> None:
        self.intervals: list[tuple[float, float]] = []

    def hook(self, state, bucket):  # unannotated: DDP checks the annotations, which are strings here
        t0 = time.perf_counter()
        work = dist.all_reduce(bucket.buffer().div_(dist.get_world_size()), async_op=True)

        def done(fut: torch.futures.Future) -> torch.Tensor:
            self.intervals.append((t0, time.perf_counter()))
            return fut.value()[0]

        return work.get_future().then(done)

    def busy_seconds(self) -> float:
        """Length of the union of the recorded intervals (buckets in flight together count once)."""
        total, end = 0.0, -np.inf
        for a, b in sorted(self.intervals):
            total += max(0.0, b - max(a, end))
            end = max(end, b)
        return total


def measure_model(name: str, ranks: Ranks, warmup: int, steps: int) -> dict[str, Any]:
    """Every measurement of one model; collective: both ranks call it, rank 0's numbers are returned."""
    b, world = per_rank_batch(name), ranks.world

    def fresh(ddp: bool = True, bucket_cap_mb: float = 25.0) -> tuple[nn.Module, torch.optim.Optimizer, Case]:
        case = make_case(name, b, seed=ranks.rank)
        model = case.net
        if ddp:  # as the trainer does: look for unused parameters (chem's N network) only if there are some
            find_unused = bool(unused_parameters(case.net, case.loss, case.batch))  # type: ignore[arg-type]
            model = wrap_model(case.net, ranks, CPU, shard=False, bucket_cap_mb=bucket_cap_mb, find_unused=find_unused)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-4), case

    def timed(model_opt_case: tuple, **kw: Any) -> float:
        model, opt, case = model_opt_case
        dist.barrier()
        return step_seconds(lambda: train_step(model, opt, case, **kw), warmup, steps)

    out: dict[str, Any] = {"per_rank_batch": b}
    plain = fresh(ddp=False)
    out["params"] = n_params(plain[0])
    out["grad_bytes"] = 4 * out["params"]  # fp32 gradients are what DDP all-reduces
    # one process: rank 0 alone, rank 1 waiting at the barrier meanwhile
    t_one = step_seconds(lambda: train_step(*plain), warmup, steps) if ranks.main else float("nan")
    dist.barrier()
    t_alone = timed(plain)  # both ranks at once, no communication: the bare ceiling
    ceiling = torch.tensor([b / t_alone])
    dist.all_reduce(ceiling)
    ddp = fresh()
    t_sync = timed(ddp)
    t_nosync = timed(ddp, sync=False)
    clock = AllreduceClock()
    hooked = fresh()
    hooked[0].register_comm_hook(None, clock.hook)
    for _ in range(warmup):
        train_step(*hooked)
    clock.intervals.clear()
    t0 = time.perf_counter()
    for _ in range(steps):
        train_step(*hooked)
    busy_share = clock.busy_seconds() / (time.perf_counter() - t0)
    out["step_ms"] = {"one_process": 1e3 * t_one, "alone_of_2": 1e3 * t_alone, "ddp_sync": 1e3 * t_sync,
                      "ddp_no_sync": 1e3 * t_nosync}
    out["samples_per_s"] = {"1": b / t_one if ranks.main else None, "2": world * b / t_sync,
                            "2_ceiling": float(ceiling)}
    out["allreduce_share"] = {"exposed": max(0.0, 1 - t_nosync / t_sync), "busy": busy_share}
    out["bucket_cap_mb"] = {str(mb): world * b / timed(fresh(bucket_cap_mb=float(mb))) for mb in (1, 25, 100)}
    out["grad_accum"] = {"1": world * b / t_sync,
                         "4": 4 * world * b / timed(fresh(), accum=4)}
    out["overlap"] = {"ddp_bucketed_during_backward": world * b / t_sync,
                      "one_allreduce_after_backward": world * b / timed(fresh(), allreduce_after=True)}
    return out


def allreduce_times(sizes: list[int], reps: int) -> list[float]:
    """Median seconds of a synchronous Gloo all-reduce of ``size`` bytes of float32."""
    times = []
    for size in sizes:
        x = torch.zeros(size // 4)
        for _ in range(2):
            dist.all_reduce(x)
        samples = []
        for _ in range(reps):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(x)
            samples.append(time.perf_counter() - t0)
        times.append(statistics.median(samples))
    return times


def fit_alpha_beta(sizes: list[int], seconds: list[float]) -> tuple[float, float]:
    """(alpha s, beta bytes/s) of t = alpha + bytes / beta, fitted in relative error (weights 1/t)."""
    x, y = np.asarray(sizes, float), np.asarray(seconds, float)
    slope, intercept = np.polyfit(x, y, 1, w=1 / y)
    return max(float(intercept), 0.0), 1 / max(float(slope), 1e-30)


def worker(rank: int, world: int, port: int, opts: dict, out_path: str) -> None:
    """One rank of one stage: ``models`` (each reference model's steps) or ``allreduce`` (message sizes)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    ranks = Ranks(rank, world)
    result: dict[str, Any] = {}
    if opts["stage"] == "models":
        result["models"] = {}
        for name in opts["models"]:
            result["models"][name] = measure_model(name, ranks, opts["warmup"], opts["steps"])
            if ranks.main:
                print(f"  measured {name}", flush=True)
    else:
        sizes = opts["sizes"]
        seconds = allreduce_times(sizes, opts["reps"])
        alpha, beta = fit_alpha_beta(sizes, seconds)
        result["gloo_allreduce"] = {"world": world, "sizes_bytes": sizes, "seconds": seconds, "alpha_s": alpha,
                                    "beta_bytes_per_s": beta,
                                    "bus_bandwidth_bytes_per_s": beta * 2 * (world - 1) / world}
    if ranks.main:
        Path(out_path).write_text(json.dumps(result))  # before teardown: see run_stage
    dist.barrier()
    dist.destroy_process_group()


def ddp_summary(ddp: dict) -> dict:
    """Top-level views by model: samples/s by process count and the exposed all-reduce share of a step."""
    models = ddp["models"]
    return {"samples_per_s": {name: m["samples_per_s"] for name, m in models.items()},
            "allreduce_share": {name: m["allreduce_share"]["exposed"] for name, m in models.items()}}


def run_stage(opts: dict, stage: str, tmp: str) -> dict:
    """Run one stage in 2 fresh Gloo processes and return rank 0's result.

    Tearing down after the DDP models has aborted a rank in Gloo's C++ threads
    ("terminate called without an active exception") once the results were
    written; a result on disk is complete, so that exit is reported, not fatal.
    """
    raw = Path(tmp) / f"{stage}.json"
    try:
        mp.spawn(worker, args=(2, free_port(), {**opts, "stage": stage}, str(raw)), nprocs=2, join=True)
    except mp.ProcessExitedException as err:
        if not raw.is_file():
            raise
        print(f"  ({stage}: a rank exited abnormally after the results were written: {err})", flush=True)
    return json.loads(raw.read_text())


# -- the scaling model ---------------------------------------------------------------------------------


def scaling_model(measured: dict, gpu_step_s: dict[str, float], gpu_source: str, cluster: Cluster,
                  sizes: tuple[int, ...] = (8, 64, 512)) -> dict[str, Any]:
    gloo = measured["gloo_allreduce"]
    models = {}
    for name, m in measured["models"].items():
        t_cpu = m["step_ms"]["one_process"] / 1e3
        t_gloo = gloo["alpha_s"] + m["grad_bytes"] / gloo["beta_bytes_per_s"]  # the fit itself, at 2 processes
        models[name] = {
            "grad_bytes": m["grad_bytes"], "gpu_step_ms": 1e3 * gpu_step_s[name], "gpu_step_source": gpu_source,
            "predictions": predict(gpu_step_s[name], m["grad_bytes"], cluster, sizes),
            # the model on what was measured here: CPU step time and the fitted Gloo all-reduce
            "cpu_gloo_check_2_processes": {
                "predicted_efficiency_no_overlap": efficiency(t_cpu, t_gloo, False),
                "predicted_efficiency_overlap": efficiency(t_cpu, t_gloo, True),
                "measured_efficiency_vs_1_process": m["samples_per_s"]["2"] / (2 * m["samples_per_s"]["1"]),
                "measured_efficiency_vs_ceiling": m["samples_per_s"]["2"] / m["samples_per_s"]["2_ceiling"]},
        }
    return {"assumptions": assumptions(cluster, gpu_source, PER_RANK_BATCH),
            "models": models}


def print_tables(ddp: dict, model: dict) -> None:
    print(f"\n{'model':6} {'params':>9} {'1 proc/s':>9} {'2 DDP/s':>9} {'ceiling/s':>9} {'exposed':>8} "
          f"{'busy':>6}  bucket 1/25/100 MB /s    accum 4 /s  no-overlap /s")
    for name, m in ddp["models"].items():
        s, share = m["samples_per_s"], m["allreduce_share"]
        buckets = "/".join(f"{v:.0f}" for v in m["bucket_cap_mb"].values())
        print(f"{name:6} {m['params']:>9} {s['1']:>9.0f} {s['2']:>9.0f} {s['2_ceiling']:>9.0f} "
              f"{share['exposed']:>8.1%} {share['busy']:>6.1%}  {buckets:22} {m['grad_accum']['4']:>11.0f} "
              f"{m['overlap']['one_allreduce_after_backward']:>14.0f}")
    g = ddp["gloo_allreduce"]
    print(f"\nGloo all-reduce, 2 processes: alpha {g['alpha_s'] * 1e6:.0f} us, "
          f"beta {g['beta_bytes_per_s'] / 1e9:.2f} GB/s (bus {g['bus_bandwidth_bytes_per_s'] / 1e9:.2f} GB/s)")
    print(f"\nscaling model ({model['assumptions']['gpu_step']}):")
    header = " ".join(f"{n + ' GPUs: all-reduce ms, eff.':>34}" for n in ("8", "64", "512"))
    print(f"{'model':6} {'GPU step ms':>11} {header}\n{'':19}" + " (no overlap / overlap)".rjust(34) * 3)
    for name, m in model["models"].items():
        cells = " ".join(f"{p['allreduce_ms']:.3f} ms, {p['efficiency_no_overlap']:.1%} / {p['efficiency_overlap']:.1%}"
                         .rjust(34) for p in m["predictions"].values())
        print(f"{name:6} {m['gpu_step_ms']:>11.2f} {cells}")
    print("\nthe model on the 2 measured CPU processes (predicted no overlap / overlap vs measured):")
    for name, m in model["models"].items():
        c = m["cpu_gloo_check_2_processes"]
        print(f"  {name:6} {c['predicted_efficiency_no_overlap']:.1%} / {c['predicted_efficiency_overlap']:.1%} vs "
              f"{c['measured_efficiency_vs_1_process']:.1%} of 2 x 1 process, "
              f"{c['measured_efficiency_vs_ceiling']:.1%} of the ceiling")


def plot(ddp: dict, model: dict, cluster: Cluster, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    g = ddp["gloo_allreduce"]
    sizes = np.asarray(g["sizes_bytes"], float)
    ax1.loglog(sizes, np.asarray(g["seconds"]) * 1e3, "o", label="measured")
    fine = np.geomspace(sizes.min(), sizes.max(), 100)
    ax1.loglog(fine, (g["alpha_s"] + fine / g["beta_bytes_per_s"]) * 1e3, "-",
               label=f"alpha {g['alpha_s'] * 1e6:.0f} us + bytes / {g['beta_bytes_per_s'] / 1e9:.2f} GB/s")
    ax1.set(xlabel="message (bytes)", ylabel="all-reduce (ms)", title="Gloo all-reduce, 2 CPU processes")
    ax1.legend(fontsize=8)
    ns = np.array([2 ** k for k in range(1, 10)])
    for i, (name, m) in enumerate(model["models"].items()):
        t_c = m["gpu_step_ms"] / 1e3
        for overlap, style in ((True, "-"), (False, "--")):
            eff = [efficiency(t_c, cluster_allreduce_seconds(int(n), m["grad_bytes"], cluster), overlap) for n in ns]
            ax2.semilogx(ns, eff, style, color=f"C{i}", label=f"{name} ({'overlap' if overlap else 'no overlap'})")
    ax2.axvline(cluster.gpus_per_node, color="grey", lw=0.8)
    assumed = " (GPU step times assumed)" if "ASSUMED" in model["assumptions"]["gpu_step"] else ""
    ax2.set(xlabel="GPUs", ylabel="scaling efficiency", ylim=(0, 1.05), title="ring all-reduce model" + assumed)
    ax2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def parse_gpu_steps(text: str | None) -> dict[str, float]:
    """``gw=1.5,chem=4`` (ms) -> seconds by model."""
    if not text:
        return {}
    pairs = (item.split("=") for item in text.split(","))
    return {k.strip(): float(v) / 1e3 for k, v in pairs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a smoke run (seconds of timing); results under runs/")
    ap.add_argument("--out", type=Path,
                    help="results folder (default benchmarks/results; with --quick runs/scale_ddp_quick)")
    ap.add_argument("--models", default=",".join(default_models()), help="comma-separated: installed apps and mlp")
    ap.add_argument("--gpu-step-ms", help="measured GPU step times at the same per-GPU batch, e.g. gw=1.2,chem=5")
    ap.add_argument("--cpu-to-gpu", type=float, default=50.0,
                    help="otherwise: GPU step time = CPU step time / this factor (an assumption) ...")
    ap.add_argument("--gpu-floor-ms", type=float, default=1.0,
                    help="... but no less than this (kernel launches bound a small model's step on a GPU)")
    args = ap.parse_args()
    out_dir = args.out or (Path("runs/scale_ddp_quick") if args.quick else RESULTS)
    out_dir.mkdir(parents=True, exist_ok=True)
    opts = {"models": [m.strip() for m in args.models.split(",")],
            "warmup": 1 if args.quick else 3, "steps": 3 if args.quick else 20, "reps": 3 if args.quick else 20,
            "sizes": [2 ** k for k in ((10, 16, 20, 22) if args.quick else range(10, 27, 2))]}
    with tempfile.TemporaryDirectory() as tmp:
        print(f"measuring {', '.join(opts['models'])} in 2 Gloo processes ...", flush=True)
        ddp = {**run_stage(opts, "models", tmp), **run_stage(opts, "allreduce", tmp)}
    ddp.update(ddp_summary(ddp))
    ddp["host"] = {"cpus": os.cpu_count(), "threads_per_process": 1, "torch": torch.__version__,
                   "load_average_1min": os.getloadavg()[0]}
    given = parse_gpu_steps(args.gpu_step_ms)
    gpu_step = {name: given.get(name, max(m["step_ms"]["one_process"] / 1e3 / args.cpu_to_gpu,
                                          args.gpu_floor_ms / 1e3)) for name, m in ddp["models"].items()}
    source = ("measured on a GPU (--gpu-step-ms) where given; " if given else "") + (
        f"ASSUMED for the others: CPU step time / {args.cpu_to_gpu:g}, at least {args.gpu_floor_ms:g} ms "
        "(a few dozen kernel launches; no GPU was measured)")
    cluster = Cluster()
    model = scaling_model(ddp, gpu_step, source, cluster)
    print_tables(ddp, model)
    plot(ddp, model, cluster, out_dir / "scale_ddp.png")
    path = out_dir / "scale.json"
    merged = json.loads(path.read_text()) if path.is_file() else {}
    merged.update({"ddp": ddp, "scaling_model": model})
    atomic_write_bytes(path, (json.dumps(merged, indent=2) + "\n").encode())
    print(f"\nwritten {path} (keys ddp, scaling_model) and {out_dir / 'scale_ddp.png'}")


if __name__ == "__main__":
    main()
