"""Serving throughput and latency of a trained run: the model alone, then the real server under load.

``run_serve_benchmark(run_dir, cfg)`` measures, in one run:

1. the model's own ceiling, no server: ``ServedModel.predict`` (the app's
   ``serve_predict`` under the run's autocast, the very call the batcher makes)
   at batch sizes 1..256, samples/s at each;
2. ``converge serve`` (uvicorn, in a subprocess on a free 127.0.0.1 port) with
   dynamic batching on (``max_batch_size`` 64, no queue delay) and off
   (``max_batch_size`` 1), swept over client concurrency with the load
   generator of :mod:`.loadgen`, one sample per request, JSON and binary tensors.

The headline numbers: ``throughput_single_unbatched`` (one client, no
batching), ``throughput_batched_best`` (the best concurrency with batching) and
its p99 latency, their ratio ``gain_vs_single_unbatched``, and the fraction of
the model's own ceiling the server reaches.

3. with ``peers`` (``mlserver``, ``litserve``; :mod:`.peers`): the same model
   served by each peer, in its own environment, swept the same way over JSON;
   ``peer`` names the faster one and ``gain_vs_peer_at_equal_p99`` is our
   best batched JSON throughput at a p99 no worse than that peer's p99 at its
   best, over the peer's best throughput (target: >= 1.3).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from ..config import parse_positive_ints
from .loadgen import InferTarget, LoadProcess
from .server_process import ServeBenchError, ServerProcess, check_server
from .peers import (DEFAULT_ENV_ROOT, PEERS, PeerBatching, PeerError, compare_with_peers, ensure_peer_env,
                    fastest_clean, measure_peer)

CONCURRENCIES = (1, 2, 4, 8, 16, 32, 64, 128)
CEILING_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
FORMATS = ("binary", "json")
DISTINCT_REQUESTS = 16  # different samples cycled through by the clients


@dataclass(frozen=True)
class BatchingMode:
    """One server set-up to sweep: its batch limit, where the model runs, and (None: the config's) client counts."""

    name: str
    max_batch_size: int
    model_process: bool = True  # `converge serve`'s default; False: --no-model-process (the model on a thread)
    concurrencies: tuple[int, ...] | None = None


# One unbatched client is also measured with the model on a server thread, where a lone request is ~0.5 ms
# quicker: the batching gain is taken against the faster of the two, never against a slowed baseline.
MODES = (BatchingMode("batched", 64), BatchingMode("unbatched", 1),
         BatchingMode("unbatched_thread", 1, model_process=False, concurrencies=(1,)))


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
    peers: tuple[str, ...] = ()  # other servers of the same model, over JSON: mlserver, litserve
    peer_batching: PeerBatching = PeerBatching()
    peer_env_root: str = str(DEFAULT_ENV_ROOT)  # their virtual environments, made on first use

    def __post_init__(self) -> None:
        if not self.concurrencies or any(c < 1 for c in self.concurrencies):
            raise ValueError(f"concurrencies={self.concurrencies}: give one or more clients counts >= 1")
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
        if self.peers and "json" not in self.formats:
            raise ValueError(f"peers={self.peers} speak JSON only: add json to formats={self.formats}")

    @classmethod
    def from_options(cls, concurrency: str, duration_s: float, warmup_s: float, formats: str, max_batch_size: int,
                     device: str = "cpu", peers: str = "") -> "ServeBenchConfig":
        """From command-line text (``"1,4,16"``, ``"binary,json"``, ``"mlserver,litserve"``): batched at
        ``max_batch_size`` (the peers too) and unbatched."""
        return cls(concurrencies=parse_counts(concurrency), duration_s=duration_s, warmup_s=warmup_s,
                   formats=tuple(f.strip() for f in formats.split(",")), device=device,
                   modes=(replace(MODES[0], max_batch_size=max_batch_size), *MODES[1:]),
                   peers=parse_peers(peers), peer_batching=PeerBatching(max_batch_size=max_batch_size))


def parse_peers(text: str) -> tuple[str, ...]:
    """``"mlserver, litserve"`` -> ("mlserver", "litserve"); ``""`` -> ()."""
    return tuple(p.strip() for p in text.split(",") if p.strip())


def parse_counts(text: str) -> tuple[int, ...]:
    """``"1,2,4"`` -> (1, 2, 4); a clear error for anything else."""
    return parse_positive_ints(text, "1,2,4,8")


# -- inputs ----------------------------------------------------------------------------------------------------------
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
            result = load.run(target, concurrency, cfg.duration_s, cfg.warmup_s, cfg.timeout_s)
            samples1, calls1 = server.counters()
            rows.append({"mode": mode.name, "max_batch_size": mode.max_batch_size, "format": fmt, **result.as_dict(),
                         "mean_batch_size": (samples1 - samples0) / max(calls1 - calls0, 1)})
    return rows


# -- the report ------------------------------------------------------------------------------------------------------
def summarize(sweep: Sequence[dict], ceiling: Sequence[dict], fmt: str, batched: str) -> dict:
    """The headline numbers of one format; the best batched point is the fastest without errors."""
    singles = [r for r in sweep if r["max_batch_size"] == 1 and r["format"] == fmt and r["concurrency"] == 1]
    single = max(singles, key=lambda r: r["throughput_sps"], default=None)  # the fastest unbatched set-up
    best = fastest_clean([r for r in sweep if r["mode"] == batched and r["format"] == fmt])
    ceiling_best = max(ceiling, key=lambda r: r["samples_per_s"])
    out: dict[str, Any] = {"format": fmt}
    if single is not None:
        out |= {"throughput_single_unbatched": single["throughput_sps"], "p99_ms_single_unbatched": single["p99_ms"],
                "mode_single_unbatched": single["mode"]}
    if best is not None:
        out |= {"throughput_batched_best": best["throughput_sps"], "concurrency_batched_best": best["concurrency"],
                "p99_ms_batched_best": best["p99_ms"], "mean_batch_size_batched_best": best["mean_batch_size"],
                "fraction_of_model_best": best["throughput_sps"] / ceiling_best["samples_per_s"]}
    if single is not None and best is not None and single["throughput_sps"] > 0:
        out["gain_vs_single_unbatched"] = best["throughput_sps"] / single["throughput_sps"]
    return out


def run_serve_benchmark(run_dir: str | Path, cfg: ServeBenchConfig = ServeBenchConfig(),
                        log_dir: str | Path | None = None) -> dict:
    """Model ceiling and the server sweep of one run (see the module docstring); server logs go to ``log_dir``."""
    import torch

    from ..contract import load_app
    from ..config import from_dict
    from ..serve.protocol import check_inputs
    from ..serve.registry import load_served_model, run_config

    run_dir = Path(run_dir).resolve()
    model = load_served_model(run_dir, device=cfg.device)
    for peer in cfg.peers:  # set up (once) before anything is measured: a failure here costs nothing
        ensure_peer_env(peer, cfg.peer_env_root)
    config = run_config(run_dir)
    app_cfg = from_dict(load_app(config["app"]).config_cls, config["app_config"], "app")
    pool = example_inputs(config["app"], app_cfg, max(max(cfg.ceiling_batches), DISTINCT_REQUESTS), cfg.seed)
    check_inputs(pool, model.inputs)
    outputs, precision, threads = [s.name for s in model.outputs], model.precision, torch.get_num_threads()
    t0 = time.perf_counter()
    ceiling = model_ceiling(model.predict, pool, cfg.ceiling_batches, cfg.ceiling_min_time_s)
    samples = [{k: v[i:i + 1] for k, v in pool.items()} for i in range(DISTINCT_REQUESTS)]
    reference = model.predict(samples[0])  # what the peers must answer
    del model  # the servers get the cores from here on
    sweep: list[dict] = []
    peers: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as scratch, LoadProcess() as load:
        logs = Path(log_dir) if log_dir is not None else Path(scratch)
        logs.mkdir(parents=True, exist_ok=True)
        for mode in cfg.modes:
            with ServerProcess(run_dir, config["app"], mode.max_batch_size, logs / f"serve-{mode.name}.log",
                               cfg.device, cfg.startup_timeout_s, threads, mode.model_process) as server:
                check_server(server.url, server.name, samples[0], outputs)
                sweep += sweep_server(load, server, samples, cfg, mode)
        for peer in cfg.peers:
            try:
                peers[peer] = measure_peer(peer, run_dir, config["app"], samples, reference, precision, load, cfg,
                                           logs, threads)
            except PeerError as err:  # ours is measured: keep it, say why this peer is missing
                print(f"error: {err}", file=sys.stderr)
                peers[peer] = {"peer": peer, "error": str(err)}
    batched = max(cfg.modes, key=lambda m: m.max_batch_size).name
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
        **({"peers": peers, **compare_with_peers(sweep, peers, batched)} if cfg.peers else {}),
        "loadgen_cpu_share_max": max(r["cpu_share"] for r in sweep),
        "loadgen_cpu_share_mean": float(np.mean([r["cpu_share"] for r in sweep])),
        "seconds": time.perf_counter() - t0,
    }


