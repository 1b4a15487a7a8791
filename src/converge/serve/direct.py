"""The direct path: POST .../infer answered from uvicorn's HTTP protocol, with no ASGI in between.

``converge serve`` runs uvicorn with :class:`DirectInferProtocol`, its httptools
protocol with one change: a POST to a model's infer URL is read and answered
by an :class:`InferExchange`, which hands the body to the app's
:class:`~converge.serve.app.InferEndpoint` and writes the reply to the socket
in one write. Every other request (health, metadata, metrics, another method
on an infer URL, a percent-encoded path) goes through the ASGI app as before.

What the ASGI path costs per request, and this one does not: the scope dict
(with a copy of the app state), a request-response cycle with its
``asyncio.Event``, a receive and two send coroutines with their message dicts,
the lane's route match and the guard's closures. The exchange keeps what a
request needs: the bearer-token check, the body limit (413 whether declared or
streamed), keep-alive and ``Connection: close``, ``Expect: 100-continue``,
pipelined requests answered in order, the HTTP metrics and the access log,
and a vanished client's request cancelled in its queue.
"""
from __future__ import annotations

import asyncio
import functools
import logging
import time
from typing import TYPE_CHECKING, Any, Coroutine

from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from .app import (ERRORS, HEADER_LENGTH_KEY, InferEndpoint, Reply, ServeError, as_reply, authorized, error_reply,
                  find_model, first_header, unauthorized_response)
from .batcher import Awaited
from .protocol import InferRequest
from .registry import ServedModel

if TYPE_CHECKING:
    from .access_log import AccessLog

log = logging.getLogger("converge.serve")
CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
CLIENT_GONE = 499  # the status the metrics and the access log give a request whose client left before its answer


@functools.lru_cache(maxsize=1024)  # clients send the same few URLs again and again: 2.6 us each, 0.2 us known
def infer_target(url: bytes) -> tuple[str, str | None] | None:
    """(model name, version or None) of an infer URL (``/v2/models/NAME[/versions/V]/infer``, any query), else
    None; a percent-encoded path is None too (the ASGI path decodes it)."""
    path = url.partition(b"?")[0]
    if b"%" in path:
        return None
    parts = path.split(b"/")  # b"", b"v2", b"models", NAME, [b"versions", V,] b"infer"
    if parts[:3] != [b"", b"v2", b"models"] or parts[-1] != b"infer" or not all(parts[3:-1]):
        return None
    if len(parts) == 5:
        return parts[3].decode("latin-1"), None
    if len(parts) == 7 and parts[4] == b"versions":
        return parts[3].decode("latin-1"), parts[5].decode("latin-1")
    return None


def internal_error(err: Exception) -> Reply:
    """A bug's reply (500), logged with its traceback: not the request's fault."""
    log.error("direct infer path failed", exc_info=err)
    return error_reply(ServeError(500, f"internal server error: {type(err).__name__}: {err}"))


def encode_reply(reply: Reply, default_headers: list[tuple[bytes, bytes]], keep_alive: bool) -> bytes:
    """The whole HTTP/1.1 response: status line, uvicorn's default headers (date, server), the reply's, its
    content-length, ``connection: close`` unless kept alive, and the body."""
    out = [STATUS_LINE[reply.status]]
    for name, value in (*default_headers, *reply.headers):
        out += [name, b": ", value, b"\r\n"]
    out += [b"content-length: ", str(len(reply.content)).encode("latin-1"), b"\r\n"]
    if not keep_alive:
        out.append(b"connection: close\r\n")
    out += [b"\r\n", reply.content]
    return b"".join(out)


