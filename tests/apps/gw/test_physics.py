"""GW physics against LALSuite/PyCBC references and statistical invariants.

Tolerances: quantities that go through the same LAL C code (PSD, waveform) agree to
~1e-12 relative; statistical checks use >= 5 sigma bounds for the sample sizes drawn.
"""
from __future__ import annotations

import lal
import lalsimulation as lalsim
import numpy as np
import pytest
import torch

from converge.apps.gw.config import GWConfig
from converge.apps.gw.noise import (
    Whitener,
    colored_gaussian_noise,
    interpolate_psd,
    welch_psd,
    whiten,
)
from converge.apps.gw.psd import design_psd
from converge.apps.gw.waveforms import (
    REFERENCE_GPS_TIME,
    antenna_pattern,
    fd_detector_strain,
    fd_polarizations,
    optimal_snr,
    projected_strain,
    sample_bbh_parameters,
    segment_samples,
    whitened_signal,
    whitened_span,
)

CFG = GWConfig()
PARAMS = {"mass1": 36.0, "mass2": 29.0, "inclination": 0.7, "polarization": 1.1, "ra": 2.2,
          "dec": -0.6, "coa_phase": 0.4, "gps_time": 1126259462.4}


def test_design_psd_equals_lalsimulation():
    n, fs = 8 * 2048, 2048
    psd = design_psd("aLIGOZeroDetHighPower", n, fs, 20.0)
    freqs = np.fft.rfftfreq(n, 1 / fs)
    for f in (20.0, 35.5, 100.0, 440.0, 1000.0):
        k = int(np.argmin(np.abs(freqs - f)))
        assert psd[k] == pytest.approx(lalsim.SimNoisePSDaLIGOZeroDetHighPower(freqs[k]), rel=1e-12)
    assert np.all(np.isinf(psd[freqs < 20.0])) and np.all(np.isfinite(psd[(freqs >= 20.0) & (freqs < fs / 2)]))


def test_design_psd_unknown_name_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown PSD 'aLIGOTypo'.*aLIGOZeroDetHighPower"):
        design_psd("aLIGOTypo", 1024, 1024, 20.0)


def test_fd_polarizations_equal_direct_lalsimulation_call():
    hp, hc = fd_polarizations(CFG, PARAMS)
    lal_hp, lal_hc = lalsim.SimInspiralChooseFDWaveform(
        PARAMS["mass1"] * lal.MSUN_SI, PARAMS["mass2"] * lal.MSUN_SI, 0, 0, 0, 0, 0, 0,
        1e6 * lal.PC_SI, PARAMS["inclination"], PARAMS["coa_phase"], 0.0, 0.0, 0.0,
        1.0 / CFG.segment, CFG.f_lower, CFG.sample_rate / 2, CFG.f_lower, None, lalsim.IMRPhenomD,
    )
    n = len(hp)
    for ours, ref in ((hp, lal_hp.data.data[:n]), (hc, lal_hc.data.data[:n])):
        assert np.abs(ours - ref).max() <= 1e-12 * np.abs(ref).max()
        assert np.abs(ref).max() > 0


def test_antenna_pattern_equals_lal_detector_response():
    gmst = lal.GreenwichMeanSiderealTime(lal.LIGOTimeGPS(PARAMS["gps_time"]))
    response = lal.CachedDetectors[lal.LHO_4K_DETECTOR].response
    ref = lal.ComputeDetAMResponse(response, PARAMS["ra"], PARAMS["dec"], PARAMS["polarization"], gmst)
    ours = antenna_pattern("H1", PARAMS["ra"], PARAMS["dec"], PARAMS["polarization"], PARAMS["gps_time"])
    # PyCBC's Detector takes the Earth rotation angle from its own GMST (not LAL's); the two
    # differ by ~1e-5 rad, i.e. a few 1e-5 in F+ and Fx.
    np.testing.assert_allclose(ours, ref, atol=1e-4)


