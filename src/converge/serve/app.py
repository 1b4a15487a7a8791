"""The HTTP server: Open Inference Protocol (KServe v2) endpoints over the batchers.

``create_app(models, settings)`` returns a FastAPI app; each model gets a
:class:`~converge.serve.batcher.Batcher`, started and drained by the app's
lifespan. Errors are ``{"error": message}`` with the status the protocol's
users expect: 400 invalid request, 401 token, 404 model/version, 413 body,
500 model failure, 503 queue full (with Retry-After) or shutting down, 504 timeout.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Mapping

import anyio
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from .. import __version__
from .batcher import BatchConfig, Batcher, BatchFailed, QueueFull, RequestTimeout, ShuttingDown
from .metrics import ServerMetrics
from .protocol import HEADER_LENGTH, ValidationError, encode_infer_response, parse_infer_request
from .registry import ServedModel

access_log = logging.getLogger("converge.serve.access")
UNAUTHENTICATED = ("/v2/health/live", "/v2/health/ready")  # probes of orchestrators carry no token


@dataclass(frozen=True)
class ServerSettings:
    batch: BatchConfig = field(default_factory=BatchConfig)
    max_body_bytes: int = 64 * 2**20
    token: str | None = None  # bearer token required on every endpoint but the health probes

    def __post_init__(self) -> None:
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes={self.max_body_bytes}: must be >= 1024")
        if self.token is not None and len(self.token) < 8:
            raise ValueError("token: use at least 8 characters (e.g. `python -c 'import secrets; "
                             "print(secrets.token_urlsafe())'`)")


class ServeError(Exception):
    """An HTTP error with its status (404, 413)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


# exception -> (status, failure reason for the metrics)
ERRORS: dict[type[Exception], tuple[int, str]] = {
    ValidationError: (400, "invalid"), QueueFull: (503, "queue_full"), ShuttingDown: (503, "shutting_down"),
    RequestTimeout: (504, "timeout"), BatchFailed: (500, "model_error"),
}


def error_response(err: Exception) -> JSONResponse:
    if isinstance(err, ServeError):
        return JSONResponse({"error": str(err)}, err.status)
    status = next(s for cls, (s, _) in ERRORS.items() if isinstance(err, cls))
    headers = {"Retry-After": str(QueueFull.retry_after_s)} if isinstance(err, QueueFull) else None
    return JSONResponse({"error": str(err)}, status, headers=headers)


