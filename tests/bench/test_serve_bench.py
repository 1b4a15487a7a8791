"""The serving benchmark: the load generator against the real `converge serve`, percentiles, the model's
ceiling, the summary and the plot. A tiny untrained gw CNN stands in for a trained run (timing needs no skill)."""
import json
import math
import os
import random
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest

from converge.apps.chem.config import ChemConfig
from converge.apps.chem.molecules import get_molecule
from converge.apps.gw.app import GWApp
from converge.apps.gw.config import GWConfig
from converge.bench.loadgen import InferTarget, LoadProcess, latency_percentiles, run_load
from converge.bench.serve import (
    BatchingMode, ServeBenchConfig, cycled, example_inputs, headline, model_ceiling, parse_counts, run_serve_benchmark,
    summarize, write_results,
)
from converge.bench.serve_plot import plot_serve_sweep
from converge.bench.server_process import ServeBenchError, ServerProcess, process_cpu_seconds
from converge.serve import ModelLoadError, load_served_model
from converge.serve.protocol import check_inputs
from converge.train.checkpoint import save_checkpoint

TINY = GWConfig(channels=(4, 4, 8), hidden=8)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """A run folder as `converge train` leaves it, holding an untrained tiny gw CNN."""
    run = tmp_path_factory.mktemp("bench") / "gw-tiny"
    run.mkdir()
    config = {"app": "gw", "app_config": asdict(TINY), "train": {"precision": "fp32"}}
    (run / "config.json").write_text(json.dumps(config))
    save_checkpoint(run / "best.pt", {"model": GWApp().make_model(TINY).state_dict(), "config": config})
    return run


def test_percentiles_are_nearest_rank_on_a_known_list():
    values = list(range(1, 101))
    random.Random(0).shuffle(values)
    assert latency_percentiles(values) == [50, 95, 99]
    assert latency_percentiles(values, (1, 100)) == [1, 100]
    assert latency_percentiles([3.0, 1.0, 2.0], (50, 99)) == [2.0, 3.0]
    assert latency_percentiles([7.0], (50, 95, 99)) == [7.0, 7.0, 7.0]
    assert latency_percentiles(list(range(1, 11)), (95,)) == [10]  # ceil(9.5) = 10th value, not interpolated 9.55
    with pytest.raises(ValueError, match="a percentile of nothing"):
        latency_percentiles([])
    with pytest.raises(ValueError, match=r"percentile 0: must be in \(0, 100\]"):
        latency_percentiles([1.0], (0,))


@pytest.mark.skipif(not Path("/proc/self/stat").is_file(), reason="CPU seconds are read from Linux's /proc")
def test_process_cpu_seconds_counts_live_children_and_is_nan_for_a_gone_process():
    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.5:\n    pass\ntime.sleep(60)"
    child = subprocess.Popen([sys.executable, "-c", burn])
    try:
        deadline = time.monotonic() + 30
        while process_cpu_seconds(child.pid) < 0.45 and time.monotonic() < deadline:
            time.sleep(0.05)
        burnt = process_cpu_seconds(child.pid)
        assert 0.45 <= burnt < 5
        ours = time.process_time()
        assert process_cpu_seconds(os.getpid()) >= ours - 0.05 + burnt - 0.05  # this process and its child
    finally:
        child.kill()
        child.wait()
    assert math.isnan(process_cpu_seconds(child.pid))  # reaped: gone


