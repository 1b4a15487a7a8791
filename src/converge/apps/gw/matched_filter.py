"""Matched filtering of whitened windows against a template bank (the classical baseline).

Everything is in the whitened domain (see ``noise``): a window ``x`` of ``N`` samples
is correlated with each template's two whitened quadratures ``t_0`` (face-on ``h_+``)
and ``t_1`` (the same signal shifted by 90 degrees in phase: ``i h_+(f)``).

Template layout. A template is ``N`` samples long with its merger at sample
``m_t = N - tail``, ``tail = max(N - round(merger_max fs), round(MIN_POST_MERGER_S fs))``:
it holds all the inspiral a window can contain before a merger at ``merger_max`` and
the ringdown after it. For a merger at window sample ``m`` (shift ``tau = m - m_t``)

    a(tau) = sum_j x[j + tau] t_0[j],   b(tau) = sum_j x[j + tau] t_1[j],

where ``x`` is zero outside ``[0, N)``: the window is zero-padded to an FFT length
``L >= N + |tau|`` so the circular FFT correlation never wraps around. The part of the
signal before the window (or the template samples falling outside it) simply does
not contribute: the statistic is normalised *per shift* by the Gram matrix ``G(tau)``
of the template samples that overlap the window,

    rho^2(tau) = [a b] G(tau)^-1 [a b]^T,   G_kl(tau) = sum_{j: 0 <= j + tau < N} t_k[j] t_l[j],

i.e. the phase- and amplitude-maximised SNR over the two quadratures. In whitened
noise ``a / sqrt(G_00)`` and ``b / sqrt(G_11)`` are N(0, 1) at every shift and
``rho^2`` is chi^2 with 2 degrees of freedom; for a signal identical to the
template, ``rho`` equals the signal's optimal SNR inside the window. Where the
template fully overlaps the window this is the usual ``|<x, t_0 + i t_1>|`` with
the normalisation of PyCBC's ``matched_filter``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from .config import GWConfig
from .waveforms import fd_polarizations, whitened_span

MIN_POST_MERGER_S = 0.05  # ringdown kept after the merger; whitened 95+95 Msun ringdown keeps <1e-3 of SNR^2 beyond
# Complex elements of one (batch, templates, L) chunk: 2 MiB of complex64 stays in a CPU's L2
# cache, which measured ~2x faster than 32 MiB chunks on one thread.
CHUNK_ELEMENTS = 1 << 18


class MatchedFilterResult(NamedTuple):
    """Per window: best SNR, its template (row of ``bank.masses``) and merger sample in the window."""

    snr: torch.Tensor  # (B,) float32
    template_index: torch.Tensor  # (B,) int64
    time_index: torch.Tensor  # (B,) int64


def template_merger_index(cfg: GWConfig) -> int:
    """Sample ``m_t`` of the merger in a window-length template (see the module docstring)."""
    n = cfg.window_samples
    tail = max(n - int(round(cfg.merger_max * cfg.sample_rate)), int(round(MIN_POST_MERGER_S * cfg.sample_rate)))
    return n - min(tail, n)


def default_valid(cfg: GWConfig) -> tuple[int, int]:
    """Merger samples searched by default: ``[round(merger_min fs), round(merger_max fs)]`` as a half-open range."""
    n = cfg.window_samples
    return int(round(cfg.merger_min * cfg.sample_rate)), min(int(round(cfg.merger_max * cfg.sample_rate)) + 1, n)


def fft_length(n_window: int, max_abs_shift: int) -> int:
    """Smallest ``2^a 3^b`` (fast FFT size) that is ``>= n_window + max_abs_shift`` (no wrap-around)."""
    need = n_window + max_abs_shift
    best = 1 << int(np.ceil(np.log2(need)))
    p3 = 1
    while p3 < best:
        size = p3 * (1 << max(0, int(np.ceil(np.log2(need / p3)))))
        best = min(best, size)
        p3 *= 3
    return best


def whitened_quadratures(cfg: GWConfig, mass1: float, mass2: float) -> np.ndarray:
    """The two whitened quadratures of a face-on template, float64 ``(2, N)``, merger at
    :func:`template_merger_index`; row 0 has unit norm, row 1 the same scale."""
    hp, _ = fd_polarizations(cfg, {"mass1": mass1, "mass2": mass2})
    m_t = template_merger_index(cfg)
    after = cfg.window_samples - m_t
    pair = np.stack([whitened_span(cfg, h, before=m_t, after=after) for h in (hp, 1j * hp)])
    return pair / np.linalg.norm(pair[0])


def overlap_gram(templates: np.ndarray, shifts: np.ndarray) -> np.ndarray:
    """Gram matrices of the template samples overlapping a window at each shift.

    ``templates`` (T, 2, N); ``shifts`` (S,) integer ``tau``; returns (T, 3, S) with rows
    ``G_00, G_01, G_11`` summed over ``j`` with ``0 <= j + tau < N``.
    """
    n = templates.shape[-1]
    products = np.stack([templates[:, 0] ** 2, templates[:, 0] * templates[:, 1], templates[:, 1] ** 2], axis=1)
    cumulative = np.concatenate([np.zeros(products.shape[:2] + (1,)), np.cumsum(products, axis=-1)], axis=-1)
    lo, hi = np.clip(-shifts, 0, n), np.clip(n - shifts, 0, n)
    return cumulative[..., hi] - cumulative[..., lo]


def inverse_gram_coefficients(gram: np.ndarray) -> np.ndarray:
    """``(c_aa, c_ab, c_bb)`` with ``rho^2 = c_aa a^2 + c_ab a b + c_bb b^2 = [a b] G^-1 [a b]^T``; (T, 3, S)."""
    g00, g01, g11 = gram[:, 0], gram[:, 1], gram[:, 2]
    det = g00 * g11 - g01**2
    return np.stack([g11 / det, -2.0 * g01 / det, g00 / det], axis=1)


@dataclass(frozen=True, eq=False)
class TemplateBank:
    """Whitened templates of a GWConfig and their precomputed filter spectra.

    ``masses`` (T, 2) [Msun]; ``templates`` (T, 2, N) float32 quadratures (row 0 unit
    norm); ``spectra`` (T, L) complex64 ``conj(FFT t_0) + i conj(FFT t_1)`` times the phase
    ramp that makes output sample ``k`` the merger at window sample ``valid[0] + k``;
    ``coefficients`` (T, 3, n_valid) float32 inverse-Gram terms; ``valid`` the half-open
    range of merger samples searched.
    """

    cfg: GWConfig
    masses: np.ndarray
    templates: torch.Tensor
    spectra: torch.Tensor
    coefficients: torch.Tensor
    valid: tuple[int, int]
    merger_index: int
    fft_len: int

    def __len__(self) -> int:
        return len(self.masses)

    def concat(self, other: "TemplateBank") -> "TemplateBank":
        """This bank followed by ``other`` (built for the same config and valid range)."""
        if other.cfg != self.cfg or other.valid != self.valid:
            raise ValueError("can only concatenate banks built for the same GWConfig and valid range")
        return TemplateBank(self.cfg, np.concatenate([self.masses, other.masses]),
                            torch.cat([self.templates, other.templates]), torch.cat([self.spectra, other.spectra]),
                            torch.cat([self.coefficients, other.coefficients]), self.valid, self.merger_index,
                            self.fft_len)

    def to(self, device: torch.device | str) -> "TemplateBank":
        """The bank with its tensors on ``device`` (do this once; filtering a GPU batch with a CPU bank
        copies the spectra on every call)."""
        return TemplateBank(self.cfg, self.masses, self.templates.to(device), self.spectra.to(device),
                            self.coefficients.to(device), self.valid, self.merger_index, self.fft_len)

    def select(self, indices: np.ndarray | list[int]) -> "TemplateBank":
        """The sub-bank of templates ``indices`` (no recomputation)."""
        idx = np.asarray(indices, dtype=np.int64)
        rows = torch.as_tensor(idx)
        return TemplateBank(self.cfg, self.masses[idx], self.templates[rows], self.spectra[rows],
                            self.coefficients[rows], self.valid, self.merger_index, self.fft_len)

    @classmethod
    def from_masses(
        cls, cfg: GWConfig, masses: np.ndarray, valid: tuple[int, int] | None = None
    ) -> "TemplateBank":
        """Build the bank for ``masses`` (T, 2) [Msun]; ``valid`` defaults to :func:`default_valid`."""
        masses = np.asarray(masses, dtype=np.float64).reshape(-1, 2)
        templates = np.stack([whitened_quadratures(cfg, m1, m2) for m1, m2 in masses]) if len(masses) else np.zeros(
            (0, 2, cfg.window_samples)
        )
        return cls.from_templates(cfg, masses, templates, valid)

    @classmethod
    def from_templates(
        cls, cfg: GWConfig, masses: np.ndarray, templates: np.ndarray, valid: tuple[int, int] | None = None
    ) -> "TemplateBank":
        """Build the bank from precomputed quadratures ``templates`` (T, 2, N)."""
        n = cfg.window_samples
        start, stop = default_valid(cfg) if valid is None else (int(valid[0]), int(valid[1]))
        if not 0 <= start < stop <= n:
            raise ValueError(f"valid merger range ({start}, {stop}) must satisfy 0 <= start < stop <= {n}")
        m_t = template_merger_index(cfg)
        shifts = np.arange(start, stop) - m_t
        fft_len = fft_length(n, int(np.abs(shifts).max()))
        spectra = np.conj(np.fft.fft(templates[:, 0], fft_len)) + 1j * np.conj(np.fft.fft(templates[:, 1], fft_len))
        spectra *= np.exp(2j * np.pi * np.arange(fft_len) * shifts[0] / fft_len)
        gram = overlap_gram(templates, shifts)
        return cls(
            cfg=cfg,
            masses=np.asarray(masses, dtype=np.float64).reshape(-1, 2),
            templates=torch.as_tensor(templates, dtype=torch.float32),
            spectra=torch.as_tensor(spectra, dtype=torch.complex64),
            coefficients=torch.as_tensor(inverse_gram_coefficients(gram), dtype=torch.float32),
            valid=(start, stop),
            merger_index=m_t,
            fft_len=fft_len,
        )


def correlate(
    windows_fft: torch.Tensor, spectra: torch.Tensor, n_valid: int, out: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quadrature correlations ``(a, b)``, each (B, T, n_valid), from the data FFT (B, L) and
    bank spectra (T, L); ``out`` is an optional (B, T, L) complex64 work buffer."""
    product = torch.mul(windows_fft[:, None, :], spectra[None], out=out)  # (B, T, L)
    z = torch.fft.ifft(product, dim=-1)[..., :n_valid]
    return z.real, z.imag


