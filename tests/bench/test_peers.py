"""The peer servers of the serving benchmark: what we send Triton, MLServer and LitServe, how each is started, the
numerical check of their answers, the pick of each one's best settings and the equal-p99 comparison. None of this
needs the peers installed, except the `slow` tests at the end, which use the environments `converge bench serve
--peers` made (and skip, saying so, without them)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from converge.bench import peer_envs, peers as peers_module
from converge.bench.loadgen import LoadResult
from converge.bench.peer_envs import (
    DEFAULT_ENV_ROOT, READY_MARKER, PeerError, base_python, ensure_peer_env, env_ready, peer_requirements,
    peer_versions, pip_check_problems, run_checked, wanted_env,
)
from converge.bench.peer_runtimes import triton_execute
from converge.bench.peer_settings import PeerSettings
from converge.bench.peer_wire import (
    array_from_v2, concat_samples, decode_litserve_request, decode_v2_response, restore_output_shapes,
    split_by_sizes, split_samples, v2_json_request,
)
from converge.bench.peers import (
    PeerAnswerError, PeerServer, best_over_settings, check_peer_answer, compare_with_peers, measure_peer,
    ours_at_peer_best, throughput_at_p99,
)
from converge.bench.serve import ServeBenchConfig, parse_peers
from converge.contract import TensorSpec

CHEM = {"species": np.array([[6, 6, 8, 1, 1, 1, 1, 1, 1]], dtype=np.int64),
        "coordinates": np.arange(27, dtype=np.float32).reshape(1, 9, 3) / 7}
GW_SIGNATURE = ((TensorSpec("strain", "FP32", (-1, 2048)),), (TensorSpec("logit", "FP32", (-1,)),))


def _row(concurrency, sps, p99, mode="batched", fmt="json", errors=0):
    return {"mode": mode, "format": fmt, "concurrency": concurrency, "throughput_sps": sps, "p99_ms": p99,
            "errors": errors, "requests": 10}


def _peer(sps, p99, concurrency=16, fmt="json"):
    return {"throughput_best": sps, "p99_ms_best": p99, "concurrency_best": concurrency, "format": fmt}


# -- the comparison at equal p99 ---------------------------------------------------------------------------------------
def test_throughput_at_p99_is_our_fastest_clean_batched_point_of_the_format_within_the_p99():
    sweep = [_row(1, 500.0, 4.0), _row(8, 1500.0, 12.0), _row(16, 2000.0, 27.5), _row(32, 3000.0, 20.0, errors=2),
             _row(64, 5000.0, 10.0, fmt="binary"), _row(64, 4000.0, 10.0, mode="unbatched")]
    assert throughput_at_p99(sweep, 27.0)["concurrency"] == 8  # 16 is slower than 27 ms, 32 had errors
    assert throughput_at_p99(sweep, 27.5)["throughput_sps"] == 2000.0  # equal p99 counts
    assert throughput_at_p99(sweep, 10.0, fmt="binary")["throughput_sps"] == 5000.0
    assert throughput_at_p99(sweep, 3.9) is None  # none of ours is as quick


def test_each_peer_is_compared_in_its_own_format_and_the_hardest_one_is_named():
    sweep = [_row(1, 500.0, 4.0), _row(8, 1500.0, 12.0), _row(16, 2000.0, 40.0),
             _row(16, 3000.0, 9.0, fmt="binary"), _row(64, 6000.0, 30.0, fmt="binary")]
    peers = {"mlserver": _peer(861.0, 27.0), "litserve": _peer(451.0, 9.0),
             "triton": _peer(4000.0, 20.0, fmt="binary"), "broken": {"peer": "broken", "error": "would not start"}}
    out = compare_with_peers(sweep, peers)
    vs = out["vs_peers"]
    assert sorted(vs) == ["litserve", "mlserver", "triton"]
    assert vs["mlserver"]["throughput"] == 1500.0 and vs["mlserver"]["gain"] == pytest.approx(1500.0 / 861.0)
    assert vs["litserve"]["concurrency"] == 1 and vs["litserve"]["gain"] == pytest.approx(500.0 / 451.0)
    # Triton's 20 ms p99 is met by our binary point at 9 ms only (6000/s had 30 ms), never by a JSON one
    assert vs["triton"]["format"] == "binary" and vs["triton"]["throughput"] == 3000.0
    assert vs["triton"]["gain"] == pytest.approx(0.75) and vs["triton"]["gain_target"] == 1.0
    assert not vs["triton"]["meets_target"] and vs["mlserver"]["meets_target"] and not vs["litserve"]["meets_target"]
    assert out["peer"] == "triton" and out["peer_format"] == "binary"  # the lowest gain
    assert out["peer_throughput_at_equal_p99"] == 4000.0 and out["throughput_at_peer_p99"] == 3000.0
    assert out["gain_vs_peer_at_equal_p99"] == pytest.approx(0.75)


def test_compare_with_peers_when_nothing_of_ours_is_as_quick_or_no_peer_answered():
    sweep = [_row(1, 500.0, 30.0)]
    out = compare_with_peers(sweep, {"mlserver": _peer(861.0, 27.0), "litserve": _peer(100.0, 40.0)})
    assert out["peer"] == "mlserver" and out["throughput_at_peer_p99"] is None  # no point of ours counts as 0
    assert out["gain_vs_peer_at_equal_p99"] is None and out["vs_peers"]["litserve"]["gain"] == 5.0
    assert ours_at_peer_best(sweep, "mlserver", _peer(861.0, 27.0))["meets_target"] is False
    assert compare_with_peers(sweep, {"litserve": {"error": "x"}}) == {
        "peer": None, "peer_throughput_at_equal_p99": None, "gain_vs_peer_at_equal_p99": None, "vs_peers": {}}


# -- each peer at its best settings ------------------------------------------------------------------------------------
def _run(label, *points, error=None):
    run = {"settings": label, "sweep": [{"concurrency": c, "throughput_sps": sps, "p99_ms": 10.0, "errors": e,
                                         "requests": 0 if sps == 0 else 10} for c, sps, e in points]}
    return {**run, "error": error} if error else run


def test_the_best_is_the_fastest_clean_point_over_every_setting():
    runs = [_run("b64-d0ms-w1", (8, 900.0, 0), (64, 1500.0, 0)),
            _run("b64-d0ms-w2", (8, 1200.0, 0), (64, 2500.0, 3)),  # faster, but with errors: passed over
            _run("b128-d1ms-w2", (8, 1300.0, 0), (64, 1400.0, 0)),
            _run("b128-d0ms-w1", error="would not start")]
    run, row = best_over_settings(runs)
    assert run["settings"] == "b64-d0ms-w1" and row["throughput_sps"] == 1500.0 and row["concurrency"] == 64
    with pytest.raises(PeerError, match=r"no setting gave a clean measurement \(b64-d0ms-w1: errors only; "
                                        r"b64-d0ms-w2: would not start\)"):
        best_over_settings([_run("b64-d0ms-w1", (8, 0.0, 4)), _run("b64-d0ms-w2", error="would not start")])


class _FakeServer:
    """Stands in for PeerServer: starts (or not), answers ``answer``, counts nothing."""

    def __init__(self, peer, python, run_dir, name, log, settings, threads, timeout, signature, answer, fail):
        self.peer, self.settings, self.answer, self.fail = peer, settings, answer, fail

    def __enter__(self):
        if self.settings in self.fail:
            raise PeerError(f"{self.peer} exited with status 1:\nno room for {self.settings.workers} workers")
        return self

    def __exit__(self, *exc):
        pass

    def infer(self, sample):
        return self.answer

    def target(self, samples):
        return None

    def counters(self):
        return None

    def cpu_seconds(self):
        """0.6 CPU seconds more at each call: the CPU of one load window."""
        self.cpu = getattr(self, "cpu", 0.0) + 0.6
        return self.cpu


class _FakeLoad:
    """100 samples/s per client, p99 3 ms per client; after ``slower_after`` windows, 10% slower."""

    def __init__(self, slower_after=10 ** 6):
        self.windows, self.slower_after = 0, slower_after

    def run(self, target, concurrency, duration_s, warmup_s, timeout_s):
        self.windows += 1
        sps = 100.0 * concurrency * (0.9 if self.windows > self.slower_after else 1.0)
        return LoadResult(concurrency, duration_s, int(sps * duration_s), 0, 1, sps, sps, 1.0, 2.0, 3.0 * concurrency,
                          1.5, 4.0, 0.1)


GRID = (PeerSettings(64, 2.0, 1), PeerSettings(64, 2.0, 2), PeerSettings(64, 10.0, 1))


def _measure(monkeypatch, tmp_path, answer, fail=(), load=None, confirm=True):
    started = []

    def server(*args):
        started.append(args[5])
        return _FakeServer(*args, answer=answer, fail=fail)

    monkeypatch.setattr(peers_module, "ensure_peer_env", lambda peer, root: tmp_path / "bin" / "python")
    monkeypatch.setattr(peers_module, "peer_versions", lambda python: {"mlserver": "1.7.1"})
    monkeypatch.setattr(peers_module, "PeerServer", server)
    cfg = ServeBenchConfig(concurrencies=(1, 8), peers=("mlserver",), peer_grid={"mlserver": GRID},
                           peer_confirm=confirm)
    reference = {"logit": np.array([0.25], np.float32)}
    out = measure_peer("mlserver", tmp_path, "gw", GW_SIGNATURE, [{"strain": np.zeros((1, 2048), np.float32)}],
                       reference, "fp32", load or _FakeLoad(), cfg, tmp_path)
    return out, started


def test_measure_peer_sweeps_every_setting_and_passes_over_one_that_will_not_start(monkeypatch, tmp_path):
    answer = {"logit": np.array([0.25], np.float32)}
    out, started = _measure(monkeypatch, tmp_path, answer, fail=(GRID[1],), confirm=False)
    assert started == list(GRID) and out["format"] == "json" and out["path"] == "/v2/models/gw/infer"
    assert [b["settings"] for b in out["by_settings"]] == [s.label for s in GRID]
    assert "no room for 2 workers" in out["by_settings"][1]["error"] and "throughput_best" not in out["by_settings"][1]
    assert out["by_settings"][0]["throughput_best"] == 800.0 and out["by_settings"][0]["concurrency_best"] == 8
    assert out["settings_best"] == {"max_batch_size": 64, "delay_ms": 2.0, "workers": 1}  # the first of the ties
    assert out["native_settings_best"] == {"max_batch_size": 64, "max_batch_time": 0.002, "parallel_workers": 1}
    assert out["throughput_best"] == 800.0 and out["p99_ms_best"] == 24.0 and out["max_abs_diff_vs_ours"] == 0.0
    assert [(r["settings"], r["concurrency"]) for r in out["sweep"]] == [
        ("b64-d2ms-w1", 1), ("b64-d2ms-w1", 8), ("b64-d10ms-w1", 1), ("b64-d10ms-w1", 8)]
    assert "confirm_sweep" not in out
    # no sample count from MLServer: its CPU per sample is over the load's rate through warm-up and window (6 s)
    assert [r["server_cpu_us_per_sample"] for r in out["sweep"][:2]] == pytest.approx([1e6 * 0.6 / (100 * 6.0),
                                                                                         1e6 * 0.6 / (800 * 6.0)])
    assert out["server_cpu_us_per_sample_best"] == pytest.approx(1e6 * 0.6 / (800 * 6.0))
    json.dumps(out, allow_nan=False)


def test_the_selected_setting_is_swept_again_and_that_pass_is_reported(monkeypatch, tmp_path):
    answer = {"logit": np.array([0.25], np.float32)}
    out, started = _measure(monkeypatch, tmp_path, answer, load=_FakeLoad(slower_after=6))  # 3 settings x 2 windows
    assert started == [*GRID, GRID[0]]  # the grid, then its best again
    assert out["throughput_best_in_grid"] == 800.0 and out["throughput_best"] == pytest.approx(720.0)
    assert [r["throughput_sps"] for r in out["confirm_sweep"]] == pytest.approx([90.0, 720.0])
    assert out["settings_best"] == {"max_batch_size": 64, "delay_ms": 2.0, "workers": 1}
    assert "confirm_error" not in out
    # a confirming start that fails leaves the grid's figures, and says why
    monkeypatch.setattr(_FakeServer, "__enter__", _fail_second_start_of(GRID[0]))
    out, _ = _measure(monkeypatch, tmp_path, answer)
    assert out["throughput_best"] == 800.0 and "confirm_sweep" not in out
    assert "exited with status 1:\nport taken" in out["confirm_error"]


def _fail_second_start_of(settings):
    seen = []

    def enter(self):
        seen.append(self.settings)
        if self.settings == settings and seen.count(settings) > 1:
            raise PeerError("mlserver exited with status 1:\nport taken")
        return self
    return enter


def test_measure_peer_fails_the_peer_on_a_wrong_answer(monkeypatch, tmp_path):
    with pytest.raises(PeerAnswerError, match="mlserver: output 'logit' differs from our model's by up to 0.75"):
        _measure(monkeypatch, tmp_path, {"logit": np.array([1.0], np.float32)})
    with pytest.raises(PeerError, match=r"no setting gave a clean measurement"):
        _measure(monkeypatch, tmp_path, {"logit": np.array([0.25], np.float32)}, fail=GRID)


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


def test_triton_batches_requests_of_any_size_and_answers_each_in_our_shapes():
    def predict(x):  # a stand-in model: one scalar and one vector per sample
        return {"logit": x["strain"].sum(axis=1), "echo": x["strain"][:, :2] * 2}

    requests = [{"strain": np.full((n, 4), float(i), np.float32)} for i, n in enumerate((1, 3, 2))]
    answers = triton_execute(predict, requests)
    for request, answer in zip(requests, answers):  # batched together = each alone
        alone = predict(request)
        assert answer.keys() == alone.keys() and all(np.array_equal(answer[k], alone[k]) for k in alone)
        assert all(v.flags.c_contiguous for v in answer.values())
    with pytest.raises(ValueError, match=r"requests of \[1, 2\] samples, but the batch answered 4"):
        split_by_sizes({"logit": np.zeros(4)}, [1, 2])
    got = restore_output_shapes({"logit": np.ones((3, 1)), "forces": np.ones((3, 9, 3)), "extra": np.ones((3, 1))},
                                {"logit": (-1,), "forces": (-1, 9, 3)})
    assert got["logit"].shape == (3,) and got["forces"].shape == (3, 9, 3) and got["extra"].shape == (3, 1)


def _fake_triton_env(tmp_path):
    """The layout of nvidia-pytriton in a venv, with empty files."""
    dist = tmp_path / "env" / "lib" / "python3.11" / "site-packages" / "pytriton" / "tritonserver"
    for part in ("bin/tritonserver", "backends/python/libtriton_python.so",
                 "backends/python/triton_python_backend_utils.py",
                 "python_backend_stubs/3.11/triton_python_backend_stub"):
        (dist / part).parent.mkdir(parents=True, exist_ok=True)
        (dist / part).write_text("")
    (tmp_path / "env" / "bin").mkdir()
    return tmp_path / "env" / "bin" / "python", dist


def test_peer_commands_and_targets(tmp_path):
    python, dist = _fake_triton_env(tmp_path)
    triton = PeerServer("triton", python, tmp_path, "gw", tmp_path / "log", PeerSettings(128, 0.5, 2),
                        signature=GW_SIGNATURE)
    cmd, ready, env = triton.command(8000)
    assert cmd[0] == str(dist / "bin" / "tritonserver") and ready == "/v2/models/gw/ready"
    assert cmd[cmd.index("--http-address") + 1] == "127.0.0.1" and cmd[cmd.index("--http-port") + 1] == "8000"
    models, backends = Path(cmd[cmd.index("--model-repository") + 1]), Path(cmd[cmd.index("--backend-directory") + 1])
    assert "instance_group [ { count: 2 kind: KIND_CPU } ]" in (models / "gw" / "config.pbtxt").read_text()
    assert "import TritonPythonModel" in (models / "gw" / "1" / "model.py").read_text()
    assert sorted(p.name for p in (backends / "python").iterdir()) == [
        "libtriton_python.so", "triton_python_backend_stub", "triton_python_backend_utils.py"]
    assert (backends / "python" / "triton_python_backend_stub").resolve() == (
        dist / "python_backend_stubs" / "3.11" / "triton_python_backend_stub")
    assert env["PATH"].startswith(f"{python.parent}:") and env["LD_LIBRARY_PATH"].endswith("nvidia_pytriton.libs")
    triton.url = "http://127.0.0.1:8000"
    strain = {"strain": np.ones((1, 2048), np.float32)}
    target = triton.target([strain])
    assert target.request_path == "/v2/models/gw/infer"
    body = target.requests[0][0]
    assert body.startswith(b'{"inputs":[{"name":"strain"') and b"binary_data_size" in body
    assert dict(target.requests[0][1])["Content-Type"] == "application/octet-stream"

    mlserver = PeerServer("mlserver", python, tmp_path, "gw", tmp_path / "log", PeerSettings(64, 2.0, 2))
    cmd, ready, env = mlserver.command(8080)
    assert cmd[:2] == [str(python.parent / "mlserver"), "start"] and ready == "/v2/models/gw/ready" and env == {}
    settings = json.loads((Path(cmd[2]) / "settings.json").read_text())
    assert settings["http_port"] == 8080 and settings["parallel_workers"] == 2
    assert json.loads((Path(cmd[2]) / "gw" / "model-settings.json").read_text())["max_batch_time"] == 0.002
    assert mlserver.counters() is None

    litserve = PeerServer("litserve", python, tmp_path, "gw", tmp_path / "log", PeerSettings(32, 5.0, 2))
    cmd, ready, _ = litserve.command(9000)
    assert cmd[:4] == [str(python), "-m", "converge.bench.peer_runtimes", "litserve"] and ready == "/health"
    assert [cmd[cmd.index(k) + 1] for k in ("--max-batch-size", "--batch-timeout", "--workers", "--port")] == [
        "32", "0.005", "2", "9000"]
    litserve.url = "http://127.0.0.1:9000"
    target = litserve.target([CHEM, CHEM])
    assert target.request_path == "/predict" and target.samples_per_request == 1
    assert target.raw_requests()[0].startswith(b"POST /predict HTTP/1.1\r\n")
    assert target.requests[0][0] == v2_json_request(CHEM)
    with pytest.raises(ValueError, match="peer 'tgi': choose from triton, mlserver, litserve"):
        PeerServer("tgi", python, tmp_path, "gw", tmp_path / "log", PeerSettings())
    with pytest.raises(ValueError, match="triton: give the model's signature"):
        PeerServer("triton", python, tmp_path, "gw", tmp_path / "log", PeerSettings())
    with pytest.raises(PeerError, match="no pytriton/tritonserver under"):
        PeerServer("triton", tmp_path / "none" / "bin" / "python", tmp_path, "gw", tmp_path / "log", PeerSettings(),
                   signature=GW_SIGNATURE).command(8000)


def test_check_peer_answer_passes_the_same_outputs_and_fails_on_different_ones():
    ours = {"energy": np.array([-97000.5]), "forces": np.ones((1, 9, 3), np.float32)}
    assert check_peer_answer("mlserver", {k: v.copy() for k, v in ours.items()}, ours, "fp32") == 0.0
    near = {**ours, "forces": ours["forces"] * (1 + 4e-3)}  # a bf16 rounding, not a different model
    assert check_peer_answer("litserve", near, ours, "bf16") == pytest.approx(4e-3, rel=1e-3)
    with pytest.raises(PeerAnswerError, match="mlserver: output 'forces' differs from our model's by up to 0.004"):
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
    env = tmp_path / "mlserver"
    (env / "bin").mkdir(parents=True)
    (env / "bin" / "python").write_text("")
    wanted = wanted_env("mlserver")
    (env / READY_MARKER).write_text(json.dumps({"wanted": wanted, "versions": {"mlserver": "1.7.1"}}))
    steps = []
    assert env_ready("mlserver", tmp_path) and not env_ready("litserve", tmp_path)
    assert ensure_peer_env("mlserver", tmp_path, log=steps.append) == env / "bin" / "python" and steps == []
    assert peer_versions(env / "bin" / "python") == {"mlserver": "1.7.1"}
    assert "mlserver==1.7.1" in wanted["requirements"] and "uvloop<0.22" in wanted["requirements"]
    assert "fastapi>=0.115" in wanted["requirements"] and wanted["python"] == os.path.realpath(sys.executable)
    assert "nvidia-pytriton==0.7.0" in peer_requirements("triton")
    (env / READY_MARKER).write_text(json.dumps({"wanted": {**wanted, "python": "/other/python"}, "versions": {}}))
    assert not env_ready("mlserver", tmp_path)  # made from another interpreter: made again
    with pytest.raises(PeerError, match=r"(?s)failed \(3\):\nboom"):
        run_checked([sys.executable, "-c", "print('boom'); raise SystemExit(3)"])
    with pytest.raises(ValueError, match="peer 'tgi': choose from"):
        ensure_peer_env("tgi", tmp_path)
    (env / READY_MARKER).write_text(json.dumps({"wanted": wanted, "versions": {}}))
    # `make peers`: a ready one is reported, an unknown one fails the command and says why
    assert peer_envs.main(["mlserver", "--root", str(tmp_path)]) == 0
    assert peer_envs.main(["mlserver", "tgi", "--root", str(tmp_path)]) == 1


def test_triton_env_is_made_from_debians_python_and_says_how_to_get_it(tmp_path, monkeypatch):
    assert base_python("triton") == "/usr/bin/python3.11" and wanted_env("triton")["python"] == "/usr/bin/python3.11"
    monkeypatch.setattr(peer_envs, "SYSTEM_PYTHON", str(tmp_path / "python3.11"))
    with pytest.raises(PeerError, match="apt-get install python3.11 python3.11-venv"):
        ensure_peer_env("triton", tmp_path)
    assert not (tmp_path / "triton").exists()  # nothing was made


def test_parse_peers():
    assert parse_peers("triton, mlserver,litserve") == ("triton", "mlserver", "litserve") and parse_peers("") == ()


def test_runtimes_import_without_the_peers_installed():
    import converge.bench.peer_runtimes as runtimes

    with pytest.raises(AttributeError, match="has no attribute 'Nope'"):
        runtimes.Nope  # noqa: B018


# -- against the installed peers (made by `converge bench serve RUN --peers ...`) -------------------------------------
def _installed(peer):
    if not env_ready(peer):
        pytest.skip(f"{peer} is not installed in {DEFAULT_ENV_ROOT / peer} (made once by `converge bench serve RUN "
                    f"--peers {peer}`)")
    return DEFAULT_ENV_ROOT / peer / "bin" / "python"


@pytest.mark.slow
def test_mlserver_accepts_our_request_as_its_own_types():
    python = _installed("mlserver")
    code = ("import sys; from mlserver.types import InferenceRequest; "
            "r = InferenceRequest.model_validate_json(sys.stdin.buffer.read()); print(r.inputs[1].shape)")
    done = subprocess.run([str(python), "-c", code], input=v2_json_request(CHEM), capture_output=True, check=True)
    assert done.stdout.strip() == b"[1, 9, 3]"


@pytest.mark.slow
@pytest.mark.parametrize("peer, settings", [("triton", PeerSettings(64, 0.0, 2)),
                                            ("mlserver", PeerSettings(64, 2.0, 2)),
                                            ("litserve", PeerSettings(64, 1.0, 2))])
def test_peer_serves_our_model_with_our_answers(peer, settings, tmp_path):
    from converge.apps.gw.config import GWConfig
    from converge.bench.loadgen import LoadProcess
    from converge.bench.serve import example_inputs
    from converge.serve import load_served_model

    tiny = GWConfig(channels=(4, 4, 8), hidden=8)  # untrained: the answers need no skill, only to agree
    run = _make_tiny_run(tmp_path, tiny)
    model = load_served_model(run)
    strain = example_inputs("gw", tiny, 3)["strain"]
    samples = [{"strain": strain[i:i + 1]} for i in range(3)]
    with PeerServer(peer, _installed(peer), run, "gw", tmp_path / "peer.log", settings, startup_timeout_s=120,
                    signature=(model.inputs, model.outputs)) as server, LoadProcess() as load:
        for sample in samples:  # two workers: each answers the same
            assert check_peer_answer(peer, server.infer(sample), model.predict(sample), "fp32") < 1e-5
        cpu0 = server.cpu_seconds()
        result = load.run(server.target(samples), 4, 1.0, 0.2, timeout_s=10)
        counted, cpu1 = server.counters(), server.cpu_seconds()
    assert 0 < cpu0 < cpu1  # the peer's server and its model instances, from /proc
    assert result.requests > 0 and result.errors == 0, result.error_examples
    if peer == "triton":  # Triton's own statistics: every request inferred, in batches
        assert counted[0] >= result.requests and 0 < counted[1] <= counted[0]


@pytest.mark.slow
def test_serve_benchmark_with_all_peers_reports_each_at_its_best(tmp_path):
    from converge.apps.gw.config import GWConfig
    from converge.bench.peer_settings import parse_peer_grid
    from converge.bench.serve import headline, run_serve_benchmark, write_results

    peers = ("triton", "mlserver", "litserve")
    for peer in peers:
        _installed(peer)
    run = _make_tiny_run(tmp_path, GWConfig(channels=(4, 4, 8), hidden=8))
    grid = parse_peer_grid("triton.max_batch_size=64 triton.delay_ms=0 mlserver.delay_ms=2 mlserver.workers=1 "
                           "litserve.delay_ms=1", peers)  # triton 1-2 workers, litserve 1-2
    cfg = ServeBenchConfig(concurrencies=(1, 4), duration_s=0.5, warmup_s=0.1, formats=("binary", "json"),
                           ceiling_batches=(1, 4), ceiling_min_time_s=0.05, peers=peers, peer_grid=grid,
                           head_to_head_rounds=2)
    report = run_serve_benchmark(run, cfg, log_dir=tmp_path)
    duel = report["head_to_head"]  # ours and the hardest peer up at once, loaded in turn
    assert "error" not in duel, duel.get("error")
    assert duel["peer"] == report["peer"] and duel["peer_settings"] == report["peers"][duel["peer"]]["settings_best"]
    assert len(duel["rows"]) == 2 * 2 * len(duel["concurrencies"]) and len(duel["gain_per_round"]) == 2
    assert duel["gain_median"] > 0 and "head_to_head" in headline(report)
    assert sorted(report["peers"]) == sorted(peers) and report["peer"] in peers
    for name, measured in report["peers"].items():
        assert "error" not in measured, measured.get("error")
        assert measured["format"] == ("binary" if name == "triton" else "json")
        assert len(measured["sweep"]) == 2 * len(grid[name]) and measured["max_abs_diff_vs_ours"] < 1e-5
        assert all(r["errors"] == 0 and r["requests"] > 0 for r in measured["sweep"])
        reported = measured["confirm_sweep"] if len(grid[name]) > 1 else measured["sweep"]  # a grid is confirmed
        assert measured["throughput_best"] == max(r["throughput_sps"] for r in reported)
        assert measured["throughput_best_in_grid"] == max(r["throughput_sps"] for r in measured["sweep"])
        assert measured["settings_best"] in measured["settings_grid"]
        ours = measured["ours_at_equal_p99"]
        assert ours["format"] == measured["format"]
        if ours["throughput"] is not None:
            assert ours["p99_ms"] <= measured["p99_ms_best"]
            assert ours["gain"] == ours["throughput"] / measured["throughput_best"]
    assert report["by_format"]["binary"]["throughput_batched_best"] > 0
    assert set(headline(report)["peers"]) == set(peers)
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
