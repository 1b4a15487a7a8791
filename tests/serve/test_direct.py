"""The direct infer path (serve/direct.py) on a real uvicorn: the same replies as the ASGI path, and HTTP/1.1 kept."""
import json
import logging
import socket
import threading
import time

import httpx
import numpy as np
import pytest
import torch

from converge.contract import TensorSpec
from converge.serve import ServedModel, ServerSettings, create_app
from converge.serve.app import InferEndpoint
from converge.serve.direct import infer_target
from converge.serve.protocol import HEADER_LENGTH, decode_infer_response, encode_infer_request

TOKEN = "s3cret-token"


def doc(x: np.ndarray) -> bytes:
    return json.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": list(x.shape),
                                   "data": x.reshape(-1).tolist()}]}).encode()


@pytest.mark.parametrize("url, target", [
    (b"/v2/models/linear/infer", ("linear", None)),
    (b"/v2/models/linear/versions/3/infer?x=1", ("linear", "3")),
    (b"/v2/models/linear/infer/", None), (b"/v2/models//infer", None), (b"/v2/models/linear", None),
    (b"/v2/models/a/b/infer", None), (b"/v2/models/linear/versions//infer", None),
    (b"/v2/models/lin%20ear/infer", None), (b"http://host/v2/models/linear/infer", None), (b"/v2/infer", None),
])
def test_infer_urls_are_recognised_and_nothing_else(url, target):
    assert infer_target(url) == target
    assert infer_target(bytes(url)) == target  # the second time from the cache of URLs seen, the same answer


def counting_asgi_calls(monkeypatch) -> list:
    """InferEndpoint's ASGI entry, counted: the direct path must never take it."""
    calls, original = [], InferEndpoint.__call__

    async def counted(self, scope, receive, send):
        calls.append(scope["path"])
        return await original(self, scope, receive, send)

    monkeypatch.setattr(InferEndpoint, "__call__", counted)
    return calls


def exchange(url: str, requests: list[tuple[str, str, dict, bytes]]) -> list[tuple[int, str | None, str | None, bytes]]:
    """(status, content type, binary header length, body) of each request, in turn on one connection."""
    with httpx.Client(base_url=url, timeout=30) as c:
        out = []
        for method, path, headers, body in requests:
            r = c.request(method, path, headers=headers, content=body)
            out.append((r.status_code, r.headers.get("content-type"), r.headers.get(HEADER_LENGTH), r.content))
        return out


def test_the_direct_path_answers_as_the_asgi_path_does(known, live_server, monkeypatch):
    calls = counting_asgi_calls(monkeypatch)
    x = known.sample(2, 3)
    binary, bin_headers = encode_infer_request({"x": x}, binary=True)
    requests = [
        ("POST", "/v2/models/linear/infer", {}, doc(x)),
        ("POST", "/v2/models/linear/versions/1/infer", bin_headers, binary),
        ("POST", "/v2/models/linear/infer", {}, b"{"),  # 400
        ("POST", "/v2/models/linear/infer", {}, doc(np.ones((2, 5), np.float32))),  # 400: shape
        ("POST", "/v2/models/nosuch/infer", {}, doc(x)),  # 404
        ("POST", "/v2/models/linear/versions/9/infer", {}, doc(x)),  # 404
        ("POST", "/v2/models/linear/infer", {}, doc(np.ones((70, 4), np.float32))),  # 400: over max_batch_size
        ("GET", "/v2/models/linear/infer", {}, b""),  # 405, through the ASGI app
        ("GET", "/v2/models/linear", {}, b""),
    ]
    replies = {}
    for direct in (True, False):
        app = create_app({"linear": known.model()}, ServerSettings(access_log=False))
        with live_server(app, direct_infer=direct) as url:
            replies[direct] = exchange(url, requests)
    assert [r[0] for r in replies[True]] == [200, 200, 400, 400, 404, 404, 400, 405, 200]
    assert replies[True] == replies[False]
    assert len(calls) == 7  # all seven POSTs of the ASGI server, none of the direct one's
    out = decode_infer_response(replies[True][1][3], replies[True][1][2])  # the binary reply, read back
    np.testing.assert_array_equal(out["y"], known.expected(x)["y"])


