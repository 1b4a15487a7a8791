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
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from ..config import parse_positive_ints
from .loadgen import InferTarget, LoadProcess

CONCURRENCIES = (1, 2, 4, 8, 16, 32, 64, 128)
CEILING_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
FORMATS = ("binary", "json")
DISTINCT_REQUESTS = 16  # different samples cycled through by the clients


class ServeBenchError(RuntimeError):
    """The server would not start or answer; the message carries the tail of its log."""


@dataclass(frozen=True)
class BatchingMode:
    name: str
    max_batch_size: int


@dataclass(frozen=True)
class ServeBenchConfig:
    concurrencies: tuple[int, ...] = CONCURRENCIES
    duration_s: float = 5.0  # measured window per point
    warmup_s: float = 1.0  # before each window
    formats: tuple[str, ...] = FORMATS
    modes: tuple[BatchingMode, ...] = (BatchingMode("batched", 64), BatchingMode("unbatched", 1))
    ceiling_batches: tuple[int, ...] = CEILING_BATCHES
    ceiling_min_time_s: float = 1.0  # per batch size
    device: str = "cpu"
    timeout_s: float = 30.0  # per request
    startup_timeout_s: float = 180.0  # for `converge serve` to answer
    seed: int = 0

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


def parse_counts(text: str) -> tuple[int, ...]:
    """``"1,2,4"`` -> (1, 2, 4); a clear error for anything else."""
    return parse_positive_ints(text, "1,2,4,8")


# -- inputs ----------------------------------------------------------------------------------------------------------
def example_inputs(app_name: str, app_cfg: Any, n: int, seed: int = 0) -> dict[str, np.ndarray]:
    """``n`` realistic samples for the served model of ``app_name`` (the app's ``serving_example``)."""
    from ..apps.base import load_app

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


# -- the server ------------------------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


