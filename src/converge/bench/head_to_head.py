"""Ours against the hardest peer, both servers up at once and loaded in turn: a ratio that drift cannot bias.

The sweeps of :mod:`.serve` measure our set-ups first and each peer after, minutes
apart. On a shared 2-vCPU machine the speed of the whole machine can drift by more
than the gap between two servers over such spans (the README's serve section shows
a peer's grid best and its confirming pass of the same setting far apart). Here our server at its selected set-up and the peer at its best settings run side by
side, idle but for the window being measured, and the load generator alternates
between them: ours then the peer's at each concurrency, the order reversed every
round. Each round gives one gain, computed as the sweeps' is (:func:`round_gain`):
our best throughput at a p99 no worse than the peer's at its best, over the peer's
best. The median over rounds is the figure.
"""
from __future__ import annotations

import statistics
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

import numpy as np

from .loadgen import InferTarget, LoadProcess
from .peer_envs import ensure_peer_env
from .peer_settings import PeerSettings
from .peers import GAIN_TARGETS, PEER_FORMATS, PeerServer, fastest_clean
from .server_process import ServerProcess

if TYPE_CHECKING:
    from .serve import ServeBenchConfig

ROUNDS = 4
CONCURRENCIES = (32, 64, 128)  # where the batched servers' bests lie on two cores (serve.json's sweeps)


