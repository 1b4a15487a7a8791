"""The HTTP app in process (ASGI): endpoints, every error status and message, metrics, logs, robustness."""
import asyncio
import contextlib
import json
import logging
import re
import threading

import httpx
import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient

from converge.contract import TensorSpec
from converge.serve import (AsyncClient, BatchConfig, ModelLoadError, ServedModel, ServerError, ServerSettings,
                            ValidationError, create_app)
from converge.serve.access_log import AccessLog
from converge.serve.protocol import HEADER_LENGTH, decode_infer_response, encode_infer_request

TOKEN = "s3cret-token"


def infer_json(x: np.ndarray, name: str = "x", datatype: str = "FP32") -> dict:
    return {"inputs": [{"name": name, "datatype": datatype, "shape": list(x.shape), "data": x.reshape(-1).tolist()}]}


@contextlib.asynccontextmanager
async def running(app, token=None):
    """The app's lifespan (batchers started, then drained) and an AsyncClient on it, all in process."""
    async with app.router.lifespan_context(app):
        async with AsyncClient("http://test", token=token, transport=httpx.ASGITransport(app)) as client:
            yield client


def test_health_and_metadata(known):
    app = create_app({"linear": known.model(version="3")})
    with TestClient(app) as c:
        assert c.get("/v2/health/live").json() == {"live": True}
        assert c.get("/v2/health/ready").json() == {"ready": True}
        assert c.get("/v2").json() == {"name": "converge", "version": "0.1.0", "extensions": ["binary_tensor_data"]}
        meta = c.get("/v2/models/linear").json()
        assert meta == c.get("/v2/models/linear/versions/3").json()
        assert meta["versions"] == ["3"] and meta["platform"] == "pytorch"
        assert meta["inputs"] == [{"name": "x", "datatype": "FP32", "shape": [-1, 4]}]
        assert meta["outputs"][1] == {"name": "total", "datatype": "FP64", "shape": [-1]}
        assert c.get("/v2/models/linear/ready").status_code == 200
        assert c.get("/v2/models/linear/versions/3/ready").json() == {"name": "linear", "ready": True}
    # outside its lifespan the batchers are not running: not ready
    assert TestClient(app).get("/v2/health/ready").status_code == 503


@pytest.mark.parametrize("binary", [False, True])
def test_infer_gives_the_known_answer(known, binary):
    x = known.sample(3, n=5)
    with TestClient(create_app({"linear": known.model()})) as c:
        body, headers = encode_infer_request({"x": x}, binary=binary)
        r = c.post("/v2/models/linear/versions/1/infer", content=body, headers=headers)
        assert r.status_code == 200
        assert (HEADER_LENGTH in r.headers) == binary
        out = decode_infer_response(r.content, r.headers.get(HEADER_LENGTH))
        header = json.loads(r.content[:int(r.headers.get(HEADER_LENGTH, len(r.content)))])
        assert header["model_name"] == "linear" and header["model_version"] == "1"
    want = known.expected(x)
    assert out["y"].dtype == np.float32 and out["total"].dtype == np.float64
    np.testing.assert_array_equal(out["y"], want["y"])
    np.testing.assert_array_equal(out["total"], want["total"])


@pytest.mark.parametrize("doc, message", [
    (infer_json(np.ones((2, 3), np.float32)), r"input 'x': shape \[2, 3\], expected \[-1, 4\]"),
    (infer_json(np.ones((2, 4)), datatype="FP64"), "input 'x': datatype FP64, expected FP32"),
    (infer_json(np.ones((2, 4)), name="strain"), "unknown input 'strain'; the model takes 'x'"),
    (infer_json(np.array([[1, 2, float("inf"), 4]])), "input 'x': 1 values are NaN or infinite"),
    (infer_json(np.ones((9, 4))), "9 samples exceed max_batch_size=8; split the request"),
])
def test_invalid_requests_get_400_with_the_reason(known, doc, message):
    app = create_app({"linear": known.model()}, ServerSettings(BatchConfig(max_batch_size=8)))
    with TestClient(app) as c:
        r = c.post("/v2/models/linear/infer", content=json.dumps(doc).encode())
    assert r.status_code == 400
    assert re.search(message, r.json()["error"])