class ServerProcess:
    """``converge serve NAME=RUN`` on a free 127.0.0.1 port, its output in ``log_path``; SIGINT drains it on exit."""

    def __init__(self, run_dir: Path, name: str, max_batch_size: int, log_path: Path, device: str = "cpu",
                 startup_timeout_s: float = 180.0, threads: int = 1) -> None:
        self.run_dir, self.name, self.max_batch_size, self.log_path = Path(run_dir), name, max_batch_size, log_path
        self.device, self.startup_timeout_s, self.threads = device, startup_timeout_s, threads
        self.url = ""
        self._proc: subprocess.Popen | None = None

    def __enter__(self) -> "ServerProcess":
        import httpx

        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        cmd = [sys.executable, "-m", "converge", "serve", f"{self.name}={self.run_dir}", "--host", "127.0.0.1",
               "--port", str(port), "--max-batch-size", str(self.max_batch_size), "--max-queue-delay-us", "0",
               "--device", self.device]
        with open(self.log_path, "wb") as log:
            self._proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                          env={**os.environ, "OMP_NUM_THREADS": str(self.threads)})
        deadline = time.monotonic() + self.startup_timeout_s
        while True:
            if self._proc.poll() is not None:
                raise ServeBenchError(f"`converge serve` exited with status {self._proc.returncode}:\n"
                                      f"{_tail(self.log_path)}")
            try:
                if httpx.get(f"{self.url}/v2/models/{self.name}/ready", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.__exit__()
                raise ServeBenchError(f"`converge serve` not ready after {self.startup_timeout_s:g} s:\n"
                                      f"{_tail(self.log_path)}")
            time.sleep(0.1)

    def __exit__(self, *exc: object) -> None:
        if self._proc is None or self._proc.poll() is not None:
            return
        self._proc.send_signal(signal.SIGINT)
        try:
            self._proc.wait(30)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait(10)

    def counters(self) -> tuple[float, float]:
        """(samples inferred, model calls) so far, from the server's own Prometheus counters."""
        import httpx

        text = httpx.get(f"{self.url}/metrics", timeout=10).text

        def value(metric: str) -> float:
            found = re.search(rf'^{metric}_total\{{model="{re.escape(self.name)}"\}} (\S+)$', text, re.M)
            return float(found.group(1)) if found else 0.0

        return value("converge_inference_samples"), value("converge_inference_executions")


def check_server(url: str, name: str, sample: Mapping[str, np.ndarray], outputs: Sequence[str]) -> None:
    """One request through the real client, JSON and binary: the outputs must be the signature's."""
    from ..serve.client import Client

    with Client(url, timeout=60) as client:
        for binary in (False, True):
            got = client.infer(name, sample, binary=binary)
            if sorted(got) != sorted(outputs):
                raise ServeBenchError(f"the server answered outputs {sorted(got)}, expected {sorted(outputs)}")


def sweep_server(load: LoadProcess, server: ServerProcess, samples: list[dict[str, np.ndarray]],
                 cfg: ServeBenchConfig, mode: BatchingMode) -> list[dict]:
    """One row per (format, concurrency): the load generator's result and the mean batch the server ran."""
    rows = []
    for fmt in cfg.formats:
        target = InferTarget.from_inputs(server.url, server.name, samples, binary=fmt == "binary")
        for concurrency in cfg.concurrencies:
            samples0, calls0 = server.counters()
            result = load.run(target, concurrency, cfg.duration_s, cfg.warmup_s, cfg.timeout_s)
            samples1, calls1 = server.counters()
            rows.append({"mode": mode.name, "max_batch_size": mode.max_batch_size, "format": fmt, **result.as_dict(),
                         "mean_batch_size": (samples1 - samples0) / max(calls1 - calls0, 1)})
    return rows


# -- the report ------------------------------------------------------------------------------------------------------
def summarize(sweep: Sequence[dict], ceiling: Sequence[dict], fmt: str, batched: str, unbatched: str) -> dict:
    """The headline numbers of one format; the best batched point is the fastest without errors."""
    single = next((r for r in sweep if r["mode"] == unbatched and r["format"] == fmt and r["concurrency"] == 1), None)
    candidates = [r for r in sweep if r["mode"] == batched and r["format"] == fmt]
    clean = [r for r in candidates if r["errors"] == 0 and r["requests"] > 0] or candidates
    best = max(clean, key=lambda r: r["throughput_sps"], default=None)
    ceiling_best = max(ceiling, key=lambda r: r["samples_per_s"])
    out: dict[str, Any] = {"format": fmt}
    if single is not None:
        out |= {"throughput_single_unbatched": single["throughput_sps"], "p99_ms_single_unbatched": single["p99_ms"]}
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

    from ..apps.base import load_app
    from ..config import from_dict
    from ..serve.protocol import check_inputs
    from ..serve.registry import load_served_model, run_config

    run_dir = Path(run_dir).resolve()
    model = load_served_model(run_dir, device=cfg.device)
    config = run_config(run_dir)
    app_cfg = from_dict(load_app(config["app"]).config_cls, config["app_config"], "app")
    pool = example_inputs(config["app"], app_cfg, max(max(cfg.ceiling_batches), DISTINCT_REQUESTS), cfg.seed)
    check_inputs(pool, model.inputs)
    outputs, precision, threads = [s.name for s in model.outputs], model.precision, torch.get_num_threads()
    t0 = time.perf_counter()
    ceiling = model_ceiling(model.predict, pool, cfg.ceiling_batches, cfg.ceiling_min_time_s)
    del model  # the servers get the cores from here on
    samples = [{k: v[i:i + 1] for k, v in pool.items()} for i in range(DISTINCT_REQUESTS)]
    sweep: list[dict] = []
    with tempfile.TemporaryDirectory() as scratch, LoadProcess() as load:
        logs = Path(log_dir) if log_dir is not None else Path(scratch)
        logs.mkdir(parents=True, exist_ok=True)
        for mode in cfg.modes:
            with ServerProcess(run_dir, config["app"], mode.max_batch_size, logs / f"serve-{mode.name}.log",
                               cfg.device, cfg.startup_timeout_s, threads) as server:
                check_server(server.url, server.name, samples[0], outputs)
                sweep += sweep_server(load, server, samples, cfg, mode)
    batched = max(cfg.modes, key=lambda m: m.max_batch_size).name
    unbatched = min(cfg.modes, key=lambda m: m.max_batch_size).name
    by_format = {fmt: summarize(sweep, ceiling, fmt, batched, unbatched) for fmt in cfg.formats}
    best = max(ceiling, key=lambda r: r["samples_per_s"])
    single = next((r["samples_per_s"] for r in ceiling if r["batch_size"] == 1), None)
    return {
        "app": config["app"], "run": str(run_dir), "precision": precision, "device": cfg.device,
        "torch_threads": threads, "config": asdict(cfg),
        "inputs": {k: {"datatype": str(v.dtype), "shape": [-1, *v.shape[1:]]} for k, v in pool.items()},
        "model_only": ceiling, "model_only_single": single,
        "model_only_best": {"samples_per_s": best["samples_per_s"], "batch_size": best["batch_size"]},
        **by_format[cfg.formats[0]], "by_format": by_format, "sweep": sweep,
        "loadgen_cpu_share_max": max(r["cpu_share"] for r in sweep),
        "loadgen_cpu_share_mean": float(np.mean([r["cpu_share"] for r in sweep])),
        "seconds": time.perf_counter() - t0,
    }


def headline(report: Mapping[str, Any]) -> dict:
    """The numbers worth printing, rounded."""
    keys = ("model_only_single", "model_only_best", "format", "throughput_single_unbatched",
            "throughput_batched_best", "concurrency_batched_best", "p99_ms_batched_best", "gain_vs_single_unbatched",
            "fraction_of_model_best", "loadgen_cpu_share_max")

    def tidy(v: Any) -> Any:
        if isinstance(v, dict):
            return {k: tidy(x) for k, x in v.items()}
        return float(f"{v:.3g}") if isinstance(v, float) else v

    return {k: tidy(report[k]) for k in keys if k in report}


def plot_serve_sweep(reports: Mapping[str, Mapping[str, Any]], path: str | Path) -> Path:
    """Throughput (samples/s) against p99 latency, one panel per report, one line per (mode, format);
    the model's own best and batch-1 throughputs as vertical lines."""
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
            for r in rows:
                ax.annotate(str(r["concurrency"]), (r["throughput_sps"], r["p99_ms"]), fontsize=7,
                            textcoords="offset points", xytext=(3, 3))
        best = report["model_only_best"]
        ax.axvline(best["samples_per_s"], color="k", lw=1, label=f"model alone, batch {best['batch_size']}")
        if report.get("model_only_single"):
            ax.axvline(report["model_only_single"], color="grey", lw=1, ls=":", label="model alone, batch 1")
        ax.set(xscale="log", yscale="log", xlabel="throughput [samples/s]", ylabel="p99 latency [ms]",
               title=f"{label}: converge serve (labels: concurrency)")
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
    """``python -m converge.bench.serve RUN [--duration S] [--concurrency 1,2,4] [--out DIR]``."""
    parser = argparse.ArgumentParser(prog="converge bench serve", description=__doc__.split("\n")[0])
    parser.add_argument("run", type=Path, help="a `converge train` run folder (any app)")
    parser.add_argument("--duration", type=float, default=5.0, help="measured seconds per concurrency level")
    parser.add_argument("--warmup", type=float, default=1.0, help="seconds before each measured window")
    parser.add_argument("--concurrency", default=",".join(map(str, CONCURRENCIES)), help="client counts, e.g. 1,4,16")
    parser.add_argument("--formats", default=",".join(FORMATS), help="binary, json or binary,json")
    parser.add_argument("--max-batch-size", type=int, default=64, help="of the batched server")
    parser.add_argument("--device", default="cpu", help="cpu | cuda | auto")
    parser.add_argument("--out", type=Path, default=None, help="where serve.json, serve.png go (default RUN)")
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(int(os.environ.setdefault("OMP_NUM_THREADS", "1")))
    try:
        cfg = ServeBenchConfig(concurrencies=parse_counts(args.concurrency), duration_s=args.duration,
                               warmup_s=args.warmup, formats=tuple(f.strip() for f in args.formats.split(",")),
                               modes=(BatchingMode("batched", args.max_batch_size), BatchingMode("unbatched", 1)),
                               device=args.device)
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
