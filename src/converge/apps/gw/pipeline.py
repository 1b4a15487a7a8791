"""The gw data pipeline: stored waveforms + fresh noise, time shift and SNR.

The ensemble stores only the expensive part, whitened detector responses to
binary-black-hole waveforms. Everything cheap is drawn afresh for every batch
(and every epoch): Gaussian noise coloured by the design PSD and whitened by the
same PSD, the merger time inside the window, and the optimal SNR the signal is
scaled to. Fixed sources (validation, test) draw the same numbers every epoch.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Iterator

import torch

from ...data.sources import stream_seed
from .config import GWConfig
from .noise import whiten
from .psd import config_psd


def colored_noise_torch(psd: torch.Tensor, n: int, batch: int, sample_rate: float, g: torch.Generator) -> torch.Tensor:
    """Stationary Gaussian noise of one-sided PSD ``psd`` (1/Hz on the rfft grid).

    X_k = sqrt(N fs S_k / 4) (a + i b) with a, b ~ N(0, 1) gives
    E|X_k|^2 = N fs S_k / 2, the DFT of a series of one-sided PSD S (bins where
    S is infinite, below f_lower, carry no noise: whitening zeroes them anyway).
    Returns (batch, n) float32.
    """
    amp = torch.sqrt(torch.where(torch.isfinite(psd), psd, torch.zeros_like(psd)) * n * sample_rate / 4)
    re = torch.randn(batch, psd.shape[-1], generator=g)
    im = torch.randn(batch, psd.shape[-1], generator=g)
    return torch.fft.irfft(torch.complex(re, im) * amp, n=n).float()  # (B, N)


@lru_cache(maxsize=8)
def window_psd(cfg: GWConfig) -> torch.Tensor:
    """The config's PSD on the rfft grid of one window, as a tensor (training noise is coloured and whitened by
    it, so it leaves white noise; with the challenge's PSDs, its first one of the first detector)."""
    return torch.tensor(config_psd(cfg.psd, cfg.network[0], cfg.window_samples, cfg.sample_rate, cfg.f_lower))


def whitened_noise(cfg: GWConfig, batch: int, g: torch.Generator) -> torch.Tensor:
    """Design-PSD noise, whitened by the same PSD: (batch, window_samples), or (batch, D, window_samples)
    for a network (independent noise in each detector)."""
    psd = window_psd(cfg)
    n_det = len(cfg.network) if cfg.coherent else 1
    noise = colored_noise_torch(psd, cfg.window_samples, batch * n_det, cfg.sample_rate, g)
    white = whiten(noise, psd, cfg.sample_rate).float()
    return white.reshape(batch, n_det, cfg.window_samples) if cfg.coherent else white


def crop_windows(signals: torch.Tensor, offsets: torch.Tensor, n: int) -> torch.Tensor:
    """Windows ``signals[i, ..., offsets[i] : offsets[i] + n]``: (B, L) -> (B, n), or (B, D, L) -> (B, D, n)
    with the same offset in every detector (their relative delays are kept)."""
    idx = offsets.unsqueeze(1) + torch.arange(n).unsqueeze(0)  # (B, n)
    if signals.dim() == 3:
        idx = idx.unsqueeze(1).expand(-1, signals.shape[1], -1)  # (B, D, n)
        return torch.gather(signals, 2, idx)
    return torch.gather(signals, 1, idx)


def scale_to_snr(windows: torch.Tensor, snr: torch.Tensor) -> torch.Tensor:
    """Rescale whitened windows so each has optimal SNR ``snr`` (its L2 norm; over all detectors of a
    (B, D, n) network window: the network SNR)."""
    dims = tuple(range(1, windows.dim()))
    norm = torch.linalg.vector_norm(windows, dim=dims, keepdim=True).clamp_min(1e-12)
    return windows * (snr.reshape(-1, *([1] * len(dims))) / norm)


def signal_windows(
    cfg: GWConfig, signals: torch.Tensor, snr: torch.Tensor, g: torch.Generator
) -> torch.Tensor:
    """Whitened signals cropped at a random merger time and scaled to ``snr``."""
    span = signals.shape[-1] - cfg.window_samples
    offsets = torch.randint(0, span + 1, (signals.shape[0],), generator=g)
    return scale_to_snr(crop_windows(signals, offsets, cfg.window_samples), snr)


@dataclass
class WindowSource:
    """Labelled windows, half signal (by ``cfg.signal_fraction``) and half noise.

    Each epoch sees every stored signal once, in a fresh random crop at a fresh
    SNR drawn uniformly from ``snr_range``, plus ``len - n_signals`` noise-only
    windows. With ``fixed`` the numbers do not change between epochs.
    """

    cfg: GWConfig
    signals: torch.Tensor  # (M, L) float32, unit optimal SNR
    seed: int
    fixed: bool = False
    snr_range: tuple[float, float] | None = None

    def __post_init__(self) -> None:
        if self.snr_range is None:
            self.snr_range = (self.cfg.snr_min, self.cfg.snr_max)

    def __len__(self) -> int:
        return int(round(len(self.signals) / self.cfg.signal_fraction))

    def batches(self, epoch: int, batch_size: int, rank: int = 0, world: int = 1) -> Iterator[dict[str, torch.Tensor]]:
        e = 0 if self.fixed else epoch
        order = torch.randperm(len(self), generator=torch.Generator().manual_seed(stream_seed(self.seed, e)))
        order = order[rank::world]
        g = torch.Generator().manual_seed(stream_seed(self.seed, e, rank, 1))
        lo, hi = self.snr_range  # type: ignore[misc]
        m = len(self.signals)
        for start in range(0, len(order), batch_size):
            idx = order[start : start + batch_size]
            is_signal = idx < m
            x = whitened_noise(self.cfg, len(idx), g)
            snr = torch.zeros(len(idx))
            n_sig = int(is_signal.sum())
            if n_sig:
                snr[is_signal] = lo + (hi - lo) * torch.rand(n_sig, generator=g)
                x[is_signal] += signal_windows(self.cfg, self.signals[idx[is_signal]], snr[is_signal], g)
            yield {"input": x, "label": is_signal.float(), "snr": snr}