def test_loadgen_against_the_real_server(tiny_run, tmp_path):
    strain = example_inputs("gw", TINY, 3)["strain"]
    samples = [{"strain": strain[i:i + 1]} for i in range(3)]
    with ServerProcess(tiny_run, "gw", 64, tmp_path / "serve.log", startup_timeout_s=60) as server, \
            LoadProcess() as load:
        cpu0 = server.cpu_seconds()
        results = [load.run(InferTarget.from_inputs(server.url, "gw", samples, binary), c, 1.0, 0.2, timeout_s=10)
                   for c, binary in ((1, True), (4, False))]
        cpu1 = server.cpu_seconds()
        samples_done, calls = server.counters()
        wrong = load.run(InferTarget.from_inputs(server.url, "nope", samples), 1, 0.3, 0.0, timeout_s=10)
        v2 = InferTarget.from_inputs(server.url, "gw", samples, binary=False)
        routed = load.run(InferTarget(v2.url, "gw", v2.requests, 1, path="/v2/models/gw/infer"), 2, 0.3, 0.0)
        elsewhere = load.run(InferTarget(v2.url, "gw", v2.requests, 1, path="/predict"), 1, 0.3, 0.0, timeout_s=10)
    for r, concurrency in zip(results, (1, 4)):
        assert r.concurrency == concurrency and r.window_s == 1.0 and r.samples_per_request == 1
        assert r.requests > 0 and r.errors == 0 and not r.error_examples
        assert 0 < r.p50_ms <= r.p95_ms <= r.p99_ms <= r.max_ms and 0 < r.mean_ms <= r.max_ms
        assert r.throughput_rps == pytest.approx(r.requests / r.window_s) == r.throughput_sps
        assert 0 < r.cpu_share < 1.5  # one asyncio thread: at most one core, plus measurement slack
        json.dumps(r.as_dict(), allow_nan=False)
    assert samples_done >= sum(r.requests for r in results) and 0 < calls <= samples_done
    assert 0 < cpu0 < cpu1  # the server and its model process worked through the load
    assert wrong.requests == 0 and wrong.errors > 0 and wrong.p99_ms is None
    assert wrong.error_examples[0].startswith("HTTP 404: ") and "unknown model 'nope'" in wrong.error_examples[0]
    assert routed.requests > 0 and routed.errors == 0  # an explicit path: the same route as the default
    assert elsewhere.requests == 0 and elsewhere.error_examples[0].startswith("HTTP 404")  # it did go to /predict


def test_loadgen_target_path_defaults_to_v2_infer_and_can_be_another_route():
    body = ((b"{}", (("Content-Type", "application/json"),)),)
    default = InferTarget("http://127.0.0.1:8000", "gw", body, 1)
    assert default.path is None and default.request_path == "/v2/models/gw/infer"
    assert default.raw_requests() == [b"POST /v2/models/gw/infer HTTP/1.1\r\nHost: 127.0.0.1:8000\r\n"
                                      b"Content-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"]
    lit = InferTarget("http://127.0.0.1:8000", "gw", body, 1, path="/predict")
    assert lit.raw_requests()[0].startswith(b"POST /predict HTTP/1.1\r\n") and lit.raw_requests()[0].endswith(b"{}")
    for bad in ("predict", "/a b", "/x\r\nHost: evil"):
        with pytest.raises(ValueError, match="give an absolute URL path such as /predict"):
            InferTarget("http://127.0.0.1:8000", "gw", body, 1, path=bad)


def test_loadgen_counts_a_dead_server_as_errors_and_stops_on_time():
    import socket

    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    target = InferTarget(f"http://127.0.0.1:{port}", "gw", ((b"{}", (("Content-Type", "application/json"),)),), 1)
    r = run_load(target, concurrency=2, duration_s=0.3, warmup_s=0.0, timeout_s=2)
    assert r.requests == 0 and r.errors > 0 and r.throughput_sps == 0 and r.p50_ms is None
    assert "ConnectionRefusedError" in r.error_examples[0]
    with pytest.raises(ValueError, match="concurrency=0: must be >= 1"):
        run_load(target, concurrency=0, duration_s=1)
    with pytest.raises(ValueError, match="give http://HOST:PORT"):
        InferTarget("127.0.0.1:80", "gw", target.requests, 1)


def test_the_model_alone_is_timed_on_the_samples_the_clients_send():
    space = ChemConfig(molecules="chno_1to4")
    sent = example_inputs("chem", space, 4)  # of different sizes: 5, 4, 3 and 8 atoms
    batch = cycled(sent, 10)
    assert batch["species"].shape == (10, *sent["species"].shape[1:])
    assert all((batch[k][i] == sent[k][i % 4]).all() for k in sent for i in range(10))
    atoms = (batch["species"] >= 0).sum(1)
    assert atoms[:8].mean() == (sent["species"] >= 0).sum(1).mean() and len(set(atoms)) > 1


