"""Peer servers for the serving benchmark: the same converge model served by Triton, MLServer and LitServe.

Only the server differs. Each peer runs in its own virtual environment (:mod:`.peer_envs`) the very
``load_served_model(run).predict`` our server runs (:mod:`.peer_runtimes`): same code, same precision, one
torch thread per model worker.

- Triton (``tritonserver`` 2.51 of nvidia-pytriton, on the CPU): our model on its Python backend, dynamic
  batching, at ``/v2/models/{name}/infer``, over our own binary requests (Triton's binary tensor extension);
- MLServer, adaptive batching, parallel workers: KServe v2 JSON at ``/v2/models/{name}/infer``;
- LitServe, batching, workers: the same JSON body at ``/predict``, answered as v2 outputs.

:class:`PeerServer` starts one at one :class:`.peer_settings.PeerSettings` on a free 127.0.0.1 port and
waits for it; :func:`measure_peer` checks its answer against our model's and sweeps it with the load
generator at every setting of its grid, and :func:`best_over_settings` picks its best point;
:func:`ours_at_peer_best` puts our best throughput at a p99 no worse than the peer's there beside it.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Collection, Mapping, Sequence

import numpy as np

from .loadgen import InferTarget, LoadProcess
from .peer_envs import PeerError, check_peer, ensure_peer_env, peer_versions
from .peer_settings import (RUNTIMES, PeerSettings, mlserver_model_settings, mlserver_settings, native_settings,
                            settings_dict, triton_model_config)
from .peer_wire import JSON_HEADERS, decode_v2_response, restore_output_shapes, v2_json_request
from .server_process import free_port, log_tail, process_cpu_seconds

if TYPE_CHECKING:
    from .serve import ServeBenchConfig  # serve imports this module: the config is only a type here

PEER_FORMATS = {"triton": "binary", "mlserver": "json", "litserve": "json"}  # the best each speaks
GAIN_TARGETS = {"triton": 1.0, "mlserver": 1.3, "litserve": 1.3}  # ours over the peer's best, at equal p99


class PeerAnswerError(PeerError):
    """A peer answered something other than our model does: no setting of it can be trusted."""


def infer_path(peer: str, name: str) -> str:
    """Where ``peer`` answers inference of model ``name``."""
    return "/predict" if check_peer(peer) == "litserve" else f"/v2/models/{name}/infer"


def triton_dist(python: Path) -> Path:
    """``pytriton/tritonserver`` (bin/, backends/python/, python_backend_stubs/) in the environment of ``python``."""
    found = sorted((Path(python).parent.parent / "lib").glob("python3*/site-packages/pytriton/tritonserver"))
    if not found:
        raise PeerError(f"no pytriton/tritonserver under {Path(python).parent.parent}: is nvidia-pytriton installed?")
    return found[0]


def write_triton_repository(folder: Path, name: str, signature: tuple[Sequence, Sequence], settings: PeerSettings,
                            run_dir: str | Path, threads: int) -> tuple[Path, Path]:
    """``folder/models/NAME/{config.pbtxt,1/model.py}`` and an empty ``folder/backends/python``, which
    :class:`PeerServer` fills with links to the environment's Python backend: (model repository, backends)."""
    models, backends = folder / "models", folder / "backends"
    (models / name / "1").mkdir(parents=True, exist_ok=True)
    (backends / "python").mkdir(parents=True, exist_ok=True)
    (models / name / "config.pbtxt").write_text(triton_model_config(name, *signature, settings, run_dir, threads))
    (models / name / "1" / "model.py").write_text(f"from {RUNTIMES} import TritonPythonModel  # noqa: F401\n")
    return models, backends