def test_unknown_model_or_version_is_404(known):
    with TestClient(create_app({"linear": known.model()})) as c:
        doc = infer_json(known.sample(0))
        for method, path in [("get", "/v2/models/other"), ("get", "/v2/models/other/ready"),
                             ("post", "/v2/models/other/infer")]:
            r = c.request(method.upper(), path, json=doc if method == "post" else None)
            assert r.status_code == 404 and r.json()["error"] == "unknown model 'other'; serving: linear"
        for path in ("/v2/models/linear/versions/2", "/v2/models/linear/versions/2/infer"):
            r = c.request("POST" if path.endswith("infer") else "GET", path, json=doc)
            assert r.status_code == 404
            assert r.json()["error"] == "model 'linear' has no version '2'; serving version '1'"
        assert c.get("/v2/nowhere").status_code == 404


def test_bodies_over_the_limit_are_413_declared_or_streamed(known):
    app = create_app({"linear": known.model()}, ServerSettings(max_body_bytes=4096))
    big = json.dumps(infer_json(np.ones((300, 4), np.float32))).encode()
    with TestClient(app) as c:
        r = c.post("/v2/models/linear/infer", content=big)
        assert r.status_code == 413 and "exceeds the server's limit of 4096 bytes" in r.json()["error"]
        streamed = c.post("/v2/models/linear/infer", content=iter([big[:3000], big[3000:]]))  # chunked: no length
        assert streamed.status_code == 413
        assert c.post("/v2/models/linear/infer", json=infer_json(known.sample(1))).status_code == 200


def test_bearer_token_is_required_except_on_health_probes(known):
    app = create_app({"linear": known.model()}, ServerSettings(token=TOKEN))
    doc = infer_json(known.sample(1))
    with TestClient(app) as c:
        for headers in ({}, {"Authorization": "Bearer wrong-token"}, {"Authorization": TOKEN}):
            for path in ("/v2", "/v2/models/linear", "/metrics"):
                r = c.get(path, headers=headers)
                assert r.status_code == 401 and "Authorization: Bearer <token>" in r.json()["error"]
            assert c.post("/v2/models/linear/infer", json=doc, headers=headers).status_code == 401
        assert c.get("/v2/health/live").status_code == 200 and c.get("/v2/health/ready").status_code == 200
        ok = c.post("/v2/models/linear/infer", json=doc, headers={"Authorization": f"Bearer {TOKEN}"})
        assert ok.status_code == 200


class Gate(torch.nn.Module):
    """x -> x, but each call waits for ``release`` (and says it started): holds the worker busy on demand."""

    def __init__(self) -> None:
        super().__init__()
        self.started, self.release = threading.Event(), threading.Event()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.started.set()
        if not self.release.wait(10):
            raise RuntimeError("gate never opened")
        if (x < 0).any():
            raise ValueError("negative values are not physical")
        return x


def gated(**batch) -> tuple[Gate, object]:
    gate = Gate()
    model = ServedModel.from_module("gate", gate, [TensorSpec("x", "FP32", (-1, 2))], [TensorSpec("x", "FP32", (-1, 2))])
    return gate, create_app({"gate": model}, ServerSettings(BatchConfig(**batch)))


def test_full_queue_is_503_with_retry_after():
    gate, app = gated(max_batch_size=2, max_queue_size=2)

    async def scenario():
        async with running(app) as client:
            busy = asyncio.create_task(client.infer("gate", {"x": np.ones((2, 2), np.float32)}))
            await asyncio.to_thread(gate.started.wait, 5)  # the model is busy with the first request
            queued = asyncio.create_task(client.infer("gate", {"x": np.ones((2, 2), np.float32)}))
            for _ in range(500):  # bounded: until the second request sits in the queue
                if app.state.batchers["gate"].queued_samples == 2:
                    break
                await asyncio.sleep(0.005)
            r = await client._http.post("/v2/models/gate/infer", json=infer_json(np.ones((1, 2), np.float32)))
            gate.release.set()
            return r, await busy, await queued

    r, first, second = asyncio.run(scenario())
    assert r.status_code == 503 and r.headers["Retry-After"] == "1"
    assert "queue full (2 of 2 samples waiting); retry later" in r.json()["error"]
    assert first["x"].shape == (2, 2) and second["x"].shape == (2, 2)