def clean(rows: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    return [r for r in rows if r["errors"] == 0 and r["requests"] > 0 and r["p99_ms"] is not None]


def round_gain(ours: Sequence[Mapping[str, Any]], peer: Sequence[Mapping[str, Any]]) -> float | None:
    """Our fastest clean row with a p99 at most that of the peer's fastest clean row, over the peer's throughput;
    0.0 when no row of ours is as quick, None when the peer has no clean row."""
    theirs = max(clean(peer), key=lambda r: r["throughput_sps"], default=None)
    if theirs is None:
        return None
    fits = [r for r in clean(ours) if r["p99_ms"] <= theirs["p99_ms"]]
    best = max(fits, key=lambda r: r["throughput_sps"], default=None)
    return best["throughput_sps"] / theirs["throughput_sps"] if best is not None else 0.0


def load_in_turn(load: LoadProcess, targets: Mapping[str, InferTarget], cpu: Mapping[str, Callable[[], float]],
                 concurrencies: Sequence[int], rounds: int, duration_s: float, warmup_s: float,
                 timeout_s: float, front: Mapping[str, Callable[[], float]] | None = None) -> list[dict]:
    """``rounds`` rounds over ``concurrencies``; at each, every target in turn (order reversed on odd rounds).
    One row per window: the load result, the round, whose it was and the CPU per sample of every server (the
    idle one's shows it stayed idle); with ``front`` (CPU seconds of each server's own process), that part
    of its CPU per sample beside the rest, its model workers'."""
    rows, names, front = [], list(targets), dict(front or {})
    for k in range(rounds):
        for concurrency in concurrencies:
            for name in (names if k % 2 == 0 else names[::-1]):
                before = {n: f() for n, f in cpu.items()}
                front_before = front[name]() if name in front else float("nan")
                result = load.run(targets[name], concurrency, duration_s, warmup_s, timeout_s).as_dict()
                used = {n: f() - before[n] for n, f in cpu.items()}
                served = result["throughput_sps"] * (warmup_s + duration_s)
                per_sample = (lambda seconds: 1e6 * seconds / served) if served > 0 else (lambda _: float("nan"))
                row = {"round": k, "server": name, **result, "server_cpu_us_per_sample": per_sample(used[name]),
                       "cpu_share_of_others": {n: s / (warmup_s + duration_s) for n, s in used.items() if n != name}}
                if name in front:
                    row["front_cpu_us_per_sample"] = per_sample(front[name]() - front_before)
                    row["workers_cpu_us_per_sample"] = row["server_cpu_us_per_sample"] - row["front_cpu_us_per_sample"]
                rows.append(row)
    return rows


def cpu_split(rows: Sequence[Mapping[str, Any]], name: str) -> dict | None:
    """Median CPU per sample of ``name``'s front end and of its model workers over its clean rows, with the
    range of each; None without the split (:func:`load_in_turn`'s ``front``)."""
    mine = [r for r in clean(rows) if r["server"] == name and "front_cpu_us_per_sample" in r]
    if not mine:
        return None
    out = {}
    for part in ("front", "workers"):
        values = [r[f"{part}_cpu_us_per_sample"] for r in mine]
        out[f"{part}_cpu_us_per_sample_median"] = statistics.median(values)
        out[f"{part}_cpu_us_per_sample_range"] = [min(values), max(values)]
    return out


def summarize(rows: Sequence[Mapping[str, Any]], ours: str, peer: str, target: float) -> dict:
    """Per-round gains (:func:`round_gain`), their median and the spread, beside the target."""
    rounds = sorted({r["round"] for r in rows})
    gains = [round_gain([r for r in rows if r["round"] == k and r["server"] == ours],
                        [r for r in rows if r["round"] == k and r["server"] == peer]) for k in rounds]
    gains = [g for g in gains if g is not None]
    median = statistics.median(gains) if gains else None

    def best(name: str) -> float | None:
        values = [max((r["throughput_sps"] for r in clean(rows) if r["round"] == k and r["server"] == name),
                      default=0.0) for k in rounds]
        return statistics.median(values) if values else None

    return {"gain_per_round": gains, "gain_median": median, "gain_min": min(gains, default=None),
            "gain_max": max(gains, default=None), "throughput_best_median": {ours: best(ours), peer: best(peer)},
            "gain_target": target, "meets_target": median is not None and median >= target}


def measure_head_to_head(run_dir: Path, name: str, comparison: Mapping[str, Any], peers: Mapping[str, Mapping],
                         sweep: Sequence[Mapping], samples: list[dict[str, np.ndarray]], signature: tuple,
                         load: LoadProcess, cfg: "ServeBenchConfig", logs: Path, threads: int) -> dict:
    """:mod:`.head_to_head` against the peer hardest to beat: our set-up of the point beside it (else our
    fastest batched one) and the peer's best settings, both started, then loaded in turn."""
    rival = comparison["peer"]
    fmt, ours_mode = PEER_FORMATS[rival], comparison["vs_peers"][rival].get("mode")
    if ours_mode is None:
        ours_mode = fastest_clean([r for r in sweep if r["format"] == fmt and r["max_batch_size"] > 1])["mode"]
    mode = next(m for m in cfg.modes if m.name == ours_mode)
    settings = PeerSettings(**peers[rival]["settings_best"])
    python = ensure_peer_env(rival, cfg.peer_env_root)
    with ServerProcess(run_dir, name, mode.max_batch_size, logs / "serve-head-to-head.log", cfg.device,
                       cfg.startup_timeout_s, threads, mode.model_process, mode.instances,
                       mode.max_queue_delay_us) as ours, \
            PeerServer(rival, python, run_dir, name, logs / f"peer-{rival}-head-to-head.log", settings, threads,
                       cfg.startup_timeout_s, signature) as peer:
        targets = {"converge": InferTarget.from_inputs(ours.url, name, samples, binary=fmt == "binary"),
                   rival: peer.target(samples)}
        rows = load_in_turn(load, targets, {"converge": ours.cpu_seconds, rival: peer.cpu_seconds},
                            CONCURRENCIES, cfg.head_to_head_rounds, cfg.duration_s, cfg.warmup_s,
                            cfg.timeout_s, {"converge": ours.front_cpu_seconds, rival: peer.front_cpu_seconds})
    return {"peer": rival, "format": fmt, "ours_settings": {"mode": mode.name, **mode.settings},
            "peer_settings": peers[rival]["settings_best"], "concurrencies": list(CONCURRENCIES),
            "rounds": cfg.head_to_head_rounds, "duration_s": cfg.duration_s,
            **summarize(rows, "converge", rival, GAIN_TARGETS[rival]),
            "cpu_split": {n: cpu_split(rows, n) for n in ("converge", rival)}, "rows": rows}


def parse_triton_settings(text: str | Mapping[str, Any]) -> PeerSettings:
    """Triton's settings from ``BATCH:DELAY_MS:INSTANCES`` (``128:1:2``) or a dict of :class:`PeerSettings`."""
    if isinstance(text, Mapping):
        return PeerSettings(**text)
    parts = str(text).split(":")
    try:
        batch, delay, workers = int(parts[0]), float(parts[1]), int(parts[2])
    except (IndexError, ValueError):
        raise ValueError(f"Triton settings {text!r}: give BATCH:DELAY_MS:INSTANCES, e.g. 128:1:2") from None
    if len(parts) != 3:
        raise ValueError(f"Triton settings {text!r}: give BATCH:DELAY_MS:INSTANCES, e.g. 128:1:2")
    return PeerSettings(batch, delay, workers)


def duel_alone(run_dir: str | Path, ours_mode: str, triton: str | Mapping[str, Any], rounds: int = ROUNDS,
               duration_s: float = 4.0, warmup_s: float = 1.0, logs: Path | None = None) -> dict:
    """:func:`measure_head_to_head` on its own (``benchmarks/serve_head_to_head.py``): our serve bench mode
    ``ours_mode`` against Triton at ``triton`` (:func:`parse_triton_settings`), on the run's example inputs."""
    import tempfile

    import torch

    from ..serve.registry import load_served_model
    from .serve import DISTINCT_REQUESTS, ServeBenchConfig, one_per_request, run_examples

    settings = parse_triton_settings(triton)
    cfg = ServeBenchConfig(duration_s=duration_s, warmup_s=warmup_s, peers=("triton",), head_to_head_rounds=rounds)
    if ours_mode not in {m.name for m in cfg.modes if m.batched}:
        raise ValueError(f"ours={ours_mode!r}: choose a batched mode of the serve bench: "
                         + ", ".join(m.name for m in cfg.modes if m.batched))
    run_dir = Path(run_dir).resolve()
    model = load_served_model(run_dir, device=cfg.device)
    config, pool = run_examples(run_dir, DISTINCT_REQUESTS, cfg.seed)
    samples = one_per_request(pool)
    signature = (tuple(model.inputs), tuple(model.outputs))
    del model
    comparison = {"peer": "triton", "vs_peers": {"triton": {"mode": ours_mode}}}
    peers = {"triton": {"settings_best": asdict(settings)}}
    with tempfile.TemporaryDirectory() as scratch, LoadProcess() as load:
        folder = Path(logs) if logs is not None else Path(scratch)
        return {"app": config["app"], "run": str(run_dir),
                **measure_head_to_head(run_dir, config["app"], comparison, peers, [], samples, signature, load, cfg,
                                       folder, torch.get_num_threads())}