def test_whitened_norm_is_pycbc_optimal_snr():
    """sum w^2 over the whole segment = 4 ∫|h|^2/S df, here against pycbc.filter.sigma."""
    from pycbc.filter import sigma
    from pycbc.types import FrequencySeries

    n = segment_samples(CFG)
    h = fd_detector_strain(CFG, PARAMS, distance_mpc=400.0)
    psd = design_psd(CFG.psd, n, CFG.sample_rate, CFG.f_lower)
    ref = sigma(FrequencySeries(h, delta_f=1 / CFG.segment), FrequencySeries(psd.copy(), delta_f=1 / CFG.segment),
                low_frequency_cutoff=CFG.f_lower)
    ours = optimal_snr(whitened_span(CFG, h, before=0, after=n))
    assert ours == pytest.approx(ref, rel=1e-9)
    assert 5 < ours < 100  # a GW150914-like source at 400 Mpc


def test_whitened_signal_shape_norm_and_merger_position():
    w = whitened_signal(CFG, PARAMS)
    assert w.dtype == np.float32 and w.shape == (CFG.stored_samples,)
    assert optimal_snr(w) == pytest.approx(1.0, rel=1e-5)
    # the whitened envelope peaks within 15 ms before the FD t=0 that sits at merger_index
    assert -0.015 * CFG.sample_rate <= int(np.argmax(np.abs(w))) - CFG.merger_index <= 2


@pytest.mark.parametrize("masses", [(5.0, 5.0), (36.0, 29.0), (95.0, 90.0)])
def test_fd_time_origin_is_the_amplitude_peak(masses):
    """The documented convention: t=0 of the FD waveform is within 10 ms of the peak of |h+ - i hx|."""
    hp, hc = fd_polarizations(CFG, {"mass1": masses[0], "mass2": masses[1]})
    n = segment_samples(CFG)
    envelope = np.abs(np.fft.irfft(hp, n) - 1j * np.fft.irfft(hc, n))
    peak = int(np.argmax(envelope))
    peak = peak - n if peak > n // 2 else peak
    assert abs(peak) <= 0.010 * CFG.sample_rate


