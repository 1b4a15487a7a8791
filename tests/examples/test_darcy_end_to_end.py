"""The darcy example through the command line on a tiny case (16 x 16 nodes, a few dozen solves, 2 epochs):
simulate -> train -> evaluate -> serve one request -> predict -> learn one round (and its ensemble served with
the simulator fallback) -> bench surrogate -> demo -> report. Checks the plumbing, not the accuracy (a benchmark's job).
"""
import json

import numpy as np
import pytest
import torch

pytest.importorskip("converge_darcy", reason="the darcy example is not installed: pip install -e examples/darcy")

from fastapi.testclient import TestClient  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

from converge.cli import cli  # noqa: E402
from converge.serve import ServerSettings, create_app  # noqa: E402
from converge.serve.fallback import TrustConfig  # noqa: E402
from converge.serve.protocol import HEADER_LENGTH, decode_infer_response, encode_infer_request  # noqa: E402
from converge.serve.server import load_runs  # noqa: E402
from converge.train.loop import load_model  # noqa: E402
from converge_darcy import DarcyApp, DarcyConfig  # noqa: E402

TOML = """
[app]
resolution = 16
width = 8
modes = 4
layers = 2
padding = 4
[train]
epochs = 2
batch_size = 8
patience = 2
precision = "fp32"
device = "cpu"
[evaluate]
plot_fields = 2
timing_fields = 2
batch_size = 8
min_time_s = 0.05
"""
TINY = DarcyConfig.tiny()


def converge(*args):
    result = CliRunner().invoke(cli, [str(a) for a in args])
    if result.exit_code != 0:
        raise AssertionError(f"converge {' '.join(map(str, args))} exited {result.exit_code}:\n{result.output}"
                             + (f"\n{result.exception!r}" if result.exception else ""))
    return result


def infer(client, model, inputs):
    body, headers = encode_infer_request(inputs, binary=True)
    response = client.post(f"/v2/models/{model}/infer", content=body, headers=headers)
    assert response.status_code == 200, response.text
    return decode_infer_response(response.content, response.headers.get(HEADER_LENGTH))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("darcy")
    (root / "darcy.toml").write_text(TOML)
    cfg = ("--config", root / "darcy.toml")
    converge("simulate", "darcy", "--out", root / "train", "--samples", 48, "--seed", 1, "--workers", 1,
             "--shard-size", 24, *cfg)
    converge("simulate", "darcy", "--out", root / "test", "--samples", 16, "--seed", 2, "--workers", 1, *cfg)
    converge("train", "darcy", "--data", root / "train", "--out", root / "run", *cfg)
    converge("evaluate", "darcy", "--run", root / "run", "--data", root / "test", *cfg)
    return root


def test_evaluation_report_and_plots(tiny):
    report = json.loads((tiny / "run" / "evaluation.json").read_text())
    assert report["n_test"] == 16 and report["n_train_solves"] == 48 and report["resolution"] == 16
    assert 0 < report["relative_l2"] < 2 and report["relative_l2_median"] <= report["relative_l2_max"]
    assert report["fastest_classical"] in report["seconds_per_field"]
    assert report["speedup"]["single"] > 0 and report["speedup"]["batched"] > 0
    assert (tiny / "run" / "fields.png").stat().st_size > 10_000 and (tiny / "run" / "errors.png").is_file()
    assert json.loads((tiny / "run" / "config.json").read_text())["app_config"]["width"] == 8


def test_one_served_request_answers_as_the_model(tiny):
    models = load_runs([f"darcy={tiny / 'run'}"])
    assert models["darcy"].platform == "converge-darcy"
    k = DarcyApp().serving_example(TINY, 3, seed=9)["permeability"]
    with TestClient(create_app(models)) as client:
        out = infer(client, "darcy", {"permeability": k})
    model, _ = load_model(DarcyApp(), tiny / "run")
    with torch.inference_mode():
        direct = model(torch.from_numpy(k)).numpy()
    assert out["pressure"].shape == (3, 16, 16) and out["pressure"].dtype == np.float32
    np.testing.assert_allclose(out["pressure"], direct, rtol=1e-5, atol=1e-8)


def test_predict_writes_the_pressure_of_each_field(tiny):
    k = DarcyApp().serving_example(TINY, 2, seed=3)["permeability"]
    np.save(tiny / "fields.npy", k)
    converge("predict", "darcy", tiny / "fields.npy", "--run", tiny / "run")
    with np.load(tiny / "fields.predicted.npz") as data:
        assert data["pressure"].shape == (2, 16, 16)
        np.testing.assert_array_equal(data["permeability"], k)


def test_learn_one_round_then_serve_its_ensemble_with_the_simulator_fallback(tiny):
    converge("learn", "darcy", "--out", tiny / "learn", "--rounds", 1, "--budget", 4, "--initial", 8, "--pool", 16,
             "--members", 2, "--test", 8, "--epochs", 2, "--batch-size", 4, "--checkpoint-every", 1,
             "--config", tiny / "darcy.toml", "--set", "learn.target_error=0.05")
    curve = json.loads((tiny / "learn" / "learning_curve.json").read_text())
    assert [h["simulator_calls"] for h in curve] == [8, 12] and all(h["relative_l2"] > 0 for h in curve)
    assert json.loads((tiny / "learn" / "learning.json").read_text())["problem"]["target_error_relative_l2"] == 0.05
    ensemble = tiny / "learn" / "round-1" / "ensemble"
    models = load_runs([f"committee={ensemble}"])
    k = DarcyApp().serving_example(TINY, 2, seed=11)["permeability"]
    trust = TrustConfig(max_uncertainty=0.0, fallback="simulator")  # every sample goes to the solver
    with TestClient(create_app(models, ServerSettings(trust=trust))) as client:
        out = infer(client, "committee", {"permeability": k})
    assert out["source"].tolist() == [1, 1] and out["pressure_std"].shape == (2, 16, 16)
    np.testing.assert_allclose(out["pressure"], DarcyApp().simulate_inputs(TINY, {"permeability": k})["pressure"],
                               rtol=1e-6)


def test_bench_surrogate_times_the_run_against_the_solver(tiny):
    converge("bench", "surrogate", "--apps", "darcy", "--run", f"darcy={tiny / 'run'}", "--quick", "--out",
             tiny / "bench")
    entry = json.loads((tiny / "bench" / "surrogate.json").read_text())["apps"]["darcy"]
    assert entry["trained"] and entry["solver"] == "direct" and entry["speedup"]["single"] > 0
    assert entry["accuracy"]["source"].endswith("evaluation.json") and entry["accuracy"]["relative_l2"] > 0


def test_quick_demo_and_the_report_section(tiny):
    converge("demo", "--app", "darcy", "--quick", "--out", tiny / "demo")
    summary = json.loads((tiny / "demo" / "summary.json").read_text())["darcy"]
    assert summary["resolution"] == 16 and summary["relative_l2"] > 0 and set(summary["seconds"]) == {
        "simulate", "train", "evaluate"}
    results = tiny / "results"
    results.mkdir()
    (results / "darcy.json").write_text((tiny / "run" / "evaluation.json").read_text())
    converge("report", results, "--out", tiny / "report.html")
    page = (tiny / "report.html").read_text()
    assert "darcy: Fourier neural operator against a sparse solver" in page and "test relative L2 error" in page