def test_token_body_limit_metrics_and_access_log_on_the_direct_path(known, live_server, monkeypatch, caplog):
    calls = counting_asgi_calls(monkeypatch)
    app = create_app({"linear": known.model()}, ServerSettings(token=TOKEN, max_body_bytes=4096))
    big = doc(np.ones((300, 4), np.float32))
    auth = {"Authorization": f"Bearer {TOKEN}"}
    with caplog.at_level(logging.INFO, logger="converge.serve.access"), live_server(app) as url:
        with httpx.Client(base_url=url, timeout=30) as c:
            refused = c.post("/v2/models/linear/infer", content=doc(known.sample(1)))
            assert refused.status_code == 401 and refused.headers["www-authenticate"] == "Bearer"
            assert "Authorization: Bearer <token>" in refused.json()["error"]
            assert c.post("/v2/models/linear/infer", content=big, headers=auth).status_code == 413
            streamed = c.post("/v2/models/linear/infer", content=iter([big[:3000], big[3000:]]), headers=auth)
            assert streamed.status_code == 413 and "limit of 4096 bytes" in streamed.json()["error"]
            ok = c.post("/v2/models/linear/infer", content=doc(known.sample(1)), headers=auth)  # same connection
            assert ok.status_code == 200 and ok.json()["outputs"][0]["name"] == "y"
            text = c.get("/metrics", headers=auth).text
        time.sleep(0.5)  # the access log's writer runs every 0.2 s
    assert not calls
    route = 'method="POST",route="/v2/models/{name}/infer"'
    for status, n in ((401, 1), (413, 2), (200, 1)):
        assert f'converge_http_requests_total{{{route},status="{status}"}} {n:.1f}' in text
    lines = [json.loads(line) for r in caplog.records if r.name == "converge.serve.access"
             for line in r.getMessage().splitlines()]
    posts = [(x["path"], x["status"]) for x in lines if x["method"] == "POST"]
    assert posts == [("/v2/models/linear/infer", s) for s in (401, 413, 413, 200)]


def raw_responses(sock: socket.socket, n: int, timeout: float = 20.0) -> list[bytes]:
    """``n`` whole HTTP responses read off ``sock`` (each with a content-length)."""
    sock.settimeout(timeout)
    data, out = b"", []
    while len(out) < n:
        while b"\r\n\r\n" not in data:
            chunk = sock.recv(65536)
            if not chunk:
                return out
            data += chunk
        head, _, rest = data.partition(b"\r\n\r\n")
        if head.startswith(b"HTTP/1.1 100"):
            out.append(head)
            data = rest
            continue
        length = int(next(v for k, _, v in (line.partition(b": ") for line in head.split(b"\r\n"))
                          if k.lower() == b"content-length"))
        while len(rest) < length:
            chunk = sock.recv(65536)
            if not chunk:
                break
            rest += chunk
        out.append(head + b"\r\n\r\n" + rest[:length])
        data = rest[length:]
    return out


def post(path: str, body: bytes, extra: str = "", version: str = "1.1") -> bytes:
    return (f"POST {path} HTTP/{version}\r\nHost: t\r\nContent-Length: {len(body)}\r\n{extra}\r\n").encode() + body


def connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=20)