def test_model_failure_is_500_and_slow_results_504():
    gate, app = gated(timeout_s=0.2)
    gate.release.set()
    with TestClient(app) as c:
        r = c.post("/v2/models/gate/infer", json=infer_json(-np.ones((1, 2), np.float32)))
        assert r.status_code == 500
        assert "failed on a batch of 1 samples: ValueError: negative values are not physical" in r.json()["error"]
        gate.release.clear()
        r = c.post("/v2/models/gate/infer", json=infer_json(np.ones((1, 2), np.float32)))
        assert r.status_code == 504 and r.json()["error"] == "model 'gate': no result within 0.2 s"
        gate.release.set()
        assert c.post("/v2/models/gate/infer", json=infer_json(np.ones((1, 2), np.float32))).status_code == 200


def malformed(i: int) -> tuple[bytes, dict]:
    """A rotation of broken requests: bytes, JSON, headers, shapes, values."""
    good, headers = encode_infer_request({"x": np.ones((1, 4), np.float32)}, binary=True)
    return [
        (b"\x00\xff garbage", {}),
        (b'{"inputs": [', {}),
        (b"[]", {}),
        (good, {}),  # binary body without its header
        (good, {HEADER_LENGTH: "-5"}),
        (good, {HEADER_LENGTH: str(10**12)}),
        (good[:-2], headers),
        (json.dumps(infer_json(np.ones((1, 4)), datatype="INT8")).encode(), {}),
        (json.dumps(infer_json(np.ones((2, 2), np.float32))).encode(), {}),
        (b'{"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4], "data": [1, 2, 3, NaN]}]}', {}),
        (json.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4], "data": {"a": 1}}]}).encode(), {}),
    ][i % 11]


def test_burst_of_malformed_requests_leaves_the_server_answering(known):
    app = create_app({"linear": known.model()})

    async def scenario():
        async with running(app) as client:
            async def bad(i):
                body, headers = malformed(i)
                return (await client._http.post("/v2/models/linear/infer", content=body, headers=headers)).status_code
            statuses = await asyncio.gather(*(bad(i) for i in range(220)))
            x = known.sample(5, n=3)
            return statuses, await client.infer("linear", {"x": x}), x, await client.ready()

    statuses, out, x, ready = asyncio.run(scenario())
    assert set(statuses) == {400} and ready
    np.testing.assert_array_equal(out["y"], known.expected(x)["y"])
    text = TestClient(app).get("/metrics").text
    assert 'converge_inference_failures_total{model="linear",reason="invalid"} 220.0' in text


def test_async_client_and_metrics(known):
    app = create_app({"linear": known.model()}, ServerSettings(BatchConfig(max_batch_size=32, max_queue_delay_us=2000)))

    async def scenario():
        async with running(app) as client:
            xs = [known.sample(i, n=1 + i % 3) for i in range(40)]
            outs = await asyncio.gather(*(client.infer("linear", {"x": x}, binary=i % 2 == 0) for i, x in enumerate(xs)))
            meta, server = await client.metadata("linear"), await client.server_metadata()
            with pytest.raises(ServerError, match="HTTP 404: unknown model 'nope'"):
                await client.metadata("nope")
            return xs, outs, meta, server, await client.live()

    xs, outs, meta, server, live = asyncio.run(scenario())
    for x, out in zip(xs, outs):
        np.testing.assert_array_equal(out["total"], known.expected(x)["total"])
    assert meta["name"] == "linear" and server["name"] == "converge" and live
    text = TestClient(app).get("/metrics").text
    samples = sum(1 + i % 3 for i in range(40))
    assert f'converge_inference_samples_total{{model="linear"}} {samples}.0' in text
    assert 'converge_inference_requests_total{model="linear",outcome="success"} 40.0' in text
    executions = float(text.split('converge_inference_executions_total{model="linear"} ')[1].split()[0])
    assert executions < 40  # concurrent requests were batched
    for name in ("converge_batch_size_bucket", "converge_queue_seconds_bucket", "converge_compute_seconds_bucket",
                 'converge_http_requests_total{method="POST",route="/v2/models/{name}/infer",status="200"} 40.0'):
        assert name in text


