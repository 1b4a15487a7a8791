"""A load generator for KServe v2 servers, after Triton's perf_analyzer.

``concurrency`` clients, each on its own keep-alive HTTP/1.1 connection
(``asyncio.open_connection``, no HTTP library in the way), send pre-encoded
infer requests back to back: a client sends its next request the moment the
previous answer is read. After ``warmup_s`` a window of ``duration_s`` opens; a
request counts in it when its answer arrives inside it. Latency runs from the
first byte written to the last byte read.

It runs in its own process (:class:`LoadProcess`, spawned, importing nothing
but the standard library) so that its CPU is not the server's, and reports its
own ``cpu_share``: process CPU time over wall time in the window, as a
fraction of one core. One asyncio thread cannot use more than one core, so a
share near 1 means the generator, not the server, set the pace.

Every loop is bounded: by the window's end, by ``max_requests`` and, per
request, by ``timeout_s``.
"""
from __future__ import annotations

import asyncio
import math
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from multiprocessing import get_context
from typing import Any, Mapping, Sequence
from urllib.parse import urlsplit

MAX_ERROR_EXAMPLES = 5
RECONNECT_PAUSE_S = 0.01  # after a failed exchange: a dead server must not turn the loop into a busy spin


@dataclass(frozen=True)
class InferTarget:
    """What the clients send to one model's infer URL: client i sends ``requests[i % len]``.

    They POST to ``path``, by default the KServe v2 ``/v2/models/{model}/infer``; another server's route
    (LitServe's ``/predict``) takes its own path and pre-encoded bodies.
    """

    url: str  # http://HOST:PORT
    model: str
    requests: tuple[tuple[bytes, tuple[tuple[str, str], ...]], ...]  # (body, headers) of each request
    samples_per_request: int
    path: str | None = None  # None: /v2/models/{model}/infer

    def __post_init__(self) -> None:
        parts = urlsplit(self.url)
        if parts.scheme != "http" or not parts.hostname or not parts.port:
            raise ValueError(f"url {self.url!r}: give http://HOST:PORT (plain HTTP, explicit port)")
        if not self.requests:
            raise ValueError("requests: give at least one encoded request")
        if self.samples_per_request < 1:
            raise ValueError(f"samples_per_request={self.samples_per_request}: must be >= 1")
        if self.path is not None and (not self.path.startswith("/") or any(c in self.path for c in " \r\n")):
            raise ValueError(f"path {self.path!r}: give an absolute URL path such as /predict (no spaces)")

    @property
    def request_path(self) -> str:
        return self.path if self.path is not None else f"/v2/models/{self.model}/infer"

    @classmethod
    def from_inputs(cls, url: str, model: str, inputs: Sequence[Mapping[str, Any]], binary: bool = True
                    ) -> "InferTarget":
        """One JSON or binary-tensor infer request per mapping of arrays (all of one batch size)."""
        from ..serve.protocol import encode_infer_request  # the parent encodes; the load process stays lean

        sizes = {len(next(iter(x.values()))) for x in inputs}
        if len(sizes) != 1:
            raise ValueError(f"inputs hold batches of sizes {sorted(sizes)}; give one size")
        encoded = [encode_infer_request(x, binary=binary) for x in inputs]
        return cls(url, model, tuple((body, tuple(headers.items())) for body, headers in encoded), sizes.pop())

    def raw_requests(self) -> list[bytes]:
        """The complete HTTP/1.1 requests, head and body."""
        parts = urlsplit(self.url)
        start = f"POST {self.request_path} HTTP/1.1\r\nHost: {parts.hostname}:{parts.port}\r\n"
        return [(start + "".join(f"{k}: {v}\r\n" for k, v in headers)
                 + f"Content-Length: {len(body)}\r\n\r\n").encode("latin-1") + body
                for body, headers in self.requests]


@dataclass(frozen=True)
class LoadResult:
    """One measurement window. Latencies are ``None`` when no request succeeded."""

    concurrency: int
    window_s: float
    requests: int  # answered 200 inside the window
    errors: int  # failed inside the window (non-200, timeout, broken connection)
    samples_per_request: int
    throughput_rps: float
    throughput_sps: float
    p50_ms: float | None
    p95_ms: float | None
    p99_ms: float | None
    mean_ms: float | None
    max_ms: float | None
    cpu_share: float  # the generator's CPU time / wall time in the window (1.0 = one core)
    error_examples: tuple[str, ...] = ()

    def as_dict(self) -> dict:
        return {**asdict(self), "error_examples": list(self.error_examples)}


def latency_percentiles(values: Sequence[float], qs: Sequence[float] = (50, 95, 99)) -> list[float]:
    """Nearest-rank percentiles: the q-th is the smallest value with at least q % of ``values`` <= it.

    Always an observed value (no interpolation), as perf_analyzer reports them:
    of 1..100, p50 = 50, p95 = 95, p99 = 99.
    """
    if not values:
        raise ValueError("no values: a percentile of nothing is undefined")
    ordered = sorted(values)
    out = []
    for q in qs:
        if not 0 < q <= 100:
            raise ValueError(f"percentile {q}: must be in (0, 100]")
        out.append(ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)])
    return out


