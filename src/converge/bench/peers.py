"""Peer servers for the serving benchmark: the same converge model served by MLServer and by LitServe.

Only the server differs. Each peer lives in its own virtual environment
(``runs/peer-envs/<peer>``, made on demand by :func:`ensure_peer_env`: MLServer
pins ``fastapi<0.116``, converge's own environment does not), with converge
installed there editable and without its dependencies, so the peer runs the
very ``load_served_model(run).predict`` our server runs (:mod:`.peer_runtimes`):
same code, same precision, one torch thread.

- MLServer, adaptive batching: KServe v2 JSON at ``/v2/models/{name}/infer``;
- LitServe, batching: the same JSON body at ``/predict``, answered as v2 outputs.

:class:`PeerServer` starts one on a free 127.0.0.1 port and waits for it;
:func:`measure_peer` checks one answer against our model's and sweeps it with
the load generator; :func:`compare_with_peers` puts our best throughput at a
p99 no worse than the better peer's beside that peer's best. The encoders of
requests and settings are pure functions, tested without the peers installed.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import numpy as np

from ..data.atomic import atomic_write_bytes
from ..serve.protocol import DATATYPES, datatype_of
from .loadgen import InferTarget, LoadProcess
from .server_process import free_port, log_tail

if TYPE_CHECKING:
    from .serve import ServeBenchConfig  # serve imports this module: the config is only a type here

PEERS = ("mlserver", "litserve")
SOURCE_ROOT = Path(__file__).resolve().parents[3]  # the converge checkout: src/converge/bench/peers.py
DEFAULT_ENV_ROOT = SOURCE_ROOT / "runs" / "peer-envs"
# torch first and pinned: 2.13.0 is this machine's local CPU build; any other version would pull GBs of CUDA
TORCH_REQUIREMENT = "torch==2.13.0"
PEER_REQUIREMENTS = {"mlserver": ("mlserver==1.7.1",), "litserve": ("litserve==0.2.19",)}
# what importing converge.serve.registry and loading a gw or chem run import (converge goes in with --no-deps)
MODEL_REQUIREMENTS = ("numpy>=1.26,<2.4", "scipy>=1.11,<1.17", "torchani>=2.9", "ase>=3.23", "fastapi>=0.115",
                      "httpx>=0.27", "orjson>=3.9", "prometheus-client>=0.20", "rich>=13")
READY_MARKER = ".converge-peer-env.json"
JSON_HEADERS = (("Content-Type", "application/json"),)
RUNTIMES = "converge.bench.peer_runtimes"  # the module the peers run (MLServerRuntime, LitServeAPI)


class PeerError(RuntimeError):
    """A peer environment or server that could not be set up, started or trusted; says why."""


# -- environments ----------------------------------------------------------------------------------------------------
def check_peer(peer: str) -> str:
    if peer not in PEERS:
        raise ValueError(f"peer {peer!r}: choose from {', '.join(PEERS)}")
    return peer


def peer_requirements(peer: str) -> tuple[str, ...]:
    """What goes into the peer's environment after torch: the peer and what our model loading imports."""
    return (*PEER_REQUIREMENTS[check_peer(peer)], *MODEL_REQUIREMENTS)


def pip_check_problems(report: str) -> list[str]:
    """The lines of ``pip check`` that matter. Converge goes in with ``--no-deps``: its requirements that the
    served models never import (lalsuite, pycbc, pyscf, dask, ...) are missing on purpose and do not count."""
    lines = [line.strip() for line in report.splitlines() if line.strip()]
    return [line for line in lines if line != "No broken requirements found."
            and not (line.startswith("converge ") and line.endswith("which is not installed."))]


def run_checked(cmd: Sequence[str], log=lambda msg: None) -> str:
    """``cmd``'s standard output; a PeerError carrying the tail of its output when it fails."""
    log(" ".join(map(str, cmd)))
    done = subprocess.run(list(map(str, cmd)), capture_output=True, text=True)
    if done.returncode != 0:
        raise PeerError(f"`{' '.join(map(str, cmd))}` failed ({done.returncode}):\n"
                        f"{done.stdout[-2000:]}{done.stderr[-2000:]}")
    return done.stdout


def _pip(python: Path, args: Sequence[str], log) -> None:
    run_checked([python, "-m", "pip", "install", "--disable-pip-version-check", *args], log)


