"""The HTTP server: Open Inference Protocol (KServe v2) endpoints over the batchers.

``create_app(models, settings)`` returns a FastAPI app; each model gets a
:class:`~converge.serve.batcher.Batcher`, started and drained by the app's
lifespan. Errors are ``{"error": message}`` with the status the protocol's
users expect: 400 invalid request, 401 token, 404 model/version, 413 body,
422 untrusted samples and no fallback, 500 model failure, 502 simulator fallback
failed, 503 queue full (with Retry-After) or shutting down, 504 timeout (of the
queue or of the simulator fallback). ``settings.trust`` gates answers per sample
(:mod:`converge.serve.fallback`).

The infer endpoint is the hot path (:class:`InferEndpoint`). ``converge serve``
answers it straight from the HTTP protocol (:mod:`converge.serve.direct`); as
plain ASGI it is reached through a lane that skips FastAPI's middleware and
router (:class:`ServingApp`). Either way it waits for the batcher on the
event loop (``RequestQueue.submit_waiter``), never a thread per request.
"""
from __future__ import annotations

import asyncio
import gc
import hmac
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from typing import Any, Coroutine, Mapping, NamedTuple, Sequence

import anyio
import numpy as np
import torch
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match, Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .. import __version__
from .access_log import AccessLog
from .batcher import (Awaited, BatchConfig, Batcher, BatchFailed, QueueFull, RequestQueue, RequestTimeout,
                      ShuttingDown)
from .fallback import SOURCE, Fallback, FallbackFailed, FallbackTimeout, TrustConfig, TrustGate, Untrusted
from .metrics import ServerMetrics
from .protocol import HEADER_LENGTH, InferRequest, RequestParser, ResponseEncoder, ValidationError
from .registry import ServedModel
from .worker import ModelInstances, ProcessBatcher

HEADER_LENGTH_KEY = HEADER_LENGTH.lower().encode("latin-1")  # as ASGI spells header names
UNAUTHENTICATED = ("/v2/health/live", "/v2/health/ready")  # probes of orchestrators carry no token


@dataclass(frozen=True)
class ServerSettings:
    batch: BatchConfig = field(default_factory=BatchConfig)
    max_body_bytes: int = 64 * 2**20
    token: str | None = None  # bearer token required on every endpoint but the health probes
    access_log: bool = True  # one JSON line per request on the "converge.serve.access" logger, at INFO
    trust: TrustConfig | None = None  # uncertainty gate and simulator fallback; None: only a run's ood.json gates

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
    Untrusted: (422, "untrusted"), FallbackTimeout: (504, "fallback_timeout"), FallbackFailed: (502, "fallback_failed"),
}


def error_response(err: Exception) -> JSONResponse:
    if isinstance(err, ServeError):
        return JSONResponse({"error": str(err)}, err.status)
    status = next(s for cls, (s, _) in ERRORS.items() if isinstance(err, cls))
    headers = {"Retry-After": str(QueueFull.retry_after_s)} if isinstance(err, QueueFull) else None
    return JSONResponse({"error": str(err)}, status, headers=headers)


def unauthorized_response() -> JSONResponse:
    return JSONResponse({"error": "missing or wrong bearer token; send 'Authorization: Bearer <token>'"}, 401,
                        headers={"WWW-Authenticate": "Bearer"})


def authorized(header: str | None, token: str) -> bool:
    scheme, _, given = (header or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), token.encode())


async def read_body(receive: Receive, declared: str | None, limit: int) -> bytes | None:
    """The request body, refused (413) past ``limit`` bytes whether declared or streamed; None if the client left."""
    too_large = f"request body exceeds the server's limit of {limit} bytes; send fewer samples per request"
    if declared and declared.isdigit() and int(declared) > limit:
        raise ServeError(413, too_large)
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise ServeError(413, too_large)
        chunks.append(chunk)
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def find_model(models: Mapping[str, ServedModel], name: str, version: str | None) -> ServedModel:
    """The model called ``name`` (at ``version``, if given), or a 404 naming what is served."""
    if name not in models:
        raise ServeError(404, f"unknown model {name!r}; serving: {', '.join(sorted(models)) or 'none'}")
    model = models[name]
    if version is not None and version != model.version:
        raise ServeError(404, f"model {name!r} has no version {version!r}; serving version {model.version!r}")
    return model


