"""Whitening continuous strain: the segment PSD, the FIR filter, chunked equal to whole-file processing."""
from __future__ import annotations

import numpy as np
import pytest

from converge.apps.gw.conditioning import (
    Conditioning,
    fir_whiten,
    segment_psd,
    valid_range,
    whiten_segment,
    whitening_fir,
)
from converge.apps.gw.datafile import open_strain, write_mlgwsc1
from converge.apps.gw.noise import colored_gaussian_noise, whiten
from converge.apps.gw.psd import design_psd

FS = 2048


@pytest.fixture(scope="module")
def noise_file(tmp_path_factory):
    n = FS * 80
    psd = design_psd("aLIGOZeroDetHighPower", n, FS, 15.0)
    rng = np.random.default_rng(0)
    path = tmp_path_factory.mktemp("c") / "n.hdf"
    write_mlgwsc1(path, [(1e9, {d: colored_gaussian_noise(psd, n, FS, rng) for d in ("H1", "L1")})], FS)
    return open_strain(path)


def test_segment_psd_matches_the_design_psd(noise_file):
    freqs, psd = segment_psd(noise_file, 0, "H1", Conditioning(block_s=32.0))
    design = design_psd("aLIGOZeroDetHighPower", 4 * FS, FS, 15.0)
    band = (freqs > 30) & (freqs < 800)
    ratio = psd[band] / design[band]
    # 80 s: ~40 Welch windows per bin, so single bins scatter by ~20%; the median and the mean must not
    assert np.median(ratio) == pytest.approx(1.0, abs=0.03) and np.mean(ratio) == pytest.approx(1.0, abs=0.05)


def test_whitened_noise_is_white_with_the_band_fraction_as_variance(noise_file):
    freqs, psd = segment_psd(noise_file, 0, "H1", Conditioning())
    fir = whitening_fir(freqs, psd, FS, 20.0)
    y = fir_whiten(noise_file.read(0, "H1", 0, FS * 80), fir)
    assert y.var() == pytest.approx(1 - 2 * 20 / FS, abs=0.03)  # the filter's Hann taper softens the 20 Hz edge
    x = noise_file.read(0, "H1", 0, FS * 80)
    exact = whiten(x, np.where(np.fft.rfftfreq(len(x), 1 / FS) >= 20, design_psd(
        "aLIGOZeroDetHighPower", len(x), FS, 15.0), np.inf), FS)
    h = len(fir) // 2
    assert np.corrcoef(y, exact[h:len(x) - h])[0, 1] > 0.995  # the truncated filter is the whitening filter


@pytest.mark.parametrize("n_samples", [8193, 8194, 20000, 8 * 8193, 8 * 8193 + 1, 300_001])
def test_fir_whiten_equals_scipy_oaconvolve(n_samples):
    """Overlap-save with a precomputed filter spectrum: one output sample, one block, a block boundary, many
    blocks with a short last one."""
    from scipy.signal import oaconvolve

    rng = np.random.default_rng(n_samples)
    x, fir = rng.standard_normal(n_samples) * 1e-21, rng.standard_normal(8193) * 1e21
    ours, ref = fir_whiten(x, fir), oaconvolve(x, fir, mode="valid")
    assert ours.shape == ref.shape == (n_samples - 8192,) and ours.dtype == np.float64
    np.testing.assert_allclose(ours, ref, rtol=0, atol=1e-10 * np.abs(ref).max())
    single = fir_whiten(x.astype(np.float32), fir)  # float32 in, float32 arithmetic out
    assert single.dtype == np.float32
    np.testing.assert_allclose(single, ref, rtol=0, atol=2e-6 * np.abs(ref).max())


def test_float32_conditioning_whitens_as_float64_does(noise_file, tmp_path):
    """The CNN search's conditioning: the segment's PSD, filter and whitened strain in float32 equal float64's
    to float32's precision."""
    from converge.apps.gw.conditioning import whiten_strain_set

    double = whiten_strain_set(noise_file, Conditioning(block_s=32.0), tmp_path / "d", ("H1",))[0]
    single = whiten_strain_set(noise_file, Conditioning(block_s=32.0, dtype="float32"), tmp_path / "s", ("H1",))[0]
    freqs = double.psd["H1"][0]
    band = freqs >= 20.0  # below, the noise has ~1e-9 of the peak power: float32 keeps no digits of it
    np.testing.assert_allclose(single.psd["H1"][1][band], double.psd["H1"][1][band], rtol=1e-4)
    a, b = np.asarray(double.channels["H1"]), np.asarray(single.channels["H1"])
    assert np.abs(a - b).max() < 1e-5 * np.abs(a).max()
    with pytest.raises(ValueError, match="give float32 or float64"):
        Conditioning(dtype="float16")