def headline(report: Mapping[str, Any]) -> dict:
    """The numbers worth printing, rounded."""
    keys = ("model_only_single", "model_only_best", "format", "throughput_single_unbatched",
            "throughput_batched_best", "concurrency_batched_best", "p99_ms_batched_best", "gain_vs_single_unbatched",
            "fraction_of_model_best", "loadgen_cpu_share_max", "peer", "peer_throughput_at_equal_p99", "peer_p99_ms_best",
            "throughput_at_peer_p99", "p99_ms_at_peer_p99", "gain_vs_peer_at_equal_p99")

    def tidy(v: Any) -> Any:
        if isinstance(v, dict):
            return {k: tidy(x) for k, x in v.items()}
        return float(f"{v:.3g}") if isinstance(v, float) else v

    return {k: tidy(report[k]) for k in keys if k in report}


def _annotate_concurrency(ax, rows: Sequence[Mapping[str, Any]]) -> None:
    for r in rows:
        ax.annotate(str(r["concurrency"]), (r["throughput_sps"], r["p99_ms"]), fontsize=7, textcoords="offset points",
                    xytext=(3, 3))


def plot_serve_sweep(reports: Mapping[str, Mapping[str, Any]], path: str | Path) -> Path:
    """Throughput (samples/s) against p99 latency, one panel per report, one line per (mode, format) and one
    per peer (JSON); the model's own best and batch-1 throughputs as vertical lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(reports), figsize=(6 * len(reports), 4.5), squeeze=False)
    for ax, (label, report) in zip(axes[0], reports.items()):
        modes = list(dict.fromkeys(r["mode"] for r in report["sweep"]))
        for mode, fmt in sorted({(r["mode"], r["format"]) for r in report["sweep"]}):
            rows = [r for r in report["sweep"] if (r["mode"], r["format"]) == (mode, fmt) and r["p99_ms"] is not None]
            ax.plot([r["throughput_sps"] for r in rows], [r["p99_ms"] for r in rows], "o-" if fmt == "binary"
                    else "s--", color=f"C{modes.index(mode)}", label=f"{mode}, {fmt}")
            _annotate_concurrency(ax, rows)
        for i, (peer, measured) in enumerate(report.get("peers", {}).items()):
            rows = [r for r in measured.get("sweep", []) if r["p99_ms"] is not None]
            ax.plot([r["throughput_sps"] for r in rows], [r["p99_ms"] for r in rows], "^:", color=f"C{len(modes) + i}",
                    label=f"{peer}, json")
            _annotate_concurrency(ax, rows)
        best = report["model_only_best"]
        ax.axvline(best["samples_per_s"], color="k", lw=1, label=f"model alone, batch {best['batch_size']}")
        if report.get("model_only_single"):
            ax.axvline(report["model_only_single"], color="grey", lw=1, ls=":", label="model alone, batch 1")
        peers = " vs " + ", ".join(report["peers"]) if report.get("peers") else ""
        ax.set(xscale="log", yscale="log", xlabel="throughput [samples/s]", ylabel="p99 latency [ms]",
               title=f"{label}: converge serve{peers} (labels: concurrency)")
        ax.legend(fontsize=8)
        ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}.png")
    fig.savefig(tmp, dpi=120)
    plt.close(fig)
    os.replace(tmp, path)
    return path


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
    """``python -m converge.bench.serve RUN [--duration S] [--concurrency 1,2,4] [--peers mlserver,litserve]``."""
    parser = argparse.ArgumentParser(prog="converge bench serve", description=__doc__.split("\n")[0])
    parser.add_argument("run", type=Path, help="a `converge train` run folder (any app)")
    parser.add_argument("--duration", type=float, default=5.0, help="measured seconds per concurrency level")
    parser.add_argument("--warmup", type=float, default=1.0, help="seconds before each measured window")
    parser.add_argument("--concurrency", default=",".join(map(str, CONCURRENCIES)), help="client counts, e.g. 1,4,16")
    parser.add_argument("--formats", default=",".join(FORMATS), help="binary, json or binary,json")
    parser.add_argument("--max-batch-size", type=int, default=64, help="of the batched server")
    parser.add_argument("--device", default="cpu", help="cpu | cuda | auto")
    parser.add_argument("--out", type=Path, default=None, help="where serve.json, serve.png go (default RUN)")
    parser.add_argument("--peers", default="", help="also serve the model with mlserver, litserve or both (JSON)")
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(int(os.environ.setdefault("OMP_NUM_THREADS", "1")))
    try:
        cfg = ServeBenchConfig.from_options(args.concurrency, args.duration, args.warmup, args.formats,
                                            args.max_batch_size, args.device, args.peers)
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