def first_header(headers: Sequence[tuple[bytes, bytes]], name: bytes) -> str | None:
    """The first value of header ``name`` (lower case) among ``(name, value)`` pairs, as ASGI and httptools give."""
    for key, value in headers:
        if key == name:
            return value.decode("latin-1")
    return None


def header(scope: Scope, name: bytes) -> str | None:
    """The first value of header ``name`` (lower case) in an ASGI scope."""
    return first_header(scope["headers"], name)


class GuardAndLog:
    """ASGI middleware: the bearer-token check, the HTTP request counter and the JSON access log.

    Plain ASGI rather than ``@app.middleware("http")`` (Starlette's
    BaseHTTPMiddleware), whose task group and memory streams per request took
    ~20 % of the event loop's time under load.
    """

    def __init__(self, app: ASGIApp, settings: ServerSettings, metrics: ServerMetrics,
                 log: AccessLog | None = None) -> None:
        self.app, self.settings, self.metrics, self.log = app, settings, metrics, log

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0, status = time.perf_counter(), 500

        async def send_and_note(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        token = self.settings.token
        try:
            if token and scope["path"] not in UNAUTHENTICATED \
                    and not authorized(header(scope, b"authorization"), token):
                await unauthorized_response()(scope, receive, send_and_note)
            else:
                await self.app(scope, receive, send_and_note)
        finally:
            route = getattr(scope.get("route"), "path", "unmatched")
            self.metrics.http_request(scope["method"], route, status)
            if self.log is not None:
                client = scope.get("client")
                self.log.note(round(time.time(), 3), scope["method"], scope["path"], status,
                              round(1e3 * (time.perf_counter() - t0), 3), client[0] if client else None,
                              int(header(scope, b"content-length") or 0))


class LabelledRoute(Route):
    """A plain Starlette route that names itself in ``scope["route"]`` for the metrics' route label.

    FastAPI's router records only its own ``APIRoute``s there.
    """

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        scope["route"] = self
        await super().handle(scope, receive, send)


class Reply(NamedTuple):
    """An HTTP answer: status, headers (lower-case bytes, as ASGI spells them; content-length is added when
    sent) and body."""

    status: int
    headers: list[tuple[bytes, bytes]]
    content: bytes


def as_reply(response: Response) -> Reply:
    """A rendered Starlette response as a :class:`Reply`."""
    return Reply(response.status_code, [(k, v) for k, v in response.raw_headers if k != b"content-length"],
                 response.body)


def error_reply(err: Exception) -> Reply:
    """The JSON error ``err`` is answered with (:func:`error_response`'s status, headers and body)."""
    return as_reply(error_response(err))


class InferEndpoint:
    """POST /v2/models/NAME[/versions/V]/infer, the one hot path of the server.

    :meth:`answer` turns a request's body into its :class:`Reply` (every failure
    is its JSON error); as an ASGI app it reads the body, answers and sends the
    reply as two messages, and :mod:`converge.serve.direct` calls it straight
    from the HTTP protocol.
    """

    ROUTES = ("/v2/models/{name}/versions/{version}/infer", "/v2/models/{name}/infer")

    def __init__(self, models: Mapping[str, ServedModel], batchers: Mapping[str, RequestQueue], settings: ServerSettings,
                 metrics: ServerMetrics, gates: Mapping[str, TrustGate] | None = None) -> None:
        self.models, self.batchers, self.settings, self.metrics = models, batchers, settings, metrics
        self.gates = dict(gates or {})
        self.parsers = {name: RequestParser(m.inputs, m.all_outputs) for name, m in models.items()}
        self.encoders = {name: ResponseEncoder(m.name, m.version) for name, m in models.items()}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        params = scope["path_params"]
        try:
            model = find_model(self.models, params["name"], params.get("version"))
            body = await read_body(receive, header(scope, b"content-length"), self.settings.max_body_bytes)
        except ServeError as err:
            return await error_response(err)(scope, receive, send)
        if body is None:
            return  # the client is gone: nobody to answer
        reply = await self.answer(model, body, header(scope, HEADER_LENGTH_KEY))
        raw = [*reply.headers, (b"content-length", str(len(reply.content)).encode("latin-1"))]
        await send({"type": "http.response.start", "status": reply.status, "headers": raw})
        await send({"type": "http.response.body", "body": reply.content})

    async def answer(self, model: ServedModel, body: bytes, header_length: str | None) -> Reply:
        """The reply to an infer request for ``model`` with ``body`` (and its binary header length, if any)."""
        submitted = self.submit(model, body, header_length)
        if isinstance(submitted, Reply):
            return submitted
        parsed, awaited = submitted
        try:
            try:
                results = await awaited.waiter
            except asyncio.CancelledError:  # the caller went away (client disconnect)
                awaited.future.cancel()
                raise
        except tuple(ERRORS) as err:
            return self.refused(model, err)
        settled = self.settle(model, parsed, results)
        return settled if isinstance(settled, Reply) else await settled

    def settle(self, model: ServedModel, parsed: InferRequest,
               results: Mapping[str, np.ndarray]) -> Reply | Coroutine[Any, Any, Reply]:
        """The reply to ``parsed`` once the model has given ``results``: at once after the model's trust gate
        (if any), or, when the gate sends samples to the simulator, a coroutine to await for it."""
        gate = self.gates.get(model.name)
        if gate is not None:
            try:
                verdict = gate.review_now(parsed.inputs, results)
            except Untrusted as err:
                return self.refused(model, err)
            if isinstance(verdict, Fallback):
                return self.fall_back(model, parsed, gate, verdict)
            results = verdict
        return self.reply(model, parsed, results)

    async def fall_back(self, model: ServedModel, parsed: InferRequest, gate: TrustGate, pending: Fallback) -> Reply:
        try:
            results = await gate.fall_back(pending)
        except tuple(ERRORS) as err:
            return self.refused(model, err)
        return self.reply(model, parsed, results)

    def submit(self, model: ServedModel, body: bytes, header_length: str | None) -> Reply | tuple[InferRequest, Awaited]:
        """Parse, check and queue a request: its error reply at once, or the parsed request and its
        :class:`~converge.serve.batcher.Awaited` outputs (before the trust gate, if the model has one)."""
        limits = self.settings.batch
        try:
            parsed = self.parsers[model.name](body, header_length)
            if parsed.batch_size > limits.max_batch_size:
                raise ValidationError(f"{parsed.batch_size} samples exceed max_batch_size={limits.max_batch_size}; "
                                      "split the request")
            return parsed, self.batchers[model.name].submit_waiter(parsed.inputs)
        except tuple(ERRORS) as err:
            return self.refused(model, err)

    def refused(self, model: ServedModel, err: Exception) -> Reply:
        """The error reply to a request ``err`` ended (one of :data:`ERRORS`), counted."""
        self.metrics.request_done(model.name, next(r for cls, (_, r) in ERRORS.items() if isinstance(err, cls)))
        return error_reply(err)

    def reply(self, model: ServedModel, parsed: InferRequest, results: Mapping[str, np.ndarray]) -> Reply:
        """The answer to ``parsed`` with the model's ``results``, counted."""
        try:
            content, headers = self.encoders[model.name](parsed, results)
        except ValueError as err:  # e.g. NaN asked for as JSON
            self.metrics.request_done(model.name, "model_error")
            return error_reply(ServeError(500, f"model {model.name!r}: {err}"))
        self.metrics.request_done(model.name, None)
        return Reply(200, headers, content)


class ServingApp(FastAPI):
    """The FastAPI app with a fast lane: POST .../infer skips FastAPI's middleware stack and router.

    Those layers cost about a fifth of the event loop's time per inference
    request. The lane still authenticates, counts and logs (``lane`` is a
    :class:`GuardAndLog` around the :class:`InferEndpoint`); every other
    request, and an infer URL with another method (405), takes the full stack.
    """

    _infer_routes: Sequence[Route] = ()
    _infer_lane: ASGIApp | None = None

    def open_infer_lane(self, routes: Sequence[Route], lane: ASGIApp) -> None:
        self._infer_routes, self._infer_lane = tuple(routes), lane

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self._infer_lane is not None and scope["type"] == "http" and scope["method"] == "POST":
            for route in self._infer_routes:
                match, child_scope = route.matches(scope)
                if match is Match.FULL:
                    scope.update(child_scope, route=route, app=self)
                    return await self._infer_lane(scope, receive, send)
        await super().__call__(scope, receive, send)


def model_batcher(model: ServedModel, config: BatchConfig, metrics: ServerMetrics) -> RequestQueue:
    """A model's batcher, not yet started: in a process of its own with ``config.model_process`` and a loader
    (models built in memory have none), in ``config.instances`` of them if more than one, else a thread of
    this process."""
    if config.model_process and model.loader is not None:
        kind = ModelInstances if config.instances > 1 else ProcessBatcher
        return kind(model.loader, config, model.name, on_batch=metrics.batch_observer(model.name), start=False,
                    threads=torch.get_num_threads())
    return Batcher(model.serve, config, model.name, on_batch=metrics.batch_observer(model.name), start=False)


def create_app(models: Mapping[str, ServedModel], settings: ServerSettings = ServerSettings()) -> ServingApp:
    """The KServe v2 app serving ``models`` (by name) with ``settings``."""
    for key, model in models.items():
        if key != model.name:
            raise ValueError(f"models[{key!r}] is named {model.name!r}; key the dict by model name")
    metrics = ServerMetrics()
    gates = {}  # refuses trust settings a model cannot honour, before anything starts
    for name, m in models.items():
        gate = TrustGate.build(m, settings.trust, metrics)
        if gate is not None:
            gates[name] = gate
    models = {name: replace(m, server_outputs=(*m.server_outputs, SOURCE)) if name in gates else m
              for name, m in models.items()}
    batchers = {name: model_batcher(m, settings.batch, metrics) for name, m in models.items()}
    log = AccessLog() if settings.access_log else None
    for name, b in batchers.items():
        metrics.queued.labels(name).set_function(lambda b=b: b.queued_samples)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        try:
            loop = asyncio.get_running_loop()  # a model process's answers are read on it, where they are awaited
            for b in batchers.values():  # a model process loads its model here: seconds
                await anyio.to_thread.run_sync(b.start, loop)
            # the heap built so far (torch, the model, the app) stays out of the cyclic collector's scans: a full
            # collection of it stalled every request in flight for tens of milliseconds, the p99 under load
            gc.collect()
            gc.freeze()
            if log is not None:
                log.start()
            yield
        finally:  # finish what is queued
            for b in batchers.values():
                await anyio.to_thread.run_sync(b.close)
            if log is not None:
                log.close()
            for g in gates.values():
                g.close()

    app = ServingApp(title="converge", version=__version__, lifespan=lifespan, openapi_url=None)
    app.state.models, app.state.batchers, app.state.metrics = models, batchers, metrics
    app.state.gates = gates

    async def as_json_error(request: Request, err: Exception) -> JSONResponse:
        return error_response(err)

    for cls in (*ERRORS, ServeError):
        app.add_exception_handler(cls, as_json_error)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
        return JSONResponse({"error": str(err.detail)}, err.status_code)

    app.add_middleware(GuardAndLog, settings=settings, metrics=metrics, log=log)

    def find(name: str, version: str | None) -> ServedModel:
        return find_model(models, name, version)

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

    infer = InferEndpoint(models, batchers, settings, metrics, gates)
    app.state.infer, app.state.access_log = infer, log  # what the direct HTTP path (direct.py) answers with
    for path in InferEndpoint.ROUTES:
        app.router.routes.insert(0, LabelledRoute(path, infer, methods=["POST"]))  # first: the router tries in order
    app.open_infer_lane(app.router.routes[:2], GuardAndLog(infer, settings, metrics, log))

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    return app