@pytest.mark.parametrize("n_out", [40960 - 8192, 2 * 32768, 2 * 32768 + 1, 32768 - 1])
def test_fir_whiten_writes_into_an_array_block_by_block(n_out):
    """Blocks of a power of two of outputs (32,768 for 8,193 taps; whole blocks, one more sample, one fewer),
    written into a strided ``out`` exactly as returned."""
    from scipy.signal import oaconvolve

    rng = np.random.default_rng(n_out)
    x, fir = rng.standard_normal(n_out + 8192), rng.standard_normal(8193)
    room = np.full(2 * n_out + 1, np.nan)
    out = room[1::2]  # every other element: a view that a flat copy could not fill
    assert fir_whiten(x, fir, out) is out
    np.testing.assert_allclose(out, oaconvolve(x, fir, mode="valid"), rtol=0, atol=1e-9 * np.abs(out).max())
    assert np.isnan(room[::2]).all()  # nothing written between


def test_fir_whiten_refuses_a_stretch_shorter_than_the_filter():
    with pytest.raises(ValueError, match="too few for a filter of 9 taps"):
        fir_whiten(np.zeros(8), np.ones(9))


def test_fir_is_symmetric_and_odd_length():
    freqs = np.fft.rfftfreq(8 * 64, 1 / 64.0)
    fir = whitening_fir(freqs, np.ones_like(freqs), 64.0, 5.0)
    assert len(fir) % 2 == 1 and np.allclose(fir, fir[::-1])


@pytest.mark.parametrize("chunk_s", [3.0, 17.0])
def test_chunked_whitening_equals_whole_file_whitening(noise_file, chunk_s):
    freqs, psd = segment_psd(noise_file, 0, "L1", Conditioning())
    fir = whitening_fir(freqs, psd, FS, 20.0)
    n = noise_file.segments[0].n_samples
    whole = np.zeros(n)
    whiten_segment(noise_file, 0, "L1", fir, whole, chunk=n)
    chunked = np.zeros(n)
    whiten_segment(noise_file, 0, "L1", fir, chunked, chunk=int(chunk_s * FS))
    np.testing.assert_allclose(chunked, whole, rtol=0, atol=1e-9)
    lo, hi = valid_range(n, fir)
    assert lo == len(fir) // 2 and not whole[:lo].any() and not whole[hi:].any() and whole[lo:hi].std() > 0.5


def test_psd_blocks_do_not_depend_on_the_chunk_size(noise_file):
    a = segment_psd(noise_file, 0, "H1", Conditioning(chunk_s=8.0))[1]
    b = segment_psd(noise_file, 0, "H1", Conditioning(chunk_s=64.0))[1]
    np.testing.assert_array_equal(a, b)


def test_whitened_data_leaves_memory_past_its_bound(noise_file, tmp_path, monkeypatch):
    """Bounded memory: the whitened set stays in memory only while it fits the bound, else it is memmapped,
    with the same samples either way."""
    from converge.apps.gw import conditioning
    from converge.apps.gw.conditioning import whiten_strain_set

    small = whiten_strain_set(noise_file, Conditioning(), tmp_path / "m", ("H1", "L1"))[0]
    monkeypatch.setattr(conditioning, "WHITENED_IN_MEMORY_BYTES", 4 * FS * 80)  # one detector's worth
    monkeypatch.setattr(conditioning, "RAW_IN_MEMORY_BYTES", 8 * FS)
    mapped = whiten_strain_set(noise_file, Conditioning(), tmp_path / "d", ("H1", "L1"))[0]
    assert not isinstance(small.channels["H1"], np.memmap) and isinstance(mapped.channels["H1"], np.memmap)
    np.testing.assert_array_equal(np.asarray(small.channels["L1"]), np.asarray(mapped.channels["L1"]))
