"""Serving throughput and latency of trained runs: the model alone, `converge serve`, and Triton, MLServer, LitServe.

    make peers    # the peers' environments, once
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/serve.py --gw runs/gw-full/run --chem runs/chem-full/ethanol/run \
        --peers triton,mlserver,litserve

Trains nothing: give run folders of `converge train`. For each, measures the
model's own throughput (batch 1 and its best batch, no server), then sweeps
`converge serve` with dynamic batching on (max_batch_size 64, no queue delay;
one model process, and two: ``--instances 2``) and off (max_batch_size 1) over
client concurrency, JSON and binary tensors, with the load generator in its
own process (its CPU share is reported, to show it is not the bottleneck).
Writes ``benchmarks/results/serve.json`` and ``serve.png`` (throughput against
p99 latency); apps not measured in this run keep their entries unless ``--replace``.

With ``--peers triton,mlserver,litserve`` the same run also serves the same model
with Triton (dynamic batching, Python backend, binary tensors), MLServer (adaptive
batching, JSON) and LitServe (batching, JSON), each calling our
``load_served_model(run).predict`` from its own virtual environment
(``runs/peer-envs/<peer>``, made on first use or by ``make peers``), each swept
over a grid of its own settings and its best confirmed by a second sweep, its
answers checked against our model's. Each app's report gains ``peers`` (their
sweeps, best settings and bests, with ours beside each at a p99 no worse) and
``gain_vs_peer_at_equal_p99`` against the hardest one. Targets: 1.0x Triton,
1.3x the others.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

RESULTS = Path(__file__).parent / "results"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gw", type=Path, help="a trained gw run folder")
    parser.add_argument("--chem", type=Path, help="a trained chem run folder")
    parser.add_argument("--duration", type=float, default=5.0, help="measured seconds per concurrency level")
    parser.add_argument("--warmup", type=float, default=1.0, help="seconds before each measured window")
    parser.add_argument("--concurrency", default="1,2,4,8,16,32,64,128", help="client counts")
    parser.add_argument("--formats", default="binary,json", help="binary, json or both")
    parser.add_argument("--max-batch-size", type=int, default=64, help="of the batched server")
    parser.add_argument("--out", type=Path, default=RESULTS, help="where serve.json and serve.png go")
    parser.add_argument("--peers", default="", help="also triton (binary), mlserver and litserve (JSON)")
    parser.add_argument("--peer-grid", default="", help='the peers\' settings to sweep, e.g. "triton.workers=1,2" '
                        "(default: each peer's grid around --max-batch-size)")
    parser.add_argument("--replace", action="store_true", help="write only the apps measured now (default: an "
                        "existing serve.json keeps the entries of apps not measured in this run)")
    args = parser.parse_args()
    runs = {label: run for label, run in (("gw", args.gw), ("chem", args.chem)) if run is not None}
    if not runs:
        parser.error("give --gw RUN and/or --chem RUN")

    import torch

    from converge.bench.serve import ServeBenchConfig, headline, run_serve_benchmark, write_results

    torch.set_num_threads(int(os.environ.setdefault("OMP_NUM_THREADS", "1")))
    cfg = ServeBenchConfig.from_options(args.concurrency, args.duration, args.warmup, args.formats,
                                        args.max_batch_size, peers=args.peers, peer_grid=args.peer_grid)
    reports = {}
    for label, run in runs.items():
        print(f"{label}: {run}", file=sys.stderr)
        reports[label] = run_serve_benchmark(run, cfg)
        print(json.dumps({label: headline(reports[label])}, indent=2))
        # written after each app, so that an app that fails later loses nothing measured before it
        previous = args.out / "serve.json"
        kept = json.loads(previous.read_text()) if not args.replace and previous.is_file() else {}
        json_path, png_path = write_results({**{k: v for k, v in kept.items() if k not in reports}, **reports},
                                            args.out)
        print(f"written {json_path} and {png_path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