def test_model_ceiling_and_example_inputs(tiny_run):
    model = load_served_model(tiny_run)
    pool = example_inputs("gw", TINY, 8, seed=1)
    check_inputs(pool, model.inputs)
    assert abs(pool["strain"].std() - 1) < 0.1  # whitened noise has unit variance
    rows = model_ceiling(model.predict, pool, (1, 8), min_time_s=0.05)
    assert [r["batch_size"] for r in rows] == [1, 8]
    assert all(r["samples_per_s"] > 0 and r["ms_per_call"] > 0 and r["calls"] >= 1 for r in rows)
    with pytest.raises(ValueError, match="batch size 16: the pool holds only 8 samples"):
        model_ceiling(model.predict, pool, (16,), min_time_s=0.01)

    water = ChemConfig(molecule="water")
    chem = example_inputs("chem", water, 5)
    from converge.apps.chem.app import ChemApp

    check_inputs(chem, ChemApp().serving_signature(water)[0])
    molecule = get_molecule("water")
    assert (chem["species"] == molecule.atomic_numbers).all()
    assert 0 < np.abs(chem["coordinates"] - molecule.positions).max() < 0.5
    with pytest.raises(ServeBenchError, match="no example inputs for app 'md'"):
        example_inputs("md", None, 1)


def test_run_serve_benchmark_end_to_end(tiny_run, tmp_path):
    cfg = ServeBenchConfig(concurrencies=(2,), duration_s=0.5, warmup_s=0.1, formats=("binary",),
                           ceiling_batches=(1, 4), ceiling_min_time_s=0.05)
    report = run_serve_benchmark(tiny_run, cfg, log_dir=tmp_path)
    assert [(r["mode"], r["format"], r["concurrency"]) for r in report["sweep"]] == [
        ("batched", "binary", 2), ("batched_1ms", "binary", 2), ("batched_2_instances", "binary", 2),
        ("batched_2_instances_1ms", "binary", 2),
        ("unbatched", "binary", 2), ("unbatched_thread", "binary", 1)]
    assert all(r["errors"] == 0 and r["requests"] > 0 for r in report["sweep"])
    # the CPU the server and its model processes spent per sample (Linux: from /proc)
    assert all(0 < r["server_cpu_us_per_sample"] < 1e6 for r in report["sweep"])
    assert report["server_cpu_us_per_sample_batched_best"] > 0
    assert report["mode_batched_best"] in ("batched", "batched_1ms", "batched_2_instances", "batched_2_instances_1ms")
    assert report["settings_batched_best"]["instances"] == (2 if "2_instances" in report["mode_batched_best"] else 1)
    delayed = [r for r in report["sweep"] if r["mode"] == "batched_2_instances_1ms"]
    assert delayed[0]["settings"] == {"max_batch_size": 128, "max_queue_delay_us": 1000, "model_process": True,
                                      "instances": 2}
    assert (tmp_path / "serve-batched_2_instances.log").read_text().count("/infer") > 0
    assert report["model_only_single"] > 0 and report["model_only_best"]["batch_size"] in (1, 4)
    assert report["throughput_batched_best"] > 0 and report["p99_ms_batched_best"] > 0
    assert report["machine"]["logical_cpus"] == os.cpu_count() and report["machine"]["cpu"]["model_name"]
    # one lone client, measured with the model on a thread only (concurrency 1 was not swept otherwise)
    assert report["mode_single_unbatched"] == "unbatched_thread" and report["throughput_single_unbatched"] > 0
    assert 0 < report["loadgen_cpu_share_max"] < 1.5
    assert (tmp_path / "serve-batched.log").read_text().count("/infer") > 0
    json_path, png_path = write_results({"gw": report}, tmp_path)
    assert json.loads(json_path.read_text())["gw"]["sweep"] == report["sweep"]
    assert png_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _row(mode, concurrency, sps, errors=0, fmt="binary"):
    return {"mode": mode, "max_batch_size": 64 if mode == "batched" else 1, "format": fmt,
            "concurrency": concurrency, "throughput_sps": sps, "errors": errors,
            "requests": 10, "p99_ms": 100.0 / sps * concurrency, "mean_batch_size": concurrency / 2, "cpu_share": 0.1}


def test_summary_picks_the_fastest_clean_batched_point():
    sweep = [_row("unbatched", 1, 100.0), _row("unbatched", 8, 150.0), _row("batched", 1, 110.0),
             _row("batched", 8, 400.0), _row("batched", 64, 900.0, errors=3), _row("batched", 8, 50.0, fmt="json")]
    ceiling = [{"batch_size": 1, "samples_per_s": 200.0}, {"batch_size": 64, "samples_per_s": 1000.0}]
    s = summarize(sweep, ceiling, "binary", ("batched",))
    assert s["throughput_single_unbatched"] == 100.0 and s["concurrency_batched_best"] == 8  # 64 had errors
    assert s["throughput_batched_best"] == 400.0 and s["gain_vs_single_unbatched"] == 4.0
    assert s["fraction_of_model_best"] == 0.4 and s["p99_ms_batched_best"] == 2.0
    # the gain is taken against the fastest lone unbatched client, whichever server set-up gave it
    s = summarize([*sweep, _row("unbatched_thread", 1, 125.0)], ceiling, "binary", ("batched",))
    assert s["mode_single_unbatched"] == "unbatched_thread" and s["gain_vs_single_unbatched"] == 3.2