def authorized(header: str | None, token: str) -> bool:
    scheme, _, given = (header or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), token.encode())


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refused (413) past ``limit`` bytes whether declared or streamed."""
    declared = request.headers.get("content-length", "")
    too_large = f"request body exceeds the server's limit of {limit} bytes; send fewer samples per request"
    if declared.isdigit() and int(declared) > limit:
        raise ServeError(413, too_large)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ServeError(413, too_large)
        chunks.append(chunk)
    return b"".join(chunks)


def create_app(models: Mapping[str, ServedModel], settings: ServerSettings = ServerSettings()) -> FastAPI:
    """The KServe v2 app serving ``models`` (by name) with ``settings``."""
    for key, model in models.items():
        if key != model.name:
            raise ValueError(f"models[{key!r}] is named {model.name!r}; key the dict by model name")
    metrics = ServerMetrics()
    batchers = {name: Batcher(m.predict, settings.batch, name, on_batch=metrics.batch_observer(name), start=False)
                for name, m in models.items()}
    for name, b in batchers.items():
        metrics.queued.labels(name).set_function(lambda b=b: b.queued_samples)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        for b in batchers.values():
            b.start()
        try:
            yield
        finally:  # finish what is queued, then stop the workers
            for b in batchers.values():
                await anyio.to_thread.run_sync(b.close)

    app = FastAPI(title="converge", version=__version__, lifespan=lifespan, openapi_url=None)
    app.state.models, app.state.batchers, app.state.metrics = models, batchers, metrics

    async def as_json_error(request: Request, err: Exception) -> JSONResponse:
        return error_response(err)

    for cls in (*ERRORS, ServeError):
        app.add_exception_handler(cls, as_json_error)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
        return JSONResponse({"error": str(err.detail)}, err.status_code)

    @app.middleware("http")
    async def guard_and_log(request: Request, call_next):
        t0 = time.perf_counter()
        if settings.token and request.url.path not in UNAUTHENTICATED \
                and not authorized(request.headers.get("authorization"), settings.token):
            response = JSONResponse({"error": "missing or wrong bearer token; send 'Authorization: Bearer <token>'"},
                                    401, headers={"WWW-Authenticate": "Bearer"})
        else:
            response = await call_next(request)
        route = request.scope.get("route")
        metrics.http.labels(request.method, getattr(route, "path", "unmatched"), str(response.status_code)).inc()
        if access_log.isEnabledFor(logging.INFO):
            access_log.info(json.dumps({
                "ts": round(time.time(), 3), "method": request.method, "path": request.url.path,
                "status": response.status_code, "ms": round(1e3 * (time.perf_counter() - t0), 3),
                "client": request.client.host if request.client else None,
                "bytes_in": int(request.headers.get("content-length") or 0)}))
        return response

    def find(name: str, version: str | None) -> ServedModel:
        if name not in models:
            raise ServeError(404, f"unknown model {name!r}; serving: {', '.join(sorted(models)) or 'none'}")
        model = models[name]
        if version is not None and version != model.version:
            raise ServeError(404, f"model {name!r} has no version {version!r}; serving version {model.version!r}")
        return model

    @app.get("/v2/health/live")
    async def live() -> dict:
        return {"live": True}

    @app.get("/v2/health/ready")
    async def ready() -> JSONResponse:
        ok = all(b.running for b in batchers.values())
        return JSONResponse({"ready": ok}, 200 if ok else 503)

    @app.get("/v2")
    async def server_metadata() -> dict:
        return {"name": "converge", "version": __version__, "extensions": ["binary_tensor_data"]}

    @app.get("/v2/models/{name}")
    @app.get("/v2/models/{name}/versions/{version}")
    async def model_metadata(name: str, version: str | None = None) -> dict:
        return find(name, version).metadata()

    @app.get("/v2/models/{name}/ready")
    @app.get("/v2/models/{name}/versions/{version}/ready")
    async def model_ready(name: str, version: str | None = None) -> JSONResponse:
        ok = batchers[find(name, version).name].running
        return JSONResponse({"name": name, "ready": ok}, 200 if ok else 503)

    @app.post("/v2/models/{name}/infer")
    @app.post("/v2/models/{name}/versions/{version}/infer")
    async def infer(name: str, request: Request, version: str | None = None) -> Response:
        model = find(name, version)
        body = await read_body(request, settings.max_body_bytes)
        try:
            parsed = parse_infer_request(body, request.headers.get(HEADER_LENGTH), model.inputs, model.outputs)
            if parsed.batch_size > settings.batch.max_batch_size:
                raise ValidationError(f"{parsed.batch_size} samples exceed max_batch_size="
                                      f"{settings.batch.max_batch_size}; split the request")
            future = batchers[model.name].submit(parsed.inputs)
            try:
                results = await asyncio.wait_for(asyncio.wrap_future(future), settings.batch.timeout_s)
            except asyncio.TimeoutError:
                raise RequestTimeout(f"model {name!r}: no result within {settings.batch.timeout_s:g} s") from None
        except tuple(ERRORS) as err:
            metrics.request_done(model.name, next(r for cls, (_, r) in ERRORS.items() if isinstance(err, cls)))
            raise
        metrics.request_done(model.name, None)
        content, headers = encode_infer_response(model.name, model.version, parsed, results)
        return Response(content, headers=headers)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    return app