def ensure_peer_env(peer: str, root: str | Path = DEFAULT_ENV_ROOT, log=lambda msg: print(msg, file=sys.stderr)
                    ) -> Path:
    """The python of ``root/<peer>``, a virtual environment made here on first use: torch (pinned, first), then
    the peer and the model's imports, then converge itself (editable, ``--no-deps``), then ``pip check``."""
    env = Path(root).resolve() / check_peer(peer)
    python = env / "bin" / "python"
    wanted = {"torch": TORCH_REQUIREMENT, "requirements": list(peer_requirements(peer)), "source": str(SOURCE_ROOT)}
    marker = env / READY_MARKER
    if marker.is_file() and python.is_file() and json.loads(marker.read_text()).get("wanted") == wanted:
        return python
    log(f"{peer}: making its environment in {env} (once; minutes)")
    run_checked([sys.executable, "-m", "venv", "--clear", env], log)
    _pip(python, ["--upgrade", "pip"], log)
    _pip(python, [TORCH_REQUIREMENT], log)
    _pip(python, [TORCH_REQUIREMENT, *peer_requirements(peer)], log)  # torch repeated: nothing may move it
    _pip(python, ["--no-deps", "-e", str(SOURCE_ROOT)], log)
    report = subprocess.run([str(python), "-m", "pip", "check"], capture_output=True, text=True).stdout
    if problems := pip_check_problems(report):
        raise PeerError(f"{peer}: `pip check` in {env} reports conflicts:\n" + "\n".join(problems))
    versions = run_checked([python, "-c", "import importlib.metadata as m, json, sys; print(json.dumps("
                            "{d: m.version(d) for d in sys.argv[1:]}))", peer, "torch", "fastapi", "numpy"])
    atomic_write_bytes(marker, json.dumps({"wanted": wanted, "versions": json.loads(versions)}, indent=2).encode())
    return python


def peer_versions(python: Path) -> dict[str, str]:
    """What :func:`ensure_peer_env` installed (peer, torch, fastapi, numpy)."""
    return json.loads((python.parent.parent / READY_MARKER).read_text())["versions"]


# -- what goes over the wire: pure functions, the same tensors as our JSON requests ----------------------------------
def v2_tensor(name: str, array: np.ndarray) -> dict:
    """A KServe v2 JSON tensor: name, shape, datatype and the data flattened row-major (as our client sends)."""
    array = np.asarray(array)
    return {"name": name, "shape": list(array.shape), "datatype": datatype_of(array.dtype),
            "data": array.reshape(-1).tolist()}


def array_from_v2(data: Any, datatype: str, shape: Sequence[int]) -> np.ndarray:
    """The array of a v2 JSON tensor's parts; a clear error for a datatype or a size that does not fit."""
    if datatype not in DATATYPES:
        raise ValueError(f"datatype {datatype!r}: expected one of {', '.join(DATATYPES)}")
    array = np.asarray(data, dtype=DATATYPES[datatype])
    if array.size != int(np.prod(shape)):
        raise ValueError(f"{array.size} values do not fill shape {list(shape)}")
    return array.reshape(shape)


def v2_json_request(inputs: Mapping[str, np.ndarray]) -> bytes:
    """The body both peers get: ``{"inputs": [v2 tensors]}``, plain KServe v2 JSON (no binary extension)."""
    return json.dumps({"inputs": [v2_tensor(k, v) for k, v in inputs.items()]}).encode()


def decode_v2_tensors(tensors: Sequence[Mapping[str, Any]]) -> dict[str, np.ndarray]:
    """Arrays by name of a list of v2 JSON tensors (a request's ``inputs`` or a response's ``outputs``)."""
    return {t["name"]: array_from_v2(t["data"], t["datatype"], t["shape"]) for t in tensors}


def decode_v2_response(body: bytes) -> dict[str, np.ndarray]:
    """Output arrays by name of a v2 JSON response (MLServer's, and LitServe's as :class:`LitServeAPI` encodes)."""
    doc = json.loads(body)
    if "outputs" not in doc:
        raise ValueError(f"a response without 'outputs': {body[:300]!r}")
    return decode_v2_tensors(doc["outputs"])


