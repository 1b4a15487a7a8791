"""The peer servers of the serving benchmark: what we send MLServer and LitServe, their settings, the numerical
check of their answers and the equal-p99 comparison. None of this needs the peers installed, except the `slow`
tests at the end, which use the environments `benchmarks/serve.py --peers` made (and skip without them)."""
import json
import subprocess
from pathlib import Path

import numpy as np
import pytest

from converge.bench.peers import (
    DEFAULT_ENV_ROOT, READY_MARKER, SOURCE_ROOT, TORCH_REQUIREMENT, PeerBatching, PeerError, PeerServer,
    array_from_v2, check_peer, check_peer_answer, compare_with_peers, concat_samples, decode_litserve_request,
    decode_v2_response, ensure_peer_env, mlserver_model_settings, mlserver_settings, peer_requirements,
    peer_versions, pip_check_problems, run_checked, split_samples, throughput_at_p99, v2_json_request,
    write_mlserver_repository,
)
from converge.bench.serve import ServeBenchConfig, parse_peers

CHEM = {"species": np.array([[6, 6, 8, 1, 1, 1, 1, 1, 1]], dtype=np.int64),
        "coordinates": np.arange(27, dtype=np.float32).reshape(1, 9, 3) / 7}


def _row(concurrency, sps, p99, mode="batched", fmt="json", errors=0):
    return {"mode": mode, "format": fmt, "concurrency": concurrency, "throughput_sps": sps, "p99_ms": p99,
            "errors": errors, "requests": 10}


def _peer(sps, p99, concurrency=16):
    return {"throughput_best": sps, "p99_ms_best": p99, "concurrency_best": concurrency}


# -- the comparison at equal p99 ---------------------------------------------------------------------------------------
def test_throughput_at_p99_is_our_fastest_clean_json_batched_point_within_the_p99():
    sweep = [_row(1, 500.0, 4.0), _row(8, 1500.0, 12.0), _row(16, 2000.0, 27.5), _row(32, 3000.0, 20.0, errors=2),
             _row(64, 5000.0, 10.0, fmt="binary"), _row(64, 4000.0, 10.0, mode="unbatched")]
    assert throughput_at_p99(sweep, 27.0)["concurrency"] == 8  # 16 is slower than 27 ms, 32 had errors
    assert throughput_at_p99(sweep, 27.5)["throughput_sps"] == 2000.0  # equal p99 counts
    assert throughput_at_p99(sweep, 10.0, fmt="binary")["throughput_sps"] == 5000.0
    assert throughput_at_p99(sweep, 3.9) is None  # none of ours is as quick


def test_compare_with_peers_takes_the_faster_peer_and_gives_the_ratio_at_its_p99():
    sweep = [_row(1, 500.0, 4.0), _row(8, 1500.0, 12.0), _row(16, 2000.0, 40.0)]
    peers = {"mlserver": _peer(861.0, 27.0), "litserve": _peer(451.0, 9.0),
             "broken": {"peer": "broken", "error": "would not start"}}
    out = compare_with_peers(sweep, peers)
    assert out["peer"] == "mlserver" and out["peer_throughput_at_equal_p99"] == 861.0 and out["peer_p99_ms_best"] == 27.0
    assert out["throughput_at_peer_p99"] == 1500.0 and out["concurrency_at_peer_p99"] == 8
    assert out["gain_vs_peer_at_equal_p99"] == pytest.approx(1500.0 / 861.0)


def test_compare_with_peers_when_nothing_of_ours_is_as_quick_or_no_peer_answered():
    sweep = [_row(1, 500.0, 30.0)]
    out = compare_with_peers(sweep, {"mlserver": _peer(861.0, 27.0)})
    assert out["peer"] == "mlserver" and out["throughput_at_peer_p99"] is None
    assert out["gain_vs_peer_at_equal_p99"] is None
    assert compare_with_peers(sweep, {"litserve": {"error": "x"}}) == {
        "peer": None, "peer_throughput_at_equal_p99": None, "gain_vs_peer_at_equal_p99": None}


