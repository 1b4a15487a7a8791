"""The platform benchmarks at their full configurations, then the report page.

    .venv/bin/python benchmarks/platform_benchmarks.py                      # all of them, ~6 min on 2 cores
    .venv/bin/python benchmarks/platform_benchmarks.py --only gemm,report
    .venv/bin/python benchmarks/platform_benchmarks.py --quick --out /tmp/x  # a seconds-long check

Writes into ``benchmarks/results/``: ``gemm.{json,png}`` (1 thread, 512..8192,
fp64/fp32/bf16/fp16, 100 s budget), ``allreduce.{json,png}`` (2 Gloo ranks, 8 B ..
256 MiB), ``ddp.{json,png}`` (gw, chem and MLP training on 1 and 2 Gloo ranks, the
ring model to 512 GPUs), ``surrogate.{json,png}`` (the trained runs under ``runs/`` when they
exist, else untrained networks, flagged), then ``report.html`` gathering every
result there, and ``report.png`` when Chromium is installed. The numbers are wall
times: run it on a quiet machine. GPU numbers come from ``benchmarks/gpu_check.sh``.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from converge.bench import collectives, ddp, gemm, report, surrogate

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
DEFAULT_RUNS = {"gw": ROOT / "runs" / "gw-full" / "run", "chem": ROOT / "runs" / "chem-full" / "ethanol" / "run"}
STEPS = ("gemm", "allreduce", "ddp", "surrogate", "report")


def run_or_default(given: str | None, app: str) -> str | None:
    """``given`` ("none" for an untrained network), else the default run when it holds a checkpoint."""
    if given is not None:
        return None if given == "none" else given
    return str(DEFAULT_RUNS[app]) if (DEFAULT_RUNS[app] / "best.pt").is_file() else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default=",".join(STEPS), help="steps, from gemm,allreduce,ddp,surrogate,report")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of gemm and surrogate")
    parser.add_argument("--gw-run", default=None, help=f"default {DEFAULT_RUNS['gw']} if trained; 'none': untrained")
    parser.add_argument("--chem-run", default=None, help=f"default {DEFAULT_RUNS['chem']} if trained")
    parser.add_argument("--quick", action="store_true", help="the small test configurations (not into results/)")
    args = parser.parse_args()
    steps = [s.strip() for s in args.only.split(",")]
    if set(steps) - set(STEPS):
        parser.error(f"--only {args.only}: choose from {','.join(STEPS)}")
    if args.quick and args.out.resolve() == RESULTS:
        parser.error("--quick results do not belong in benchmarks/results: give --out elsewhere")
    torch.set_num_threads(args.threads)
    if "gemm" in steps:
        result = gemm.run_gemm_benchmark(gemm.GemmConfig.quick() if args.quick else gemm.GemmConfig())
        print(json.dumps(result["summary"], indent=2), *result["notes"], sep="\n")
        print("written", *gemm.write_results(result, args.out))
    if "allreduce" in steps:
        cfg = collectives.CollectivesConfig.quick() if args.quick else collectives.CollectivesConfig()
        result = collectives.run_collectives_benchmark(cfg)
        print(json.dumps(result["summary"], indent=2))
        print("written", *collectives.write_results(result, args.out))
    if "ddp" in steps:
        cfg = ddp.DDPBenchConfig.quick() if args.quick else ddp.DDPBenchConfig()
        result = ddp.run_ddp_benchmark(cfg, progress=True)
        print(json.dumps(result["summary"], indent=2), *result["notes"], sep="\n")
        print("written", *ddp.write_results(result, args.out))
    if "surrogate" in steps:
        runs = tuple((app, run) for app, run in (("gw", run_or_default(args.gw_run, "gw")),
                                                 ("chem", run_or_default(args.chem_run, "chem"))) if run)
        options = dict(apps=("gw", "chem"), runs=runs, results_dir=str(RESULTS))
        cfg = surrogate.SurrogateBenchConfig.fast(app_overrides=(("chem", "molecule", "water"),), **options) \
            if args.quick else surrogate.SurrogateBenchConfig(**options)
        result = surrogate.run_surrogate_benchmark(cfg)
        print(json.dumps(surrogate.headline(result), indent=2))
        print("written", *surrogate.write_results(result, args.out))
    if "report" in steps:
        info = report.write_report(args.out, args.out / "report.html")
        print("written", info.path, "; not measured yet:", [k for k, files in info.files.items() if not files])
        try:
            print("written", report.render_png(info.path, args.out / "report.png"))
        except FileNotFoundError as err:
            print(f"no report.png: {err}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