def test_pipelined_requests_are_answered_in_order_and_connections_close_when_asked(known, live_server):
    app = create_app({"linear": known.model()}, ServerSettings(access_log=False))
    xs = [known.sample(i, 1 + i) for i in range(4)]
    with live_server(app) as url:
        with connect(url) as sock:  # four infers and a GET between them, in one write
            sock.sendall(post("/v2/models/linear/infer", doc(xs[0])) + post("/v2/models/linear/infer", doc(xs[1]))
                         + b"GET /v2/health/live HTTP/1.1\r\nHost: t\r\n\r\n"
                         + post("/v2/models/linear/infer", doc(xs[2])) + post("/v2/models/linear/infer", doc(xs[3])))
            replies = raw_responses(sock, 5)
        assert [r.split(b"\r\n")[0] for r in replies] == [b"HTTP/1.1 200 OK"] * 5
        bodies = [json.loads(r.partition(b"\r\n\r\n")[2]) for r in replies]
        assert bodies[2] == {"live": True}
        for x, body in zip(xs, bodies[:2] + bodies[3:]):
            assert body["outputs"][0]["shape"] == [len(x), 3]
            np.testing.assert_array_equal(np.reshape(body["outputs"][0]["data"], (-1, 3)), known.expected(x)["y"])
        with connect(url) as sock:  # Expect: 100-continue gets its interim answer before the body is sent
            body = doc(xs[0])
            sock.sendall(post("/v2/models/linear/infer", b"", "Expect: 100-continue\r\n").replace(
                b"Content-Length: 0", f"Content-Length: {len(body)}".encode()))
            assert raw_responses(sock, 1)[0].startswith(b"HTTP/1.1 100 Continue")
            sock.sendall(body)
            assert raw_responses(sock, 1)[0].startswith(b"HTTP/1.1 200 OK")
        for extra, version in (("Connection: close\r\n", "1.1"), ("", "1.0")):
            with connect(url) as sock:
                sock.sendall(post("/v2/models/linear/infer", doc(xs[0]), extra, version))
                reply = raw_responses(sock, 1)[0]
                assert reply.startswith(b"HTTP/1.1 200 OK") and b"connection: close" in reply.lower()
                assert sock.recv(10) == b""  # the server closed the connection


class Held(torch.nn.Module):
    """x -> x, after ``release`` is set: a request held in the model while its client leaves."""

    def __init__(self) -> None:
        super().__init__()
        self.started, self.release = threading.Event(), threading.Event()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.started.set()
        assert self.release.wait(20)
        return x.clone()


def test_a_client_that_leaves_is_counted_and_the_server_answers_the_next(live_server):
    held = Held()
    spec = [TensorSpec("x", "FP32", (-1, 4))]
    app = create_app({"held": ServedModel.from_module("held", held, spec, [TensorSpec("y", "FP32", (-1, 4))])},
                     ServerSettings(access_log=False))
    x = np.ones((1, 4), np.float32)
    with live_server(app) as url:
        with connect(url) as sock:
            sock.sendall(post("/v2/models/held/infer", doc(x)))
            assert held.started.wait(20)
        time.sleep(0.3)  # the server sees the connection drop while the model still runs
        held.release.set()
        with httpx.Client(base_url=url, timeout=30) as c:
            r = c.post("/v2/models/held/infer", content=doc(x))
            assert r.status_code == 200 and r.json()["outputs"][0]["data"] == [1.0] * 4
            text = c.get("/metrics").text
    assert 'converge_http_requests_total{method="POST",route="/v2/models/{name}/infer",status="499"} 1.0' in text


class Picky(torch.nn.Module):
    """x -> x; negative inputs fail the batch, and an input of 99 holds it past the server's timeout."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (x < 0).any():
            raise ValueError("negative values are not physical")
        if (x == 99).any():
            time.sleep(0.6)
        return x.clone()


def test_model_failures_and_timeouts_on_the_direct_path(live_server):
    from converge.serve import BatchConfig

    spec = [TensorSpec("x", "FP32", (-1, 4))]
    model = ServedModel.from_module("picky", Picky(), spec, [TensorSpec("y", "FP32", (-1, 4))])
    app = create_app({"picky": model}, ServerSettings(BatchConfig(timeout_s=0.3), access_log=False))
    with live_server(app) as url, httpx.Client(base_url=url, timeout=30) as c:
        failed = c.post("/v2/models/picky/infer", content=doc(-np.ones((1, 4), np.float32)))
        assert failed.status_code == 500
        assert "failed on a batch of 1 samples: ValueError: negative values are not physical" in failed.json()["error"]
        slow = c.post("/v2/models/picky/infer", content=doc(np.full((1, 4), 99, np.float32)))
        assert slow.status_code == 504 and slow.json()["error"] == "model 'picky': no result within 0.3 s"
        time.sleep(0.5)  # the held batch ends
        ok = c.post("/v2/models/picky/infer", content=doc(np.ones((2, 4), np.float32)))
        assert ok.status_code == 200 and ok.json()["outputs"][0]["shape"] == [2, 4]
        text = c.get("/metrics").text
    for reason in ("model_error", "timeout"):
        assert f'converge_inference_failures_total{{model="picky",reason="{reason}"}} 1.0' in text