def test_access_log_lines_are_json(known, caplog):
    with caplog.at_level(logging.INFO, logger="converge.serve.access"):
        with TestClient(create_app({"linear": known.model()})) as c:
            c.get("/v2/models/linear")
            c.get("/v2/models/missing")
    lines = [json.loads(line) for r in caplog.records if r.name == "converge.serve.access"
             for line in r.getMessage().splitlines()]
    assert [(x["method"], x["path"], x["status"]) for x in lines] == [
        ("GET", "/v2/models/linear", 200), ("GET", "/v2/models/missing", 404)]
    assert all(x["ms"] >= 0 and "ts" in x for x in lines)


def test_access_log_writes_every_line_in_order_in_few_records_and_bounds_its_backlog(caplog):
    logger = logging.getLogger("converge.test.access")
    log = AccessLog(logger, interval_s=0.01, max_pending=5000)
    with caplog.at_level(logging.INFO, logger="converge.test.access"):
        log.start()
        for i in range(3000):  # the event loop's side: a tuple per request
            log.note(float(i), "POST", "/v2/models/m/infer", 200, 0.5, "127.0.0.1", i)
        log.close()
        records = [r for r in caplog.records if r.name == "converge.test.access"]
        lines = [json.loads(line) for r in records for line in r.getMessage().splitlines()]
        assert [x["bytes_in"] for x in lines] == list(range(3000)) and len(records) < 100
        assert set(lines[0]) == set(AccessLog.FIELDS) and lines[0]["status"] == 200
        caplog.clear()
        full = AccessLog(logger, max_pending=10)  # nobody writes: the backlog stops at 10 lines
        for i in range(25):
            full.note(float(i), "GET", "/v2", 200, 0.1, None, 0)
        full.flush()
        lines = [json.loads(line) for r in caplog.records for line in r.getMessage().splitlines()]
        assert len(lines) == 11 and lines[-1]["dropped_access_lines"] == 15
    with caplog.at_level(logging.WARNING, logger="converge.test.access"):  # below INFO: nothing is written
        caplog.clear()
        full.note(0.0, "GET", "/v2", 200, 0.1, None, 0)
        full.flush()
        assert not caplog.records and not full._lines


def test_access_log_can_be_turned_off(known, caplog):
    with caplog.at_level(logging.INFO, logger="converge.serve.access"):
        with TestClient(create_app({"linear": known.model()}, ServerSettings(access_log=False))) as c:
            assert c.post("/v2/models/linear/infer", json=infer_json(known.sample(1))).status_code == 200
            text = c.get("/metrics").text
    assert not [r for r in caplog.records if r.name == "converge.serve.access"]
    assert 'converge_http_requests_total{method="POST",route="/v2/models/{name}/infer",status="200"} 1.0' in text


def test_infer_routes_are_labelled_in_the_metrics(known):
    with TestClient(create_app({"linear": known.model()})) as c:
        assert c.post("/v2/models/linear/versions/1/infer", json=infer_json(known.sample(1))).status_code == 200
        assert c.post("/v2/models/linear/versions/1/infer", content=b"{").status_code == 400
        assert c.get("/v2/models/linear/infer").status_code == 405
        text = c.get("/metrics").text
    route = "/v2/models/{name}/versions/{version}/infer"
    for status in (200, 400):
        assert f'converge_http_requests_total{{method="POST",route="{route}",status="{status}"}} 1.0' in text
    assert 'method="GET",route="/v2/models/{name}/infer",status="405"' in text


