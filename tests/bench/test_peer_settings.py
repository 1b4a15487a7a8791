"""The peers' settings grids, their parsing, and the configuration files each peer reads (no peer needed)."""
import json

import pytest

from converge.bench.peer_settings import (
    PeerSettings, check_settings, default_grid, grid, mlserver_model_settings, mlserver_settings, native_settings,
    parse_peer_grid, triton_model_config, triton_tensor,
)
from converge.bench.serve import ServeBenchConfig
from converge.contract import TensorSpec

GW = ((TensorSpec("strain", "FP32", (-1, 2048)),),
      (TensorSpec("logit", "FP32", (-1,)), TensorSpec("probability", "FP32", (-1,))))
CHEM = ((TensorSpec("species", "INT64", (-1, 9)), TensorSpec("coordinates", "FP32", (-1, 9, 3))),
        (TensorSpec("energy", "FP64", (-1,)), TensorSpec("forces", "FP32", (-1, 9, 3))))


def test_settings_validate_and_name_themselves_in_each_peers_terms():
    s = PeerSettings(max_batch_size=128, delay_ms=0.5, workers=2)
    assert s.label == "b128-d0.5ms-w2"
    assert native_settings("triton", s) == {"max_batch_size": 128, "dynamic_batching.max_queue_delay_microseconds": 500,
                                            "instance_group": [{"count": 2, "kind": "KIND_CPU"}]}
    assert native_settings("mlserver", s) == {"max_batch_size": 128, "max_batch_time": 0.0005, "parallel_workers": 2}
    assert native_settings("litserve", s)["workers_per_device"] == 2
    assert native_settings("litserve", s)["batch_timeout"] == 0.0005
    for bad in ({"max_batch_size": 0}, {"delay_ms": -1.0}, {"workers": 0}):
        with pytest.raises(ValueError, match="need max_batch_size >= 1, delay_ms >= 0 and workers >= 1"):
            PeerSettings(**bad)
    assert check_settings("triton", PeerSettings(delay_ms=0.0)).delay_ms == 0.0  # Triton takes no delay
    with pytest.raises(ValueError, match="MLServer's adaptive batching wants a positive max_batch_time"):
        check_settings("mlserver", PeerSettings(delay_ms=0.0))
    with pytest.raises(ValueError, match="peer 'tgi': choose from triton, mlserver, litserve"):
        native_settings("tgi", s)


def test_grids_are_the_product_of_their_axes_and_the_defaults_sweep_each_documented_knob():
    g = grid({"delay_ms": (0.0, 1.0), "workers": (1, 2, 3)})
    assert len(g) == 6 and len(set(g)) == 6 and g[0] == PeerSettings(delay_ms=0.0, workers=1)
    assert all(s.max_batch_size == 64 for s in g)
    triton = default_grid("triton", 32)
    assert {s.max_batch_size for s in triton} == {32, 64}  # around our batch limit
    assert len({s.delay_ms for s in triton}) > 1 and len({s.workers for s in triton}) > 1
    for peer in ("mlserver", "litserve"):
        settings = default_grid(peer)
        assert min(s.workers for s in settings) >= 1 and len({s.workers for s in settings}) > 1
        assert min(s.delay_ms for s in settings) > 0 and len({s.delay_ms for s in settings}) > 1
        assert all(check_settings(peer, s) for s in settings)


def test_parse_peer_grid_replaces_only_the_axes_it_names():
    out = parse_peer_grid("triton.delay_ms=0,0.5;triton.workers=1  mlserver.workers=1,2", ("triton", "mlserver"))
    assert [(s.max_batch_size, s.delay_ms, s.workers) for s in out["triton"]] == [
        (64, 0.0, 1), (64, 0.5, 1), (128, 0.0, 1), (128, 0.5, 1)]
    assert {s.workers for s in out["mlserver"]} == {1, 2} and {s.delay_ms for s in out["mlserver"]} == {2.0, 10.0}
    assert parse_peer_grid("", ("litserve",), 16) == {"litserve": default_grid("litserve", 16)}
    assert parse_peer_grid("", ()) == {}


@pytest.mark.parametrize("text, message", [
    ("triton.delay_ms", r"give PEER.AXIS=V1,V2"),
    ("delay_ms=1", r"give PEER.AXIS=V1,V2"),
    ("litserve.workers=1", r"'litserve' is not among the peers triton"),
    ("triton.threads=2", r"axis 'threads': choose from max_batch_size, delay_ms, workers"),
    ("triton.workers=1.5", r"workers takes int values"),
    ("triton.delay_ms=fast", r"delay_ms takes float values"),
    ("triton.workers=", r"give at least one value"),
    ("triton.workers=0", r"need max_batch_size >= 1, delay_ms >= 0 and workers >= 1"),
    ("mlserver.delay_ms=0,2", r"wants a positive max_batch_time"),
])
def test_parse_peer_grid_says_what_to_fix(text, message):
    with pytest.raises(ValueError, match=message):
        parse_peer_grid(text, ("triton", "mlserver"))