# -- what goes over the wire -------------------------------------------------------------------------------------------
def test_the_v2_json_request_is_plain_kserve_v2_and_round_trips():
    doc = json.loads(v2_json_request(CHEM))
    assert list(doc) == ["inputs"]  # no binary-extension parameters: the peers do not speak it
    species, coordinates = doc["inputs"]
    assert species == {"name": "species", "shape": [1, 9], "datatype": "INT64", "data": [6, 6, 8, 1, 1, 1, 1, 1, 1]}
    assert coordinates["datatype"] == "FP32" and coordinates["shape"] == [1, 9, 3] and len(coordinates["data"]) == 27
    back = decode_v2_response(json.dumps({"outputs": doc["inputs"]}).encode())
    for name, array in CHEM.items():
        assert back[name].dtype == array.dtype and np.array_equal(back[name], array)  # bit-exact, FP32 included
    with pytest.raises(ValueError, match="a response without 'outputs'"):
        decode_v2_response(b'{"error": "boom"}')


def test_array_from_v2_says_what_does_not_fit():
    assert array_from_v2([1, 2, 3, 4], "FP64", [2, 2]).dtype == np.float64
    with pytest.raises(ValueError, match="datatype 'BF16': expected one of"):
        array_from_v2([1.0], "BF16", [1])
    with pytest.raises(ValueError, match=r"3 values do not fill shape \[2, 2\]"):
        array_from_v2([1, 2, 3], "INT64", [2, 2])


def test_litserve_decode_batch_and_unbatch():
    request = json.loads(v2_json_request(CHEM))  # what LitServe hands decode_request: the parsed body
    datatypes = {"species": "INT64", "coordinates": "FP32"}
    one = decode_litserve_request(request, datatypes)
    batch = concat_samples([one, {k: v + 1 for k, v in one.items()}])
    assert batch["species"].shape == (2, 9) and batch["coordinates"].shape == (2, 9, 3)
    rows = split_samples({"energy": np.array([1.0, 2.0]), "forces": batch["coordinates"]})
    assert [r["energy"].tolist() for r in rows] == [[1.0], [2.0]] and rows[1]["forces"].shape == (1, 9, 3)
    with pytest.raises(ValueError, match=r"inputs \['coordinates', 'species'\]: the model takes \['strain'\]"):
        decode_litserve_request(request, {"strain": "FP32"})
    with pytest.raises(ValueError, match="input 'species': send one sample of INT32"):
        decode_litserve_request(request, {**datatypes, "species": "INT32"})
    two = json.loads(v2_json_request({k: np.concatenate([v, v]) for k, v in CHEM.items()}))
    with pytest.raises(ValueError, match=r"send one sample of INT64, got int64 shape \[2, 9\]"):
        decode_litserve_request(two, datatypes)


def test_mlserver_settings_and_model_settings(tmp_path):
    settings = mlserver_settings(8080, 8081)
    assert settings["parallel_workers"] == 0 and settings["metrics_endpoint"] is None
    assert (settings["host"], settings["http_port"], settings["grpc_port"]) == ("127.0.0.1", 8080, 8081)
    model = mlserver_model_settings("gw", tmp_path, 64, 0.002, 1)
    assert model["implementation"] == "converge.bench.peer_runtimes.MLServerRuntime"
    assert (model["max_batch_size"], model["max_batch_time"]) == (64, 0.002)
    assert model["parameters"]["extra"] == {"run": str(tmp_path.resolve()), "threads": 1}
    with pytest.raises(ValueError, match="MLServer's adaptive batching wants a positive max_batch_time"):
        mlserver_model_settings("gw", tmp_path, 64, 0.0, 1)
    folder = write_mlserver_repository(tmp_path / "repo", "gw", tmp_path, PeerBatching(), 1, 8080, 8081)
    assert json.loads((folder / "settings.json").read_text()) == settings
    assert json.loads((folder / "gw" / "model-settings.json").read_text()) == model


def test_peer_commands_and_targets(tmp_path):
    python = tmp_path / "env" / "bin" / "python"
    mlserver = PeerServer("mlserver", python, tmp_path, "gw", tmp_path / "log", PeerBatching())
    cmd, ready = mlserver.command(8080)
    assert cmd[:2] == [str(tmp_path / "env" / "bin" / "mlserver"), "start"] and ready == "/v2/models/gw/ready"
    assert json.loads((Path(cmd[2]) / "settings.json").read_text())["http_port"] == 8080
    litserve = PeerServer("litserve", python, tmp_path, "gw", tmp_path / "log", PeerBatching(max_batch_size=32))
    cmd, ready = litserve.command(9000)
    assert cmd[:4] == [str(python), "-m", "converge.bench.peer_runtimes", "litserve"] and ready == "/health"
    assert cmd[cmd.index("--max-batch-size") + 1] == "32" and cmd[cmd.index("--port") + 1] == "9000"
    litserve.url = "http://127.0.0.1:9000"
    target = litserve.target([CHEM, CHEM])
    assert target.request_path == "/predict" and target.samples_per_request == 1
    assert target.raw_requests()[0].startswith(b"POST /predict HTTP/1.1\r\n")
    assert target.requests[0][0] == v2_json_request(CHEM)
    with pytest.raises(ValueError, match="peer 'triton': choose from mlserver, litserve"):
        check_peer("triton")
    with pytest.raises(ValueError, match="need max_batch_size >= 1"):
        PeerBatching(mlserver_max_batch_time_s=0)


