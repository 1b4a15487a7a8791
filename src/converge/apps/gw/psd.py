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
