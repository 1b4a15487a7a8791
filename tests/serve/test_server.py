"""A real uvicorn server on 127.0.0.1: many threaded clients, Triton's client, and the serve() guards."""
import logging
import threading

import numpy as np
import pytest

from converge.serve import BatchConfig, Client, ModelLoadError, ServerSettings, create_app
from converge.serve.direct import DirectInferProtocol
from converge.serve.server import (ServeConfigError, check_bind, event_loop_and_parser, is_loopback, load_runs,
                                   parse_run, serve)


def test_many_threaded_clients_each_get_their_own_answer(known, live_server):
    app = create_app({"linear": known.model()}, ServerSettings(BatchConfig(max_batch_size=32, max_queue_delay_us=2000)))
    wrong, done = [], []

    def client(i: int, url: str) -> None:
        with Client(url, timeout=30) as c:
            for k in range(12):
                x = known.sample(100 * i + k, n=1 + (i + k) % 4)
                out = c.infer("linear", {"x": x}, binary=(i + k) % 2 == 0)
                want = known.expected(x)
                if not (np.array_equal(out["y"], want["y"]) and np.array_equal(out["total"], want["total"])):
                    wrong.append((i, k))
                done.append(1)

    with live_server(app) as url:
        threads = [threading.Thread(target=client, args=(i, url)) for i in range(12)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        with Client(url) as c:
            assert c.live() and c.ready() and c.ready("linear") and not c.ready("nope")
    assert not wrong and len(done) == 12 * 12


def test_tritonclient_round_trip(known, live_server):
    import tritonclient.http as triton

    app = create_app({"linear": known.model()})
    x = known.sample(4, n=3)
    want = known.expected(x)
    with live_server(app) as url:
        client = triton.InferenceServerClient(url.removeprefix("http://"), connection_timeout=10, network_timeout=10)
        try:
            assert client.is_server_live() and client.is_server_ready() and client.is_model_ready("linear")
            assert client.get_server_metadata()["extensions"] == ["binary_tensor_data"]
            meta = client.get_model_metadata("linear")
            assert [t["name"] for t in meta["outputs"]] == ["y", "total"]
            for binary_in in (False, True):
                for binary_out in (False, True):
                    inp = triton.InferInput("x", list(x.shape), "FP32")
                    inp.set_data_from_numpy(x, binary_data=binary_in)
                    outs = [triton.InferRequestedOutput(n, binary_data=binary_out) for n in ("total", "y")]
                    result = client.infer("linear", [inp], outputs=outs, request_id="abc")
                    np.testing.assert_array_equal(result.as_numpy("y"), want["y"])
                    np.testing.assert_array_equal(result.as_numpy("total"), want["total"])
                    assert result.get_response()["id"] == "abc"
            inp = triton.InferInput("x", list(x.shape), "FP32")
            inp.set_data_from_numpy(x)
            default = client.infer("linear", [inp])  # no outputs named: all of them, as binary
            np.testing.assert_array_equal(default.as_numpy("y"), want["y"])
            with pytest.raises(Exception, match="datatype FP64, expected FP32"):
                bad = triton.InferInput("x", list(x.shape), "FP64")
                bad.set_data_from_numpy(x.astype(np.float64))
                client.infer("linear", [bad])
        finally:
            client.close()


@pytest.mark.parametrize("host, loopback", [("127.0.0.1", True), ("127.3.2.1", True), ("::1", True),
                                            ("localhost", True), ("0.0.0.0", False), ("10.0.0.5", False),
                                            ("example.org", False)])
def test_only_loopback_binds_without_a_token(host, loopback):
    assert is_loopback(host) == loopback
    if loopback:
        check_bind(host, None, False)
    else:
        with pytest.raises(ServeConfigError, match=f"refusing to serve on '{host}' without a token"):
            check_bind(host, None, False)
        check_bind(host, "a-long-token", False)
        check_bind(host, None, True)


def test_serve_refuses_an_open_bind_before_loading_anything(tmp_path):
    with pytest.raises(ServeConfigError, match="without a token"):
        serve([tmp_path / "nothing"], host="0.0.0.0")


def test_run_specs_and_load_errors(tmp_path):
    assert parse_run("gw=runs/a") == ("gw", tmp_path.__class__("runs/a"))
    assert parse_run(tmp_path) == (None, tmp_path)
    with pytest.raises(ServeConfigError, match="no runs to serve"):
        load_runs([])
    with pytest.raises(ModelLoadError, match="no such run folder"):
        load_runs([tmp_path / "missing"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="holds neither config.json nor best.pt"):
        load_runs([tmp_path / "empty"])
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "config.json").write_text('{"app": "nosuchapp", "app_config": {}}')
    with pytest.raises(ModelLoadError, match="unknown app 'nosuchapp'; installed apps: .*chem.*gw"):
        load_runs([tmp_path / "foreign"])
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "config.json").write_text('{"epochs": 3}')
    with pytest.raises(ModelLoadError, match="config has no 'app'"):
        load_runs([tmp_path / "other"])


def test_uvloop_and_httptools_are_chosen_when_installed(monkeypatch, caplog):
    import importlib.util

    installed = {"uvloop", "httptools"}
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object() if name in installed else None)
    assert event_loop_and_parser() == ("uvloop", "httptools")
    installed.discard("httptools")
    with caplog.at_level(logging.WARNING, logger="converge.serve"):
        assert event_loop_and_parser() == ("uvloop", "h11")
    assert "httptools not installed" in caplog.text and "uvicorn[standard]" in caplog.text




@pytest.mark.parametrize("direct, parser, expected", [
    (True, "httptools", DirectInferProtocol), (False, "httptools", "httptools"), (True, "h11", "h11")])
def test_serve_runs_uvicorn_with_the_direct_infer_protocol_on_httptools(monkeypatch, known, direct, parser, expected):
    import uvicorn

    from converge.serve import server

    seen = {}
    monkeypatch.setattr(server, "build_app", lambda runs, settings, device: create_app({"linear": known.model()}))
    monkeypatch.setattr(server, "event_loop_and_parser", lambda: ("asyncio", parser))
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: seen.update(kw))
    server.serve(["unused"], model_process=False, direct_infer=direct)
    assert seen["http"] is expected and seen["loop"] == "asyncio"
