"""``converge serve``: load runs, build the app, run uvicorn (on uvloop and httptools when installed).

Access log lines are rendered and written by a background thread, off the event loop
(:class:`~converge.serve.access_log.AccessLog`).
Binding to anything but loopback without a token is refused unless
``insecure=True``: a served model is an open compute endpoint.
"""
from __future__ import annotations

import importlib.util
import ipaddress
import logging
import sys
from pathlib import Path
from typing import Sequence

from fastapi import FastAPI

from .app import ServerSettings, create_app
from .batcher import BatchConfig
from .fallback import TrustConfig
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


MODEL_PROCESS_SWITCH_INTERVAL_S = 0.0001


def event_loop_and_parser() -> tuple[str, str]:
    """uvicorn's ``loop`` and ``http``: uvloop and httptools (C) when installed, else asyncio and h11 (Python).

    Named explicitly so a missing package is logged rather than silently costing
    most of the throughput (``pip install 'uvicorn[standard]'`` brings both).
    """
    have = {name: importlib.util.find_spec(name) is not None for name in ("uvloop", "httptools")}
    if not all(have.values()):
        log.warning("%s not installed: serving on the pure-Python fallback, several times slower; "
                    "pip install 'uvicorn[standard]'", " and ".join(n for n, ok in have.items() if not ok))
    return ("uvloop" if have["uvloop"] else "asyncio"), ("httptools" if have["httptools"] else "h11")


def http_protocol(parser: str, direct_infer: bool = True) -> str | type:
    """uvicorn's ``http``: :class:`~converge.serve.direct.DirectInferProtocol` on httptools if ``direct_infer``,
    else the parser's name."""
    if parser == "httptools" and direct_infer:
        from .direct import DirectInferProtocol

        return DirectInferProtocol
    return parser


def serve(runs: Sequence[str | Path], host: str = "127.0.0.1", port: int = 8000, max_batch_size: int = 64,
          max_queue_delay_us: int = 0, max_queue_size: int = 1024, token: str | None = None,
          insecure: bool = False, device: str = "cpu", timeout_s: float = 30.0,
          max_body_bytes: int = 64 * 2**20, log_level: str = "info", access_log: bool = True,
          model_process: bool = True, instances: int = 1, trust: TrustConfig | None = None,
          direct_infer: bool = True) -> None:
    """Serve ``runs`` over the Open Inference Protocol until interrupted (Ctrl-C drains the queues).

    ``access_log``: one JSON line per request on stderr (logger ``converge.serve.access``, rendered and
    written by a background thread: the event loop keeps a tuple per request).

    ``model_process``: each model in a process of its own with its queue (:mod:`converge.serve.worker`);
    False: on a thread of the server, sharing its GIL.
    ``instances``: model processes per model (:class:`~converge.serve.worker.ModelInstances`).

    ``trust``: the uncertainty gate and simulator fallback (:mod:`converge.serve.fallback`).

    ``direct_infer``: POST .../infer answered from the HTTP protocol (:mod:`converge.serve.direct`; with
    httptools); False: through the ASGI app like every other route.
    """
    import uvicorn

    check_bind(host, token, insecure)
    try:
        batch = BatchConfig(max_batch_size, max_queue_delay_us, max_queue_size, timeout_s, model_process, instances)
    except ValueError as err:
        raise ServeConfigError(str(err)) from None
    if model_process:  # a request writer thread (a pile the pipe has no room for) waits for the GIL: not 5 ms
        sys.setswitchinterval(min(sys.getswitchinterval(), MODEL_PROCESS_SWITCH_INTERVAL_S))
    logging.basicConfig(level=log_level.upper(), format="%(message)s")
    app = build_app(runs, ServerSettings(batch, max_body_bytes, token, access_log, trust), device)
    for model in app.state.models.values():
        log.info("serving %s (version %s, %s, %s) at http://%s:%d/v2/models/%s", model.name, model.version,
                 model.platform, model.precision, host, port, model.name)
    loop, http = event_loop_and_parser()
    uvicorn.run(app, host=host, port=port, log_level=log_level, access_log=False, loop=loop,
                http=http_protocol(http, direct_infer),
                timeout_graceful_shutdown=int(timeout_s) + 5)
