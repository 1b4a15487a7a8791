"""MLGWSC-1 dataset 1: the coherent CNN search against the matched-filter search, on the challenge's own files.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/mlgwsc.py --work runs/mlgwsc                 # a day; 30 days
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/mlgwsc.py --work runs/mlgwsc-2h --duration 7200 --slides 360

Stages; each one resumes (a finished stage's files are reused, the matched filter's per-detector triggers are
cached piece by piece), so an interrupted run picks up where it stopped:

1. data: the challenge's ``generate_data.py -d 1`` for the test foreground/background (``--seed``) and, from
   another seed, a shorter calibration foreground (``--calibration-seed``); neither seed is used in training;
2. train: ``--train-samples`` two-detector DS1 waveforms (``GWConfig.mlgwsc1(1)``, seed ``--train-seed``), the
   coherent CNN (``--cnn-channels``) trained ``--epochs`` epochs;
3. calibrate: both searches on the calibration foreground; each one's timing bias and tolerance ``var`` from
   its injections (:mod:`converge.apps.gw.timing`), used by the test searches;
4. search: both searches on the test foreground (zero lag) and on the background file with ``--slides`` slides
   of ``--slide-step`` s, so the background lasts ``slides x duration``;
5. evaluate: the challenge's ``get_stats`` with the slid background's duration; sensitive distance at 1, 10 and
   100 false alarms per month with errors, the challenge-style plot and a found/missed plot;
6. latency: ``--follow`` on the first ``--follow-seconds`` s of the test foreground, landed as 4 s GWOSC files
   in real time, for each search (p50, p99 of the event latencies);
7. compute: seconds per strain second of both foreground searches on the same ``--compute-seconds`` of data,
   back to back and alternating, the matched filter from an empty cache (whitening included), one thread.

``--only cnn`` and ``--only matched_filter`` run stages 1-4 and 6 for one search, so that two invocations share
the two cores; a last invocation without ``--only`` reuses their files, evaluates and times both side by side.

Writes ``benchmarks/results/mlgwsc.json``, ``mlgwsc_sensitivity.png`` and ``mlgwsc_found_missed.png``.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

from converge.apps.gw.app import GWApp
from converge.apps.gw.challenge import (PUBLISHED_DS1, challenge_folder, evaluate_events, found_at,
                                        plot_found_missed, plot_sensitivity)
from converge.apps.gw.config import GWConfig
from converge.apps.gw.datafile import open_strain
from converge.apps.gw.events import merge_backgrounds, read_events
from converge.apps.gw.follow import feed_stretches, follow_cnn, follow_matched_filter
from converge.apps.gw.mfsearch import FilterConfig, search_matched_filter
from converge.apps.gw.search import SearchConfig, add_far, search_cnn
from converge.apps.gw.slides import SECONDS_PER_MONTH
from converge.apps.gw.timing import TIMING_FILE, measure_timing, write_timing
from converge.bench.artifacts import write_json
from converge.data.store import ShardStore
from converge.simulate.runner import SimulateConfig, run_ensemble
from converge.train.loop import TrainConfig, train

RESULTS = Path(__file__).parent / "results"
METHODS = ("cnn", "matched_filter")


def log(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", flush=True)


def generate(work: Path, name: str, seed: int, duration: int) -> dict[str, Path]:
    """The challenge's generator (unchanged) into ``work/name_{inj,fg,bg}.hdf``; reused when complete. A lock
    on ``work`` makes a second invocation (``--only``) wait for the first one's files instead of writing them
    too."""
    import fcntl

    files = {k: work / f"{name}_{k}.hdf" for k in ("inj", "fg", "bg")}
    done = work / f".{name}.done"
    with open(work / ".generate.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.is_file():
            _generate(files, done, seed, duration)
    return files


def _generate(files: dict[str, Path], done: Path, seed: int, duration: int) -> None:
    for f in files.values():
        f.unlink(missing_ok=True)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "generate_data.py", "-d", "1", "-i", files["inj"], "-f", files["fg"],
                    "-b", files["bg"], "-s", str(seed), "--duration", str(duration)],
                   cwd=challenge_folder(), env=env, check=True)
    done.write_text(json.dumps({"seed": seed, "duration": duration, "seconds": time.perf_counter() - t0}))


def train_cnn(work: Path, args) -> Path:
    """Simulate the DS1 training set and train the coherent CNN (both resume)."""
    app, cfg = GWApp(), GWConfig.mlgwsc1(1, conv_padding=args.cnn_padding, channels=args.cnn_channels)
    data, run = work / "train_data", work / "run"
    done = work / ".trained"
    if done.is_file():
        trained = json.loads((run / "config.json").read_text())["app_config"]
        if tuple(trained["channels"]) != tuple(args.cnn_channels):
            raise SystemExit(f"{run} was trained with --cnn-channels {','.join(map(str, trained['channels']))}, not "
                             f"{','.join(map(str, args.cnn_channels))}: give those, or another --work")
    else:
        # the store holds the population alone (network settings such as conv_padding do not enter it);
        # complete shards, another work folder's linked here included, are kept
        run_ensemble(app, GWConfig.mlgwsc1(1), SimulateConfig(samples=args.train_samples, seed=args.train_seed,
                                                              workers=1, shard_size=1000), data, progress=False)
        arrays = ShardStore.open(data).load()
        result = train(app, cfg, TrainConfig(epochs=args.epochs, batch_size=128, seed=args.train_seed), arrays,
                       run, resume=(run / "last.pt").exists(), progress=False, extra_config={"data": str(data)})
        done.write_text(json.dumps({"samples": args.train_samples, "epochs": args.epochs,
                                    "best": {k: v for k, v in vars(result).items() if isinstance(v, (int, float))}}))
    return run


def run_searches(work: Path, run: Path, cfg: GWConfig, files: dict[str, Path], tag: str, slides: int,
                 step: float, timing: dict[str, Path | None], methods=METHODS, group: int = 40,
                 fcfg: FilterConfig = FilterConfig()) -> dict[str, dict]:
    """Both searches on ``files``' foreground and on its background with ``slides`` slides, run in groups of
    ``group`` slides (each group's file is kept, so an interrupted background resumes at its last group)."""
    out = {}
    for method in methods:
        paths = {"fg": work / f"{tag}_{method}_fg.hdf", "bg": work / f"{tag}_{method}_bg.hdf"}
        summaries = {}
        jobs = [("fg", paths["fg"], 0, 1)] + background_groups(work, f"{tag}_{method}_bg", slides, group)
        for kind, target, n, first in jobs:
            if target.is_file() and target.with_suffix(".json").is_file():
                summaries.setdefault(kind, []).append(json.loads(target.with_suffix(".json").read_text()))
                continue
            log(f"{tag}: {method} search of the {kind} file (slides {first}..{first + n - 1})" if n else
                f"{tag}: {method} search of the {kind} file (zero lag)")
            search = SearchConfig(slides=n, slide_step=step, first_slide=first)
            if method == "cnn":
                result = search_cnn(run, files[kind], target, search, progress=False, timing=timing.get("cnn"))
            else:
                result = search_matched_filter(cfg, files[kind], target, search, fcfg,
                                               cache_dir=work / "mf-cache", timing=timing.get("mf"), progress=False)
            summaries.setdefault(kind, []).append(result)
        summaries["fg"] = summaries["fg"][0]
        if slides:
            merge_backgrounds([target for kind, target, _, _ in jobs if kind == "bg"], paths["bg"])
            groups = summaries["bg"]
            summaries["bg"] = {**groups[0], "background_s": sum(g["background_s"] for g in groups),
                               "seconds": sum(g["seconds"] for g in groups), "slides": slides, "first_slide": 1}
        out[method] = {"paths": paths, "summaries": summaries}
    return out


def background_groups(work: Path, stem: str, slides: int, group: int) -> list[tuple[str, Path, int, int]]:
    """("bg", file, n, first) of the groups covering slides 1..``slides``: a finished group file is kept with the
    slides it holds (a run asked for more slides adds groups after it), new groups hold up to ``group``."""
    jobs, first = [], 1
    while first <= slides:
        target, n = work / f"{stem}_{first}.hdf", min(group, slides - first + 1)
        summary = target.with_suffix(".json")
        if target.is_file() and summary.is_file():
            held = int(json.loads(summary.read_text())["slides"])
            if held > slides - first + 1:
                raise SystemExit(f"{target} holds slides {first}..{first + held - 1}, more than the {slides} asked "
                                 "for: ask for at least that many, or remove it")
            n = held
        jobs.append(("bg", target, n, first))
        first += n
    return jobs


def calibrate(work: Path, run: Path, cfg: GWConfig, files: dict[str, Path], methods=METHODS,
              fcfg: FilterConfig = FilterConfig()) -> dict[str, dict]:
    """Timing bias and tolerance of each search from the calibration foreground's injections (each method's
    record is kept in ``timing_<method>.done.json`` and reused)."""
    done = {m: work / f"timing_{m}.done.json" for m in methods}
    todo = [m for m in methods if not done[m].is_file()]
    records = _calibrate(work, run, cfg, files, todo, fcfg) if todo else {}
    for m in todo:
        done[m].write_text(json.dumps(records[m], indent=1))
    return {m: json.loads(done[m].read_text()) for m in methods}


def _calibrate(work: Path, run: Path, cfg: GWConfig, files: dict[str, Path], methods,
               fcfg: FilterConfig) -> dict[str, dict]:
    import h5py

    with h5py.File(files["inj"]) as f:
        tc = f["tc"][()]
    fg = open_strain(files["fg"])
    tc = tc[(tc > fg.segments[0].start + 30) & (tc < fg.segments[-1].end - 30)]
    if "cnn" in methods and (run / TIMING_FILE).is_file():  # a search made with a record folds it in
        (run / TIMING_FILE).unlink()
    searches = run_searches(work, run, cfg, files, "calibration", 0, 2.0, {}, methods, fcfg=fcfg)
    records = {}
    for method, s in searches.items():
        events, attrs = read_events(s["paths"]["fg"])
        # the loudest event farther than 1 s from every injection is noise: a match must beat it
        near = np.min(np.abs(events["time"][:, None] - tc[None]), axis=1)
        floor = float(events["stat"][near > 1.0].max(initial=-np.inf))
        try:
            record = measure_timing(events["time"], events["stat"], tc, stat_floor=floor, window=0.5,
                                    applied_offset=float(attrs.get("timing_offset_s", 0.0)))
            record.update(measured=True, measured_on=str(files["fg"]))
        except ValueError as err:  # too few found: the search keeps its default tolerance, and says so
            record = {"measured": False, "reason": str(err), "var_s": float(attrs["var_s"]), "offset_s": 0.0}
        records[method] = record
    if records.get("cnn", {}).get("measured"):
        write_timing(run, records["cnn"])
    if records.get("matched_filter", {}).get("measured"):
        write_timing(work / "mf_timing.json", records["matched_filter"])
    return records


def latency(work: Path, run: Path, cfg: GWConfig, fg: Path, seconds: float, speed: float,
            methods=METHODS, fcfg: FilterConfig = FilterConfig()) -> dict[str, dict]:
    """Event latencies in --follow mode, 4 s GWOSC files landing ``speed`` times faster than real time (one search
    at a time; the summary's busy_fraction < 1 shows the search kept up, so that the landing rate does not enter
    the latency)."""
    out = {}
    data = open_strain(fg)
    for method in methods:
        target = work / f"follow_{method}.hdf"
        if target.with_suffix(".json").is_file():
            out[method] = json.loads(target.with_suffix(".json").read_text())
            continue
        landing = work / f"landing_{method}"
        shutil.rmtree(landing, ignore_errors=True)
        log(f"latency: {method} following {seconds:g} s of 4 s files at {speed:g}x real time")
        feeder = threading.Thread(target=feed_stretches, args=(data, landing, 4.0, 4.0 / speed, seconds),
                                  daemon=True)
        feeder.start()
        if method == "cnn":
            out[method] = follow_cnn(run, landing, target, SearchConfig(), idle_timeout=20.0)
        else:
            timing = work / "mf_timing.json"
            out[method] = follow_matched_filter(cfg, landing, target, SearchConfig(), fcfg,
                                                idle_timeout=20.0, timing=timing if timing.is_file() else None)
        feeder.join()
        shutil.rmtree(landing, ignore_errors=True)
    return out


def link_matched_filter(work: Path, source: Path, fcfg: FilterConfig) -> None:
    """The matched filter's finished files of another work folder on the same challenge files (its calibration,
    searches, timing record and follow run), linked into ``work`` so that they are reused, not recomputed; they
    must have been made with ``fcfg``."""
    names = [p.name for p in source.iterdir() if "matched_filter" in p.name or p.name == "mf_timing.json"]
    if not names:
        raise SystemExit(f"--matched-filter-from {source}: no matched-filter files there")
    for summary in sorted(source.glob("*_matched_filter_*.json")):
        made = json.loads(summary.read_text()).get("filter_config", {})
        if made and made != asdict(fcfg):
            raise SystemExit(f"--matched-filter-from {source}: {summary.name} was made with {made}, not {asdict(fcfg)}"
                             " (give the same --snr-threshold)")
    for name in names:
        if not (work / name).exists():
            (work / name).symlink_to(source.resolve() / name)


def accumulate_stages(work: Path, stages: dict[str, float]) -> dict[str, float]:
    """Wall seconds spent in each stage over every invocation on ``work`` (a resumed run adds what it spent)."""
    path = work / "stage_seconds.json"
    total = json.loads(path.read_text()) if path.is_file() else {}
    for name, seconds in stages.items():
        total[name] = total.get(name, 0.0) + seconds
    path.write_text(json.dumps(total, indent=1))
    return total


def finite(value):
    """``value`` with every non-finite float replaced by None (strict JSON)."""
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    if isinstance(value, float) and not np.isfinite(value):
        return None
    return value


def compute_cost(work: Path, run: Path, cfg: GWConfig, fg: Path, seconds: float, repeats: int = 3,
                 fcfg: FilterConfig = FilterConfig()) -> dict:
    """Both foreground searches on the same first ``seconds`` of the test foreground, back to back and alternating
    (so that both see the same load on a shared machine), the matched filter from an empty trigger cache; the
    fastest of ``repeats`` runs of each, per strain second (whitening included, one thread)."""
    import tempfile

    from converge.apps.gw.datafile import write_mlgwsc1

    data = open_strain(fg)
    seg, n = data.segments[0], int(seconds * data.sample_rate)
    piece = work / "compute_slice.hdf"
    write_mlgwsc1(piece, [(seg.start, {d: data.read(0, d, 0, n) for d in data.detectors})], data.sample_rate)
    times: dict[str, list[float]] = {"cnn": [], "matched_filter": []}
    conditioning: dict[str, list[float]] = {"cnn": [], "matched_filter": []}
    for _ in range(repeats):
        t = time.perf_counter()
        summary = search_cnn(run, piece, work / "compute_cnn.hdf", SearchConfig(), progress=False)
        times["cnn"].append(time.perf_counter() - t)
        conditioning["cnn"].append(summary["conditioning_seconds"])
        with tempfile.TemporaryDirectory(dir=work) as cache:
            t = time.perf_counter()
            summary = search_matched_filter(cfg, piece, work / "compute_mf.hdf", SearchConfig(), fcfg,
                                            cache_dir=Path(cache), progress=False)
            times["matched_filter"].append(time.perf_counter() - t)
            conditioning["matched_filter"].append(summary["conditioning_seconds"])
    cnn, mf = min(times["cnn"]) / seconds, min(times["matched_filter"]) / seconds
    # the slice is written uncompressed; the challenge's own files are gzip-compressed (shuffle + deflate), and a
    # search of them also pays for decompressing them: both detectors of the same stretch, read from there
    reads = []
    for _ in range(repeats):
        t = time.perf_counter()
        for d in data.detectors:
            data.read(0, d, 0, n, np.empty(n, np.float32))
        reads.append(time.perf_counter() - t)
    read = min(reads) / seconds
    # the same data conditioning (Welch PSD and FIR whitening of both detectors) is part of both searches
    beyond = {m: min(t - c for t, c in zip(times[m], conditioning[m])) / seconds for m in times}
    return {"cnn_s_per_strain_s": cnn, "mf_s_per_strain_s": mf, "speedup": mf / cnn,
            "beyond_conditioning_s_per_strain_s": beyond,
            "speedup_beyond_conditioning": beyond["matched_filter"] / beyond["cnn"],
            "conditioning_s_per_strain_s": {m: min(c) / seconds for m, c in conditioning.items()},
            "challenge_file_read_s_per_strain_s": read,
            "speedup_reading_the_challenge_file": (mf + read) / (cnn + read),
            "threads": torch.get_num_threads(),
            "what": f"foreground search of the same {seconds:g} s of two-detector strain, whitening included, fastest "
                    f"of {repeats} alternating runs each, one thread, this CPU", "runs_s": times,
            "load_average": os.getloadavg()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, default=Path("runs/mlgwsc"))
    ap.add_argument("--duration", type=int, default=86400, help="test foreground (and background file) [s]")
    ap.add_argument("--slides", type=int, default=35, help="time slides of the background file: 35 of a day give "
                    "35 days, enough to resolve 1 false alarm per month (30 slides of 86,380 s fall 600 s short)")
    ap.add_argument("--slide-step", type=float, default=2.0)
    ap.add_argument("--seed", type=int, default=20230, help="the challenge generator's seed of the test files")
    ap.add_argument("--calibration-seed", type=int, default=20231)
    ap.add_argument("--calibration-duration", type=int, default=3600)
    ap.add_argument("--train-seed", type=int, default=1)
    ap.add_argument("--train-samples", type=int, default=60000)
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--cnn-padding", choices=("valid", "same"), default="valid",
                    help="valid: the search scores each stretch's overlapping windows from one pass of the "
                         "convolutions (exact); same: window by window, zeros at the edges")
    ap.add_argument("--cnn-channels", type=lambda t: tuple(int(c) for c in t.split(",")), default=(8, 16, 32),
                    help="channels of the CNN's three conv blocks: 8,16,32 (default) costs 3.6x less than the app's "
                         "16,32,64 and was as sensitive on the full day (README)")
    ap.add_argument("--matched-filter-from", type=Path, help="reuse the matched filter's results of another work "
                    "folder searched on the same --data (two CNNs against one matched filter)")
    ap.add_argument("--data", type=Path, help="where the challenge's files are made (default: --work); two work "
                    "folders may share them")
    ap.add_argument("--follow-seconds", type=float, default=1200.0)
    ap.add_argument("--follow-speed", type=float, default=4.0, help="landing rate over real time")
    ap.add_argument("--snr-threshold", type=float, default=FilterConfig().snr_threshold,
                    help="the matched filter's single-detector SNR threshold for triggers (use a work folder of its "
                         "own per threshold: its cache and files depend on it)")
    ap.add_argument("--compute-seconds", type=float, default=600.0, help="stretch both searches are timed on")
    ap.add_argument("--results", type=Path, default=RESULTS)
    ap.add_argument("--only", choices=METHODS, help="run the stages of one search only and stop before evaluating "
                    "(two invocations with --only cnn and --only matched_filter share the two cores; a last one "
                    "without it evaluates, times both side by side and writes the results)")
    args = ap.parse_args()
    methods = (args.only,) if args.only else METHODS
    torch.set_num_threads(1)
    work = args.work.resolve()  # the generator runs in the challenge's folder
    work.mkdir(parents=True, exist_ok=True)
    data = (args.data or args.work).resolve()
    data.mkdir(parents=True, exist_ok=True)
    stages: dict[str, float] = {}
    cfg = GWConfig.mlgwsc1(1)
    fcfg = FilterConfig(snr_threshold=args.snr_threshold)

    t = time.perf_counter()
    log("train: the coherent two-detector CNN")
    run = train_cnn(work, args) if "cnn" in methods else work / "run"
    stages["train"] = time.perf_counter() - t
    t = time.perf_counter()
    log("data: the challenge's generator")
    test = generate(data, "test", args.seed, args.duration)
    calib = generate(data, "calibration", args.calibration_seed, args.calibration_duration)
    stages["data"] = time.perf_counter() - t
    t = time.perf_counter()
    if args.matched_filter_from:
        link_matched_filter(work, args.matched_filter_from, fcfg)
    log("calibrate: timing on the calibration injections")
    records = calibrate(work, run, cfg, calib, methods, fcfg)
    stages["calibrate"] = time.perf_counter() - t
    t = time.perf_counter()
    measured = {"cnn": run / TIMING_FILE, "mf": work / "mf_timing.json"}
    searches = run_searches(work, run, cfg, test, "test", args.slides, args.slide_step,
                            {k: v for k, v in measured.items() if v.is_file()}, methods, fcfg=fcfg)
    stages["search"] = time.perf_counter() - t
    if args.only:
        follow = latency(work, run, cfg, test["fg"], args.follow_seconds, args.follow_speed, methods, fcfg)
        accumulate_stages(work, {f"{name} ({args.only})": v for name, v in stages.items()})
        log(f"{args.only}: searches and latency done ({follow[args.only]['latency_ms']}); run again without --only")
        return
    t = time.perf_counter()
    results, found = {}, {}
    background_s = min(s["summaries"]["bg"]["background_s"] for s in searches.values())
    far_level = max(1.0, SECONDS_PER_MONTH / background_s)  # per month: no lower than the background resolves
    for method, s in searches.items():
        add_far(s["paths"]["fg"], s["paths"]["bg"])
        results[method] = evaluate_events(s["paths"]["fg"], s["paths"]["bg"], test["inj"], [test["fg"]])
        found[method] = found_at(s["paths"]["fg"], s["paths"]["bg"], test["inj"], [test["fg"]], far_level)
    stages["evaluate"] = time.perf_counter() - t
    t = time.perf_counter()
    follow = latency(work, run, cfg, test["fg"], args.follow_seconds, args.follow_speed, fcfg=fcfg)
    stages["latency"] = time.perf_counter() - t

    t = time.perf_counter()
    cost_path = work / "compute.done.json"
    if cost_path.is_file():
        cost = json.loads(cost_path.read_text())
    else:
        log("compute: both searches on the same stretch, alternating")
        cost = compute_cost(work, run, cfg, test["fg"], args.compute_seconds, fcfg=fcfg)
        cost_path.write_text(json.dumps(cost, indent=1))
    stages["compute"] = time.perf_counter() - t
    fg_s = {m: s["summaries"]["fg"] for m, s in searches.items()}
    reduced = args.duration < 86400 or searches["cnn"]["summaries"]["bg"]["background_s"] < 30 * 86400
    labels = {"cnn": "coherent CNN", "matched_filter": "matched filter (ours)"}
    title = (f"MLGWSC-1 DS1, {args.duration / 3600:.3g} h foreground, {background_s / 86400:.3g} d background"
             + (" (reduced size)" if reduced else ""))
    plot_sensitivity({labels[m]: r for m, r in results.items()}, args.results / "mlgwsc_sensitivity.png", title)
    plot_found_missed({f"{labels[m]}, FAR <= {far_level:.3g}/month": f for m, f in found.items()},
                      args.results / "mlgwsc_found_missed.png", title)
    method_entry = lambda m: {  # noqa: E731
        "sensitive_distance_mpc": results[m]["sensitive_distance_mpc"],
        "sensitive_distance_error_mpc": results[m]["sensitive_distance_error_mpc"],
        "threshold": results[m]["threshold"], "background_s": searches[m]["summaries"]["bg"]["background_s"],
        "n_background_events": results[m]["n_background_events"], "timing": records[m],
        "n_found": {"far_per_month": far_level, "n": int(found[m]["found"].sum())},
        "n_injections": results[m]["n_injections"]}
    result = {
        "ds1": {
            "foreground_s": fg_s["cnn"]["analysed_s"],
            "background_s": background_s,
            "reduced_size": reduced,
            "seeds": {"test": args.seed, "calibration": args.calibration_seed, "training": args.train_seed},
            "cnn": {**method_entry("cnn"), "training": {"samples": args.train_samples, "epochs": args.epochs},
                    "conv_padding": args.cnn_padding, "channels": list(args.cnn_channels),
                    "n_windows_per_slide_s": 1 / SearchConfig().stride},
            "matched_filter": {**method_entry("matched_filter"),
                               "n_templates": fg_s["matched_filter"]["n_templates"],
                               "snr_threshold": fcfg.snr_threshold},
            "compute": {**cost,
                        "full_foreground_runs_s_per_strain_s": {
                            "cnn": fg_s["cnn"]["seconds"] / fg_s["cnn"]["duration_s"],
                            "matched_filter": fg_s["matched_filter"]["compute_seconds_per_strain_second"]},
                        "cnn_background_s_per_strain_s_per_slide":
                            searches["cnn"]["summaries"]["bg"]["seconds"] / (args.slides * args.duration),
                        "mf_background_s_per_strain_s_per_slide":
                            searches["matched_filter"]["summaries"]["bg"]["seconds"] / (args.slides * args.duration)},
            "latency_ms": {m: follow[m]["latency_ms"] for m in follow},
            "latency_setup": {"stretch_s": 4.0, "landing_speed_over_real_time": args.follow_speed,
                              "followed_s": args.follow_seconds,
                              "busy_fraction": {m: follow[m].get("busy_fraction") for m in follow},
                              "warmup_events_left_out": {m: follow[m].get("n_warmup_events") for m in follow}},
            "published": PUBLISHED_DS1,
        },
        "stage_seconds": accumulate_stages(work, stages),
        "machine": {"cpu": platform.processor() or platform.machine(), "torch": torch.__version__,
                    "load_average": os.getloadavg()},
        "curves": {m: results[m]["curve"] for m in results},
        "notes": [
            f"{'reduced size: ' if reduced else ''}{args.duration / 3600:.3g} h of foreground with "
            f"{results['cnn']['n_injections']} injections and {args.slides} slides of {args.slide_step:g} s "
            f"({background_s / 86400:.3g} days of background); the distance errors are the injections' sampling "
            "error (get_stats), and a FAR of 1 per month rests on the one or two loudest background events",
            f"the CNN: {args.train_samples} training waveforms, {args.epochs} epochs (a short training that shows "
            "the pipeline, not a trained network)",
            "compute: both foreground searches timed back to back on the same stretch (fastest of 3 alternating "
            "runs), written uncompressed; challenge_file_read is the cost of decompressing the same stretch from the "
            "challenge's gzip file, which a search of that file adds to both, and speedup_reading_the_challenge_file "
            "counts it; full_foreground_runs are the test searches' own timings on the challenge's file (decompression "
            "and the day's memmaps included), under whatever load the machine had",
            "latency: 4 s GWOSC files landing at landing_speed_over_real_time; busy_fraction < 1 means the search "
            "kept up, so the landing rate does not enter the latency; the PSD's warm-up step is left out"],
    }
    write_json(args.results / "mlgwsc.json", finite(result))
    print(json.dumps({k: v for k, v in result["ds1"].items() if k not in ("published",)}, indent=1, default=str))


if __name__ == "__main__":
    main()
