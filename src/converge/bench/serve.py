"""Serving throughput and latency of a trained run: the model alone, then the real server under load.

``run_serve_benchmark(run_dir, cfg)`` measures, in one run:

1. the model's own ceiling, no server: ``ServedModel.predict`` (the app's
   ``serve_predict`` under the run's autocast, the very call the batcher makes)
   at batch sizes 1..256, samples/s at each, on the samples the clients send,
   cycled (chem's example molecules differ in size: the first 16 average 5.3
   atoms, the first 64 7.8, so any other batch would time other work);
2. ``converge serve`` (uvicorn, in a subprocess on a free 127.0.0.1 port) with
   dynamic batching on (``max_batch_size`` 64, no queue delay) and off
   (``max_batch_size`` 1), swept over client concurrency with the load
   generator of :mod:`.loadgen`, one sample per request, JSON and binary tensors.

The headline numbers: ``throughput_single_unbatched`` (one client, no
batching), ``throughput_batched_best`` (the best concurrency with batching) and
its p99 latency, their ratio ``gain_vs_single_unbatched``, and the fraction of
the model's own ceiling the server reaches.

3. with ``peers`` (``triton``, ``mlserver``, ``litserve``; :mod:`.peers`): the
   same model served by each peer, in its own environment, at every setting of
   its grid (:mod:`.peer_settings`: batch size, queue delay, workers), swept
   the same way in the best format it speaks (Triton binary, the others JSON).
   Each ``peers.<name>`` holds its best (``throughput_best``, its p99 and its
   settings, ``settings_best``) and ``ours_at_equal_p99``: our best batched
   throughput in that format at a p99 no worse, and the gain over the peer's
   best (targets: >= 1.0 for Triton, >= 1.3 for the others). ``peer`` and
   ``gain_vs_peer_at_equal_p99`` name the peer hardest to beat.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from ..config import parse_positive_ints
from .loadgen import InferTarget, LoadProcess
from .server_process import ServeBenchError, ServerProcess, check_server
from .peer_envs import DEFAULT_ENV_ROOT, PEERS, ensure_peer_env
from .peer_settings import PeerSettings, check_settings, default_grid, parse_peer_grid
from .head_to_head import ROUNDS, measure_head_to_head
from .machine import describe_machine
from .peers import PEER_FORMATS, PeerError, compare_with_peers, fastest_clean, measure_peer
from .serve_plot import plot_serve_sweep

CONCURRENCIES = (1, 2, 4, 8, 16, 32, 64, 128)
CEILING_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
FORMATS = ("binary", "json")
DISTINCT_REQUESTS = 16  # different samples cycled through by the clients
LIKE_FOR_LIKE = ("every server calls the same ServedModel.predict of the run, at the run's precision, with "
                 "OMP_NUM_THREADS torch threads per model worker (converge serve over its batching modes, MODES); "
                 "converge serve also does what only it offers: a run with a training envelope (chem's ood.json) is "
                 "trust-gated, its envelope checked on every batch in the model process, which the peers skip; the "
                 "same load generator, warm-up, window, concurrencies and distinct requests; each peer in the best "
                 "tensor format it speaks (Triton: KServe v2 binary extension, MLServer and LitServe: JSON) at its "
                 "best point over its settings grid, beside our best in that format at a p99 no worse")


@dataclass(frozen=True)
class BatchingMode:
    """One server set-up to sweep: its batch limit, where the model runs, and (None: the config's) client counts."""

    name: str
    max_batch_size: int
    model_process: bool = True  # `converge serve`'s default; False: --no-model-process (the model on a thread)
    concurrencies: tuple[int, ...] | None = None
    instances: int = 1  # --instances: model processes
    max_queue_delay_us: int = 0  # --max-queue-delay-us: how long a batch may wait to fill

    @property
    def batched(self) -> bool:
        return self.max_batch_size > 1

    @property
    def settings(self) -> dict:
        """The `converge serve` options of this set-up."""
        return {"max_batch_size": self.max_batch_size, "max_queue_delay_us": self.max_queue_delay_us,
                "model_process": self.model_process,
                "instances": self.instances}


# One unbatched client is also measured with the model on a server thread, where a lone request is ~0.5 ms
# quicker: the batching gain is taken against the faster of the two, never against a slowed baseline.
# Batched, ours is also swept with a 1 ms queue delay (Triton's grid has it too), with two model processes (as
# Triton's two-instance group), and at Triton's own best settings on these machines (twice the batch limit, a 1 ms
# queue delay, two instances): each peer is set beside our best over these set-ups, named in the results.
MODES = (BatchingMode("batched", 64), BatchingMode("batched_1ms", 64, max_queue_delay_us=1000),
         BatchingMode("batched_2_instances", 64, instances=2),
         BatchingMode("batched_2_instances_1ms", 128, instances=2, max_queue_delay_us=1000),
         BatchingMode("unbatched", 1), BatchingMode("unbatched_thread", 1, model_process=False, concurrencies=(1,)))


@dataclass(frozen=True)
class ServeBenchConfig:
    concurrencies: tuple[int, ...] = CONCURRENCIES
    duration_s: float = 5.0  # measured window per point
    warmup_s: float = 1.0  # before each window
    formats: tuple[str, ...] = FORMATS
    modes: tuple[BatchingMode, ...] = MODES
    ceiling_batches: tuple[int, ...] = CEILING_BATCHES
    ceiling_min_time_s: float = 1.0  # per batch size
    device: str = "cpu"
    timeout_s: float = 30.0  # per request
    startup_timeout_s: float = 180.0  # for `converge serve` (and the peers) to answer
    seed: int = 0
    peers: tuple[str, ...] = ()  # other servers of the same model: triton, mlserver, litserve
    peer_grid: dict[str, tuple[PeerSettings, ...]] = field(default_factory=dict)  # absent: default_grid(peer)
    peer_env_root: str = str(DEFAULT_ENV_ROOT)  # their virtual environments, made on first use
    peer_confirm: bool = True  # sweep each peer's selected setting again and report that pass
    head_to_head_rounds: int = ROUNDS  # ours and the hardest peer up at once, loaded in turn (0: not measured)

    def __post_init__(self) -> None:
        if not self.concurrencies or any(c < 1 for c in self.concurrencies):
            raise ValueError(f"concurrencies={self.concurrencies}: give one or more clients counts >= 1")
        if self.head_to_head_rounds < 0:
            raise ValueError(f"head_to_head_rounds={self.head_to_head_rounds}: give 0 (none) or more rounds")
        if not self.duration_s > 0 or self.warmup_s < 0:
            raise ValueError(f"duration_s={self.duration_s}, warmup_s={self.warmup_s}: need duration > 0, warm-up >= 0")
        if not self.formats or set(self.formats) - set(FORMATS):
            raise ValueError(f"formats={self.formats}: choose from {', '.join(FORMATS)}")
        if not self.modes or any(m.max_batch_size < 1 for m in self.modes):
            raise ValueError(f"modes={self.modes}: give batching modes with max_batch_size >= 1")
        if len({m.name for m in self.modes}) != len(self.modes):
            raise ValueError(f"modes={self.modes}: names must be distinct")
        if not self.ceiling_batches or any(b < 1 for b in self.ceiling_batches) or not self.ceiling_min_time_s > 0:
            raise ValueError(f"ceiling_batches={self.ceiling_batches}, ceiling_min_time_s={self.ceiling_min_time_s}: "
                             "need batch sizes >= 1 and a time > 0")
        if set(self.peers) - set(PEERS) or len(set(self.peers)) != len(self.peers):
            raise ValueError(f"peers={self.peers}: choose distinct ones from {', '.join(PEERS)}")
        for peer in self.peers:
            if PEER_FORMATS[peer] not in self.formats:
                raise ValueError(f"peers={self.peers}: {peer} is compared over {PEER_FORMATS[peer]}: add "
                                 f"{PEER_FORMATS[peer]} to formats={self.formats}")
        if set(self.peer_grid) - set(self.peers):
            raise ValueError(f"peer_grid names {sorted(set(self.peer_grid) - set(self.peers))}, not among "
                             f"peers={self.peers}")
        for peer, grid in self.peer_grid.items():
            if not grid:
                raise ValueError(f"peer_grid[{peer!r}] is empty: give one setting or more, or leave it out")
            for settings in grid:
                check_settings(peer, settings)

    def peer_settings_for(self, peer: str) -> tuple[PeerSettings, ...]:
        """The settings ``peer`` is measured at: ``peer_grid``'s, or its default grid around our batch limit."""
        ours = min((m.max_batch_size for m in self.modes if m.batched), default=1)  # our base batch limit
        return self.peer_grid.get(peer) or default_grid(peer, ours)

    @classmethod
    def from_options(cls, concurrency: str, duration_s: float, warmup_s: float, formats: str, max_batch_size: int,
                     device: str = "cpu", peers: str = "", peer_grid: str = "") -> "ServeBenchConfig":
        """From command-line text (``"1,4,16"``, ``"binary,json"``, ``"triton,mlserver"``, ``peer_grid`` as
        :func:`.peer_settings.parse_peer_grid` reads it): batched at ``max_batch_size`` and unbatched; the
        peers' default grids are centred on ``max_batch_size``."""
        chosen = parse_peers(peers)
        return cls(concurrencies=parse_counts(concurrency), duration_s=duration_s, warmup_s=warmup_s,
                   formats=tuple(f.strip() for f in formats.split(",")), device=device,
                   modes=tuple(replace(m, max_batch_size=max_batch_size * m.max_batch_size // MODES[0].max_batch_size)
                               if m.batched else m for m in MODES),
                   peers=chosen, peer_grid=parse_peer_grid(peer_grid, chosen, max_batch_size))


def parse_peers(text: str) -> tuple[str, ...]:
    """``"triton, mlserver"`` -> ("triton", "mlserver"); ``""`` -> ()."""
    return tuple(p.strip() for p in text.split(",") if p.strip())


def parse_counts(text: str) -> tuple[int, ...]:
    """``"1,2,4"`` -> (1, 2, 4); a clear error for anything else."""
    return parse_positive_ints(text, "1,2,4,8")


# -- inputs ----------------------------------------------------------------------------------------------------------
def run_examples(run_dir: Path, n: int, seed: int = 0) -> tuple[dict, dict[str, np.ndarray]]:
    """A run's config and ``n`` example inputs for its served model (:func:`example_inputs`)."""
    from ..config import from_dict
    from ..contract import load_app
    from ..serve.registry import run_config

    config = run_config(run_dir)
    app_cfg = from_dict(load_app(config["app"]).config_cls, config["app_config"], "app")
    return config, example_inputs(config["app"], app_cfg, n, seed)


def one_per_request(pool: Mapping[str, np.ndarray], n: int = DISTINCT_REQUESTS) -> list[dict[str, np.ndarray]]:
    """The first ``n`` samples of ``pool``, each a request of its own (what the clients send, cycled)."""
    return [{k: v[i:i + 1] for k, v in pool.items()} for i in range(n)]


def cycled(pool: Mapping[str, np.ndarray], size: int) -> dict[str, np.ndarray]:
    """``pool``'s samples repeated in order to ``size`` rows (row ``i`` is sample ``i % len(pool)``)."""
    return {k: np.take(v, np.arange(size) % len(v), axis=0) for k, v in pool.items()}


def example_inputs(app_name: str, app_cfg: Any, n: int, seed: int = 0) -> dict[str, np.ndarray]:
    """``n`` realistic samples for the served model of ``app_name`` (the app's ``serving_example``)."""
    from ..contract import load_app

    try:
        return load_app(app_name).serving_example(app_cfg, n, seed)
    except (KeyError, NotImplementedError) as err:
        raise ServeBenchError(f"no example inputs for app {app_name!r}: {str(err).strip(chr(39))}") from None


# -- the model alone -------------------------------------------------------------------------------------------------
def model_ceiling(predict, pool: Mapping[str, np.ndarray], batch_sizes: Sequence[int], min_time_s: float = 1.0,
                  max_calls: int = 100_000) -> list[dict]:
    """Samples/s of ``predict`` (arrays by name -> arrays) at each batch size, the first rows of ``pool``.

    One untimed call per size, then calls until ``min_time_s`` has passed (or ``max_calls``).
    """
    rows = []
    for b in batch_sizes:
        x = {k: v[:b] for k, v in pool.items()}
        if len(next(iter(x.values()))) != b:
            raise ValueError(f"batch size {b}: the pool holds only {len(next(iter(pool.values())))} samples")
        predict(x)
        calls, t0 = 0, time.perf_counter()
        while True:
            predict(x)
            calls += 1
            elapsed = time.perf_counter() - t0
            if elapsed >= min_time_s or calls >= max_calls:
                break
        rows.append({"batch_size": b, "samples_per_s": b * calls / elapsed, "ms_per_call": 1e3 * elapsed / calls,
                     "calls": calls})
    return rows


def sweep_server(load: LoadProcess, server: ServerProcess, samples: list[dict[str, np.ndarray]],
                 cfg: ServeBenchConfig, mode: BatchingMode) -> list[dict]:
    """One row per (format, concurrency): the load generator's result and the mean batch the server ran."""
    rows = []
    for fmt in cfg.formats:
        target = InferTarget.from_inputs(server.url, server.name, samples, binary=fmt == "binary")
        for concurrency in mode.concurrencies or cfg.concurrencies:
            samples0, calls0 = server.counters()
            cpu0 = server.cpu_seconds()
            result = load.run(target, concurrency, cfg.duration_s, cfg.warmup_s, cfg.timeout_s)
            cpu1 = server.cpu_seconds()
            samples1, calls1 = server.counters()
            # CPU per sample of the server and its model processes together, warm-up included on both sides:
            # steadier than throughput on a shared machine, and what two vCPUs ration
            cpu_us = 1e6 * (cpu1 - cpu0) / (samples1 - samples0) if samples1 > samples0 else float("nan")
            rows.append({"mode": mode.name, "max_batch_size": mode.max_batch_size, "settings": mode.settings,
                         "format": fmt, **result.as_dict(),
                         "mean_batch_size": (samples1 - samples0) / max(calls1 - calls0, 1),
                         "server_cpu_us_per_sample": cpu_us})
    return rows


# -- the report ------------------------------------------------------------------------------------------------------
def summarize(sweep: Sequence[dict], ceiling: Sequence[dict], fmt: str, batched: Sequence[str]) -> dict:
    """The headline numbers of one format; the best batched point is the fastest without errors over the
    ``batched`` modes, named under ``mode_batched_best``."""
    singles = [r for r in sweep if r["max_batch_size"] == 1 and r["format"] == fmt and r["concurrency"] == 1]
    single = max(singles, key=lambda r: r["throughput_sps"], default=None)  # the fastest unbatched set-up
    best = fastest_clean([r for r in sweep if r["mode"] in batched and r["format"] == fmt])
    ceiling_best = max(ceiling, key=lambda r: r["samples_per_s"])
    out: dict[str, Any] = {"format": fmt}
    if single is not None:
        out |= {"throughput_single_unbatched": single["throughput_sps"], "p99_ms_single_unbatched": single["p99_ms"],
                "mode_single_unbatched": single["mode"]}
    if best is not None:
        out |= {"throughput_batched_best": best["throughput_sps"], "mode_batched_best": best["mode"],
                "settings_batched_best": best.get("settings"), "concurrency_batched_best": best["concurrency"],
                "p99_ms_batched_best": best["p99_ms"], "mean_batch_size_batched_best": best["mean_batch_size"],
                "server_cpu_us_per_sample_batched_best": best.get("server_cpu_us_per_sample"),
                "fraction_of_model_best": best["throughput_sps"] / ceiling_best["samples_per_s"]}
    if single is not None and best is not None and single["throughput_sps"] > 0:
        out["gain_vs_single_unbatched"] = best["throughput_sps"] / single["throughput_sps"]
    return out


def run_serve_benchmark(run_dir: str | Path, cfg: ServeBenchConfig = ServeBenchConfig(),
                        log_dir: str | Path | None = None) -> dict:
    """Model ceiling and the server sweep of one run (see the module docstring); server logs go to ``log_dir``."""
    import torch

    from ..serve.protocol import check_inputs
    from ..serve.registry import load_served_model

    run_dir = Path(run_dir).resolve()
    model = load_served_model(run_dir, device=cfg.device)
    for peer in cfg.peers:  # set up (once) before anything is measured: a failure here costs nothing
        ensure_peer_env(peer, cfg.peer_env_root)
    config, pool = run_examples(run_dir, DISTINCT_REQUESTS, cfg.seed)
    check_inputs(pool, model.inputs)
    outputs, precision, threads = [s.name for s in model.outputs], model.precision, torch.get_num_threads()
    signature = (tuple(model.inputs), tuple(model.outputs))  # what Triton's config declares
    t0 = time.perf_counter()
    ceiling = model_ceiling(model.predict, cycled(pool, max(cfg.ceiling_batches)), cfg.ceiling_batches,
                            cfg.ceiling_min_time_s)
    samples = one_per_request(pool)
    reference = model.predict(samples[0])  # what the peers must answer
    del model  # the servers get the cores from here on
    sweep: list[dict] = []
    peers: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as scratch, LoadProcess() as load:
        logs = Path(log_dir) if log_dir is not None else Path(scratch)
        logs.mkdir(parents=True, exist_ok=True)
        for mode in cfg.modes:
            with ServerProcess(run_dir, config["app"], mode.max_batch_size, logs / f"serve-{mode.name}.log",
                               cfg.device, cfg.startup_timeout_s, threads, mode.model_process,
                               mode.instances, mode.max_queue_delay_us) as server:
                check_server(server.url, server.name, samples[0], outputs)
                sweep += sweep_server(load, server, samples, cfg, mode)
        for peer in cfg.peers:
            try:
                peers[peer] = measure_peer(peer, run_dir, config["app"], signature, samples, reference, precision,
                                           load, cfg, logs, threads)
            # ours is measured: keep it, say why this peer is missing (ValueError: a signature the peer cannot
            # declare, e.g. Triton and chem's variable atom axis)
            except (PeerError, ValueError) as err:
                print(f"error: {err}", file=sys.stderr)
                peers[peer] = {"peer": peer, "error": str(err)}
        batched = (tuple(m.name for m in cfg.modes if m.batched)
                   or (max(cfg.modes, key=lambda m: m.max_batch_size).name,))
        comparison = compare_with_peers(sweep, peers, batched) if cfg.peers else {}
        duel = {}
        if comparison.get("peer") and cfg.head_to_head_rounds > 0:
            try:
                duel = {"head_to_head": measure_head_to_head(run_dir, config["app"], comparison, peers, sweep,
                                                             samples, signature, load, cfg, logs, threads)}
            except PeerError as err:  # the sweeps stand; the report says why the duel is missing
                print(f"error: {err}", file=sys.stderr)
                duel = {"head_to_head": {"peer": comparison["peer"], "error": str(err)}}
    for peer, ours in comparison.pop("vs_peers", {}).items():
        peers[peer]["ours_at_equal_p99"] = ours
    by_format = {fmt: summarize(sweep, ceiling, fmt, batched) for fmt in cfg.formats}
    best = max(ceiling, key=lambda r: r["samples_per_s"])
    single = next((r["samples_per_s"] for r in ceiling if r["batch_size"] == 1), None)
    return {
        "app": config["app"], "run": str(run_dir), "precision": precision, "device": cfg.device,
        "torch_threads": threads, "config": asdict(cfg),
        "inputs": {k: {"datatype": str(v.dtype), "shape": [-1, *v.shape[1:]]} for k, v in pool.items()},
        "model_only": ceiling, "model_only_single": single,
        "model_only_best": {"samples_per_s": best["samples_per_s"], "batch_size": best["batch_size"]},
        **by_format[cfg.formats[0]], "by_format": by_format, "sweep": sweep,
        **({"peers": peers, **comparison, "like_for_like": LIKE_FOR_LIKE} if cfg.peers else {}), **duel,
        "loadgen_cpu_share_max": max(r["cpu_share"] for r in sweep),
        "loadgen_cpu_share_mean": float(np.mean([r["cpu_share"] for r in sweep])),
        "seconds": time.perf_counter() - t0,
        "machine": describe_machine(),  # apps of one serve.json may come from different runs, machines
    }


def headline(report: Mapping[str, Any]) -> dict:
    """The numbers worth printing, rounded."""
    keys = ("model_only_single", "model_only_best", "format", "throughput_single_unbatched",
            "throughput_batched_best", "concurrency_batched_best", "p99_ms_batched_best", "gain_vs_single_unbatched",
            "fraction_of_model_best", "loadgen_cpu_share_max", "peer", "peer_format", "peer_throughput_at_equal_p99",
            "peer_p99_ms_best", "throughput_at_peer_p99", "p99_ms_at_peer_p99", "gain_vs_peer_at_equal_p99")

    def tidy(v: Any) -> Any:
        if isinstance(v, dict):
            return {k: tidy(x) for k, x in v.items()}
        return float(f"{v:.3g}") if isinstance(v, float) else v

    out = {k: tidy(report[k]) for k in keys if k in report}
    if "by_format" in report:
        out["throughput_batched_best_by_format"] = {f: tidy(r.get("throughput_batched_best"))
                                                    for f, r in report["by_format"].items()}
    if report.get("peers"):
        out["peers"] = {name: tidy(peer_headline(p)) for name, p in report["peers"].items()}
    if report.get("head_to_head"):
        duel = report["head_to_head"]
        out["head_to_head"] = tidy({k: duel[k] for k in ("peer", "gain_median", "gain_per_round",
                                                         "throughput_best_median", "meets_target")})
    return out


def peer_headline(peer: Mapping[str, Any]) -> dict:
    """A peer's best, its settings there and ours beside it; or why it is missing."""
    if "error" in peer:
        return {"error": peer["error"].splitlines()[0]}
    ours = peer.get("ours_at_equal_p99", {})
    return {"format": peer["format"], "throughput_best": peer["throughput_best"], "p99_ms_best": peer["p99_ms_best"],
            "concurrency_best": peer["concurrency_best"], "settings_best": peer["native_settings_best"],
            "ours_at_equal_p99": ours.get("throughput"), "gain": ours.get("gain"), "target": ours.get("gain_target")}


def write_results(reports: Mapping[str, Mapping[str, Any]], out_dir: str | Path, stem: str = "serve"
                  ) -> tuple[Path, Path]:
    """``OUT/STEM.json`` (reports by label) and ``OUT/STEM.png``, each written atomically."""
    from ..data.atomic import atomic_write_bytes

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / f"{stem}.json"
    atomic_write_bytes(json_path, (json.dumps(reports, indent=2, allow_nan=False) + "\n").encode())
    return json_path, plot_serve_sweep(reports, out_dir / f"{stem}.png")


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m converge.bench.serve RUN [--duration S] [--concurrency 1,2,4] [--peers triton,mlserver,litserve]
    [--peer-grid "triton.delay_ms=0,0.5 mlserver.workers=1,2"]``."""
    parser = argparse.ArgumentParser(prog="converge bench serve", description=__doc__.split("\n")[0])
    parser.add_argument("run", type=Path, help="a `converge train` run folder (any app)")
    parser.add_argument("--duration", type=float, default=5.0, help="measured seconds per concurrency level")
    parser.add_argument("--warmup", type=float, default=1.0, help="seconds before each measured window")
    parser.add_argument("--concurrency", default=",".join(map(str, CONCURRENCIES)), help="client counts, e.g. 1,4,16")
    parser.add_argument("--formats", default=",".join(FORMATS), help="binary, json or binary,json")
    parser.add_argument("--max-batch-size", type=int, default=64, help="of the batched server")
    parser.add_argument("--device", default="cpu", help="cpu | cuda | auto")
    parser.add_argument("--out", type=Path, default=None, help="where serve.json, serve.png go (default RUN)")
    parser.add_argument("--peers", default="", help="also serve the model with triton, mlserver and/or litserve")
    parser.add_argument("--peer-grid", default="", help="the peers' settings to sweep, PEER.AXIS=V1,V2 items (axes "
                        "max_batch_size, delay_ms, workers), e.g. 'triton.delay_ms=0,0.5 mlserver.workers=1'; "
                        "axes not named keep their defaults")
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(int(os.environ.setdefault("OMP_NUM_THREADS", "1")))
    try:
        cfg = ServeBenchConfig.from_options(args.concurrency, args.duration, args.warmup, args.formats,
                                            args.max_batch_size, args.device, args.peers, args.peer_grid)
        out = args.out or args.run
        report = run_serve_benchmark(args.run, cfg, log_dir=out)
    except (ValueError, RuntimeError) as err:  # ModelLoadError, ServeBenchError and bad settings
        print(f"error: {err}", file=sys.stderr)
        return 2
    json_path, png_path = write_results({report["app"]: report}, out)
    print(json.dumps(headline(report), indent=2))
    print(f"written {json_path} and {png_path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
