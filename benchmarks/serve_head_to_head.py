"""Ours against Triton, side by side only: the head to head of `benchmarks/serve.py` on its own, in minutes.

    make peers    # Triton's environment, once
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/serve_head_to_head.py --gw runs/peer-bench/run \
        --chem runs/chem-serve/run

The full serve bench sweeps every set-up of ours and of each peer (about an hour per
app on two cores) and ends with a head to head against Triton (`bench/head_to_head.py`).
This runs that last part alone, at the settings the full bench chose for each app
(`serve.json`, `<app>.head_to_head`: ours, and Triton's best), or at the ones given:
both servers up, the load generator alternating between them at 32, 64 and 128
clients, the order reversed every round. Each round's gain is our best throughput at
a p99 no worse than Triton's best, over Triton's best; the median over rounds is the
figure. Each server's CPU per sample is split into its front end (its own process:
HTTP, batching, answering) and its model workers (our model processes, Triton's
Python backend stubs), which says where the two differ. Triton's answers are checked equal
to ours by the full bench, not again here.

Writes ``benchmarks/results/serve_head_to_head.json`` (per app, with the machine);
apps not measured keep their entries.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

RESULTS = Path(__file__).parent / "results"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gw", type=Path, help="a trained gw run folder")
    parser.add_argument("--chem", type=Path, help="a trained chem run folder")
    parser.add_argument("--rounds", type=int, default=4, help="rounds of 32, 64 and 128 clients, each server in turn")
    parser.add_argument("--duration", type=float, default=4.0, help="measured seconds per window")
    parser.add_argument("--warmup", type=float, default=1.0, help="seconds before each measured window")
    parser.add_argument("--settings-from", type=Path, default=RESULTS / "serve.json",
                        help="the serve.json whose head-to-head settings are used for each app")
    parser.add_argument("--ours", default="", help="our set-up instead, as a serve bench mode name: batched, "
                        "batched_1ms, batched_2_instances or batched_2_instances_1ms")
    parser.add_argument("--triton", default="", help="Triton's settings instead, as BATCH:DELAY_MS:INSTANCES, "
                        "e.g. 128:1:2")
    parser.add_argument("--out", type=Path, default=RESULTS, help="where serve_head_to_head.json goes")
    args = parser.parse_args()
    runs = {label: run for label, run in (("gw", args.gw), ("chem", args.chem)) if run is not None}
    if not runs:
        parser.error("give --gw RUN and/or --chem RUN")

    import torch

    from converge.bench.head_to_head import duel_alone
    from converge.bench.machine import describe_machine

    torch.set_num_threads(int(os.environ.setdefault("OMP_NUM_THREADS", "1")))
    chosen = json.loads(args.settings_from.read_text()) if args.settings_from.is_file() else {}
    path = args.out / "serve_head_to_head.json"
    for label, run in runs.items():
        before = chosen.get(label, {}).get("head_to_head", {})
        ours = args.ours or before.get("ours_settings", {}).get("mode")
        triton = args.triton or before.get("peer_settings")
        if not ours or not triton:
            parser.error(f"{label}: {args.settings_from} holds no head to head to take settings from; "
                         "give --ours and --triton")
        print(f"{label}: {run}, ours {ours}, Triton {triton}", file=sys.stderr)
        with tempfile.TemporaryDirectory() as logs:
            report = duel_alone(run, ours, triton, args.rounds, args.duration, args.warmup, Path(logs))
        report["machine"] = describe_machine()
        kept = json.loads(path.read_text()) if path.is_file() else {}
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({**kept, label: report}, indent=2))
        print(json.dumps({label: {k: report[k] for k in ("gain_per_round", "gain_median", "throughput_best_median",
                                                          "cpu_split")}}, indent=2))
        print(f"written {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
