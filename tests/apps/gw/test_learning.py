"""Active learning for the gw app: candidate windows, the held-out errors, and a tiny run end to end."""
import json

import numpy as np
import pytest
import torch

from converge.apps.gw import GWApp, GWConfig
from converge.train.loop import TrainConfig
from converge.validate.active import round_dir, run_active_learning
from converge.apps.gw.learning import GWLearning, binary_cross_entropy, candidate_window

CFG = GWConfig(channels=(4, 4, 8), hidden=8)


def test_candidate_windows_are_the_waveform_at_its_snr_in_reproducible_noise():
    problem = GWLearning(GWApp(), CFG)
    params = problem.draw(seed=1, n=3)
    assert problem.draw(seed=1, n=3) == params and problem.draw(seed=2, n=3) != params
    assert all(CFG.snr_min <= p["snr"] <= CFG.snr_max for p in params)
    signal = problem.label(params[0])["signal"]
    seed = int(params[0]["noise_seed"])
    noise = candidate_window(CFG, signal, None, seed)
    loud = candidate_window(CFG, signal, 8.0, seed)
    np.testing.assert_array_equal(loud, candidate_window(CFG, signal, 8.0, seed))
    # same noise draw, plus the crop of the waveform scaled to optimal SNR 8 (its L2 norm, whitened)
    assert np.linalg.norm(loud - noise) == pytest.approx(8.0, rel=1e-5)
    assert abs(np.std(noise) - 1.0) < 0.1  # whitened design-PSD noise: unit variance
    windows = problem.inputs(params)["strain"]
    assert windows.shape == (3, CFG.window_samples) and windows.dtype == np.float32


def test_binary_cross_entropy_known_values():
    np.testing.assert_allclose(binary_cross_entropy(np.array([0.5, 0.9, 0.1]), np.array([1.0, 1.0, 0.0])),
                               [np.log(2), -np.log(0.9), -np.log(0.9)])
    assert np.isfinite(binary_cross_entropy(np.array([0.0, 1.0]), np.array([1.0, 0.0]))).all()


def test_tiny_gw_run_labels_the_most_disputed_binaries(tmp_path):
    torch.set_num_threads(1)
    train = TrainConfig(epochs=1, batch_size=8, lr=1e-3, precision="fp32", device="cpu", patience=10)
    problem = GWLearning(GWApp(), CFG)
    history = run_active_learning(GWApp(), CFG, tmp_path, initial=4, budget=2, rounds=1, pool_size=6, seed=0,
                                  members=2, n_test=4, train_cfg=train, problem=problem)
    assert [h["simulator_calls"] for h in history] == [4, 6]
    for h in history:
        assert h["n_test"] == 8 and np.isfinite(h["bce"]) and 0 <= h["error_rate"] <= 1
    selection = json.loads((round_dir(tmp_path, 1) / "selection.json").read_text())
    scores = np.asarray(selection["disagreement"])
    assert sorted(selection["selected"]) == sorted(np.argsort(-scores)[:2].tolist())


def test_gw_is_the_registered_problem_of_its_app():
    from converge.validate.active import default_problem

    assert isinstance(default_problem(GWApp(), CFG), GWLearning)
    with pytest.raises(NotImplementedError, match="batch diversity has no descriptor"):
        GWLearning(GWApp(), CFG).descriptors({})
