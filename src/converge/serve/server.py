"""``converge serve``: load runs, build the app, run uvicorn.

Binding to anything but loopback without a token is refused unless
``insecure=True``: a served model is an open compute endpoint.
"""
from __future__ import annotations

import ipaddress
import logging
from pathlib import Path
from typing import Sequence

from fastapi import FastAPI

from .app import ServerSettings, create_app
from .batcher import BatchConfig
from .registry import ModelLoadError, ServedModel, load_served_model

log = logging.getLogger("converge.serve")


class ServeConfigError(ValueError):
    """Settings that would make an unsafe or broken server."""


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: assume it is reachable from outside


def check_bind(host: str, token: str | None, insecure: bool) -> None:
    """Refuse a non-loopback bind without a token unless the user said ``insecure``."""
    if not is_loopback(host) and not token and not insecure:
        raise ServeConfigError(f"refusing to serve on {host!r} without a token: anyone who can reach it could run "
                               "the models. Pass --token (clients send 'Authorization: Bearer <token>'), bind "
                               "127.0.0.1, or pass --insecure if the network is trusted")


def parse_run(spec: str | Path) -> tuple[str | None, Path]:
    """``PATH`` or ``NAME=PATH`` -> (name or None, path)."""
    text = str(spec)
    if "=" in text and not Path(text).exists():
        name, _, path = text.partition("=")
        return name, Path(path)
    return None, Path(text)


def load_runs(runs: Sequence[str | Path], device: str = "cpu") -> dict[str, ServedModel]:
    """Served models by name, one per run (``PATH`` or ``NAME=PATH``); names must be distinct."""
    if not runs:
        raise ServeConfigError("no runs to serve: give one or more `converge train` output folders")
    models: dict[str, ServedModel] = {}
    for spec in runs:
        name, path = parse_run(spec)
        model = load_served_model(path, name=name, device=device)
        if model.name in models:
            raise ModelLoadError(f"two runs are both named {model.name!r}; name them with NAME=PATH")
        models[model.name] = model
    return models


def build_app(runs: Sequence[str | Path], settings: ServerSettings = ServerSettings(), device: str = "cpu") -> FastAPI:
    return create_app(load_runs(runs, device), settings)


def serve(runs: Sequence[str | Path], host: str = "127.0.0.1", port: int = 8000, max_batch_size: int = 64,
          max_queue_delay_us: int = 0, max_queue_size: int = 1024, token: str | None = None,
          insecure: bool = False, device: str = "cpu", timeout_s: float = 30.0,
          max_body_bytes: int = 64 * 2**20, log_level: str = "info") -> None:
    """Serve ``runs`` over the Open Inference Protocol until interrupted (Ctrl-C drains the queues)."""
    import uvicorn

    check_bind(host, token, insecure)
    batch = BatchConfig(max_batch_size, max_queue_delay_us, max_queue_size, timeout_s)
    app = build_app(runs, ServerSettings(batch, max_body_bytes, token), device)
    logging.basicConfig(level=log_level.upper(), format="%(message)s")
    for model in app.state.models.values():
        log.info("serving %s (version %s, %s, %s) at http://%s:%d/v2/models/%s", model.name, model.version,
                 model.platform, model.precision, host, port, model.name)
    uvicorn.run(app, host=host, port=port, log_level=log_level, access_log=False,
                timeout_graceful_shutdown=int(timeout_s) + 5)
