"""simulate -> train -> evaluate -> detect through the command line, on a tiny gw run."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from converge.apps.gw.config import GWConfig
from converge.apps.gw.strainfile import Strain, make_injection_strain, write_strain
from converge.apps.gw.waveforms import sample_bbh_parameters

# Loud signals and a small network: learnable in a few seconds, so the test checks the plumbing
# and that detection lands at the right GPS time, not the full-size sensitivity (a benchmark).
TOML = """
[app]
snr_min = 15.0
snr_max = 30.0
curriculum_snr = 15.0
channels = [8, 16, 16]
hidden = 16
[train]
epochs = 4
batch_size = 32
lr = 0.003
[evaluate]
n_noise = 1000
n_per_snr = 40
faps = [0.01]
snrs = [4, 10, 20]
roc_snrs = [10]
timing_windows = 256  # fewer than the 1,120 windows: a second evaluation takes the rest from the cache
"""


def converge(*args, check=True):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "converge", *map(str, args)], capture_output=True, text=True,
                          env=env, timeout=600)
    if check and proc.returncode != 0:
        raise AssertionError(f"converge {' '.join(map(str, args))} failed:\n{proc.stdout}\n{proc.stderr}")
    return proc


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("e2e")
    cfg_file = root / "gw.toml"
    cfg_file.write_text(TOML)
    converge("simulate", "gw", "--samples", 240, "--out", root / "train", "--seed", 1, "--workers", 2,
             "--shard-size", 80, "--config", cfg_file)
    converge("simulate", "gw", "--samples", 40, "--out", root / "test", "--seed", 2, "--config", cfg_file)
    converge("train", "gw", "--data", root / "train", "--out", root / "run", "--config", cfg_file)
    converge("evaluate", "gw", "--run", root / "run", "--data", root / "test", "--config", cfg_file)
    return root


def test_evaluation_report_and_plots(tiny_run):
    report = json.loads((tiny_run / "run" / "evaluation.json").read_text())
    for key in ("n_templates", "speedup"):
        assert report[key] > 0
    for method in ("cnn", "matched_filter"):
        eff = report[method]["efficiency"]["1e-02"]
        assert set(eff) == {"4", "10", "20"} and all(0 <= v <= 1 for v in eff.values())
        assert report[method]["seconds_per_strain_second"] > 0
    # physics: the matched filter finds SNR-10 signals at FAP 1e-2; SNR 4 mostly hides in the noise
    assert report["matched_filter"]["efficiency"]["1e-02"]["10"] > 0.9
    assert report["matched_filter"]["efficiency"]["1e-02"]["4"] < 0.5
    assert report["cnn"]["efficiency"]["1e-02"]["20"] > 0.8
    assert (tiny_run / "run" / "efficiency.png").stat().st_size > 10_000
    assert (tiny_run / "run" / "roc.png").stat().st_size > 10_000
    saved = json.loads((tiny_run / "run" / "config.json").read_text())
    assert saved["app_config"]["snr_min"] == 15.0 and saved["train"]["epochs"] == 4


def test_second_evaluation_reuses_the_matched_filter_scores(tiny_run):
    first = json.loads((tiny_run / "run" / "evaluation.json").read_text())
    assert first["matched_filter_cache"] is None and list((tiny_run / "test" / "cache").glob("matched_filter-*.npz"))
    converge("evaluate", "gw", "--run", tiny_run / "run", "--data", tiny_run / "test", "--config",
             tiny_run / "gw.toml", "--out", tiny_run / "again")
    again = json.loads((tiny_run / "again" / "evaluation.json").read_text())
    assert again["matched_filter_cache"] and again["matched_filter"]["efficiency"] == first["matched_filter"]["efficiency"]
    assert again["cnn"]["efficiency"] == first["cnn"]["efficiency"]


def test_detect_finds_loud_injections_at_the_right_gps_time(tiny_run):
    cfg = GWConfig()
    rng = np.random.default_rng(5)
    gps0 = 1_126_259_000.0
    injections = [{**sample_bbh_parameters(cfg, rng), "mass1": 40.0, "mass2": 30.0, "gps_time": gps0 + t, "snr": 30.0}
                  for t in (10.3, 21.7)]
    strain, placed = make_injection_strain(cfg, 32.0, injections, seed=3, gps_start=gps0)
    write_strain(tiny_run / "strain.hdf5", strain)
    thr = json.loads((tiny_run / "run" / "evaluation.json").read_text())["cnn"]["thresholds"]["1e-02"]
    proc = converge("detect", "gw", tiny_run / "strain.hdf5", "--run", tiny_run / "run", "--threshold", thr)
    result = json.loads((tiny_run / "strain.triggers.json").read_text())
    assert result["strain_seconds_per_second"] > 1
    for inj in placed:
        near = [t for t in result["triggers"] if abs(t["gps_time"] - inj["gps_time"]) < 0.3]
        assert near, f"no trigger near {inj['gps_time']}: {result['triggers']}\n{proc.stdout}"
    assert len(result["triggers"]) <= len(placed) + 3


def test_detect_refuses_a_wrong_sample_rate(tiny_run):
    write_strain(tiny_run / "s4096.hdf5", Strain(np.random.default_rng(0).normal(size=4096 * 16), 4096.0, 0.0, "H1"))
    proc = converge("detect", "gw", tiny_run / "s4096.hdf5", "--run", tiny_run / "run", "--threshold", 0, check=False)
    assert proc.returncode == 2 and "sample rate 4096 Hz" in proc.stderr and "2048" in proc.stderr


def test_resume_of_simulate_is_a_no_op_and_dataset_is_intact(tiny_run):
    before = {p.name: p.read_bytes() for p in (tiny_run / "train" / "shards").iterdir()}
    proc = converge("simulate", "gw", "--samples", 240, "--out", tiny_run / "train", "--seed", 1, "--shard-size", 80,
                    "--config", tiny_run / "gw.toml")
    assert "0 shards computed" in " ".join(proc.stderr.split())
    assert before == {p.name: p.read_bytes() for p in (tiny_run / "train" / "shards").iterdir()}


def test_an_error_naming_a_long_path_is_printed_on_one_line(tmp_path):
    missing = tmp_path / ("deep" * 40) / "data"  # far wider than a terminal: the path must stay copyable
    proc = converge("train", "gw", "--data", missing, "--out", tmp_path / "r", check=False)
    assert proc.returncode == 2 and f"dataset {missing} does not exist" in proc.stderr.splitlines()[0]


def test_cli_config_errors_name_the_key(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[train]\nlearning_rate = 0.1\n")
    proc = converge("train", "gw", "--data", tmp_path, "--out", tmp_path / "r", "--config", bad, check=False)
    assert proc.returncode == 2
    proc = converge("simulate", "gw", "--samples", 4, "--out", tmp_path / "d", "--set", "app.detector=V1",
                    check=False)
    assert proc.returncode == 2 and "app.detector='V1'" in proc.stderr
    proc = converge("simulate", "nope", "--samples", 4, "--out", tmp_path / "d", check=False)
    assert proc.returncode == 2 and "unknown app 'nope'" in proc.stderr
