"""Full-size gw run: CNN against matched filtering at FAP 1e-3, with timings.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/gw_full.py --out runs/gw-full

Simulates the training and test sets, trains the CNN (fresh noise each epoch,
SNR curriculum), evaluates it beside the matched-filter bank on >= 100k noise
windows, and writes ``benchmarks/results/gw.json`` (the evaluation keys plus
how long each stage took) and the plots beside it. Every step resumes, so an
interrupted run picks up where it stopped.
"""
from __future__ import annotations

import argparse
import json
import platform
import shutil
import time
from pathlib import Path

import torch

from converge.apps.gw.app import GWApp
from converge.apps.gw.config import GWConfig
from converge.apps.gw.evaluate import GWEvalConfig, fill_matched_filter_cache
from converge.data.store import ShardStore
from converge.simulate.runner import SimulateConfig, run_ensemble
from converge.train.loop import TrainConfig, train

RESULTS = Path(__file__).parent / "results"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("runs/gw-full"))
    ap.add_argument("--train-samples", type=int, default=60_000)
    ap.add_argument("--test-samples", type=int, default=2_000)
    ap.add_argument("--epochs", type=int, default=14)
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--channels", type=int, nargs=3, default=(16, 32, 64))
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--n-noise", type=int, default=100_000)
    ap.add_argument("--n-per-snr", type=int, default=500)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="torch threads for training (evaluation uses 1)")
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--signal-fraction", type=float, default=0.4)
    ap.add_argument("--snr-range", type=float, nargs=2, default=(5.0, 15.0), help="training SNR range")
    ap.add_argument("--stop-after-training", action="store_true", help="simulate and train only")
    ap.add_argument("--matched-filter-only", action="store_true",
                    help="simulate and cache the matched-filter scores of the test set (run beside training)")
    args = ap.parse_args()

    app = GWApp()
    data_cfg = GWConfig()  # the physics; the training-time settings below do not change the ensembles
    cfg = GWConfig(channels=tuple(args.channels), hidden=args.hidden, signal_fraction=args.signal_fraction,
                   snr_min=args.snr_range[0], snr_max=args.snr_range[1])
    ev = GWEvalConfig(n_noise=args.n_noise, n_per_snr=args.n_per_snr, batch_size=512)
    stages: dict[str, float] = {}
    t = time.perf_counter()
    for name, n, seed in (("train", args.train_samples, 101), ("test", args.test_samples, 202)):
        run_ensemble(app, data_cfg, SimulateConfig(samples=n, seed=seed, workers=args.workers, shard_size=1000),
                     args.out / "data" / name)
    stages["simulate_s"] = time.perf_counter() - t
    if args.matched_filter_only:
        torch.set_num_threads(1)
        print(fill_matched_filter_cache(cfg, args.out / "data" / "test", ev))
        return

    torch.set_num_threads(args.threads)
    t = time.perf_counter()
    arrays = ShardStore.open(args.out / "data" / "train").load()
    tcfg = TrainConfig(epochs=args.epochs, batch_size=args.batch_size, lr=args.lr, patience=args.epochs)
    res = train(app, cfg, tcfg, arrays, args.out / "run", resume=args.resume and (args.out / "run" / "last.pt").exists())
    stages["train_s"] = time.perf_counter() - t
    if args.stop_after_training:
        return

    torch.set_num_threads(1)  # the CNN and the matched filter are timed on one thread each
    t = time.perf_counter()
    report = app.evaluate(args.out / "run", args.out / "data" / "test", args.out / "run", ev=ev)
    stages["evaluate_s"] = time.perf_counter() - t

    report.update({
        "training": {"samples_seen": res.samples_seen, "epochs": len(res.history), "best_epoch": res.best_epoch,
                     "train_samples": args.train_samples, "seconds": res.seconds, "threads": args.threads,
                     "history": res.history},
        "stages": stages, "machine": {"cpu": platform.processor() or platform.machine(),
                                      "python": platform.python_version(), "torch": torch.__version__},
    })
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "gw.json").write_text(json.dumps(report, indent=2))
    for name in ("efficiency.png", "roc.png"):
        shutil.copy(args.out / "run" / name, RESULTS / f"gw_{name}")
    print(json.dumps(app.summary(report), indent=2))
    print(json.dumps(stages, indent=2))


if __name__ == "__main__":
    main()