class InferExchange:
    """One POST .../infer on the direct path, shaped as uvicorn's protocol expects a request-response cycle
    (``body``, ``more_body``, ``response_complete``, ``disconnected``, ``keep_alive``, ``message_event``).

    It is started when its turn on the connection comes (:meth:`start`), collects the body as it arrives
    (:meth:`receive`, :meth:`finish_body`), submits the request once both have happened, sends the reply from
    the callback of its outputs' future (no task per request), and then lets the protocol go on to the next
    request (``on_response_complete``).
    """

    def __init__(self, protocol: DirectInferProtocol, path: str, target: tuple[str, str | None],
                 headers: list[tuple[bytes, bytes]], keep_alive: bool, expect_100_continue: bool) -> None:
        self.protocol, self.path, self.target, self.headers = protocol, path, target, headers
        self.keep_alive, self.expect_100_continue = keep_alive, expect_100_continue
        self.chunks: list[bytes] = []
        self.size, self.too_large = 0, False
        self.more_body, self.started, self.response_complete, self.disconnected = True, False, False, False
        self.message_event = self  # the protocol calls message_event.set() when the client leaves
        self.task: asyncio.Task | None = None  # the answer, while the simulator fallback runs
        self.awaited: Awaited | None = None  # the submitted request (model, parsed, awaited: once submitted)
        self.model: ServedModel | None = None
        self.parsed: InferRequest | None = None
        self.t0 = time.perf_counter()

    def receive(self, chunk: bytes) -> None:
        """A piece of the body; past the server's limit the rest is read and dropped, and 413 answered."""
        self.size += len(chunk)
        if self.size > self.protocol.endpoint.settings.max_body_bytes:
            self.too_large, self.chunks = True, []
        elif not self.too_large:
            self.chunks.append(chunk)

    def finish_body(self) -> None:
        self.more_body = False
        if self.started:
            self._answer()

    def start(self) -> None:
        """Its turn: the requests before it on this connection are answered."""
        self.started = True
        if not self.more_body:
            self._answer()
        elif self.expect_100_continue:
            self.protocol.transport.write(CONTINUE)

    def set(self) -> None:
        """``message_event.set()``: after ``disconnected``, cancel the request where it waits."""
        if not self.disconnected:
            return
        if self.task is not None:
            self.task.cancel()
        elif self.awaited is not None:
            self.awaited.cancel()

    def _answer(self) -> None:
        """Check and submit the request; its reply is sent when its outputs come (:meth:`_outputs_ready`), after
        the model's trust gate. Only a request the gate sends to the simulator is finished in a task."""
        try:
            checked = self.check()
            if isinstance(checked, Reply):
                return self._send(checked)
            endpoint, body = self.protocol.endpoint, self.chunks[0] if len(self.chunks) == 1 else b"".join(self.chunks)
            header_length = first_header(self.headers, HEADER_LENGTH_KEY)
            submitted = endpoint.submit(checked, body, header_length)
            if isinstance(submitted, Reply):
                return self._send(submitted)
        except Exception as err:  # a bug, not the request's fault
            return self._send(internal_error(err))
        self.model, (self.parsed, self.awaited) = checked, submitted
        self.awaited.waiter.add_done_callback(self._outputs_ready)

    def _outputs_ready(self, waiter: asyncio.Future) -> None:
        if waiter.cancelled():
            return self._done(CLIENT_GONE)
        endpoint, err = self.protocol.endpoint, waiter.exception()
        try:
            if err is None:
                reply = endpoint.settle(self.model, self.parsed, waiter.result())
                if not isinstance(reply, Reply):  # the trust gate awaits the simulator
                    return self._answer_in_task(reply)
            else:
                reply = endpoint.refused(self.model, err) if isinstance(err, tuple(ERRORS)) else internal_error(err)
        except Exception as bug:
            reply = internal_error(bug)
        self._send(reply)

    def _answer_in_task(self, reply: Coroutine[Any, Any, Reply]) -> None:
        tasks = self.protocol.tasks
        self.task = task = self.protocol.loop.create_task(self._send_when_ready(reply))
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    async def _send_when_ready(self, reply: Coroutine[Any, Any, Reply]) -> None:
        try:
            ready = await reply
        except asyncio.CancelledError:
            return self._done(CLIENT_GONE)
        except Exception as err:
            ready = internal_error(err)
        self._send(ready)

    def check(self) -> Reply | ServedModel:
        """The token, the model and the body limit: the model to answer with, or the refusal."""
        endpoint: InferEndpoint = self.protocol.endpoint
        settings = endpoint.settings
        if settings.token and not authorized(first_header(self.headers, b"authorization"), settings.token):
            return as_reply(unauthorized_response())
        try:
            model = find_model(endpoint.models, *self.target)
            declared = first_header(self.headers, b"content-length")
            if self.too_large or (declared and declared.isdigit() and int(declared) > settings.max_body_bytes):
                raise ServeError(413, f"request body exceeds the server's limit of {settings.max_body_bytes} bytes; "
                                      "send fewer samples per request")
        except ServeError as err:
            return error_reply(err)
        return model

    def _send(self, reply: Reply) -> None:
        protocol = self.protocol
        if self.disconnected or protocol.transport.is_closing():
            return self._done(CLIENT_GONE)
        protocol.transport.write(encode_reply(reply, protocol.server_state.default_headers, self.keep_alive))
        self._done(reply.status)
        protocol.on_response_complete()
        if not self.keep_alive:
            protocol.transport.close()

    def _done(self, status: int) -> None:
        self.response_complete = True
        protocol = self.protocol
        route = InferEndpoint.ROUTES[0] if self.target[1] is not None else InferEndpoint.ROUTES[1]
        protocol.endpoint.metrics.http_request("POST", route, status)
        lines: AccessLog | None = protocol.access_lines
        if lines is not None:
            lines.note(round(time.time(), 3), "POST", self.path, status, round(1e3 * (time.perf_counter() - self.t0), 3),
                       protocol.client[0] if protocol.client else None, self.size)


class DirectInferProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, answering POST .../infer directly (:class:`InferExchange`).

    Serves any ASGI app; the direct path opens only for the app of :func:`~converge.serve.app.create_app`
    (its ``state.infer``), on an infer URL, for POST.
    """

    def __init__(self, config, server_state, app_state, _loop=None) -> None:
        super().__init__(config, server_state, app_state, _loop)
        state = getattr(config.app, "state", None)
        self.endpoint: InferEndpoint | None = getattr(state, "infer", None)
        self.access_lines: AccessLog | None = getattr(state, "access_log", None)

    def on_message_begin(self) -> None:  # the ASGI scope is built only for a request that needs it
        self.url, self.expect_100_continue, self.headers = b"", False, []

    def on_headers_complete(self) -> None:
        if self.endpoint is not None and self.parser.get_method() == b"POST" and not self.parser.should_upgrade():
            target = infer_target(self.url)
            if target is not None:
                return self._begin_exchange(self.url.partition(b"?")[0].decode("latin-1"), target)
        url, headers, expect = self.url, self.headers, self.expect_100_continue
        super().on_message_begin()
        self.url, self.expect_100_continue, self.headers = url, expect, headers
        self.scope["headers"] = headers
        super().on_headers_complete()

    def _begin_exchange(self, path: str, target: tuple[str, str | None]) -> None:
        keep_alive = self.parser.get_http_version() != "1.0" and self.parser.should_keep_alive()
        previous, self.cycle = self.cycle, InferExchange(self, path, target, self.headers, keep_alive,
                                                         self.expect_100_continue)
        if previous is None or previous.response_complete:
            self.cycle.start()
        else:  # pipelined: its turn comes when the request before it is answered (on_response_complete)
            self.flow.pause_reading()
            self.pipeline.appendleft((self.cycle, None))

    def _start_asgi_task(self, cycle, app) -> None:
        if isinstance(cycle, InferExchange):
            return cycle.start()
        super()._start_asgi_task(cycle, app)

    def on_body(self, body: bytes) -> None:
        if isinstance(self.cycle, InferExchange):
            return self.cycle.receive(body)
        super().on_body(body)

    def on_message_complete(self) -> None:
        if isinstance(self.cycle, InferExchange):
            return self.cycle.finish_body()
        super().on_message_complete()