def test_app_and_settings_are_validated(known):
    with pytest.raises(ValueError, match="models\\['a'\\] is named 'linear'; key the dict by model name"):
        create_app({"a": known.model()})
    with pytest.raises(ValueError, match="max_body_bytes=10: must be >= 1024"):
        ServerSettings(max_body_bytes=10)
    with pytest.raises(ValueError, match="token: use at least 8 characters"):
        ServerSettings(token="abc")


def test_requests_after_shutdown_are_503(known):
    app = create_app({"linear": known.model()})
    with TestClient(app):
        pass  # lifespan ran and drained: the batcher is closed
    r = TestClient(app).post("/v2/models/linear/infer", json=infer_json(known.sample(1)))
    assert r.status_code == 503 and r.json()["error"] == "model 'linear' is shutting down"


def test_a_model_breaking_its_signature_is_a_500_naming_the_output(known):
    specs = [TensorSpec("x", "FP32", (-1, 4))]
    wrong_shape = ServedModel.from_module("m", torch.nn.Linear(4, 2), specs, [TensorSpec("y", "FP32", (-1, 3))])
    missing = ServedModel("n", torch.nn.Identity(), specs, [TensorSpec("y", "FP32", (-1, 4))], lambda m, x: {"z": x["x"]})
    with TestClient(create_app({"m": wrong_shape, "n": missing})) as c:
        r = c.post("/v2/models/m/infer", json=infer_json(known.sample(1)))
        assert r.status_code == 500 and "output 'y' has shape [1, 2], signature says [-1, 3]" in r.json()["error"]
        r = c.post("/v2/models/n/infer", json=infer_json(known.sample(1)))
        assert r.status_code == 500 and "the model gave no output 'y' (it gave z)" in r.json()["error"]


@pytest.mark.parametrize("kw, message", [
    ({"name": "a/b"}, "model name 'a/b': use letters"),
    ({"version": "v 2"}, "model name 'v 2'"),
    ({"precision": "fp8"}, "precision 'fp8': choose one of bf16, fp16, fp32"),
    ({"outputs": [TensorSpec("s", "BYTES", (-1,))]}, "tensor 's': datatype 'BYTES' cannot be served"),
    ({"inputs": [TensorSpec("x", "FP32", (4,))]}, r"tensor 'x': shape \(4,\) must start with the batch axis -1"),
])
def test_served_model_signatures_are_validated(kw, message):
    args = {"name": "m", "module": torch.nn.Identity(), "inputs": [TensorSpec("x", "FP32", (-1, 4))],
            "outputs": [TensorSpec("y", "FP32", (-1, 4))], "predict_fn": lambda m, x: x, **kw}
    with pytest.raises(ModelLoadError, match=message):
        ServedModel(**args)


def test_client_refuses_a_malformed_response():
    with pytest.raises(ValidationError, match="malformed response from the server: 'outputs' must be a non-empty"):
        decode_infer_response(b'{"outputs": []}', None)


class NotANumber(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.sum(1) * float("nan")


def test_nan_outputs_come_as_binary_and_as_json_are_a_500_that_says_so():
    model = ServedModel.from_module("nan", NotANumber(), [TensorSpec("x", "FP32", (-1, 2))],
                                    [TensorSpec("y", "FP32", (-1,))])
    with TestClient(create_app({"nan": model})) as c:
        r = c.post("/v2/models/nan/infer", json=infer_json(np.ones((1, 2), np.float32)))
        assert r.status_code == 500
        assert r.json()["error"] == ("model 'nan': tensor 'y' holds NaN or infinity, which JSON cannot carry; "
                                     "send it as binary data")
        body, headers = encode_infer_request({"x": np.ones((1, 2), np.float32)}, binary=True)
        r = c.post("/v2/models/nan/infer", content=body, headers=headers)
        assert r.status_code == 200
        assert np.isnan(decode_infer_response(r.content, r.headers[HEADER_LENGTH])["y"]).all()