class PeerServer:
    """``peer`` serving ``run_dir`` as ``name`` at ``settings`` in a subprocess (its own session) on a free
    127.0.0.1 port, output in ``log_path``; ``path`` answers inference. ``signature`` (our model's input and output
    specs) is what Triton's config declares. SIGINT on exit, then SIGKILL to its process group."""

    def __init__(self, peer: str, python: Path, run_dir: Path, name: str, log_path: Path, settings: PeerSettings,
                 threads: int = 1, startup_timeout_s: float = 180.0,
                 signature: tuple[Sequence, Sequence] | None = None) -> None:
        self.peer, self.python, self.run_dir, self.name = check_peer(peer), Path(python), Path(run_dir), name
        self.log_path, self.settings, self.threads, self.signature = log_path, settings, threads, signature
        if peer == "triton" and signature is None:
            raise ValueError("triton: give the model's signature (its config declares every tensor)")
        self.startup_timeout_s = startup_timeout_s
        self.path = infer_path(peer, name)
        self.url = ""
        self._proc: subprocess.Popen | None = None
        self._scratch = tempfile.TemporaryDirectory(prefix=f"converge-{peer}-")

    def command(self, port: int) -> tuple[list[str], str, dict[str, str]]:
        """The command line, the path that answers 200 once the model is loaded, and extra environment."""
        scratch = Path(self._scratch.name)
        if self.peer == "triton":
            dist = triton_dist(self.python)
            models, backends = write_triton_repository(scratch, self.name, self.signature, self.settings,
                                                       self.run_dir, self.threads)
            for src in (dist / "backends" / "python").glob("*.*"):
                (backends / "python" / src.name).unlink(missing_ok=True)
                (backends / "python" / src.name).symlink_to(src)
            stub = backends / "python" / "triton_python_backend_stub"
            stub.unlink(missing_ok=True)
            stub.symlink_to(dist / "python_backend_stubs" / "3.11" / "triton_python_backend_stub")
            cmd = [str(dist / "bin" / "tritonserver"), "--model-repository", str(models), "--backend-directory",
                   str(backends), "--http-address", "127.0.0.1", "--http-port", str(port), "--allow-grpc", "false",
                   "--allow-metrics", "false", "--exit-timeout-secs", "5",
                   f"--backend-config=python,shm-region-prefix-name=converge-{os.getpid()}-{port}"]
            # the stub's embedded libpython3.11 finds this environment through PATH, as PyTriton arranges it
            env = {"PATH": f"{self.python.parent}:{os.environ.get('PATH', '')}",
                   "LD_LIBRARY_PATH": str(dist.parent.parent / "nvidia_pytriton.libs")}
            return cmd, f"/v2/models/{self.name}/ready", env
        if self.peer == "mlserver":
            (scratch / self.name).mkdir(parents=True, exist_ok=True)
            (scratch / "settings.json").write_text(json.dumps(mlserver_settings(port, free_port(),
                                                                                self.settings.workers), indent=2))
            model = mlserver_model_settings(self.name, self.run_dir, self.settings, self.threads)
            (scratch / self.name / "model-settings.json").write_text(json.dumps(model, indent=2))
            return [str(self.python.parent / "mlserver"), "start", str(scratch)], f"/v2/models/{self.name}/ready", {}
        s = self.settings
        return [str(self.python), "-m", RUNTIMES, "litserve", str(self.run_dir), "--port", str(port),
                "--max-batch-size", str(s.max_batch_size), "--batch-timeout", str(s.delay_ms / 1000),
                "--workers", str(s.workers), "--threads", str(self.threads)], "/health", {}

    def __enter__(self) -> "PeerServer":
        import httpx

        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        cmd, ready, extra = self.command(port)
        env = {**os.environ, "OMP_NUM_THREADS": str(self.threads), "PYTHONUNBUFFERED": "1", **extra}
        env.pop("VIRTUAL_ENV", None)
        with open(self.log_path, "wb") as log:
            self._proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                          env=env, cwd=self._scratch.name, start_new_session=True)
        deadline = time.monotonic() + self.startup_timeout_s
        while True:
            if self._proc.poll() is not None:
                status = self._proc.returncode
                self.__exit__()
                raise PeerError(f"{self.peer} exited with status {status}:\n{log_tail(self.log_path)}")
            try:
                if httpx.get(self.url + ready, timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.__exit__()
                raise PeerError(f"{self.peer} not ready after {self.startup_timeout_s:g} s:\n{log_tail(self.log_path)}")
            time.sleep(0.2)

    def __exit__(self, *exc: object) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
                try:
                    proc.wait(20)
                except subprocess.TimeoutExpired:
                    pass
            try:  # Triton's stubs, LitServe's and MLServer's workers share its session
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(10)
        self._scratch.cleanup()

    def target(self, samples: Sequence[Mapping[str, np.ndarray]]) -> InferTarget:
        """What the load generator sends, one request per sample, cycled: Triton our binary requests themselves,
        the others :func:`.peer_wire.v2_json_request`."""
        if self.peer == "triton":
            return InferTarget.from_inputs(self.url, self.name, samples, binary=True)
        bodies = tuple((v2_json_request(x), JSON_HEADERS) for x in samples)
        return InferTarget(self.url, self.name, bodies, len(next(iter(samples[0].values()))), path=self.path)

    def infer(self, sample: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The peer's answer to ``sample``, sent as the load generator sends it, in our signature's shapes."""
        import httpx

        from ..serve.protocol import HEADER_LENGTH, decode_infer_response

        (body, headers), = self.target([sample]).requests
        answer = httpx.post(self.url + self.path, content=body, headers=dict(headers), timeout=60)
        if answer.status_code != 200:
            raise PeerError(f"{self.peer} answered HTTP {answer.status_code}: {answer.text[:300]}")
        if self.peer != "triton":
            return decode_v2_response(answer.content)
        got = decode_infer_response(answer.content, answer.headers.get(HEADER_LENGTH))
        return restore_output_shapes(got, {t.name: t.shape for t in self.signature[1]})

    def cpu_seconds(self) -> float:
        """CPU seconds the peer's processes (its server and every model instance) have used so far."""
        return process_cpu_seconds(self._proc.pid) if self._proc is not None else float("nan")

    def front_cpu_seconds(self) -> float:
        """CPU seconds of the peer's own process alone (tritonserver's C++ front end and scheduler, without the
        Python backend stubs that run the model; MLServer's and LitServe's main process)."""
        return process_cpu_seconds(self._proc.pid, descendants=False) if self._proc is not None else float("nan")

    def counters(self) -> tuple[float, float] | None:
        """(samples inferred, model executions) so far, from Triton's statistics; None for the other peers."""
        if self.peer != "triton":
            return None
        import httpx

        stats = httpx.get(f"{self.url}/v2/models/{self.name}/stats", timeout=10).json()["model_stats"][0]
        return float(stats["inference_count"]), float(stats["execution_count"])


# -- measuring and comparing -------------------------------------------------------------------------------------------
def check_peer_answer(peer: str, got: Mapping[str, np.ndarray], reference: Mapping[str, np.ndarray],
                      precision: str) -> float:
    """The largest difference between a peer's outputs and our model's on the same input; a PeerError when an
    output is missing, of another shape, or off by more than the precision allows (both run the same code):
    a PeerAnswerError."""
    rtol, atol = (1e-5, 1e-6) if precision == "fp32" else (2e-2, 2e-2)  # bf16/fp16 keep ~3 significant digits
    if sorted(got) != sorted(reference):
        raise PeerAnswerError(f"{peer} answered outputs {sorted(got)}, our model gives {sorted(reference)}")
    worst = 0.0
    for name, want in reference.items():
        have = np.asarray(got[name])
        if have.shape != want.shape:
            raise PeerAnswerError(f"{peer}: output {name!r} has shape {list(have.shape)}, ours {list(want.shape)}")
        if not np.allclose(have, want, rtol=rtol, atol=atol):
            raise PeerAnswerError(f"{peer}: output {name!r} differs from our model's by up to "
                            f"{np.abs(have - want).max():.3g} (rtol {rtol:g}, atol {atol:g})")
        worst = max(worst, float(np.abs(have.astype(np.float64) - want).max()) if want.size else 0.0)
    return worst


def fastest_clean(rows: Sequence[Mapping[str, Any]]) -> Mapping[str, Any] | None:
    """The row of highest throughput among those without errors (all rows if none is clean)."""
    clean = [r for r in rows if r["errors"] == 0 and r["requests"] > 0] or list(rows)
    return max(clean, key=lambda r: r["throughput_sps"], default=None)


def best_over_settings(runs: Sequence[Mapping[str, Any]]) -> tuple[Mapping[str, Any], Mapping[str, Any]]:
    """(the run, its row) of the fastest clean point over every setting's sweep; runs that failed to start
    (``error``) or answered only errors are passed over. A PeerError when no setting gave a clean point."""
    clean = [(run, row) for run in runs if "error" not in run for row in run["sweep"]
             if row["errors"] == 0 and row["requests"] > 0]
    if not clean:
        reasons = "; ".join(f"{r['settings']}: {r.get('error', 'errors only')}" for r in runs)
        raise PeerError(f"no setting gave a clean measurement ({reasons or 'no settings'})")
    return max(clean, key=lambda pair: pair[1]["throughput_sps"])


def measure_settings(server: PeerServer, samples: Sequence[Mapping[str, np.ndarray]],
                     reference: Mapping[str, np.ndarray], precision: str, load: LoadProcess,
                     cfg: "ServeBenchConfig") -> dict:
    """Check the started ``server``'s answer to ``samples[0]``, then sweep it over ``cfg.concurrencies``."""
    max_diff = check_peer_answer(server.peer, server.infer(samples[0]), reference, precision)
    target, sweep = server.target(samples), []
    for concurrency in cfg.concurrencies:
        before, cpu0 = server.counters(), server.cpu_seconds()
        row = load.run(target, concurrency, cfg.duration_s, cfg.warmup_s, cfg.timeout_s).as_dict()
        after, cpu1 = server.counters(), server.cpu_seconds()
        batch = None if before is None else (after[0] - before[0]) / max(after[1] - before[1], 1)
        # samples over the same span as the CPU seconds: the server's count (Triton), else the load's rate
        # over its warm-up and window (MLServer, LitServe keep none)
        served = after[0] - before[0] if before is not None else row["throughput_sps"] * (cfg.warmup_s + cfg.duration_s)
        sweep.append({"peer": server.peer, "format": PEER_FORMATS[server.peer], "settings": server.settings.label,
                      **row, "mean_batch_size": batch,
                      "server_cpu_us_per_sample": 1e6 * (cpu1 - cpu0) / served if served > 0 else float("nan")})
    return {"settings": server.settings.label, "max_abs_diff_vs_ours": max_diff, "sweep": sweep}


def measure_peer(peer: str, run_dir: Path, name: str, signature: tuple[Sequence, Sequence],
                 samples: Sequence[Mapping[str, np.ndarray]], reference: Mapping[str, np.ndarray], precision: str,
                 load: LoadProcess, cfg: "ServeBenchConfig", log_dir: Path, threads: int = 1) -> dict:
    """``peer`` (its environment made once) on ``run_dir`` at every setting of ``cfg.peer_settings_for(peer)``:
    its answer checked against ``reference`` (our model's), then swept with the same load as ours. A setting
    that will not start is recorded and passed over; a wrong answer at any setting fails the peer.

    The grid only selects: the best of many noisy sweeps is biased upward (ours is swept once), so with
    ``cfg.peer_confirm`` the selected setting is started and swept again, and that pass is the one reported
    (``confirm_sweep``; the grid's own best stays as ``throughput_best_in_grid``)."""
    python = ensure_peer_env(peer, cfg.peer_env_root)
    grid = cfg.peer_settings_for(peer)

    def measure(settings: PeerSettings, tag: str = "") -> dict:
        entry = {"settings": settings.label, "values": settings_dict(settings),
                 "native": native_settings(peer, settings)}
        log = log_dir / f"peer-{peer}-{settings.label}{tag}.log"
        try:
            with PeerServer(peer, python, run_dir, name, log, settings, threads, cfg.startup_timeout_s,
                            signature) as server:
                return entry | measure_settings(server, samples, reference, precision, load, cfg)
        except PeerAnswerError:
            raise
        except PeerError as err:
            return entry | {"error": str(err)}

    runs = [measure(settings) for settings in grid]
    best_run, best = best_over_settings(runs)
    out = {"peer": peer, "format": PEER_FORMATS[peer], "versions": peer_versions(python),
           "path": infer_path(peer, name), "settings_grid": [r["values"] for r in runs],
           "settings_best": best_run["values"], "native_settings_best": best_run["native"],
           "by_settings": [{k: v for k, v in r.items() if k != "sweep"} | _run_best(r) for r in runs],
           "sweep": [row for r in runs for row in r.get("sweep", [])],
           "throughput_best_in_grid": best["throughput_sps"]}
    if cfg.peer_confirm and len(runs) > 1:
        again = measure(grid[runs.index(best_run)], "-confirm")
        clean = [r for r in again.get("sweep", []) if r["errors"] == 0 and r["requests"] > 0]
        if clean:
            runs.append(again)
            best = max(clean, key=lambda r: r["throughput_sps"])
            out["confirm_sweep"] = again["sweep"]
        else:  # the grid's figures stand, and the report says why they were not confirmed
            out["confirm_error"] = again.get("error", "the second pass answered only errors")
    return out | {"max_abs_diff_vs_ours": max(r["max_abs_diff_vs_ours"] for r in runs if "error" not in r),
                  "throughput_best": best["throughput_sps"], "concurrency_best": best["concurrency"],
                  "p99_ms_best": best["p99_ms"], "mean_batch_size_best": best["mean_batch_size"],
                  "server_cpu_us_per_sample_best": best.get("server_cpu_us_per_sample")}


def _run_best(run: Mapping[str, Any]) -> dict:
    """One setting's fastest clean point (nothing for a setting that did not start or answered only errors)."""
    clean = [r for r in run.get("sweep", []) if r["errors"] == 0 and r["requests"] > 0]
    if not clean or "error" in run:
        return {}
    best = max(clean, key=lambda r: r["throughput_sps"])
    return {"throughput_best": best["throughput_sps"], "concurrency_best": best["concurrency"],
            "p99_ms_best": best["p99_ms"]}


def throughput_at_p99(sweep: Sequence[Mapping[str, Any]], p99_ms: float, modes: Collection[str] = ("batched",),
                      fmt: str = "json") -> Mapping[str, Any] | None:
    """Our fastest clean point of any of ``modes`` in ``fmt`` whose p99 is at most ``p99_ms``; None when none is."""
    fits = [r for r in sweep if r["mode"] in modes and r["format"] == fmt and r["errors"] == 0 and r["requests"] > 0
            and r["p99_ms"] is not None and r["p99_ms"] <= p99_ms]
    return max(fits, key=lambda r: r["throughput_sps"], default=None)


def ours_at_peer_best(sweep: Sequence[Mapping[str, Any]], name: str, peer: Mapping[str, Any],
                      modes: Collection[str] = ("batched",)) -> dict:
    """Our best throughput in the peer's format at a p99 no worse than the peer's at its best, and the gain over
    the peer's best throughput (None when no point of ours is as quick), beside the target."""
    fmt = peer.get("format", "json")
    ours = throughput_at_p99(sweep, peer["p99_ms_best"], modes, fmt)
    gain = ours["throughput_sps"] / peer["throughput_best"] if ours is not None else None
    target = GAIN_TARGETS.get(name, 1.3)
    found = ours if ours is not None else {}
    return {"format": fmt, "throughput": found.get("throughput_sps"), "p99_ms": found.get("p99_ms"),
            "concurrency": found.get("concurrency"), "mode": found.get("mode"), "settings": found.get("settings"),
            "gain": gain, "gain_target": target,
            "meets_target": gain is not None and gain >= target}


def compare_with_peers(sweep: Sequence[Mapping[str, Any]], peers: Mapping[str, Mapping[str, Any]],
                       modes: Collection[str] = ("batched",)) -> dict:
    """Ours beside every measured peer (:func:`ours_at_peer_best`, by name under ``vs_peers``), and the peer
    hardest to beat, the one of lowest gain (no point of ours as quick counts as 0), under the summary keys:
    ``peer``, ``peer_format``, ``peer_throughput_at_equal_p99`` (its best), ``peer_p99_ms_best``,
    ``throughput_at_peer_p99`` (ours), ``p99_ms_at_peer_p99`` and ``gain_vs_peer_at_equal_p99``."""
    measured = {k: p for k, p in peers.items() if p.get("throughput_best") and p.get("p99_ms_best") is not None}
    if not measured:
        return {"peer": None, "peer_throughput_at_equal_p99": None, "gain_vs_peer_at_equal_p99": None, "vs_peers": {}}
    vs = {name: ours_at_peer_best(sweep, name, p, modes) for name, p in measured.items()}
    name = min(vs, key=lambda n: vs[n]["gain"] or 0.0)
    peer, ours = measured[name], vs[name]
    return {"peer": name, "peer_format": ours["format"], "peer_throughput_at_equal_p99": peer["throughput_best"],
            "peer_p99_ms_best": peer["p99_ms_best"], "peer_concurrency_best": peer["concurrency_best"],
            "throughput_at_peer_p99": ours["throughput"], "p99_ms_at_peer_p99": ours["p99_ms"],
            "concurrency_at_peer_p99": ours["concurrency"], "gain_vs_peer_at_equal_p99": ours["gain"], "vs_peers": vs}
