"""Strain files in the GWOSC HDF5 layout, and synthetic ones with injections.

GWOSC (gwosc.org) distributes detector strain as HDF5 with ``strain/Strain``
(attributes ``Xspacing`` = 1/sample rate in s, ``Xstart`` = GPS start,
``Npoints``), ``meta/GPSstart``, ``meta/Duration`` and ``meta/Detector``; gaps in
the data are NaN. ``converge detect`` reads that layout; :func:`make_injection_strain`
writes one from design-PSD noise with real waveforms injected at known times.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

import h5py
import numpy as np

from .config import GWConfig
from .noise import colored_gaussian_noise, whiten
from .psd import config_psd
from .waveforms import projected_strain


class StrainFileError(ValueError):
    """A strain file is missing data, has the wrong sample rate, NaNs or gaps."""


@dataclass(frozen=True)
class Strain:
    data: np.ndarray  # (N,) float64 strain
    sample_rate: float  # Hz
    gps_start: float  # s
    detector: str


def read_strain(path: str | Path) -> Strain:
    """Read a GWOSC-layout file; every missing piece is a clear :class:`StrainFileError`."""
    path = Path(path)
    if not path.is_file():
        raise StrainFileError(f"{path}: no such file")
    try:
        f = h5py.File(path, "r")
    except OSError as err:
        raise StrainFileError(f"{path}: not an HDF5 file ({err})") from None
    with f:
        if "strain/Strain" not in f:
            raise StrainFileError(f"{path}: no 'strain/Strain' dataset; expected the GWOSC HDF5 layout")
        dset = check_gwosc_layout(f, path)
        data = np.asarray(dset[()], dtype=np.float64)
        spacing = float(dset.attrs["Xspacing"])
        gps = float(f["meta/GPSstart"][()])
        duration = float(f["meta/Duration"][()])
        detector = f["meta/Detector"][()].decode() if "meta/Detector" in f else "unknown"
    if not spacing > 0:
        raise StrainFileError(f"{path}: Xspacing={spacing} is not a positive time step")
    rate = 1.0 / spacing
    if abs(len(data) * spacing - duration) > spacing:
        raise StrainFileError(f"{path}: {len(data)} samples at {rate:g} Hz cover {len(data) * spacing:g} s, "
                              f"but meta/Duration says {duration:g} s: the file has a gap or is truncated")
    bad = ~np.isfinite(data)
    if bad.any():
        first = np.flatnonzero(bad)[0]
        raise StrainFileError(f"{path}: {int(bad.sum())} NaN/inf samples (a data gap), the first at GPS "
                              f"{gps + first * spacing:.3f}; cut the file into gap-free segments first")
    return Strain(data, rate, gps, detector)


def write_strain(path: str | Path, strain: Strain) -> None:
    """Write ``strain`` in the GWOSC layout, atomically (temp file, fsync, rename)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with h5py.File(tmp, "w") as f:
        d = f.create_dataset("strain/Strain", data=strain.data)
        d.attrs["Xspacing"] = 1.0 / strain.sample_rate
        d.attrs["Xstart"] = strain.gps_start
        d.attrs["Npoints"] = len(strain.data)
        f["meta/GPSstart"] = strain.gps_start
        f["meta/Duration"] = len(strain.data) / strain.sample_rate
        f["meta/Detector"] = strain.detector.encode()
    with open(tmp, "rb+") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def check_gwosc_layout(f: h5py.File, path: Path) -> h5py.Dataset:
    """The ``strain/Strain`` dataset of an open GWOSC file, once its ``Xspacing`` attribute and its
    ``meta/GPSstart`` and ``meta/Duration`` datasets are known to be there; else a StrainFileError naming the gap."""
    dset = f["strain/Strain"]
    if "Xspacing" not in dset.attrs:
        raise StrainFileError(f"{path}: strain/Strain has no 'Xspacing' attribute (seconds per sample)")
    for key in ("meta/GPSstart", "meta/Duration"):
        if key not in f:
            raise StrainFileError(f"{path}: no '{key}' dataset; expected the GWOSC HDF5 layout")
    return dset