async def _read_response(reader: asyncio.StreamReader) -> tuple[int, bytes, bool]:
    """(status, body, keep the connection) of one HTTP/1.1 response."""
    head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
    status = int(head[0].split(" ", 2)[1])
    fields = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in head[1:] if line)}
    keep = fields.get("connection", "").lower() != "close"
    if "content-length" in fields:
        body = await reader.readexactly(int(fields["content-length"]))
    elif fields.get("transfer-encoding", "").lower() == "chunked":
        chunks = []
        while size := int((await reader.readuntil(b"\r\n")).split(b";")[0], 16):
            chunks.append(await reader.readexactly(size))
            await reader.readexactly(2)
        await reader.readuntil(b"\r\n")  # no trailers are sent by uvicorn: the final empty line
        body = b"".join(chunks)
    else:
        body, keep = await reader.read(), False
    return status, body, keep


class _Window:
    """Shared state of one run: the clock marks and what completed."""

    def __init__(self, start: float, end: float, max_requests: int) -> None:
        self.start, self.end, self.max_requests = start, end, max_requests
        self.latencies: list[float] = []
        self.errors = 0
        self.error_examples: list[str] = []
        self.sent = 0

    def record(self, t0: float, t1: float, error: str | None) -> None:
        if not self.start <= t1 <= self.end:
            return
        if error is None:
            self.latencies.append(t1 - t0)
        else:
            self.errors += 1
            if len(self.error_examples) < MAX_ERROR_EXAMPLES:
                self.error_examples.append(error)


async def _client(request: bytes, host: str, port: int, window: _Window, timeout_s: float) -> None:
    reader = writer = None
    try:
        while time.perf_counter() < window.end and window.sent < window.max_requests:
            window.sent += 1
            t0 = time.perf_counter()
            try:
                if writer is None:
                    reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout_s)
                writer.write(request)
                status, body, keep = await asyncio.wait_for(_read_response(reader), timeout_s)
            except (OSError, EOFError, asyncio.TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError,
                    ValueError, IndexError) as err:
                window.record(t0, time.perf_counter(), f"{type(err).__name__}: {err}"[:300])
                if writer is not None:
                    writer.close()
                reader = writer = None
                await asyncio.sleep(RECONNECT_PAUSE_S)
                continue
            error = None if status == 200 else f"HTTP {status}: {body[:200].decode('utf-8', 'replace')}"
            window.record(t0, time.perf_counter(), error)
            if not keep:
                writer.close()
                reader = writer = None
    finally:
        if writer is not None:
            writer.close()


async def _run(target: InferTarget, concurrency: int, duration_s: float, warmup_s: float, timeout_s: float,
               max_requests: int) -> LoadResult:
    parts = urlsplit(target.url)
    requests = target.raw_requests()
    start = time.perf_counter() + warmup_s
    window = _Window(start, start + duration_s, max_requests)
    marks: dict[str, float] = {}

    async def mark_cpu() -> None:
        await asyncio.sleep(max(0.0, window.start - time.perf_counter()))
        marks["wall0"], marks["cpu0"] = time.perf_counter(), time.process_time()
        await asyncio.sleep(max(0.0, window.end - time.perf_counter()))
        marks["wall1"], marks["cpu1"] = time.perf_counter(), time.process_time()

    await asyncio.gather(mark_cpu(), *(_client(requests[i % len(requests)], parts.hostname, parts.port, window,
                                               timeout_s) for i in range(concurrency)))
    cpu_share = (marks["cpu1"] - marks["cpu0"]) / (marks["wall1"] - marks["wall0"])
    n = len(window.latencies)
    if n:
        p50, p95, p99 = (1e3 * v for v in latency_percentiles(window.latencies))
        mean_ms, max_ms = 1e3 * sum(window.latencies) / n, 1e3 * max(window.latencies)
    else:
        p50 = p95 = p99 = mean_ms = max_ms = None
    return LoadResult(concurrency, duration_s, n, window.errors, target.samples_per_request, n / duration_s,
                      n * target.samples_per_request / duration_s, p50, p95, p99, mean_ms, max_ms, cpu_share,
                      tuple(window.error_examples))


def run_load(target: InferTarget, concurrency: int, duration_s: float, warmup_s: float = 1.0,
             timeout_s: float = 30.0, max_requests: int = 10_000_000) -> LoadResult:
    """Drive ``target`` with ``concurrency`` closed-loop clients in this process (see :class:`LoadProcess`)."""
    if concurrency < 1:
        raise ValueError(f"concurrency={concurrency}: must be >= 1")
    if not duration_s > 0 or warmup_s < 0:
        raise ValueError(f"duration_s={duration_s}, warmup_s={warmup_s}: need duration > 0 and warm-up >= 0")
    if not timeout_s > 0 or max_requests < 1:
        raise ValueError(f"timeout_s={timeout_s}, max_requests={max_requests}: both must be positive")
    return asyncio.run(_run(target, concurrency, duration_s, warmup_s, timeout_s, max_requests))


class LoadProcess:
    """One spawned process that runs :func:`run_load`, reused across a sweep.

        with LoadProcess() as load:
            result = load.run(target, concurrency=8, duration_s=5)
    """

    def __init__(self) -> None:
        self._pool: ProcessPoolExecutor | None = None

    def __enter__(self) -> "LoadProcess":
        self._pool = ProcessPoolExecutor(max_workers=1, mp_context=get_context("spawn"))
        return self

    def __exit__(self, *exc: object) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def run(self, target: InferTarget, concurrency: int, duration_s: float, warmup_s: float = 1.0,
            timeout_s: float = 30.0, max_requests: int = 10_000_000) -> LoadResult:
        if self._pool is None:
            raise RuntimeError("use LoadProcess in a `with` block")
        future = self._pool.submit(run_load, target, concurrency, duration_s, warmup_s, timeout_s, max_requests)
        # the clients stop at the window's end and each waits at most timeout_s for its last answer
        return future.result(timeout=warmup_s + duration_s + 2 * timeout_s + 60)