def test_check_peer_answer_passes_the_same_outputs_and_fails_on_different_ones():
    ours = {"energy": np.array([-97000.5]), "forces": np.ones((1, 9, 3), np.float32)}
    assert check_peer_answer("mlserver", {k: v.copy() for k, v in ours.items()}, ours, "fp32") == 0.0
    near = {**ours, "forces": ours["forces"] * (1 + 4e-3)}  # a bf16 rounding, not a different model
    assert check_peer_answer("litserve", near, ours, "bf16") == pytest.approx(4e-3, rel=1e-3)
    with pytest.raises(PeerError, match="mlserver: output 'forces' differs from our model's by up to 0.004"):
        check_peer_answer("mlserver", near, ours, "fp32")
    with pytest.raises(PeerError, match=r"answered outputs \['energy'\], our model gives \['energy', 'forces'\]"):
        check_peer_answer("mlserver", {"energy": ours["energy"]}, ours, "fp32")
    with pytest.raises(PeerError, match=r"output 'energy' has shape \[1, 1\], ours \[1\]"):
        check_peer_answer("mlserver", {**ours, "energy": ours["energy"][:, None]}, ours, "fp32")


def test_pip_check_ignores_only_convergences_unneeded_dependencies():
    report = ("converge 0.1.0 requires lalsuite, which is not installed.\n"
              "converge 0.1.0 requires pycbc, which is not installed.\n")
    assert pip_check_problems(report) == [] and pip_check_problems("No broken requirements found.\n") == []
    conflict = "mlserver 1.7.1 has requirement fastapi<0.116.0,>=0.88.0, but you have fastapi 0.165.0."
    assert pip_check_problems(report + conflict) == [conflict]
    assert pip_check_problems("torchani 2.9.0 requires ase, which is not installed.") != []


def test_a_ready_peer_env_is_reused_and_failed_steps_say_why(tmp_path):
    import sys

    env = tmp_path / "mlserver"
    (env / "bin").mkdir(parents=True)
    (env / "bin" / "python").write_text("")
    wanted = {"torch": TORCH_REQUIREMENT, "requirements": list(peer_requirements("mlserver")),
              "source": str(SOURCE_ROOT)}
    (env / READY_MARKER).write_text(json.dumps({"wanted": wanted, "versions": {"mlserver": "1.7.1"}}))
    steps = []
    assert ensure_peer_env("mlserver", tmp_path, log=steps.append) == env / "bin" / "python" and steps == []
    assert peer_versions(env / "bin" / "python") == {"mlserver": "1.7.1"}
    assert "mlserver==1.7.1" in wanted["requirements"] and "fastapi>=0.115" in wanted["requirements"]
    with pytest.raises(PeerError, match=r"(?s)failed \(3\):\nboom"):
        run_checked([sys.executable, "-c", "print('boom'); raise SystemExit(3)"])
    with pytest.raises(ValueError, match="peer 'tgi': choose from"):
        ensure_peer_env("tgi", tmp_path)


def test_bench_config_takes_peers_over_json_only():
    cfg = ServeBenchConfig.from_options("1,16", 2.0, 0.5, "json", 32, peers="mlserver, litserve")
    assert cfg.peers == ("mlserver", "litserve") and cfg.peer_batching.max_batch_size == 32
    assert parse_peers("") == () and ServeBenchConfig().peers == ()
    with pytest.raises(ValueError, match="peers=\\('triton',\\): choose distinct ones from mlserver, litserve"):
        ServeBenchConfig(peers=("triton",))
    with pytest.raises(ValueError, match="speak JSON only: add json to formats"):
        ServeBenchConfig(peers=("mlserver",), formats=("binary",))