def test_colored_noise_whitens_to_unit_white_noise():
    n, fs, f_lower = 8192, 2048, 20.0
    psd = design_psd("aLIGOZeroDetHighPower", n, fs, f_lower)
    x = colored_gaussian_noise(psd, n, fs, np.random.default_rng(1), batch=(4, 8))
    assert x.shape == (4, 8, n)
    w = whiten(x, psd, fs)
    band = 1 - 2 * f_lower / fs
    # 262144 samples: the variance estimate has relative std sqrt(2/262144) = 0.3%
    assert w.var() == pytest.approx(band, rel=0.015)
    freqs, density = welch_psd(w.reshape(-1), fs, seg_duration=1.0, average="mean")
    in_band = (freqs > f_lower + 2) & (freqs < fs / 2 - 2)
    flat = density[in_band] * fs / 2  # one-sided PSD of unit-variance white noise is 2/fs
    assert flat.mean() == pytest.approx(1.0, rel=0.02)
    # 32-Hz bands average ~8000 periodogram bins each: relative std ~1.5%, bound at 5 sigma
    bands = flat[: len(flat) // 32 * 32].reshape(-1, 32).mean(axis=1)
    assert np.abs(bands - 1).max() < 0.08


def test_colored_noise_has_the_design_psd():
    n, fs = 64 * 2048, 2048
    psd = design_psd("aLIGOZeroDetHighPower", n, fs, 10.0)
    x = colored_gaussian_noise(psd, n, fs, np.random.default_rng(2))
    freqs, est = welch_psd(x, fs, seg_duration=4.0, average="mean")
    model = interpolate_psd(np.fft.rfftfreq(n, 1 / fs), psd, 4 * fs, fs, 10.0)
    band = (freqs > 30) & (freqs < 900)
    ratio = est[band] / model[band]
    assert np.median(ratio) == pytest.approx(1.0, rel=0.03)


def test_whiten_numpy_and_torch_agree_with_batch_axes():
    n, fs = 2048, 2048
    psd = design_psd("aLIGOZeroDetHighPower", n, fs, 20.0)
    x = colored_gaussian_noise(psd, n, fs, np.random.default_rng(3), batch=(2, 3))
    ref = whiten(x, psd, fs)
    out64 = whiten(torch.tensor(x), psd, fs)
    out_tensor_psd = whiten(torch.tensor(x), torch.tensor(psd), fs)
    out32 = Whitener(psd, fs, n)(torch.tensor(x, dtype=torch.float32))
    assert out64.dtype == torch.float64 and out32.dtype == torch.float32 and out64.shape == (2, 3, n)
    np.testing.assert_allclose(out64.numpy(), ref, rtol=0, atol=1e-12)
    np.testing.assert_allclose(out_tensor_psd.numpy(), ref, rtol=0, atol=1e-12)
    np.testing.assert_allclose(out32.numpy(), ref, rtol=0, atol=1e-5)


def test_whiten_rejects_a_psd_on_the_wrong_grid():
    with pytest.raises(ValueError, match="needs 1025"):
        whiten(np.zeros(2048), np.ones(513), 2048)


def test_welch_estimate_whitens_real_format_data():
    """The `converge detect` path: estimate the PSD from data, interpolate, whiten."""
    fs, n = 2048, 128 * 2048
    psd = design_psd("aLIGOZeroDetHighPower", n, fs, 15.0)
    x = colored_gaussian_noise(psd, n, fs, np.random.default_rng(4))
    freqs, est = welch_psd(x, fs)
    w = whiten(x, interpolate_psd(freqs, est, n, fs, 20.0), fs)
    band_fraction = 1 - 2 * 20.0 / fs
    assert w[fs : -fs].var() == pytest.approx(band_fraction, rel=0.05)


@pytest.mark.parametrize("n_samples, seg_duration, average", [
    (9 * 1024, 1.0, "median"),  # 17 segments: an odd count, one middle value
    (10 * 1024, 1.0, "median"),  # 19 segments
    (11 * 1024 + 100, 1.0, "median"),  # 21 segments, samples past the last one unused
    (10 * 1024, 2.0, "median"),  # 9 segments
    (7 * 1024, 1.0, "median"),  # 13 segments
    (6 * 1024, 1.0, "median"),  # 11 segments
    (5 * 1024 + 512, 1.0, "median"),  # 10 segments: an even count, the mean of the two middle values
    (10 * 1024, 1.0, "mean"),
    (1001 * 3, 1001 / 1024, "median"),  # an odd nperseg (1001 samples, hop 501): no Nyquist bin
    (1024, 1.0, "median"),  # one segment
])
def test_welch_psd_equals_scipy(n_samples, seg_duration, average):
    """Our Welch (strided segments, the mean removed in the frequency domain, the median by partition) is
    scipy.signal.welch's estimate, batch axes included."""
    from scipy.signal import welch

    fs = 1024.0
    x = np.random.default_rng(7).standard_normal((2, n_samples)) * 1e-21 + 3e-21  # strain-sized, with an offset
    nperseg = int(round(seg_duration * fs))
    freqs, ours = welch_psd(x, fs, seg_duration, average)
    ref_f, ref = welch(x, fs=fs, window="hann", nperseg=nperseg, noverlap=nperseg // 2, average=average)
    np.testing.assert_allclose(freqs, ref_f)
    np.testing.assert_allclose(ours, ref, rtol=1e-9, atol=0)
    assert ours.shape == (2, nperseg // 2 + 1)
    _, single = welch_psd(x, fs, seg_duration, average, dtype=np.float32)  # strain-sized: scaled, no underflow
    assert single.dtype == np.float64 and np.all(single > 0)
    np.testing.assert_allclose(single, ref, rtol=1e-4, atol=0)  # the DC bin cancels the offset: 4e-5


@pytest.mark.parametrize("group_bytes", [1, 3 * 1024 * 8, 2**30])
def test_welch_psd_in_groups_of_segments_equals_scipy(monkeypatch, group_bytes):
    """The segments are transformed a few at a time: one per group, groups that do not divide the 19 segments,
    all in one; the same estimate in float64 and float32."""
    from scipy.signal import welch

    import converge.apps.gw.noise as noise

    monkeypatch.setattr(noise, "WELCH_GROUP_BYTES", group_bytes)
    x = np.random.default_rng(8).standard_normal((2, 10 * 1024)) * 1e-21
    ref = welch(x, fs=1024.0, window="hann", nperseg=1024, noverlap=512, average="median")[1]
    np.testing.assert_allclose(welch_psd(x, 1024.0, 1.0)[1], ref, rtol=1e-9, atol=0)
    np.testing.assert_allclose(welch_psd(x, 1024.0, 1.0, dtype=np.float32)[1], ref, rtol=1e-4, atol=0)
    np.testing.assert_allclose(welch_psd(x, 1024.0, 1.0, "mean")[1],
                               welch(x, fs=1024.0, nperseg=1024, average="mean")[1], rtol=1e-9, atol=0)


def test_welch_psd_error_paths():
    with pytest.raises(ValueError, match="fewer than one"):
        welch_psd(np.zeros(100), 2048)
    with pytest.raises(ValueError, match="average"):
        welch_psd(np.zeros(10000), 2048, seg_duration=1.0, average="max")


def test_sample_bbh_parameters_ranges_and_isotropy():
    rng = np.random.default_rng(5)
    draws = [sample_bbh_parameters(CFG, rng) for _ in range(4000)]
    m1, m2 = np.array([d["mass1"] for d in draws]), np.array([d["mass2"] for d in draws])
    assert np.all(m1 >= m2) and m2.min() >= CFG.mass_min and m1.max() <= CFG.mass_max
    cos_i = np.cos([d["inclination"] for d in draws])
    sin_dec = np.sin([d["dec"] for d in draws])
    for u in (cos_i, sin_dec):  # uniform on [-1, 1]: mean 0, variance 1/3; std of mean 0.009
        assert abs(u.mean()) < 0.05 and u.var() == pytest.approx(1 / 3, rel=0.06)
    assert all(d["gps_time"] == REFERENCE_GPS_TIME for d in draws)


def test_optimal_snr_numpy_and_torch():
    x = np.random.default_rng(6).standard_normal((3, 100))
    np.testing.assert_allclose(optimal_snr(torch.tensor(x)).numpy(), optimal_snr(x), rtol=1e-12)
    np.testing.assert_allclose(optimal_snr(x, axis=0), np.sqrt((x**2).sum(0)), rtol=1e-12)


def test_projected_strain_agrees_with_frequency_domain_snr():
    """TD injection waveform vs the FD response: same optimal SNR (TD conditioning taper: ~1%)."""
    fs, distance = 2048, 400.0
    times, h = projected_strain(CFG, PARAMS, duration=16.0, sample_rate=fs, distance_mpc=distance)
    assert times[0] < -1.0 and 0.0 < times[-1] <= 0.5 + 1 / fs
    assert abs(times[np.argmax(np.abs(h))]) < 0.02
    n = segment_samples(CFG)
    series = np.zeros(n)
    series[: len(h)] = h
    td_snr = optimal_snr(whiten(series, design_psd(CFG.psd, n, fs, CFG.f_lower), fs))
    fd_snr = optimal_snr(whitened_span(CFG, fd_detector_strain(CFG, PARAMS, distance), before=0, after=n))
    assert td_snr == pytest.approx(fd_snr, rel=0.02)
    _, h_far = projected_strain(CFG, PARAMS, duration=16.0, sample_rate=fs, distance_mpc=2 * distance)
    np.testing.assert_allclose(h_far, h / 2, rtol=1e-9, atol=1e-30)