def concat_samples(requests: Sequence[Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """One batch of single-sample requests: each input concatenated along axis 0, in request order."""
    return {k: np.concatenate([r[k] for r in requests]) for k in requests[0]}


def split_samples(outputs: Mapping[str, np.ndarray]) -> list[dict[str, np.ndarray]]:
    """A batch's outputs back into one single-sample answer per request (row i to request i)."""
    n = len(next(iter(outputs.values())))
    return [{k: v[i:i + 1] for k, v in outputs.items()} for i in range(n)]


def decode_litserve_request(request: Mapping[str, Any], datatypes: Mapping[str, str]) -> dict[str, np.ndarray]:
    """One request of :func:`v2_json_request` as LitServe hands it over: one sample of each input the model takes."""
    inputs = decode_v2_tensors(request["inputs"])
    if sorted(inputs) != sorted(datatypes):
        raise ValueError(f"inputs {sorted(inputs)}: the model takes {sorted(datatypes)}")
    for name, array in inputs.items():
        if datatype_of(array.dtype) != datatypes[name] or len(array) != 1:
            raise ValueError(f"input {name!r}: send one sample of {datatypes[name]}, got {array.dtype} "
                             f"shape {list(array.shape)}")
    return inputs


def mlserver_settings(http_port: int, grpc_port: int) -> dict:
    """settings.json: in-process inference (the default ``parallel_workers`` crashed here), no metrics server."""
    return {"host": "127.0.0.1", "http_port": http_port, "grpc_port": grpc_port, "parallel_workers": 0,
            "metrics_endpoint": None, "load_models_at_startup": True}


def mlserver_model_settings(name: str, run_dir: str | Path, max_batch_size: int, max_batch_time_s: float,
                            threads: int) -> dict:
    """model-settings.json: :class:`MLServerRuntime` on ``run_dir`` with adaptive batching."""
    if max_batch_size < 1 or not max_batch_time_s > 0:
        raise ValueError(f"max_batch_size={max_batch_size}, max_batch_time_s={max_batch_time_s}: need >= 1 and > 0 "
                         "(MLServer's adaptive batching wants a positive max_batch_time)")
    return {"name": name, "implementation": f"{RUNTIMES}.MLServerRuntime",
            "max_batch_size": max_batch_size, "max_batch_time": max_batch_time_s,
            "parameters": {"extra": {"run": str(Path(run_dir).resolve()), "threads": threads}}}


# -- running a peer ----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PeerBatching:
    """The peers' batching: up to ``max_batch_size`` requests, waiting at most the peer's delay for more.

    MLServer needs a positive ``max_batch_time``: 2 ms did best of 1, 2, 5 and 10 ms in a short trial (gw CNN,
    JSON, 16 and 64 clients, 2 busy cores). LitServe's ``batch_timeout`` 0 spins its worker on ``get_nowait``,
    a core lost on a small machine; 1 ms polls instead (1, 5 and 20 ms measured alike, within the noise).
    """

    max_batch_size: int = 64
    mlserver_max_batch_time_s: float = 0.002
    litserve_batch_timeout_s: float = 0.001

    def __post_init__(self) -> None:
        if self.max_batch_size < 1 or not self.mlserver_max_batch_time_s > 0 or self.litserve_batch_timeout_s < 0:
            raise ValueError(f"{self}: need max_batch_size >= 1, mlserver_max_batch_time_s > 0 and "
                             "litserve_batch_timeout_s >= 0")


def write_mlserver_repository(folder: Path, name: str, run_dir: str | Path, batching: PeerBatching, threads: int,
                              http_port: int, grpc_port: int) -> Path:
    """``folder/settings.json`` and ``folder/NAME/model-settings.json``: what ``mlserver start folder`` reads."""
    (folder / name).mkdir(parents=True, exist_ok=True)
    (folder / "settings.json").write_text(json.dumps(mlserver_settings(http_port, grpc_port), indent=2))
    model = mlserver_model_settings(name, run_dir, batching.max_batch_size, batching.mlserver_max_batch_time_s,
                                    threads)
    (folder / name / "model-settings.json").write_text(json.dumps(model, indent=2))
    return folder


class PeerServer:
    """``peer`` serving ``run_dir`` as ``name`` in a subprocess (its own session) on a free 127.0.0.1 port, output
    in ``log_path``; ``path`` is where it answers inference. SIGINT on exit, then SIGKILL to its process group."""

    def __init__(self, peer: str, python: Path, run_dir: Path, name: str, log_path: Path, batching: PeerBatching,
                 threads: int = 1, startup_timeout_s: float = 180.0) -> None:
        self.peer, self.python, self.run_dir, self.name = check_peer(peer), Path(python), Path(run_dir), name
        self.log_path, self.batching, self.threads = log_path, batching, threads
        self.startup_timeout_s = startup_timeout_s
        self.path = f"/v2/models/{name}/infer" if peer == "mlserver" else "/predict"
        self.url = ""
        self._proc: subprocess.Popen | None = None
        self._scratch = tempfile.TemporaryDirectory(prefix=f"converge-{peer}-")

    def command(self, port: int) -> tuple[list[str], str]:
        """The command line and the path that answers 200 once the model is loaded."""

        if self.peer == "mlserver":
            folder = write_mlserver_repository(Path(self._scratch.name), self.name, self.run_dir, self.batching,
                                               self.threads, port, free_port())
            return [str(self.python.parent / "mlserver"), "start", str(folder)], f"/v2/models/{self.name}/ready"
        return [str(self.python), "-m", RUNTIMES, "litserve", str(self.run_dir), "--port", str(port),
                "--max-batch-size", str(self.batching.max_batch_size), "--batch-timeout",
                str(self.batching.litserve_batch_timeout_s), "--threads", str(self.threads)], "/health"

    def __enter__(self) -> "PeerServer":
        import httpx


        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        cmd, ready = self.command(port)
        env = {**os.environ, "OMP_NUM_THREADS": str(self.threads), "PYTHONUNBUFFERED": "1"}
        env.pop("VIRTUAL_ENV", None)
        with open(self.log_path, "wb") as log:
            self._proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                          env=env, cwd=self._scratch.name, start_new_session=True)
        deadline = time.monotonic() + self.startup_timeout_s
        while True:
            if self._proc.poll() is not None:
                self.__exit__()
                raise PeerError(f"{self.peer} exited with status {self._proc.returncode}:\n{log_tail(self.log_path)}")
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
            try:  # LitServe's workers and MLServer's children share its session
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(10)
        self._scratch.cleanup()

    def target(self, samples: Sequence[Mapping[str, np.ndarray]]) -> InferTarget:
        """What the load generator sends: one :func:`v2_json_request` per sample, cycled."""
        bodies = tuple((v2_json_request(x), JSON_HEADERS) for x in samples)
        return InferTarget(self.url, self.name, bodies, len(next(iter(samples[0].values()))), path=self.path)

    def infer(self, sample: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        import httpx

        answer = httpx.post(self.url + self.path, content=v2_json_request(sample), headers=dict(JSON_HEADERS),
                            timeout=60)
        if answer.status_code != 200:
            raise PeerError(f"{self.peer} answered HTTP {answer.status_code}: {answer.text[:300]}")
        return decode_v2_response(answer.content)


# -- measuring and comparing -------------------------------------------------------------------------------------------
def check_peer_answer(peer: str, got: Mapping[str, np.ndarray], reference: Mapping[str, np.ndarray],
                      precision: str) -> float:
    """The largest difference between a peer's outputs and our model's on the same input; a PeerError when an
    output is missing, of another shape, or off by more than the precision allows (both run the same code)."""
    rtol, atol = (1e-5, 1e-6) if precision == "fp32" else (2e-2, 2e-2)  # bf16/fp16 keep ~3 significant digits
    if sorted(got) != sorted(reference):
        raise PeerError(f"{peer} answered outputs {sorted(got)}, our model gives {sorted(reference)}")
    worst = 0.0
    for name, want in reference.items():
        have = np.asarray(got[name])
        if have.shape != want.shape:
            raise PeerError(f"{peer}: output {name!r} has shape {list(have.shape)}, ours {list(want.shape)}")
        if not np.allclose(have, want, rtol=rtol, atol=atol):
            raise PeerError(f"{peer}: output {name!r} differs from our model's by up to "
                            f"{np.abs(have - want).max():.3g} (rtol {rtol:g}, atol {atol:g})")
        worst = max(worst, float(np.abs(have.astype(np.float64) - want).max()) if want.size else 0.0)
    return worst


def fastest_clean(rows: Sequence[Mapping[str, Any]]) -> Mapping[str, Any] | None:
    """The row of highest throughput among those without errors (all rows if none is clean)."""
    clean = [r for r in rows if r["errors"] == 0 and r["requests"] > 0] or list(rows)
    return max(clean, key=lambda r: r["throughput_sps"], default=None)


def measure_peer(peer: str, run_dir: Path, name: str, samples: Sequence[Mapping[str, np.ndarray]],
                 reference: Mapping[str, np.ndarray], precision: str, load: LoadProcess, cfg: "ServeBenchConfig",
                 log_dir: Path, threads: int = 1) -> dict:
    """Set up ``peer`` (once), start it on ``run_dir``, check its answer to ``samples[0]`` against ``reference``
    (our model's), then sweep it over ``cfg.concurrencies`` with the load generator: same window as ours."""
    python = ensure_peer_env(peer, cfg.peer_env_root)
    with PeerServer(peer, python, run_dir, name, log_dir / f"peer-{peer}.log", cfg.peer_batching, threads,
                    cfg.startup_timeout_s) as server:
        max_diff = check_peer_answer(peer, server.infer(samples[0]), reference, precision)
        target = server.target(samples)
        sweep = [{"peer": peer, "format": "json",
                  **load.run(target, c, cfg.duration_s, cfg.warmup_s, cfg.timeout_s).as_dict()}
                 for c in cfg.concurrencies]
    best = fastest_clean(sweep)
    return {"peer": peer, "versions": peer_versions(python), "path": server.path, "batching": asdict(cfg.peer_batching),
            "max_abs_diff_vs_ours": max_diff, "sweep": sweep, "throughput_best": best["throughput_sps"],
            "concurrency_best": best["concurrency"], "p99_ms_best": best["p99_ms"]}


def throughput_at_p99(sweep: Sequence[Mapping[str, Any]], p99_ms: float, mode: str = "batched",
                      fmt: str = "json") -> Mapping[str, Any] | None:
    """Our fastest clean point of ``mode`` and ``fmt`` whose p99 is at most ``p99_ms``; None when none is."""
    fits = [r for r in sweep if r["mode"] == mode and r["format"] == fmt and r["errors"] == 0 and r["requests"] > 0
            and r["p99_ms"] is not None and r["p99_ms"] <= p99_ms]
    return max(fits, key=lambda r: r["throughput_sps"], default=None)


def compare_with_peers(sweep: Sequence[Mapping[str, Any]], peers: Mapping[str, Mapping[str, Any]],
                       mode: str = "batched", fmt: str = "json") -> dict:
    """The better peer (highest best throughput) beside our best throughput at a p99 no worse than its p99 there.

    ``peer_throughput_at_equal_p99`` is the better peer's best throughput, at its p99 ``peer_p99_ms_best``;
    ``throughput_at_peer_p99`` ours at a p99 no worse; ``gain_vs_peer_at_equal_p99`` ours over the peer's
    (None when no point of ours is as quick). The target is a gain of 1.3.
    """
    measured = {k: p for k, p in peers.items() if p.get("throughput_best") and p.get("p99_ms_best") is not None}
    if not measured:
        return {"peer": None, "peer_throughput_at_equal_p99": None, "gain_vs_peer_at_equal_p99": None}
    name, peer = max(measured.items(), key=lambda kv: kv[1]["throughput_best"])
    ours = throughput_at_p99(sweep, peer["p99_ms_best"], mode, fmt)
    out = {"peer": name, "peer_throughput_at_equal_p99": peer["throughput_best"], "peer_p99_ms_best": peer["p99_ms_best"],
           "peer_concurrency_best": peer["concurrency_best"], "throughput_at_peer_p99": None,
           "p99_ms_at_peer_p99": None, "concurrency_at_peer_p99": None, "gain_vs_peer_at_equal_p99": None}
    if ours is not None:
        out |= {"throughput_at_peer_p99": ours["throughput_sps"], "p99_ms_at_peer_p99": ours["p99_ms"],
                "concurrency_at_peer_p99": ours["concurrency"],
                "gain_vs_peer_at_equal_p99": ours["throughput_sps"] / peer["throughput_best"]}
    return out