def snr_squared(a: torch.Tensor, b: torch.Tensor, coefficients: torch.Tensor) -> torch.Tensor:
    """``rho^2 = c_aa a^2 + c_ab a b + c_bb b^2`` (B, T, S) with ``coefficients`` (T, 3, S)."""
    rho2 = coefficients[:, 0] * a
    rho2.mul_(a).addcmul_(coefficients[:, 1] * a, b).addcmul_(coefficients[:, 2] * b, b)
    return rho2


def matched_filter_snr(
    windows: torch.Tensor, bank: TemplateBank, valid: tuple[int, int] | None = None, chunk: int | None = None
) -> MatchedFilterResult:
    """Matched-filter SNR of whitened windows (B, N): max over templates and merger samples of ``rho``.

    ``valid`` (half-open merger-sample range) must lie inside ``bank.valid`` (default: all of
    it). Runs in float32 on ``windows``' device: one FFT of the zero-padded windows, then per
    chunk of ``chunk`` templates (default: :data:`CHUNK_ELEMENTS` worth) a broadcast complex
    product, one inverse complex FFT and the inverse-Gram quadratic form. Returns a
    :class:`MatchedFilterResult` (merger samples counted from the window start).
    """
    start, stop = bank.valid if valid is None else valid
    if not bank.valid[0] <= start < stop <= bank.valid[1]:
        raise ValueError(f"valid={valid} is outside the bank's searched range {bank.valid}; rebuild it with that range")
    if windows.ndim != 2 or windows.shape[-1] != bank.cfg.window_samples:
        raise ValueError(f"windows must be (B, {bank.cfg.window_samples}), got {tuple(windows.shape)}")
    if len(bank) == 0:
        raise ValueError("the template bank is empty")
    n_windows, device = windows.shape[0], windows.device
    lo, hi = start - bank.valid[0], stop - bank.valid[0]
    data_fft = torch.fft.fft(windows.to(torch.float32), n=bank.fft_len, dim=-1)  # (B, L)
    chunk = chunk or max(1, CHUNK_ELEMENTS // (n_windows * bank.fft_len))
    work = torch.empty(n_windows, min(chunk, len(bank)), bank.fft_len, dtype=torch.complex64, device=device)
    best = torch.full((n_windows,), -1.0, device=device)
    best_template = torch.zeros(n_windows, dtype=torch.int64, device=device)
    best_time = torch.zeros(n_windows, dtype=torch.int64, device=device)
    for first in range(0, len(bank), chunk):
        spectra = bank.spectra[first : first + chunk].to(device)
        coefficients = bank.coefficients[first : first + chunk, :, lo:hi].to(device)
        a, b = correlate(data_fft, spectra, hi, out=work[:, : len(spectra)])
        rho2 = snr_squared(a[..., lo:], b[..., lo:], coefficients)  # (B, T, S)
        value, flat = rho2.flatten(1).max(dim=1)
        better = value > best
        best = torch.where(better, value, best)
        best_template = torch.where(better, first + flat // rho2.shape[-1], best_template)
        best_time = torch.where(better, start + flat % rho2.shape[-1], best_time)
    return MatchedFilterResult(best.clamp_min(0).sqrt(), best_template, best_time)
