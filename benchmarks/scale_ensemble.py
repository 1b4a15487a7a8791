"""Ensemble throughput of the local pool and Dask, against bare processes, on real DFT.

    .venv/bin/python benchmarks/scale_ensemble.py           # full: about 5 minutes on 2 idle vCPUs
    .venv/bin/python benchmarks/scale_ensemble.py --quick   # smoke run; writes nothing unless --out

The simulator is the chem app's DFT at the ``fast`` level (B3LYP/6-31G*, density
fitting, grid 1) on one normal-mode conformer of ``--molecule`` per sample
(ethanol: about a second on one core). Every configuration runs the same samples
(seed 0, indices 0..N-1), one thread per process:

- bare: 1 and 2 independent processes calling ``ChemApp.simulate`` in a loop with
  nothing around them. Two of them are this machine's ceiling for 2 workers: its
  cores slow each other (shared caches, memory bandwidth, clocks), so 2x is not;
- local and dask: 1 and 2 workers through the executor interface
  (:func:`converge.simulate.executors.run_samples`; a fresh pool or LocalCluster each).

Throughputs are steady state: the samples done after the first round, over the
time they took, which leaves out start-up (pool or cluster, imports, the
molecule's normal modes); wall times, start-up included, are reported beside.
``overhead_ms_per_task`` is worker time per task not spent simulating, from
trivial tasks on 2 workers: throughput ~= workers / (seconds per sample + overhead).
``overhead_ms_per_task_dft`` is the same read off the DFT runs (against two bare
processes). Results go under "ensemble" in benchmarks/results/scale.json (other
keys are kept); run it on an otherwise idle machine.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from importlib.metadata import version
from pathlib import Path
from typing import Any

import numpy as np

RESULTS = Path(__file__).parent / "results"
SEED = 0
THREAD_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
EXECUTORS = ("local", "dask")
WORKER_COUNTS = (1, 2)
MIN_SAMPLE_S = 0.5  # shorter samples measure the executor more than the simulation
# Bare processes get this process's environment as it was at the start: Dask nannies may change it later
START_ENV = dict(os.environ)


class TrivialSimulator:
    """A simulator that costs microseconds: what is left of a task's time is the executor's."""

    def sample_parameters(self, cfg: Any, rng: np.random.Generator) -> dict[str, float]:
        return {"u": rng.uniform()}

    def simulate(self, cfg: Any, params: dict[str, float]) -> dict[str, np.ndarray]:
        return {"x": np.float64(params["u"])}


TRIVIAL_SCHEMA = {"x": {"shape": [], "dtype": "float64"}}


# -- measurements -----------------------------------------------------------------------
def steady_rate(done_at: list[float], workers: int) -> float:
    """Samples per second after the first round: (n - workers) / (t[n-1] - t[workers-1])."""
    done_at = sorted(done_at)
    if len(done_at) <= workers:
        raise ValueError(f"{len(done_at)} samples on {workers} workers leave no steady state; run more")
    return (len(done_at) - workers) / (done_at[-1] - done_at[workers - 1])


def run_executor(job: Any, n: int, executor: str, workers: int) -> dict[str, Any]:
    """Samples 0..n-1 of ``job`` on ``executor``: completion times, steady rate, wall time."""
    from converge.simulate.executors import run_samples

    done_at, failed = [], []
    start = time.perf_counter()

    def record(outcome: Any) -> None:
        done_at.append(time.perf_counter() - start)
        if outcome.error is not None:
            failed.append(f"{outcome.index}: {outcome.error}")

    run_samples(job, iter(range(n)), record, executor=executor, workers=workers)
    wall = time.perf_counter() - start
    if failed:
        raise RuntimeError(f"{executor} x{workers}: {len(failed)} samples failed, e.g. {failed[0]}")
    return {"samples_per_s": steady_rate(done_at, workers), "wall_s": wall, "done_at_s": sorted(done_at)}


def run_bare(molecule: str, n: int, processes: int) -> dict[str, Any]:
    """Samples 0..n-1 split over ``processes`` bare processes started together after their warm-up."""
    children = [
        subprocess.Popen(
            [sys.executable, __file__, "--bare-child", molecule, ",".join(map(str, range(p, n, processes)))],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env={**START_ENV, **THREAD_ENV},
        )
        for p in range(processes)
    ]
    for child in children:  # each has imported everything and simulated one sample outside the set
        if child.stdout.readline().strip() != "ready":
            raise RuntimeError(f"bare process {child.args} failed to start")
    for child in children:
        child.stdin.write("go\n")
        child.stdin.flush()
    reports = [json.loads(child.communicate()[0]) for child in children]
    rate = sum(len(r["seconds"]) / r["elapsed_s"] for r in reports)  # all run at once, so rates add up
    return {"samples_per_s": rate, "wall_s": max(r["elapsed_s"] for r in reports),
            "seconds_per_sample": [r["seconds"] for r in reports]}


def bare_child(molecule: str, indices: list[int]) -> None:
    """One bare process: ``ChemApp.simulate`` on ``indices``, timed; warm-up and go signal on stdin/stdout."""
    from converge.apps.chem import ChemApp, ChemConfig
    from converge.simulate.pool import init_worker
    from converge.simulate.sample import draw_parameters

    init_worker()
    app, cfg = ChemApp(), ChemConfig(molecule=molecule, level="fast")
    app.simulate(cfg, draw_parameters(app, cfg, SEED, 10**6 + indices[0]))  # imports, normal modes, caches
    print("ready", flush=True)
    sys.stdin.readline()
    start, seconds = time.perf_counter(), []
    for index in indices:
        params = draw_parameters(app, cfg, SEED, index)
        t0 = time.perf_counter()
        app.simulate(cfg, params)
        seconds.append(time.perf_counter() - t0)
    print(json.dumps({"seconds": seconds, "elapsed_s": time.perf_counter() - start}), flush=True)


# -- the benchmark ----------------------------------------------------------------------
def measure(molecule: str, samples: int, trivial_tasks: int) -> dict[str, Any]:
    from converge.apps.chem import ChemApp, ChemConfig
    from converge.data.store import schema_to_json
    from converge.simulate.sample import SampleJob

    app, cfg = ChemApp(), ChemConfig(molecule=molecule, level="fast")
    dft = SampleJob(ChemApp, cfg, schema_to_json(app.schema(cfg)), SEED, retries=0)
    trivial = SampleJob(TrivialSimulator, None, TRIVIAL_SCHEMA, SEED, retries=0)
    load = os.getloadavg()
    runs: dict[str, dict[int, dict[str, Any]]] = {"bare": {}, "local": {}, "dask": {}}
    for workers in WORKER_COUNTS:
        runs["bare"][workers] = run_bare(molecule, samples, workers)
        for executor in EXECUTORS:
            runs[executor][workers] = run_executor(dft, samples, executor, workers)
            print(f"  {executor:5s} x{workers}: {runs[executor][workers]['samples_per_s']:.3f} samples/s", flush=True)
    cheap = {executor: run_executor(trivial, trivial_tasks, executor, 2) for executor in EXECUTORS}

    rate = {kind: {w: runs[kind][w]["samples_per_s"] for w in WORKER_COUNTS} for kind in runs}
    sample_s = float(np.mean(runs["bare"][1]["seconds_per_sample"][0]))
    return {
        "simulator": {"app": "chem", "molecule": molecule, "level_of_theory": cfg.level_of_theory,
                      "seconds_per_sample_bare": sample_s, "long_enough": sample_s >= MIN_SAMPLE_S},
        "samples": samples, "seed": SEED, "trivial_tasks": trivial_tasks,
        "cpu_count": os.cpu_count(), "load_average_at_start": [round(x, 2) for x in load],
        "versions": {name: version(name) for name in ("dask", "distributed", "torch", "pyscf")},
        "throughput_samples_per_s": {kind: {str(w): r for w, r in by_w.items()} for kind, by_w in rate.items()},
        "speedup_2_workers": {kind: rate[kind][2] / rate[kind][1] for kind in rate},
        "efficiency_vs_bare": {kind: rate[kind][2] / rate["bare"][2] for kind in EXECUTORS},
        "overhead_ms_per_task": {kind: 1000 * 2 / cheap[kind]["samples_per_s"] for kind in EXECUTORS},
        "overhead_ms_per_task_dft": {kind: 1000 * (2 / rate[kind][2] - 2 / rate["bare"][2]) for kind in EXECUTORS},
        "wall_s": {kind: {str(w): runs[kind][w]["wall_s"] for w in WORKER_COUNTS} for kind in runs},
        "raw": {
            "bare_seconds_per_sample": {str(w): runs["bare"][w]["seconds_per_sample"] for w in WORKER_COUNTS},
            "done_at_s": {kind: {str(w): runs[kind][w]["done_at_s"] for w in WORKER_COUNTS} for kind in EXECUTORS},
            "trivial": {kind: {"wall_s": cheap[kind]["wall_s"], "samples_per_s": cheap[kind]["samples_per_s"]}
                        for kind in EXECUTORS},
        },
    }


def table(result: dict[str, Any]) -> str:
    rate, wall = result["throughput_samples_per_s"], result["wall_s"]
    sim = result["simulator"]
    header = (f"{'':8s}{'1 worker/s':>12s}{'2 workers/s':>13s}{'speedup':>9s}{'vs bare':>9s}"
              f"{'overhead ms':>13s}{'wall 1, 2 s':>14s}")
    lines = [
        f"{sim['molecule']}, {sim['level_of_theory']}: {sim['seconds_per_sample_bare']:.2f} s a sample (bare)",
        header,
    ]
    for kind in ("bare", *EXECUTORS):
        vs_bare = result["efficiency_vs_bare"].get(kind, 1.0)
        overhead = f"{result['overhead_ms_per_task'][kind]:.1f}" if kind in EXECUTORS else "-"
        lines.append(
            f"{kind:8s}{rate[kind]['1']:12.3f}{rate[kind]['2']:13.3f}{result['speedup_2_workers'][kind]:9.2f}"
            f"{vs_bare:9.1%}{overhead:>13s}{wall[kind]['1']:8.1f},{wall[kind]['2']:5.1f}"
        )
    return "\n".join(lines)


def save(result: dict[str, Any], path: Path) -> None:
    """Put ``result`` under "ensemble" in the JSON file at ``path``, keeping its other keys."""
    from converge.data.atomic import atomic_write_bytes, json_bytes

    merged = json.loads(path.read_text()) if path.exists() else {}
    merged["ensemble"] = result
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, json_bytes(merged))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--molecule", default=None, help="chem built-in molecule (default: ethanol; water if --quick)")
    parser.add_argument("--samples", type=int, default=None, help="DFT samples per configuration (default 32; 6)")
    parser.add_argument("--trivial-tasks", type=int, default=None, help="for the overhead (default 400; 40)")
    parser.add_argument("--quick", action="store_true", help="a smoke run: small, and saved only with --out")
    parser.add_argument("--out", type=Path, default=None, help="JSON file to merge into (default: "
                        "benchmarks/results/scale.json; none with --quick)")
    parser.add_argument("--bare-child", nargs=2, metavar=("MOLECULE", "INDICES"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.bare_child:
        bare_child(args.bare_child[0], [int(i) for i in args.bare_child[1].split(",")])
        return 0
    os.environ.update(THREAD_ENV)  # for this process too: numpy and torch read it when loaded
    molecule = args.molecule or ("water" if args.quick else "ethanol")
    samples = args.samples or (6 if args.quick else 32)
    trivial_tasks = args.trivial_tasks or (40 if args.quick else 400)
    out = args.out or (None if args.quick else RESULTS / "scale.json")

    result = measure(molecule, samples, trivial_tasks)
    result["quick"] = args.quick
    print(table(result))
    if not result["simulator"]["long_enough"]:
        print(f"note: samples take under {MIN_SAMPLE_S} s; pick a larger --molecule for a fair comparison")
    if out is not None:
        save(result, out)
        print(f"saved under 'ensemble' in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
