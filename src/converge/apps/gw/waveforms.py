"""Binary-black-hole signals: LALSuite waveforms, detector projection, whitening.

Time convention. LALSimulation frequency-domain waveforms put the coalescence
time ``t = 0`` at sample 0 of ``irfft`` (the signal wraps circularly, inspiral at
the end of the segment). For IMRPhenomD, ``t = 0`` is the model's merger: its
phase carries the linear term that zeroes the group delay ``dphi/df / 2pi`` at
the peak frequency of the ringdown amplitude (``fmaxCalc`` in LALSimIMRPhenomD.c),
which lies within a few milliseconds of the peak of the time-domain
``|h_+ - i h_x|`` (tested). :func:`whitened_signal` puts this ``t = 0``, to the
sample, at index ``cfg.merger_index`` of the stored series. With one detector it is
the detector arrival time (no geocentre-to-detector delay is applied). With several
(``cfg.coherent``) it is the geocentric time, as in the challenge's injection files
(``tc``), and each detector's response arrives ``dt_d = Detector.time_delay_from_earth_center``
later (at most 21 ms for H1 and L1), applied exactly as the phase ``exp(-2 pi i f dt_d)``.

Parameters (a mapping, all floats): ``mass1``, ``mass2`` [solar masses, detector
frame], ``inclination``, ``polarization``, ``ra``, ``dec``, ``coa_phase`` [rad],
optional ``gps_time`` [s] (sets the Earth's orientation for the antenna pattern;
:data:`REFERENCE_GPS_TIME` when absent), optional spins ``spin1x`` ... ``spin2z``
(dimensionless, zero when absent; ``f_ref = f_lower``).
"""
from __future__ import annotations

from functools import lru_cache
from typing import Mapping

import numpy as np
import torch

from .config import GWConfig
from .noise import whitening_factor
from .psd import CHALLENGE_PSDS, challenge_psd, design_psd, n_challenge_psds

REFERENCE_GPS_TIME = 1187008882.4  # GW170817's merger time: an arbitrary fixed epoch for antenna patterns
DEFAULT_DISTANCE_MPC = 1.0  # amplitude is irrelevant once whitened signals are normalised
TAPER_S = 0.2  # half-Hann taper [s] where projected_strain cuts the waveform
POST_MERGER_S = 0.5  # projected_strain keeps this much after the merger (ringdown long decayed)


def segment_samples(cfg: GWConfig) -> int:
    """Samples in the whitening segment, ``segment * sample_rate``."""
    return int(round(cfg.segment * cfg.sample_rate))


@lru_cache(maxsize=8)
def _segment_whitening_factor(n: int, sample_rate: float, f_lower: float, psd_name: str) -> np.ndarray:
    return whitening_factor(design_psd(psd_name, n, sample_rate, f_lower), sample_rate, n)


@lru_cache(maxsize=4)
def _detector(name: str):
    from pycbc.detector import Detector

    return Detector(name)


def antenna_pattern(detector: str, ra: float, dec: float, polarization: float, gps_time: float) -> tuple[float, float]:
    """Detector responses ``(F+, Fx)`` to a plane wave from ``(ra, dec)`` [rad] with polarisation
    angle ``polarization`` [rad] at ``gps_time`` [s] (PyCBC ``Detector.antenna_pattern``,
    long-wavelength limit)."""
    fplus, fcross = _detector(detector).antenna_pattern(ra, dec, polarization, gps_time)
    return float(fplus), float(fcross)


SPIN_KEYS = ("spin1x", "spin1y", "spin1z", "spin2x", "spin2y", "spin2z")


