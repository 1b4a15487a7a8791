"""Several detectors: projection with antenna patterns and arrival delays, network SNR, the coherent CNN."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from converge.apps.gw.app import GWApp
from converge.apps.gw.config import GWConfig
from converge.apps.gw.model import DetectionCNN
from converge.apps.gw.pipeline import WindowSource, whitened_noise
from converge.config import ConfigError
from converge.apps.gw.waveforms import (
    arrival_delay,
    fd_detector_strain,
    fd_network_strain,
    sample_bbh_parameters,
    source_antenna_pattern,
    whitened_signal,
    whitened_span,
)

NET = GWConfig.mlgwsc1(1)
PARAMS = {"mass1": 30.0, "mass2": 22.0, "inclination": 0.6, "polarization": 0.9, "ra": 1.3, "dec": -0.4,
          "coa_phase": 0.7, "gps_time": 1238166050.0}


def test_each_detector_sees_its_antenna_pattern_and_its_delay():
    from pycbc.detector import Detector

    both = fd_network_strain(NET, PARAMS)  # (2, F)
    freqs = np.fft.rfftfreq(int(NET.segment * NET.sample_rate), 1 / NET.sample_rate)
    for k, det in enumerate(("H1", "L1")):
        alone = fd_detector_strain(GWConfig.mlgwsc1(1, detectors=(det,)), PARAMS)  # no delay, one detector
        dt = Detector(det).time_delay_from_earth_center(PARAMS["ra"], PARAMS["dec"], PARAMS["gps_time"])
        assert arrival_delay(det, PARAMS) == pytest.approx(dt, abs=1e-12)
        np.testing.assert_allclose(both[k], alone * np.exp(-2j * np.pi * freqs * dt), rtol=1e-12, atol=1e-40)
        fp, fc = Detector(det).antenna_pattern(PARAMS["ra"], PARAMS["dec"], PARAMS["polarization"],
                                               PARAMS["gps_time"])
        assert source_antenna_pattern(NET, PARAMS, det) == pytest.approx((fp, fc), abs=1e-12)
    # the delays differ by at most the H1-L1 light travel time
    assert abs(arrival_delay("H1", PARAMS) - arrival_delay("L1", PARAMS)) <= 0.0101


def test_network_signal_has_unit_network_snr_and_keeps_relative_amplitudes():
    w = whitened_signal(NET, PARAMS).astype(np.float64)
    assert w.shape == (2, NET.stored_samples)
    assert np.sqrt((w**2).sum()) == pytest.approx(1.0, rel=1e-5)
    # each detector's share of the network SNR is its own optimal SNR (the delay moves, never rescales)
    alone = [np.linalg.norm(whitened_span(NET, fd_detector_strain(GWConfig.mlgwsc1(1, detectors=(d,)), PARAMS)))
             for d in ("H1", "L1")]
    assert np.linalg.norm(w[0]) / np.linalg.norm(w[1]) == pytest.approx(alone[0] / alone[1], rel=1e-3)


def test_ds1_xas_is_xphm_restricted_to_the_22_mode():
    xphm = GWConfig.mlgwsc1(1, approximant="IMRPhenomXPHM", mode_array=(22,))
    a, b = whitened_signal(NET, PARAMS), whitened_signal(xphm, PARAMS)
    assert np.abs(a - b).max() < 1e-4  # unit-norm signals: the two agree to 1e-4 of the peak-free scale


def test_one_named_detector_is_the_original_single_detector_path():
    rng = np.random.default_rng(4)
    p = sample_bbh_parameters(GWConfig(), rng)
    np.testing.assert_array_equal(whitened_signal(GWConfig(), p), whitened_signal(GWConfig(detectors=("H1",)), p))
    assert GWApp().schema(GWConfig())["signal"].shape == (GWConfig().stored_samples,)


def test_presets_follow_the_challenge_priors():
    for dataset, (lo, spins) in {1: (10.0, "zero"), 2: (7.0, "aligned"), 3: (7.0, "isotropic")}.items():
        cfg = GWConfig.mlgwsc1(dataset)
        assert (cfg.mass_min, cfg.mass_max, cfg.spins, cfg.network) == (lo, 50.0, spins, ("H1", "L1"))
    p = sample_bbh_parameters(GWConfig.mlgwsc1(2), np.random.default_rng(0))
    assert abs(p["spin1z"]) <= 0.99 and "spin1x" not in p
    p = sample_bbh_parameters(GWConfig.mlgwsc1(3), np.random.default_rng(0))
    assert np.hypot(np.hypot(p["spin1x"], p["spin1y"]), p["spin1z"]) <= 0.99
    assert GWConfig.mlgwsc1(3).mode_array == (22, 21, 33, 32, 44)


@pytest.mark.parametrize("kwargs, message", [
    ({"detectors": ("H1", "X1")}, r"app\.detectors=\['H1', 'X1'\]: name each of H1, L1, V1 at most once"),
    ({"detectors": ("H1", "H1")}, "at most once"),
    ({"spins": "wobbly"}, r"app\.spins='wobbly': choose one of zero, aligned, isotropic"),
    ({"spin_max": 1.0}, r"app\.spin_max=1\.0: must be in \[0, 1\)"),
    ({"mode_array": (22, 55)}, r"app\.mode_array=\[22, 55\]: modes are written lm"),
])
def test_network_config_errors(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        GWConfig(**kwargs)
    with pytest.raises(ConfigError, match="presets exist for 1, 2 and 3"):
        GWConfig.mlgwsc1(4)


def test_coherent_batches_and_model():
    rng = np.random.default_rng(1)
    signals = torch.from_numpy(np.stack([whitened_signal(NET, sample_bbh_parameters(NET, rng)) for _ in range(3)]))
    src = WindowSource(NET, signals, seed=2)
    batch = next(src.batches(0, 8))
    assert batch["input"].shape == (8, 2, NET.window_samples)
    is_sig = batch["label"].bool()
    noise = whitened_noise(NET, 256, torch.Generator().manual_seed(0))
    assert noise.shape == (256, 2, NET.window_samples)
    assert torch.corrcoef(noise[:, :, 100].T)[0, 1].abs() < 0.2  # independent detectors
    model = DetectionCNN(NET.window_samples, (4, 8, 8), 8, n_detectors=2)
    assert model(batch["input"]).shape == (8,) and is_sig.sum() >= 1
    assert GWApp().make_model(NET).features[0].in_channels == 2


@pytest.mark.parametrize("detectors", [1, 2])
def test_streaming_scores_equal_window_by_window_scores(detectors):
    torch.manual_seed(0)
    model = DetectionCNN(2048, (4, 8, 8), 8, n_detectors=detectors, padding="valid").eval()
    for module in model.modules():  # statistics of a trained network, not the identity
        if isinstance(module, torch.nn.BatchNorm1d):
            module.running_mean.normal_()
            module.running_var.uniform_(0.5, 2.0)
    strain = torch.randn(detectors, 2048 * 6 + 100)
    starts = range(0, strain.shape[-1] - 2048 + 1, 256)
    windows = torch.stack([strain[:, a:a + 2048] for a in starts])
    with torch.inference_mode():
        streamed = model.stream(strain if detectors > 1 else strain[0], 256)
        one_by_one = model(windows if detectors > 1 else windows[:, 0])
    assert streamed.shape == (len(starts),) and model.window_features == 25
    torch.testing.assert_close(streamed, one_by_one, atol=1e-5, rtol=1e-5)
    folded = model.for_inference()  # BatchNorm folded into the convolutions: the same logits, the model untouched
    assert not any(isinstance(m, torch.nn.BatchNorm1d) for m in folded.modules())
    assert sum(isinstance(m, torch.nn.BatchNorm1d) for m in model.modules()) == 4
    with torch.inference_mode():
        torch.testing.assert_close(folded.stream(strain if detectors > 1 else strain[0], 256), one_by_one,
                                   atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(folded(windows if detectors > 1 else windows[:, 0]), one_by_one,
                                   atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="multiple of 64 samples"):
        model.stream(strain, 100)
    with pytest.raises(ValueError, match="padding='valid'"):
        DetectionCNN(2048, (4, 8, 8), 8).stream(strain[0], 256)
    with pytest.raises(ValueError, match="padding='full'"):
        DetectionCNN(2048, padding="full")
    with pytest.raises(ConfigError, match="conv_padding='full'"):
        GWConfig(conv_padding="full")


def test_challenge_psds_match_the_challenges_files_and_whiten_each_detector():
    from converge.apps.gw.psd import challenge_psd, config_psd, design_psd, n_challenge_psds
    from converge.apps.gw.waveforms import signal_psds

    assert n_challenge_psds() == 20
    psd = challenge_psd("L1", 7, 32 * 2048, 2048, 20.0)
    freqs = np.fft.rfftfreq(32 * 2048, 1 / 2048)
    assert np.isinf(psd[freqs < 20.0]).all() and np.isfinite(psd[(freqs >= 20.0) & (freqs < 1024)]).all()
    design = design_psd("aLIGOZeroDetHighPower", 32 * 2048, 2048, 20.0)
    ratio = psd[(freqs > 30) & (freqs < 500)] / design[(freqs > 30) & (freqs < 500)]
    assert 0.05 < np.median(ratio) < 20  # a detector's measured-like PSD, not the design curve itself
    assert not np.allclose(ratio, ratio[0])
    challenge = __import__("pathlib").Path(__file__).parents[4] / "shared" / "mlgwsc1" / "psds" / "L1" / "psd-7.hdf"
    if challenge.is_file():  # the shipped table is the challenge's own file, at its 1 Hz bins
        from pycbc.types import load_frequencyseries

        own = load_frequencyseries(str(challenge))
        at = (freqs >= 20.0) & (freqs < 1023) & (np.abs(freqs - np.round(freqs)) < 1e-9)
        np.testing.assert_allclose(psd[at], np.asarray(own)[np.round(freqs[at]).astype(int)], rtol=1e-12)
    assert config_psd("aLIGOZeroDetHighPower", "H1", 64, 2048, 20.0) is design_psd("aLIGOZeroDetHighPower", 64,
                                                                                   2048, 20.0)
    with pytest.raises(ValueError, match="not 'V1'"):
        challenge_psd("V1", 0, 64, 2048, 20.0)
    with pytest.raises(ValueError, match="give 0..19"):
        challenge_psd("H1", 20, 64, 2048, 20.0)
    # DS2 draws one PSD per detector per sample; the whitened signal keeps unit network SNR under it
    cfg = GWConfig.mlgwsc1(2)
    assert cfg.psd == "mlgwsc1" and GWConfig.mlgwsc1(1).psd == "aLIGOZeroDetHighPower"
    p = sample_bbh_parameters(cfg, np.random.default_rng(0))
    assert {p["psd_H1"], p["psd_L1"]} <= set(map(float, range(20)))
    white = whitened_signal(cfg, p)
    assert white.shape == (2, cfg.stored_samples) and np.linalg.norm(white) == pytest.approx(1.0, rel=1e-5)
    other = whitened_signal(cfg, {**p, "psd_L1": float((p["psd_L1"] + 1) % 20)})
    np.testing.assert_allclose(white[0] / np.linalg.norm(white[0]), other[0] / np.linalg.norm(other[0]), atol=1e-6)
    assert not np.allclose(white[1] / np.linalg.norm(white[1]), other[1] / np.linalg.norm(other[1]), atol=1e-3)
    assert set(signal_psds(cfg, p)) == {"H1", "L1"} and signal_psds(GWConfig.mlgwsc1(1), p) == {}
    q = sample_bbh_parameters(GWConfig.mlgwsc1(1), np.random.default_rng(0))
    assert "psd_H1" not in q  # DS1 draws what it always drew