def injection_snr(signal: np.ndarray, psd: np.ndarray, sample_rate: float) -> float:
    """Optimal SNR of a signal-only series against ``psd``: the norm of its whitened series."""
    return float(np.linalg.norm(whiten(signal, psd, sample_rate)))


def make_injection_strain(
    cfg: GWConfig,
    duration: float,
    injections: Sequence[Mapping[str, float]],
    seed: int,
    gps_start: float = 1_000_000_000.0,
) -> tuple[Strain, list[dict[str, float]]]:
    """Design-PSD noise of ``duration`` s with BBH signals at given GPS merger times.

    Each injection mapping holds the waveform parameters of
    :func:`waveforms.sample_bbh_parameters` plus ``gps_time`` (merger) and
    ``snr`` (target optimal SNR against the design PSD). Returns the strain and
    the injections as placed (with their realised SNR).
    """
    fs = cfg.sample_rate
    n = int(round(duration * fs))
    psd = config_psd(cfg.psd, cfg.network[0], n, fs, cfg.f_lower)
    rng = np.random.default_rng(seed)
    data = colored_gaussian_noise(psd, n, fs, rng)
    placed = []
    for inj in injections:
        t, h = projected_strain(cfg, inj, duration=min(cfg.segment, duration), sample_rate=fs, distance_mpc=1000.0)
        start = int(round((inj["gps_time"] - gps_start + t[0]) * fs))
        sig = np.zeros(n)
        lo, hi = max(start, 0), min(start + len(h), n)
        if hi <= lo:
            raise ValueError(f"injection at GPS {inj['gps_time']} lies outside the {duration} s strain")
        sig[lo:hi] = h[lo - start : hi - start]
        sig *= inj["snr"] / injection_snr(sig, psd, fs)
        data = data + sig
        placed.append({**dict(inj), "snr": injection_snr(sig, psd, fs)})
    return Strain(data, float(fs), gps_start, cfg.detector), placed


def make_network_strain(
    cfg: GWConfig,
    duration: float,
    injections: Sequence[Mapping[str, float]],
    seed: int,
    gps_start: float = 1_000_000_000.0,
) -> tuple[dict[str, np.ndarray], list[dict[str, float]]]:
    """Design-PSD noise in each detector of ``cfg.network`` with BBH signals at geocentric merger times.

    Each injection holds the parameters of :func:`waveforms.sample_bbh_parameters`, ``gps_time`` (the
    geocentric merger) and ``snr`` (the target network optimal SNR against the design PSD). Every
    detector gets its antenna pattern and its arrival delay (a Fourier phase, exact to the sample's
    fraction). Returns ``({detector: strain}, injections as placed, with each detector's SNR)``.
    """
    from .waveforms import arrival_delay

    fs = cfg.sample_rate
    n = int(round(duration * fs))
    psds = {d: config_psd(cfg.psd, d, n, fs, cfg.f_lower) for d in cfg.network}
    rng = np.random.default_rng(seed)
    data = {d: colored_gaussian_noise(psds[d], n, fs, rng) for d in cfg.network}
    freqs = np.fft.rfftfreq(n, 1.0 / fs)
    placed = []
    for inj in injections:
        signals = {}
        for det in cfg.network:
            t, h = projected_strain(cfg, inj, min(cfg.segment, duration), fs, 1000.0, detector=det)
            start = int(round((inj["gps_time"] - gps_start + t[0]) * fs))
            if start < 0 or start + len(h) > n:
                raise ValueError(f"injection at GPS {inj['gps_time']} does not fit the {duration} s strain")
            sig = np.zeros(n)
            sig[start:start + len(h)] = h
            shift = arrival_delay(det, inj) + (inj["gps_time"] - gps_start + t[0]) - start / fs
            signals[det] = np.fft.irfft(np.fft.rfft(sig) * np.exp(-2j * np.pi * freqs * shift), n=n)
        snrs = {d: injection_snr(s, psds[d], fs) for d, s in signals.items()}
        scale = inj["snr"] / np.sqrt(sum(v**2 for v in snrs.values()))
        for det in cfg.network:
            data[det] = data[det] + scale * signals[det]
        placed.append({**dict(inj), **{f"snr_{d}": scale * v for d, v in snrs.items()}})
    return data, placed