def test_plot_is_written(tmp_path):
    sweep = [_row(m, c, s) for m, cs in (("batched", (1, 4, 16)), ("unbatched", (1, 4)))
             for c, s in zip(cs, (100.0, 300.0, 500.0))]
    sweep += [{**r, "format": "json"} for r in sweep]
    report = {"sweep": sweep, "model_only_best": {"samples_per_s": 2000.0, "batch_size": 64},
              "model_only_single": 400.0}
    triton = [{"settings": label, "concurrency": c, "throughput_sps": s, "p99_ms": 5.0 * c}
              for label in ("b64-d0ms-w1", "b64-d0ms-w2") for c, s in ((1, 300.0), (16, 2500.0))]
    peers = {"mlserver": {"sweep": [{"concurrency": c, "throughput_sps": s, "p99_ms": 9.0 * c} for c, s in
                                    ((1, 90.0), (16, 800.0))]}, "litserve": {"peer": "litserve", "error": "x"},
             "triton": {"format": "binary", "sweep": triton,
                        "settings_best": {"max_batch_size": 64, "delay_ms": 0.0, "workers": 2}}}
    path = plot_serve_sweep({"gw": {**report, "peers": peers}, "chem": report}, tmp_path / "plots" / "serve.png")
    assert path.is_file() and path.stat().st_size > 10_000
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".")]  # no temp file left behind


def test_headline_names_each_peers_best_and_ours_beside_it():
    peer = {"format": "binary", "throughput_best": 2512.3456, "p99_ms_best": 12.3456, "concurrency_best": 32,
            "native_settings_best": {"max_batch_size": 64, "instance_group": [{"count": 2, "kind": "KIND_CPU"}]},
            "ours_at_equal_p99": {"throughput": 3001.234, "gain": 1.19461, "gain_target": 1.0}}
    report = {"throughput_batched_best": 4000.0, "by_format": {"binary": {"throughput_batched_best": 4012.34},
                                                               "json": {"throughput_batched_best": 3012.34}},
              "peers": {"triton": peer,
                        "litserve": {"peer": "litserve", "error": "litserve exited with status 1:\nboom"}},
              "peer": "triton", "gain_vs_peer_at_equal_p99": 1.19461}
    out = headline(report)
    assert out["throughput_batched_best_by_format"] == {"binary": 4010.0, "json": 3010.0}
    assert out["peers"]["triton"] == {"format": "binary", "throughput_best": 2510.0, "p99_ms_best": 12.3,
                                      "concurrency_best": 32, "settings_best": peer["native_settings_best"],
                                      "ours_at_equal_p99": 3000.0, "gain": 1.19, "target": 1.0}
    assert out["peers"]["litserve"] == {"error": "litserve exited with status 1:"}
    assert out["peer"] == "triton" and out["gain_vs_peer_at_equal_p99"] == 1.19


def test_settings_and_failures_say_what_to_fix(tmp_path):
    assert parse_counts("1, 2,4") == (1, 2, 4)
    with pytest.raises(ValueError, match="comma-separated whole numbers"):
        parse_counts("1,two")
    with pytest.raises(ValueError, match="one or more numbers >= 1"):
        parse_counts("0,4")
    with pytest.raises(ValueError, match="formats=\\('xml',\\): choose from binary, json"):
        ServeBenchConfig(formats=("xml",))
    with pytest.raises(ValueError, match="names must be distinct"):
        ServeBenchConfig(modes=(BatchingMode("a", 1), BatchingMode("a", 2)))
    with pytest.raises(ModelLoadError, match="no such run folder"):
        run_serve_benchmark(tmp_path / "missing")
    with pytest.raises(ServeBenchError, match=r"(?s)`converge serve` exited with status 2:\n.*no\s+such run folder"):
        with ServerProcess(tmp_path / "missing", "gw", 1, tmp_path / "serve.log", startup_timeout_s=60):
            pass
