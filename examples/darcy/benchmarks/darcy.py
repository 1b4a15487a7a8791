"""The darcy benchmark: FNO against the fastest sparse solver at 64 x 64, with a 128 x 128 speed table.

    OMP_NUM_THREADS=1 nohup .venv/bin/python examples/darcy/benchmarks/darcy.py > runs/darcy-bench.log 2>&1 &

Stages, through converge's Python API as a user would call them (each resumes:
datasets by design, training from ``last.pt``, finished stages from their files):

1. ``run_ensemble``: 2000 training solves (seed 1) and 200 test solves (seed 2) at
   64 x 64, and 100 at 128 x 128 (seed 3); sample i of a set draws from
   ``default_rng([seed, i])``, and the permeability seeds are checked to be disjoint;
2. ``train`` with ``examples/darcy/darcy.toml``'s [app] and [train] tables, the
   settings ``converge train darcy --config examples/darcy/darcy.toml`` uses;
3. ``app.evaluate`` on the 64 x 64 test set: relative L2 error of u and, on 16 test
   fields, seconds per field of the sparse LU and both AMG solvers (assembly and
   setup counted) and of the FNO (one field per call, and batches of 16), each the best of 3;
4. the same timings at 128 x 128 with the same model (an FNO runs at any resolution),
   and its zero-shot error there (trained at 64 only).

Everything runs in this one process with ``torch.set_num_threads(1)`` and
``OMP_NUM_THREADS=1`` (the solvers are single-threaded). Writes
``benchmarks/results/darcy.json`` and ``darcy.png`` of the repository.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np
import torch

from converge.bench.artifacts import pyplot, save_figure, write_json
from converge.bench.machine import describe_machine
from converge.config import load_section, read_toml, to_dict
from converge.data.store import ShardStore
from converge.simulate.runner import SimulateConfig, run_ensemble
from converge.train.loop import TrainConfig, load_model, train
from converge_darcy import DarcyApp, DarcyConfig, DarcyEvalConfig
from converge_darcy.evaluate import error_statistics, predict_fields
from converge_darcy.timing import speed_entry, time_classical, time_fno

HERE = Path(__file__).resolve().parent
CONFIG = HERE.parent / "darcy.toml"
RESULTS = HERE.parents[2] / "benchmarks" / "results"
TARGET = 0.02  # relative L2 error of u the benchmark aims at
ANCHOR = "FNO on Darcy flow, 85x85, 1000 training fields: relative L2 1.08% (Li et al., ICLR 2021, table 1)"
TRAIN_SEED, TEST_SEED, TEST128_SEED = 1, 2, 3


def simulate(app: DarcyApp, cfg: DarcyConfig, n: int, seed: int, out: Path, workers: int) -> ShardStore:
    result = run_ensemble(app, cfg, SimulateConfig(samples=n, seed=seed, workers=workers, shard_size=250), out,
                          progress=False)
    if result.n_failed:
        raise RuntimeError(f"{result.n_failed} solves failed in {out}: {result.failures[:3]}")
    return ShardStore.open(out)


def shared_seeds(*stores: ShardStore) -> int:
    """How many permeability seeds occur in more than one of ``stores`` (0: the sets are disjoint)."""
    seeds = [set(s.params()["permeability_seed"].tolist()) for s in stores]
    return sum(len(a & b) for i, a in enumerate(seeds) for b in seeds[i + 1 :])


def stage_seconds(out: Path, name: str, seconds: float | None = None, redone: bool = False) -> float:
    """Wall seconds of a stage, kept in ``out``: summed over the runs of this script that worked on it (a resumed
    simulation or training), or those of the latest run for a stage every run does afresh (``redone``)."""
    path = out / "stage_seconds.json"
    found = json.loads(path.read_text()) if path.is_file() else {}
    if seconds is not None:
        found[name] = (0.0 if redone else found.get(name, 0.0)) + seconds
        write_json(path, found)
    return found.get(name, 0.0)


def plot(result: dict, history: list[dict], path: Path) -> Path:
    """Left: validation error against epochs. Right: milliseconds per field of each method, 64 and 128 nodes."""
    plt = pyplot()
    fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(12, 4.2))
    ax0.plot([h["epoch"] + 1 for h in history], [100 * h["relative_l2"] for h in history], "o-", ms=3)
    ax0.axhline(100 * result["relative_l2"], color="tab:green", ls="--",
                label=f"test, best epoch: {result['relative_l2']:.2%}")
    ax0.axhline(100 * TARGET, color="tab:red", ls=":", label=f"target {TARGET:.0%}")
    ax0.set(xlabel="epoch", ylabel="validation relative L2 of u [%]", yscale="log",
            title=f"FNO on {result['n_train_solves']} solves, {result['resolution']}x{result['resolution']}")
    ax0.grid(alpha=0.3, which="both")
    ax0.legend()
    methods = ("direct", "amg_ruge_stuben", "amg_smoothed_aggregation", "fno_single", "fno_batched")
    labels = ("sparse LU", "AMG RS + CG", "AMG SA + CG", "FNO, 1 field", f"FNO, batch {result['fno_batch']}")
    width = 0.38
    for j, (res, entry) in enumerate(result["speed_table"].items()):
        ms = [1e3 * entry["seconds_per_field"][m] for m in methods]
        ax1.barh(np.arange(len(methods)) + (j - 0.5) * width, ms, height=width, label=f"{res}x{res} nodes")
    ax1.set_yticks(np.arange(len(methods)), labels)
    ax1.invert_yaxis()
    ax1.set(xscale="log", xlabel="milliseconds per field (1 thread, setup counted)",
            title=f"speed-up over the fastest solver at {result['resolution']}: "
                  f"{result['speedup']['single']:.2g}x single, {result['speedup']['batched']:.2g}x batched")
    ax1.title.set_fontsize(10)
    ax1.grid(alpha=0.3, axis="x", which="both")
    ax1.legend()
    fig.tight_layout()
    return save_figure(fig, path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("runs/darcy-bench"), help="cache of datasets and the run")
    ap.add_argument("--train", type=int, default=2000, help="training solves (train + validation)")
    ap.add_argument("--test", type=int, default=200, help="test solves at the training resolution")
    ap.add_argument("--test128", type=int, default=100, help="solves at 128 x 128 (timing and zero-shot error)")
    ap.add_argument("--timing-fields", type=int, default=16, help="fields each classical solver is timed on")
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--config", type=Path, default=CONFIG, help="[app] and [train] tables (smoke tests: a tiny one)")
    ap.add_argument("--results-dir", type=Path, default=RESULTS, help="where darcy.json and darcy.png go")
    args = ap.parse_args()
    torch.set_num_threads(1)
    app, out = DarcyApp(), args.out
    out.mkdir(parents=True, exist_ok=True)
    tables = read_toml(args.config)
    cfg = load_section(DarcyConfig, tables, "app")
    tcfg = load_section(TrainConfig, tables, "train")
    cfg128 = DarcyConfig(**{**to_dict(cfg), "resolution": 128})

    t0 = time.perf_counter()
    train_store = simulate(app, cfg, args.train, TRAIN_SEED, out / "train", args.workers)
    test_store = simulate(app, cfg, args.test, TEST_SEED, out / "test", args.workers)
    test128 = simulate(app, cfg128, args.test128, TEST128_SEED, out / "test128", args.workers)
    stage_seconds(out, "simulate", time.perf_counter() - t0)
    overlap = shared_seeds(train_store, test_store, test128)
    if overlap:
        raise RuntimeError(f"{overlap} permeability seeds are shared between the training and test sets")

    run = out / "run"
    done = run / "train_result.json"
    if not done.is_file():
        t0 = time.perf_counter()
        result = train(app, cfg, tcfg, train_store.load(), run, resume=(run / "last.pt").is_file(), progress=False,
                       extra_config={"data": str(out / "train")})
        stage_seconds(out, "train", time.perf_counter() - t0)
        write_json(done, {"best_epoch": result.best_epoch, "best_value": result.best_value,
                          "epochs": len(result.history), "stopped_early": result.stopped_early})
    trained = json.loads(done.read_text())
    history = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line]

    load_before = os.getloadavg()  # other work on the machine disturbs the timings: recorded with them
    t0 = time.perf_counter()
    ev = DarcyEvalConfig(timing_fields=args.timing_fields, min_time_s=2.0)
    report = app.evaluate(run, out / "test", out / "evaluation", ev=ev)
    stage_seconds(out, "evaluate", time.perf_counter() - t0, redone=True)

    t0 = time.perf_counter()
    model, _ = load_model(app, run)
    k128 = test128.load(["permeability", "pressure"])
    speed128 = speed_entry(time_classical(cfg128, k128["permeability"][: args.timing_fields], ev.repeats),
                           time_fno(app, model, k128["permeability"], ev.batch_size, ev.min_time_s, ev.repeats))
    zero_shot = error_statistics(predict_fields(app, model, k128["permeability"]), k128["pressure"])
    stage_seconds(out, "speed_table_128", time.perf_counter() - t0, redone=True)
    load_after = os.getloadavg()

    keys64 = ("seconds_per_field", "fno_batch", "fastest_classical", "speedup")
    walls = {k: stage_seconds(out, k) for k in ("simulate", "train", "evaluate", "speed_table_128")}
    result = {
        "relative_l2": report["relative_l2"], "relative_l2_median": report["relative_l2_median"],
        "relative_l2_p90": report["relative_l2_p90"], "relative_l2_max": report["relative_l2_max"],
        "target": TARGET, "target_met": report["relative_l2"] <= TARGET, "anchor": ANCHOR,
        "n_train_solves": train_store.n_samples - len(train_store.failures()), "n_train": report["n_train"],
        "n_test": report["n_test"], "resolution": cfg.resolution, "seeds": {"train": TRAIN_SEED, "test": TEST_SEED,
                                                                            "test128": TEST128_SEED},
        "shared_permeability_seeds": overlap,
        **{k: report[k] for k in keys64},
        "speed_table": {str(cfg.resolution): {k: report[k] for k in keys64}, "128": speed128},
        "zero_shot_128": {**zero_shot, "n": int(len(k128["pressure"])),
                          "note": "the 64x64-trained FNO applied to 128x128 fields without retraining"},
        "train": {**to_dict(tcfg), **trained, "config_file": str(args.config),
                  "overrides_of_converge_defaults": {k: v for k, v in to_dict(tcfg).items()
                                                     if v != to_dict(TrainConfig())[k]}},
        "app_config": to_dict(cfg), "threads": torch.get_num_threads(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "timing": report["timing"],
        "load_average_1_5_15_min": {"before_timing": list(load_before), "after_timing": list(load_after),
                                    "cpus": os.cpu_count()},
        "wall_seconds": {**walls, "total": sum(walls.values())}, "machine": describe_machine(),
    }
    result["summary"] = {k: result[k] for k in ("relative_l2", "n_train_solves", "speedup", "target_met")}
    write_json(args.results_dir / "darcy.json", result)
    plot(result, history, args.results_dir / "darcy.png")
    print(json.dumps({**result["summary"], "wall_seconds": result["wall_seconds"],
                      "speed_ms": {r: {m: round(1e3 * s, 3) for m, s in e["seconds_per_field"].items()}
                                   for r, e in result["speed_table"].items()}}, indent=2))


if __name__ == "__main__":
    main()
