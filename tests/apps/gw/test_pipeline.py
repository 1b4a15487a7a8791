"""The gw data pipeline, curriculum and the efficiency-at-FAP statistic."""
import numpy as np
import pytest
import torch

from converge.apps.gw.app import GWApp, curriculum_snr_range, efficiency_at_fap
from converge.apps.gw.config import GWConfig
from converge.apps.gw.pipeline import WindowSource, crop_windows, scale_to_snr, whitened_noise
from converge.apps.gw.waveforms import sample_bbh_parameters, whitened_signal

CFG = GWConfig()


@pytest.fixture(scope="module")
def signals():
    rng = np.random.default_rng(0)
    return torch.from_numpy(np.stack([whitened_signal(CFG, sample_bbh_parameters(CFG, rng)) for _ in range(8)]))


def test_efficiency_at_fap_known_values():
    noise = np.arange(1000, dtype=float)  # scores 0..999
    thr, eff = efficiency_at_fap(noise, np.array([989.5, 990.5, 2000.0, -1.0]), 1e-2)
    # 10 noise windows (990..999) may pass at FAP 1e-2: the threshold is the 11th loudest, 989
    assert thr == 989.0 and eff == 0.75
    assert np.mean(noise > thr) == pytest.approx(1e-2)


def test_efficiency_at_fap_refuses_too_few_noise_windows():
    with pytest.raises(ValueError, match="needs more than 100 noise windows"):
        efficiency_at_fap(np.zeros(100), np.ones(3), 1e-3)


def test_curriculum_falls_from_high_snr_to_the_floor():
    ranges = [curriculum_snr_range(CFG, e, 8) for e in range(8)]
    top = CFG.snr_max
    assert ranges[0] == (12.0, top) and ranges[4] == (5.0, top) and ranges[-1] == (5.0, top)
    assert all(a[0] >= b[0] for a, b in zip(ranges, ranges[1:]))


def test_signal_windows_have_the_target_snr_and_merger_in_range(signals):
    offsets = torch.tensor([0, signals.shape[1] - CFG.window_samples])
    w = scale_to_snr(crop_windows(signals[:2], offsets, CFG.window_samples), torch.tensor([8.0, 13.0]))
    assert torch.allclose(w.norm(dim=-1), torch.tensor([8.0, 13.0]))
    peaks = w.abs().argmax(dim=-1) / CFG.sample_rate
    # merger at merger_max for offset 0, at merger_min for the largest offset (peak within ~20 ms)
    assert peaks[0] == pytest.approx(CFG.merger_max, abs=0.03)
    assert peaks[1] == pytest.approx(CFG.merger_min, abs=0.03)


def test_whitened_noise_is_white_with_the_band_fraction_as_variance():
    x = whitened_noise(CFG, 512, torch.Generator().manual_seed(1))
    band = 1 - 2 * CFG.f_lower / CFG.sample_rate
    assert x.var().item() == pytest.approx(band, rel=0.01)
    spec = torch.fft.rfft(x).abs().pow(2).mean(0)[40:-5] / CFG.window_samples  # in-band bins
    assert spec.mean().item() == pytest.approx(1.0, rel=0.02) and spec.std().item() < 0.15


def test_fresh_noise_each_epoch_but_fixed_sources_repeat(signals):
    src = WindowSource(CFG, signals, seed=5)
    a = next(src.batches(0, 16))
    b = next(src.batches(1, 16))
    a2 = next(src.batches(0, 16))
    assert torch.equal(a["input"], a2["input"]) and not torch.equal(a["input"], b["input"])
    fixed = WindowSource(CFG, signals, seed=5, fixed=True)
    assert torch.equal(next(fixed.batches(0, 16))["input"], next(fixed.batches(3, 16))["input"])
    labels = torch.cat([b["label"] for b in src.batches(0, 4)])
    assert len(labels) == len(src) == round(len(signals) / CFG.signal_fraction) and labels.sum() == len(signals)


def test_ranks_see_disjoint_halves(signals):
    src = WindowSource(CFG, signals, seed=5)
    n0 = sum(len(b["label"]) for b in src.batches(0, 4, rank=0, world=2))
    n1 = sum(len(b["label"]) for b in src.batches(0, 4, rank=1, world=2))
    assert n0 + n1 == len(src)


def test_app_schema_matches_simulation():
    app = GWApp()
    params = app.sample_parameters(CFG, np.random.default_rng(1))
    out = app.simulate(CFG, params)
    spec = app.schema(CFG)["signal"]
    assert out["signal"].shape == spec.shape and out["signal"].dtype == np.dtype(spec.dtype)
    assert 5.0 <= params["mass2"] <= params["mass1"] <= 95.0
