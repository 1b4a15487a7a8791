"""Full-length templates for a search over continuous strain, and their stochastic placement.

Unlike the window bank of :mod:`.bank` (templates cut to one CNN window), these templates hold
the whole signal from ``f_lower``: face-on ``h+(f)`` of ``cfg.approximant`` (spins zero), with
the merger (FD ``t = 0``) at sample 0 of the inverse FFT, so that a filter output at lag ``tau``
is a merger at data sample ``tau``. For a non-precessing dominant-mode population (MLGWSC-1 DS1)
any orientation's detector response is ``h+`` up to amplitude and phase, so face-on templates
and a phase-maximised filter lose nothing.

Match. ``M(h1, h2) = max_t |sum_{f>0} h1 conj(h2) / S e^{2 pi i f t}| / (|h1| |h2|)`` with the
design PSD ``S`` (maximised over time and phase), on an FFT of :data:`MATCH_FFT_S` seconds.
Placement (Harry, Allen & Sathyaprakash 2009, arXiv:0908.2090): propose masses from the
population, keep a proposal whose best match to the bank is below ``min_match``, stop after
``max_rejections`` consecutive covered proposals; the ``neighbours`` closest templates in
(ln Mc, eta) are tried first, the whole bank only when none of them covers the proposal.
"""
from __future__ import annotations

import argparse
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from .bank import DATA_DIR, chirp_mass_eta, nearest_templates, read_bank, write_bank
from .config import GWConfig
from .psd import config_psd
from .waveforms import sample_bbh_parameters

MATCH_FFT_S = 16.0  # s: longer than the longest DS1 template (10+10 Msun from 20 Hz: about 6 s)
FULL_FIELDS = ("sample_rate", "f_lower", "psd", "approximant", "mass_min", "mass_max", "spins", "mode_array")


def chirp_time(mass1: float, mass2: float, f_lower: float) -> float:
    """Newtonian time to merger [s] from ``f_lower``: ``tau0 = 5 / (256 pi f) (pi G Mc f / c^3)^(-5/3)``."""
    mc, _ = chirp_mass_eta(np.array([mass1, mass2], dtype=np.float64))
    t_sun = 4.925491025543576e-06  # G Msun / c^3 [s]
    return float(5.0 / (256.0 * np.pi * f_lower) * (np.pi * t_sun * mc * f_lower) ** (-5.0 / 3.0))