def source_arguments(cfg: GWConfig, params: Mapping[str, float], distance_mpc: float) -> dict:
    """PyCBC waveform arguments of one source: approximant, masses, orientation, distance, the spins the
    parameters hold and ``cfg.mode_array`` (as PyCBC's ``[[l, m], ...]``)."""
    args: dict = {
        "approximant": cfg.approximant,
        "mass1": float(params["mass1"]),
        "mass2": float(params["mass2"]),
        "inclination": float(params.get("inclination", 0.0)),
        "coa_phase": float(params.get("coa_phase", 0.0)),
        "distance": distance_mpc,
    }
    args.update({k: float(params[k]) for k in SPIN_KEYS if params.get(k, 0.0) != 0.0})
    if cfg.mode_array:
        args["mode_array"] = [[m // 10, m % 10] for m in cfg.mode_array]
        args["f_ref"] = cfg.f_lower
    return args


def fd_polarizations(
    cfg: GWConfig, params: Mapping[str, float], distance_mpc: float = DEFAULT_DISTANCE_MPC
) -> tuple[np.ndarray, np.ndarray]:
    """Frequency-domain ``(h+(f), hx(f))`` [strain/Hz], complex128, shape ``(n // 2 + 1,)`` with
    ``n = segment * sample_rate`` and ``delta_f = 1 / segment``.

    ``cfg.approximant`` from ``f_lower`` to Nyquist via ``pycbc.waveform.get_fd_waveform``
    (i.e. ``lalsimulation.SimInspiralChooseFDWaveform``), zero spins, ``f_ref = f_lower``.
    """
    from pycbc.waveform import get_fd_waveform

    hp, hc = get_fd_waveform(
        **source_arguments(cfg, params, distance_mpc),
        delta_f=1.0 / cfg.segment,
        f_lower=cfg.f_lower,
        f_final=cfg.sample_rate / 2.0,
    )
    n_freq = segment_samples(cfg) // 2 + 1
    return _fit_length(hp.numpy(), n_freq), _fit_length(hc.numpy(), n_freq)


def _fit_length(series: np.ndarray, n_freq: int) -> np.ndarray:
    out = np.zeros(n_freq, dtype=np.complex128)
    k = min(n_freq, len(series))
    out[:k] = series[:k]
    return out


def source_antenna_pattern(cfg: GWConfig, params: Mapping[str, float],
                           detector: str | None = None) -> tuple[float, float]:
    """(F+, Fx) of ``detector`` (default: the config's first) for a source's sky position, polarisation, GPS time."""
    return antenna_pattern(
        detector or cfg.network[0],
        float(params.get("ra", 0.0)),
        float(params.get("dec", 0.0)),
        float(params.get("polarization", 0.0)),
        float(params.get("gps_time", REFERENCE_GPS_TIME)),
    )


def fd_detector_strain(
    cfg: GWConfig, params: Mapping[str, float], distance_mpc: float = DEFAULT_DISTANCE_MPC
) -> np.ndarray:
    """Detector response ``h(f) = F+ h+(f) + Fx hx(f)`` of ``cfg.detector`` [strain/Hz], shape ``(n // 2 + 1,)``."""
    hp, hc = fd_polarizations(cfg, params, distance_mpc)
    fplus, fcross = source_antenna_pattern(cfg, params)
    return fplus * hp + fcross * hc


def arrival_delay(detector: str, params: Mapping[str, float]) -> float:
    """Arrival time at ``detector`` minus the geocentric time [s] of a plane wave from the source's sky
    position at its GPS time (PyCBC ``Detector.time_delay_from_earth_center``)."""
    return float(_detector(detector).time_delay_from_earth_center(
        float(params.get("ra", 0.0)), float(params.get("dec", 0.0)), float(params.get("gps_time", REFERENCE_GPS_TIME))))


def fd_network_strain(
    cfg: GWConfig, params: Mapping[str, float], distance_mpc: float = DEFAULT_DISTANCE_MPC
) -> np.ndarray:
    """Each detector's response ``(F+ h+ + Fx hx) exp(-2 pi i f dt_d)`` [strain/Hz], ``(D, n // 2 + 1)``,
    detectors in ``cfg.network`` order, times relative to the geocentric coalescence (module docstring)."""
    hp, hc = fd_polarizations(cfg, params, distance_mpc)
    freqs = np.fft.rfftfreq(segment_samples(cfg), 1.0 / cfg.sample_rate)
    out = []
    for det in cfg.network:
        fplus, fcross = source_antenna_pattern(cfg, params, det)
        out.append((fplus * hp + fcross * hc) * np.exp(-2j * np.pi * freqs * arrival_delay(det, params)))
    return np.stack(out)


def whitened_span(
    cfg: GWConfig,
    strain_fd: np.ndarray,
    psd: np.ndarray | None = None,
    before: int | None = None,
    after: int | None = None,
) -> np.ndarray:
    """Whiten a frequency-domain strain over the whole segment and return the stored span.

    ``w = irfft(h(f) fs / sqrt(S fs / 2))`` over ``n = segment * fs`` samples (``fs h(f)`` is
    the DFT of the sampled signal), then the ``before + after`` samples at
    ``t = -before / fs .. (after - 1) / fs``, with ``t = 0`` the FD coalescence time (taken
    circularly); the defaults ``before = merger_index``, ``after = stored_samples - merger_index``
    give the stored span. ``sum w^2`` over the whole segment is ``4 ∫ |h|^2 / S df``.
    ``psd`` (one-sided, on the segment's rfft grid) defaults to ``cfg.psd``.
    Returns float64, shape ``(before + after,)``.
    """
    n = segment_samples(cfg)
    if psd is None:
        gain = _segment_whitening_factor(n, float(cfg.sample_rate), float(cfg.f_lower), cfg.psd)
    else:
        gain = whitening_factor(psd, cfg.sample_rate, n)
    white = np.fft.irfft(strain_fd * (cfg.sample_rate * gain), n=n)
    before = cfg.merger_index if before is None else before
    after = cfg.stored_samples - cfg.merger_index if after is None else after
    if not (0 <= before <= n and 0 <= after <= n - before):
        raise ValueError(f"whitened_span: before={before}, after={after} do not fit a segment of {n} samples")
    return np.concatenate([white[n - before:], white[:after]])


def whitened_signal(cfg: GWConfig, params: Mapping[str, float], psd: np.ndarray | None = None) -> np.ndarray:
    """Whitened detector response, unit optimal SNR over the stored span, float32 ``(stored_samples,)``,
    or ``(D, stored_samples)`` for a network (``cfg.coherent``).

    The merger (FD ``t = 0``, see the module docstring) is at index ``cfg.merger_index``;
    the series is divided by its Euclidean norm (= optimal SNR, see ``noise``; for a network
    the network SNR ``sqrt(sum_d rho_d^2)``, which keeps the detectors' relative amplitudes) so
    that ``optimal_snr(out) == 1``; the data pipeline rescales it per window.
    """
    own = signal_psds(cfg, params) if psd is None else {}
    if cfg.coherent:
        span = np.stack([whitened_span(cfg, h, own.get(det, psd))
                         for det, h in zip(cfg.network, fd_network_strain(cfg, params))])  # (D, L)
    else:
        span = whitened_span(cfg, fd_detector_strain(cfg, params), own.get(cfg.network[0], psd))
    norm = np.linalg.norm(span)
    if not norm > 0:
        raise ValueError(f"signal {dict(params)} has no power above f_lower={cfg.f_lower} Hz in the stored span")
    return (span / norm).astype(np.float32)


def signal_psds(cfg: GWConfig, params: Mapping[str, float]) -> dict[str, np.ndarray]:
    """With ``psd = "mlgwsc1"``, each detector's PSD of this sample (the challenge's PSD ``params["psd_<det>"]``, on
    the whitening segment's grid); with a design PSD, none (:func:`whitened_span` uses ``cfg.psd``)."""
    if cfg.psd != CHALLENGE_PSDS:
        return {}
    n = segment_samples(cfg)
    return {det: challenge_psd(det, int(params[f"psd_{det}"]), n, cfg.sample_rate, cfg.f_lower) for det in cfg.network}


def optimal_snr(whitened: np.ndarray | torch.Tensor, axis: int = -1) -> np.ndarray | torch.Tensor:
    """Optimal SNR of whitened signals: ``rho = sqrt(sum_j w_j^2)`` along ``axis`` (numpy or torch)."""
    if isinstance(whitened, torch.Tensor):
        return torch.linalg.vector_norm(whitened, dim=axis)
    return np.linalg.norm(whitened, axis=axis)


def sample_bbh_parameters(cfg: GWConfig, rng: np.random.Generator) -> dict[str, float]:
    """Draw one binary: masses uniform on ``{mass_min <= m2 <= m1 <= mass_max}``, isotropic
    orientation (``cos(inclination)`` uniform in [-1, 1]) and sky (``ra`` uniform in
    [0, 2pi), ``sin(dec)`` uniform in [-1, 1]), ``polarization`` uniform in [0, pi),
    ``coa_phase`` uniform in [0, 2pi), ``gps_time = REFERENCE_GPS_TIME``; then the spins of
    ``cfg.spins`` (drawn after the rest, so a zero-spin config draws exactly what it always did)."""
    m_a, m_b = rng.uniform(cfg.mass_min, cfg.mass_max, size=2)
    params = {
        "mass1": float(max(m_a, m_b)),
        "mass2": float(min(m_a, m_b)),
        "inclination": float(np.arccos(rng.uniform(-1.0, 1.0))),
        "polarization": float(rng.uniform(0.0, np.pi)),
        "ra": float(rng.uniform(0.0, 2.0 * np.pi)),
        "dec": float(np.arcsin(rng.uniform(-1.0, 1.0))),
        "coa_phase": float(rng.uniform(0.0, 2.0 * np.pi)),
        "gps_time": REFERENCE_GPS_TIME,
    }
    if cfg.spins == "aligned":
        params["spin1z"], params["spin2z"] = (float(v) for v in rng.uniform(-cfg.spin_max, cfg.spin_max, 2))
    elif cfg.spins == "isotropic":
        for body in ("1", "2"):
            a = rng.uniform(0.0, cfg.spin_max)
            cos_polar, azimuth = rng.uniform(-1.0, 1.0), rng.uniform(0.0, 2.0 * np.pi)
            sin_polar = np.sqrt(1.0 - cos_polar**2)
            params[f"spin{body}x"] = float(a * sin_polar * np.cos(azimuth))
            params[f"spin{body}y"] = float(a * sin_polar * np.sin(azimuth))
            params[f"spin{body}z"] = float(a * cos_polar)
    if cfg.psd == CHALLENGE_PSDS:  # each detector one of the challenge's PSDs, drawn last as the spins are
        for det in cfg.network:
            params[f"psd_{det}"] = float(rng.integers(n_challenge_psds()))
    return params


def projected_strain(
    cfg: GWConfig, params: Mapping[str, float], duration: float, sample_rate: float, distance_mpc: float,
    detector: str | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Unwhitened detector strain ``F+ h+(t) + Fx hx(t)`` at ``distance_mpc``, for injections.

    Time domain from ``cfg.f_lower`` via ``pycbc.waveform.get_td_waveform`` (LALSimulation's
    conditioned ``SimInspiralTD``), sampled at ``sample_rate``. Returns
    ``(times [s] relative to the merger t = 0, strain)``, float64, ending at most
    ``POST_MERGER_S`` after the merger and at most ``round(duration * sample_rate)`` samples
    long (a longer inspiral is cut); each cut end gets a ``TAPER_S`` half-Hann taper.
    ``detector`` (default the config's first) sets the antenna pattern; no arrival delay is applied.
    """
    from pycbc.waveform import get_td_waveform

    hp, hc = get_td_waveform(
        **source_arguments(cfg, params, distance_mpc),
        delta_t=1.0 / sample_rate,
        f_lower=cfg.f_lower,
    )
    fplus, fcross = source_antenna_pattern(cfg, params, detector)
    strain = fplus * hp.numpy() + fcross * hc.numpy()
    times = float(hp.start_time) + np.arange(len(strain)) / sample_rate
    # LAL's FD->TD conditioning pads long after the merger; keep POST_MERGER_S of it.
    stop = int(np.searchsorted(times, POST_MERGER_S, side="right"))
    start = max(0, stop - int(round(duration * sample_rate)))
    n_taper = min(int(round(TAPER_S * sample_rate)), (stop - start) // 4)
    ramp = np.sin(0.5 * np.pi * np.arange(n_taper) / max(n_taper, 1)) ** 2
    strain, times = strain[start:stop].copy(), times[start:stop]
    if start > 0:
        strain[:n_taper] *= ramp
    if stop < len(hp) and n_taper > 0:
        strain[-n_taper:] *= ramp[::-1]
    return times, strain
