"""Design noise power spectral densities from LALSuite.

All PSDs here are one-sided, in 1/Hz, sampled on the real-FFT grid
``np.fft.rfftfreq(n_samples, 1 / sample_rate)`` (``n_samples // 2 + 1`` bins,
spacing ``sample_rate / n_samples`` Hz). Bins that must carry no signal (below
the low-frequency cutoff) hold ``np.inf`` so that whitening, which divides by
``sqrt(S)``, sets them to zero.
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np


def available_psds() -> list[str]:
    """Names accepted by :func:`design_psd` (LALSimulation ``SimNoisePSD<name>`` and PyCBC models)."""
    import pycbc.psd

    return sorted(pycbc.psd.get_psd_model_list())


def design_psd(name: str, n_samples: int, sample_rate: float, f_lower: float) -> np.ndarray:
    """One-sided analytic design PSD ``S(f)`` [1/Hz] on the rfft grid of ``n_samples`` at ``sample_rate``.

    The curve is LALSimulation's ``SimNoisePSD<name>`` (e.g. ``aLIGOZeroDetHighPower``,
    LIGO-T0900288) evaluated through ``pycbc.psd.from_string``. Bins with
    ``f < f_lower`` (DC included) and any non-positive values, among them the Nyquist
    bin that LALSimulation leaves at zero, are set to ``np.inf``.

    Returns a read-only float64 array of shape ``(n_samples // 2 + 1,)``; it is
    cached per argument set, so copy it before modifying.
    Raises ``ValueError`` naming the known PSDs when ``name`` is unknown.
    """
    if name == CHALLENGE_PSDS:
        raise ValueError(f"{name!r} names the challenge's PSDs, one per detector and sample: this step needs a "
                         "design PSD by name, or config_psd(name, detector, ...)")
    if name not in available_psds():
        raise ValueError(
            f"unknown PSD {name!r}; use one of LALSimulation's analytic PSDs, e.g. "
            f"'aLIGOZeroDetHighPower' (all: {', '.join(available_psds())})"
        )
    if n_samples < 2 or sample_rate <= 0 or not 0 <= f_lower < sample_rate / 2:
        raise ValueError(
            f"design_psd: need n_samples >= 2, sample_rate > 0 and 0 <= f_lower < Nyquist; "
            f"got n_samples={n_samples}, sample_rate={sample_rate}, f_lower={f_lower}"
        )
    return _cached_design_psd(name, int(n_samples), float(sample_rate), float(f_lower))


@lru_cache(maxsize=32)
def _cached_design_psd(name: str, n_samples: int, sample_rate: float, f_lower: float) -> np.ndarray:
    import pycbc.psd

    n_freq = n_samples // 2 + 1
    delta_f = sample_rate / n_samples
    series = pycbc.psd.from_string(name, n_freq, delta_f, f_lower)
    psd = np.array(series.numpy(), dtype=np.float64)
    freqs = np.fft.rfftfreq(n_samples, 1.0 / sample_rate)
    psd[(freqs < f_lower) | ~(psd > 0)] = np.inf
    psd.setflags(write=False)
    return psd


# -- the MLGWSC-1 challenge's PSDs ------------------------------------------------------------------------------------
CHALLENGE_PSDS = "mlgwsc1"  # GWConfig.psd: each sample's detectors see PSDs drawn from the challenge's own files
CHALLENGE_PSD_FILE = "mlgwsc1_psds.npz"


@lru_cache(maxsize=1)
def _challenge_table() -> tuple[tuple[str, ...], float, np.ndarray]:
    """(detectors, delta_f, psds (D, 20, F)) of ``data/mlgwsc1_psds.npz``: the 20 per-detector PSDs of MLGWSC-1's
    ``psds/H1`` and ``psds/L1`` (``psd-0.hdf`` .. ``psd-19.hdf``; Schäfer et al. 2023, Apache-2.0), which its
    generator colours datasets 2 and 3 with, stored as one array (1 Hz bins from 0 to 1024 Hz)."""
    from importlib.resources import files

    with files("converge.apps.gw").joinpath("data", CHALLENGE_PSD_FILE).open("rb") as f, np.load(f) as z:
        return tuple(str(d) for d in z["detectors"]), float(z["delta_f"]), np.array(z["psd"], dtype=np.float64)


def n_challenge_psds() -> int:
    return _challenge_table()[2].shape[1]


def challenge_psd(detector: str, index: int, n_samples: int, sample_rate: float, f_lower: float) -> np.ndarray:
    """The challenge's PSD ``index`` of ``detector`` interpolated (linearly) onto the rfft grid of ``n_samples`` at
    ``sample_rate``, ``np.inf`` below ``f_lower`` and above the file's last bin, as :func:`design_psd` returns it
    (read-only, cached)."""
    detectors, _, table = _challenge_table()
    if detector not in detectors:
        raise ValueError(f"the challenge ships PSDs for {', '.join(detectors)}, not {detector!r}")
    if not 0 <= index < table.shape[1]:
        raise ValueError(f"challenge PSD index {index}: give 0..{table.shape[1] - 1}")
    return _cached_challenge_psd(detector, int(index), int(n_samples), float(sample_rate), float(f_lower))


@lru_cache(maxsize=128)
def _cached_challenge_psd(detector: str, index: int, n_samples: int, sample_rate: float, f_lower: float) -> np.ndarray:
    from .noise import interpolate_psd

    detectors, delta_f, table = _challenge_table()
    psd = table[detectors.index(detector), index]
    out = interpolate_psd(np.arange(len(psd)) * delta_f, psd, n_samples, sample_rate, f_lower)
    out[~(out > 0)] = np.inf
    out.setflags(write=False)
    return out


def config_psd(name: str, detector: str, n_samples: int, sample_rate: float, f_lower: float,
               index: int = 0) -> np.ndarray:
    """The PSD a config names for ``detector``: a design PSD by name, or with :data:`CHALLENGE_PSDS` the
    challenge's PSD ``index`` of that detector."""
    if name == CHALLENGE_PSDS:
        return challenge_psd(detector, index, n_samples, sample_rate, f_lower)
    return design_psd(name, n_samples, sample_rate, f_lower)