def test_bench_config_takes_each_peer_in_its_format_and_its_grid():
    cfg = ServeBenchConfig.from_options("1,16", 2.0, 0.5, "binary,json", 32, peers="triton, mlserver",
                                        peer_grid="triton.workers=2")
    assert cfg.peers == ("triton", "mlserver")
    assert {s.workers for s in cfg.peer_settings_for("triton")} == {2}
    assert cfg.peer_settings_for("mlserver") == default_grid("mlserver", 32)
    assert ServeBenchConfig(peers=("litserve",)).peer_settings_for("litserve") == default_grid("litserve", 64)
    with pytest.raises(ValueError, match=r"triton is compared over binary: add binary to formats=\('json',\)"):
        ServeBenchConfig(peers=("triton",), formats=("json",))
    with pytest.raises(ValueError, match=r"mlserver is compared over json: add json to formats"):
        ServeBenchConfig(peers=("mlserver",), formats=("binary",))
    with pytest.raises(ValueError, match=r"peer_grid names \['litserve'\], not among peers"):
        ServeBenchConfig(peers=("triton",), peer_grid={"litserve": (PeerSettings(),)})
    with pytest.raises(ValueError, match=r"peer_grid\['triton'\] is empty"):
        ServeBenchConfig(peers=("triton",), peer_grid={"triton": ()})
    with pytest.raises(ValueError, match="wants a positive max_batch_time"):
        ServeBenchConfig(peers=("mlserver",), peer_grid={"mlserver": (PeerSettings(delay_ms=0.0),)})
    with pytest.raises(ValueError, match=r"peers=\('tgi',\): choose distinct ones from triton, mlserver, litserve"):
        ServeBenchConfig(peers=("tgi",))


def test_mlserver_settings_and_model_settings(tmp_path):
    settings = mlserver_settings(8080, 8081, parallel_workers=2)
    assert settings["parallel_workers"] == 2 and settings["metrics_endpoint"] is None
    assert (settings["host"], settings["http_port"], settings["grpc_port"]) == ("127.0.0.1", 8080, 8081)
    model = mlserver_model_settings("gw", tmp_path, PeerSettings(64, 2.0, 1), 1)
    assert model["implementation"] == "converge.bench.peer_runtimes.MLServerRuntime"
    assert (model["max_batch_size"], model["max_batch_time"]) == (64, 0.002)
    assert model["parameters"]["extra"] == {"run": str(tmp_path.resolve()), "threads": 1}
    json.dumps(model)
    with pytest.raises(ValueError, match="MLServer's adaptive batching wants a positive max_batch_time"):
        mlserver_model_settings("gw", tmp_path, PeerSettings(64, 0.0, 1), 1)


def test_triton_config_declares_our_signature_with_dynamic_batching(tmp_path):
    text = triton_model_config("gw", *GW, PeerSettings(128, 0.5, 2), tmp_path, 1)
    assert 'name: "gw"' in text and 'backend: "python"' in text and "max_batch_size: 128" in text
    assert '{ name: "strain" data_type: TYPE_FP32 dims: [2048] }' in text
    # a scalar per sample cannot be batched as dims []: [1], reshaped to the model's own []
    assert '{ name: "logit" data_type: TYPE_FP32 dims: [1] reshape: { shape: [] } }' in text
    assert "dynamic_batching { max_queue_delay_microseconds: 500 }" in text
    assert "instance_group [ { count: 2 kind: KIND_CPU } ]" in text
    assert f'key: "run" value: {{ string_value: "{tmp_path.resolve()}" }}' in text
    assert 'key: "threads" value: { string_value: "1" }' in text
    chem = triton_model_config("chem", *CHEM, PeerSettings(), tmp_path, 1)
    assert "dims: [9, 3] }" in chem and "data_type: TYPE_INT64 dims: [9] }" in chem
    assert '{ name: "energy" data_type: TYPE_FP64 dims: [1] reshape: { shape: [] } }' in chem
    assert "max_queue_delay_microseconds: 0 }" in chem
    # chemical space: a variable atom axis is Triton's -1 too
    assert triton_tensor("coordinates", "FP32", (-1, -1, 3)) == (
        '{ name: "coordinates" data_type: TYPE_FP32 dims: [-1, 3] }')
    with pytest.raises(ValueError, match="tensor 'x': shape \\[-1, 0\\]: Triton takes sizes >= 1 or -1"):
        triton_tensor("x", "FP32", (-1, 0))
    with pytest.raises(ValueError, match="tensor 'x': datatype 'BYTES' has no Triton type here"):
        triton_tensor("x", "BYTES", (-1, 4))