def test_runtimes_import_without_the_peers_installed():
    import converge.bench.peer_runtimes as runtimes

    with pytest.raises(AttributeError, match="has no attribute 'Nope'"):
        runtimes.Nope  # noqa: B018


# -- against the installed peers (made by `benchmarks/serve.py --peers ...`) -------------------------------------------
def _installed(peer):
    python = DEFAULT_ENV_ROOT / peer / "bin" / "python"
    if not (DEFAULT_ENV_ROOT / peer / READY_MARKER).is_file():
        pytest.skip(f"{peer} is not installed in {DEFAULT_ENV_ROOT} (run benchmarks/serve.py --peers {peer})")
    return python


@pytest.mark.slow
def test_mlserver_accepts_our_request_as_its_own_types():
    python = _installed("mlserver")
    code = ("import sys; from mlserver.types import InferenceRequest; "
            "r = InferenceRequest.model_validate_json(sys.stdin.buffer.read()); print(r.inputs[1].shape)")
    done = subprocess.run([str(python), "-c", code], input=v2_json_request(CHEM), capture_output=True, check=True)
    assert done.stdout.strip() == b"[1, 9, 3]"


@pytest.mark.slow
@pytest.mark.parametrize("peer", ["mlserver", "litserve"])
def test_peer_serves_our_model_with_our_answers(peer, tmp_path):
    from converge.apps.gw.config import GWConfig
    from converge.bench.loadgen import LoadProcess
    from converge.bench.serve import example_inputs
    from converge.serve import load_served_model

    tiny = GWConfig(channels=(4, 4, 8), hidden=8)  # untrained: the answers need no skill, only to agree
    run = _make_tiny_run(tmp_path, tiny)
    strain = example_inputs("gw", tiny, 3)["strain"]
    samples = [{"strain": strain[i:i + 1]} for i in range(3)]
    reference = load_served_model(run).predict(samples[0])
    with PeerServer(peer, _installed(peer), run, "gw", tmp_path / "peer.log", PeerBatching(),
                    startup_timeout_s=120) as server, LoadProcess() as load:
        assert check_peer_answer(peer, server.infer(samples[0]), reference, "fp32") < 1e-5
        result = load.run(server.target(samples), 4, 1.0, 0.2, timeout_s=10)
    assert result.requests > 0 and result.errors == 0, result.error_examples


@pytest.mark.slow
def test_serve_benchmark_with_both_peers_reports_the_comparison(tmp_path):
    from converge.apps.gw.config import GWConfig
    from converge.bench.serve import run_serve_benchmark, write_results

    for peer in ("mlserver", "litserve"):
        _installed(peer)
    run = _make_tiny_run(tmp_path, GWConfig(channels=(4, 4, 8), hidden=8))
    cfg = ServeBenchConfig(concurrencies=(1, 4), duration_s=0.5, warmup_s=0.1, formats=("json",),
                           ceiling_batches=(1, 4), ceiling_min_time_s=0.05, peers=("mlserver", "litserve"))
    report = run_serve_benchmark(run, cfg, log_dir=tmp_path)
    assert sorted(report["peers"]) == ["litserve", "mlserver"] and report["peer"] in report["peers"]
    for measured in report["peers"].values():
        assert [r["concurrency"] for r in measured["sweep"]] == [1, 4] and measured["max_abs_diff_vs_ours"] < 1e-5
        assert all(r["errors"] == 0 and r["requests"] > 0 for r in measured["sweep"])
    better = report["peers"][report["peer"]]
    assert report["peer_throughput_at_equal_p99"] == max(p["throughput_best"] for p in report["peers"].values())
    if report["throughput_at_peer_p99"] is not None:
        assert report["p99_ms_at_peer_p99"] <= better["p99_ms_best"]
        assert report["gain_vs_peer_at_equal_p99"] == report["throughput_at_peer_p99"] / better["throughput_best"]
    assert write_results({"gw": report}, tmp_path)[1].stat().st_size > 10_000


def _make_tiny_run(tmp_path, cfg):
    from dataclasses import asdict

    from converge.apps.gw.app import GWApp
    from converge.train.checkpoint import save_checkpoint

    run = tmp_path / "gw-tiny"
    run.mkdir()
    config = {"app": "gw", "app_config": asdict(cfg), "train": {"precision": "fp32"}}
    (run / "config.json").write_text(json.dumps(config))
    save_checkpoint(run / "best.pt", {"model": GWApp().make_model(cfg).state_dict(), "config": config})
    return run