def template_spectrum(cfg: GWConfig, mass1: float, mass2: float, n_fft: int) -> np.ndarray:
    """Face-on ``fs h+(f)`` on ``rfftfreq(n_fft, 1/fs)`` (the DFT of the sampled template), complex128."""
    from pycbc.waveform import get_fd_waveform

    hp, _ = get_fd_waveform(approximant=cfg.approximant, mass1=float(mass1), mass2=float(mass2), distance=1.0,
                            delta_f=cfg.sample_rate / n_fft, f_lower=cfg.f_lower, f_final=cfg.sample_rate / 2.0)
    out = np.zeros(n_fft // 2 + 1, dtype=np.complex128)
    k = min(len(out), len(hp))
    out[:k] = hp.numpy()[:k]
    return out * cfg.sample_rate


def whitened_spectra(cfg: GWConfig, masses: np.ndarray, n_fft: int, gain: np.ndarray) -> torch.Tensor:
    """Unit-norm whitened template spectra ``h(f) g(f)`` (T, n_fft // 2 + 1), complex64; ``gain`` the
    whitening gain on the same grid (zero outside the band)."""
    rows = np.stack([template_spectrum(cfg, m1, m2, n_fft) * gain for m1, m2 in masses])
    norm = np.sqrt(2.0 * np.sum(np.abs(rows[:, 1:]) ** 2, axis=1) / n_fft)  # ||t_w|| over the n_fft samples
    return torch.as_tensor(rows / norm[:, None], dtype=torch.complex64)


def analytic_correlation(data_fft: torch.Tensor, spectra: torch.Tensor, n_fft: int) -> torch.Tensor:
    """Complex filter output ``z = a + i b`` (T, n_fft): ``a[tau] = sum_n x[n + tau] t[n]`` with the unit-norm
    template ``t`` and ``b`` the same for its quadrature, from ``rfft(x)`` (F,) and template spectra (T, F).
    ``|z|`` is the SNR maximised over phase (both quadratures have unit norm)."""
    half = data_fft[None, :] * spectra.conj()  # (T, F)
    full = torch.zeros(spectra.shape[0], n_fft, dtype=half.dtype)
    full[:, 1:n_fft // 2] = 2.0 * half[:, 1:n_fft // 2]  # positive frequencies only: the analytic signal
    return torch.fft.ifft(full, dim=-1)


def bank_matches(proposal: torch.Tensor, spectra: torch.Tensor, n_fft: int) -> np.ndarray:
    """Match of a unit-norm whitened spectrum (F,) against each of ``spectra`` (T, F), maximised over time and
    phase: ``max_tau |z|`` of the one filtering the other, (T,)."""
    if len(spectra) == 0:
        return np.zeros(0)
    z = analytic_correlation(proposal, spectra, n_fft)
    return z.abs().amax(dim=-1).numpy().astype(np.float64)


def place_full_bank(cfg: GWConfig, min_match: float = 0.97, seed: int = 0, max_rejections: int = 2000,
                    neighbours: int = 32, progress=None) -> np.ndarray:
    """Stochastic placement of full-length templates (module docstring); masses (T, 2), ``m1 >= m2``."""
    n_fft = int(MATCH_FFT_S * cfg.sample_rate)
    psd = config_psd(cfg.psd, cfg.network[0], n_fft, cfg.sample_rate, cfg.f_lower)
    gain = 1.0 / np.sqrt(psd * cfg.sample_rate / 2.0)  # inf bins -> 0
    rng = np.random.default_rng(seed)
    masses = np.zeros((0, 2))
    spectra = torch.zeros(0, n_fft // 2 + 1, dtype=torch.complex64)
    rejected = proposals = 0
    while rejected < max_rejections:
        p = sample_bbh_parameters(cfg, rng)
        proposals += 1
        s = whitened_spectra(cfg, np.array([[p["mass1"], p["mass2"]]]), n_fft, gain)[0]
        if len(masses):
            near = nearest_templates(masses, p["mass1"], p["mass2"], neighbours)
            best = bank_matches(s, spectra[torch.as_tensor(near)], n_fft).max()
            if best < min_match and len(masses) > neighbours:
                best = bank_matches(s, spectra, n_fft).max()
            if best >= min_match:
                rejected += 1
                continue
        rejected = 0
        masses = np.vstack([masses, [p["mass1"], p["mass2"]]])
        spectra = torch.cat([spectra, s[None]])
        if progress is not None:
            progress(proposals, len(masses))
    return masses


def full_bank_path(cfg: GWConfig, min_match: float = 0.97) -> Path:
    """Path of the shipped full-length bank for ``cfg``'s population."""
    return DATA_DIR / f"fullbank_{cfg.approximant}_{cfg.mass_min:g}-{cfg.mass_max:g}_mm{min_match:g}.json"


def load_full_bank(cfg: GWConfig, path: Path | None = None, min_match: float = 0.97) -> tuple[np.ndarray, dict]:
    """(masses (T, 2), record) of the full-length bank for ``cfg``, refused if placed for another population."""
    path = Path(path) if path else full_bank_path(cfg, min_match)
    how = "place one with `python -m converge.apps.gw.fullbank --dataset 1 --out PATH`"
    if not path.is_file():
        raise ValueError(f"no full-length template bank at {path}; {how}")
    record = read_bank(path)
    stored = record.get("population", {})
    wrong = [f"{k}={getattr(cfg, k)!r} (bank: {stored.get(k)!r})" for k in FULL_FIELDS
             if _plain(stored.get(k)) != _plain(getattr(cfg, k))]
    if wrong:
        raise ValueError(f"template bank {path} was placed for another population: {', '.join(wrong)}; {how}")
    return np.asarray(record["masses"], dtype=np.float64), record


def _plain(value):
    return list(value) if isinstance(value, (tuple, list)) else value


def main(argv: Sequence[str] | None = None) -> None:
    """Place a full-length bank for an MLGWSC-1 population and write its JSON."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--dataset", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--min-match", type=float, default=0.97)
    parser.add_argument("--max-rejections", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    cfg = GWConfig.mlgwsc1(args.dataset)
    t0 = time.perf_counter()
    masses = place_full_bank(cfg, args.min_match, args.seed, args.max_rejections,
                             progress=lambda p, t: print(f"proposals {p:6d}  templates {t:5d}", flush=True))
    from importlib.metadata import version

    placement = {"method": "stochastic, full-length templates (converge.apps.gw.fullbank.place_full_bank)",
                 "seed": args.seed, "max_rejections": args.max_rejections, "match_fft_s": MATCH_FFT_S,
                 "seconds": round(time.perf_counter() - t0, 1),
                 "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                 "versions": {name: version(name) for name in ("lalsuite", "pycbc", "numpy", "torch")}}
    population = {k: _plain(getattr(cfg, k)) for k in FULL_FIELDS}
    record = write_bank(args.out or full_bank_path(cfg, args.min_match), cfg, masses, args.min_match,
                        kind="full-length", population=population, placement=placement)
    print({k: v for k, v in record.items() if k != "masses"})


if __name__ == "__main__":
    main()
