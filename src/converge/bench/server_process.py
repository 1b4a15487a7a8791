"""``converge serve`` as a subprocess for the benchmarks: start on a free port, wait until ready, drain on exit."""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np


def process_cpu_seconds(pid: int, descendants: bool = True) -> float:
    """User + system CPU seconds used so far by process ``pid`` and its live descendants (the model processes of
    ``converge serve``), or by ``pid`` alone; from Linux's /proc; NaN where /proc cannot tell (another OS, or
    ``pid`` gone)."""
    proc = Path(f"/proc/{pid}")
    try:
        fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()  # fields after the command's parentheses
        children = [int(c) for task in (proc / "task").iterdir() for c in (task / "children").read_text().split()]
    except (OSError, ValueError, IndexError):
        return float("nan")
    own = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime (stat fields 14, 15)
    if not descendants:
        return own
    return own + sum(np.nan_to_num(process_cpu_seconds(c)) for c in children)  # a child gone meanwhile: 0


class ServeBenchError(RuntimeError):
    """The server would not start or answer; the message carries the tail of its log."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def log_tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


class ServerProcess:
    """``converge serve NAME=RUN`` on a free 127.0.0.1 port, its output in ``log_path``; SIGINT drains it on exit."""

    def __init__(self, run_dir: Path, name: str, max_batch_size: int, log_path: Path, device: str = "cpu",
                 startup_timeout_s: float = 180.0, threads: int = 1, model_process: bool = True,
                 instances: int = 1, max_queue_delay_us: int = 0) -> None:
        self.run_dir, self.name, self.max_batch_size, self.log_path = Path(run_dir), name, max_batch_size, log_path
        self.device, self.startup_timeout_s, self.threads = device, startup_timeout_s, threads
        self.model_process, self.instances, self.max_queue_delay_us = model_process, instances, max_queue_delay_us
        self.url = ""
        self._proc: subprocess.Popen | None = None

    def __enter__(self) -> "ServerProcess":
        import httpx

        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        cmd = [sys.executable, "-m", "converge", "serve", f"{self.name}={self.run_dir}", "--host", "127.0.0.1",
               "--port", str(port), "--max-batch-size", str(self.max_batch_size), "--max-queue-delay-us",
               str(self.max_queue_delay_us),
               "--device", self.device, "--model-process" if self.model_process else "--no-model-process",
               "--instances", str(self.instances)]
        with open(self.log_path, "wb") as log:
            self._proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                          env={**os.environ, "OMP_NUM_THREADS": str(self.threads)})
        deadline = time.monotonic() + self.startup_timeout_s
        while True:
            if self._proc.poll() is not None:
                raise ServeBenchError(f"`converge serve` exited with status {self._proc.returncode}:\n"
                                      f"{log_tail(self.log_path)}")
            try:
                if httpx.get(f"{self.url}/v2/models/{self.name}/ready", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.__exit__()
                raise ServeBenchError(f"`converge serve` not ready after {self.startup_timeout_s:g} s:\n"
                                      f"{log_tail(self.log_path)}")
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

    def cpu_seconds(self) -> float:
        """CPU seconds the server and its model processes have used so far (:func:`process_cpu_seconds`)."""
        return process_cpu_seconds(self._proc.pid) if self._proc is not None else float("nan")

    def front_cpu_seconds(self) -> float:
        """CPU seconds of the server's own process alone (the HTTP front end: parsing, batching, answering)."""
        return process_cpu_seconds(self._proc.pid, descendants=False) if self._proc is not None else float("nan")

    def counters(self) -> tuple[float, float]:
        """(samples inferred, model calls) so far, from the server's own Prometheus counters."""
        import httpx

        text = httpx.get(f"{self.url}/metrics", timeout=10).text

        def value(metric: str) -> float:
            found = re.search(rf'^{metric}_total\{{model="{re.escape(self.name)}"\}} (\S+)$', text, re.M)
            return float(found.group(1)) if found else 0.0

        return value("converge_inference_samples"), value("converge_inference_executions")


def check_server(url: str, name: str, sample: Mapping[str, np.ndarray], outputs: Sequence[str]) -> None:
    """One request through the real client, JSON and binary: the outputs must be the signature's (plus ``source``
    where the server gates the run's inputs by its recorded envelope, ``ood.json``)."""
    from ..serve.client import Client
    from ..serve.fallback import SOURCE

    with Client(url, timeout=60) as client:
        for binary in (False, True):
            got = client.infer(name, sample, binary=binary)
            if sorted(set(got) - {SOURCE.name}) != sorted(outputs):
                raise ServeBenchError(f"the server answered outputs {sorted(got)}, expected {sorted(outputs)}")
