"""The classical baseline as a real search: per-detector matched filtering, coincidence, time slides.

Per detector (over data whitened exactly as for the CNN, :mod:`.conditioning`):

- the whitened templates ``t = irfft(h(f) G(f))`` of the full-length bank (:mod:`.fullbank`), ``G``
  the frequency response of the segment's whitening filter, each scaled to unit norm, so that in
  whitened noise both quadratures are N(0, 1) and ``rho = |z|`` (:func:`.fullbank.analytic_correlation`)
  is the phase-maximised SNR;
- overlap-save blocks of ``fft_s`` seconds: a block's outputs are the lags whose template lies wholly
  inside it, less ``cluster_s / 2`` either side so that clustering sees every neighbour;
- triggers: per template, samples with ``rho > snr_threshold`` that are the largest within
  ``cluster_s / 2`` either side (exactly what the whole series would give: tested);
- cached per detector and piece of ``piece_s`` seconds (``.npz``, written atomically), keyed by the
  data file, the bank and these settings, so a rerun resumes where it stopped.

Then, for slide 0 (the foreground) or slides 1..N (the background, :mod:`.slides`): coincidences of
the same template in both detectors within the light travel time plus ``coinc_margin_s``, ranked by
the network SNR ``sqrt(rho_H^2 + rho_L^2)``, the loudest kept within ``cluster_s``. The event time is
the mean of the two detectors' merger times, less the measured bias (:mod:`.timing`). A chi-squared
veto is left out: on Gaussian noise (MLGWSC-1 datasets 1-3) it has no glitches to remove.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ...data.atomic import atomic_write_bytes, json_bytes
from .conditioning import Conditioning, WhitenedSegment, whiten_strain_set
from .config import GWConfig
from .datafile import StrainSet, open_strain
from .events import keep_loudest_within, write_events
from .fullbank import analytic_correlation, chirp_time, load_full_bank, template_spectrum
from .search import SearchConfig, _Bar, _summary, check_data
from .slides import LIGHT_TRAVEL_H1_L1_S, background_seconds, slide_shifts, unslid_index
from .timing import read_timing

POST_MERGER_S = 0.25  # template samples kept after the merger (the ringdown has long decayed)


@dataclass(frozen=True)
class FilterConfig:
    """Settings of the per-detector filter and the coincidence."""

    snr_threshold: float = 5.0
    cluster_s: float = 1.0
    fft_s: float = 32.0
    template_batch: int = 32
    coinc_margin_s: float = 0.005  # beyond the light travel time: the triggers' own timing error
    piece_s: float = 1024.0  # cache granularity

    def key(self) -> dict:
        return {k: v for k, v in asdict(self).items() if k not in ("template_batch", "coinc_margin_s")}


class TemplateSet:
    """The bank's raw template spectra ``fs h(f)`` (T, F) on the filter's FFT grid, built once."""

    def __init__(self, cfg: GWConfig, masses: np.ndarray, n_fft: int, sha256: str,
                 filter_half_s: float = Conditioning().pad_s) -> None:
        self.cfg, self.masses, self.n_fft, self.sha256 = cfg, masses, n_fft, sha256
        self.spectra = torch.as_tensor(np.stack([template_spectrum(cfg, m1, m2, n_fft) for m1, m2 in masses]),
                                       dtype=torch.complex64)
        # a whitened template reaches the whitening filter's half length beyond the waveform on both sides
        longest = 1.1 * max(chirp_time(m1, m2, cfg.f_lower) for m1, m2 in masses) + 0.5
        self.pre = int(np.ceil((longest + filter_half_s) * cfg.sample_rate))
        self.post = int(np.ceil((POST_MERGER_S + filter_half_s) * cfg.sample_rate))
        if self.pre + self.post >= 3 * n_fft // 4:
            raise ValueError(f"templates of {self.pre / cfg.sample_rate:.1f} s do not fit an FFT of "
                             f"{n_fft / cfg.sample_rate:g} s with room to spare; raise FilterConfig.fft_s")

    def whitened(self, fir: np.ndarray, batch: int = 32) -> torch.Tensor:
        """Unit-norm whitened spectra (T, F) for a whitening filter ``fir`` (its frequency response is real).

        Each whitened template is cut to its ``pre`` samples before and ``post`` after the merger (what is
        beyond is the faint ringing of the band edge, < 1e-3 of its norm), so that a block's output never
        depends on data outside the block: the search is then exactly independent of where blocks start.
        """
        h = len(fir) // 2
        kernel = np.zeros(self.n_fft)
        kernel[:h + 1], kernel[-h:] = fir[h:], fir[:h]
        gain = torch.as_tensor(np.fft.rfft(kernel).real, dtype=torch.float32)
        out = torch.empty_like(self.spectra)
        for first in range(0, len(self.spectra), batch):
            td = torch.fft.irfft(self.spectra[first:first + batch] * gain, n=self.n_fft)  # (B, n), merger at 0
            td[:, self.post:self.n_fft - self.pre] = 0.0
            td /= torch.linalg.vector_norm(td, dim=1, keepdim=True)
            out[first:first + batch] = torch.fft.rfft(td)
        return out


def local_maxima(template: np.ndarray, lag: np.ndarray, snr: np.ndarray, half_window: int) -> np.ndarray:
    """Mask of the points that are the largest ``snr`` of their template within ``half_window`` lags either side.

    Given every above-threshold sample, this is exact: a louder neighbour of an above-threshold sample is
    itself above the threshold.
    """
    key = template.astype(np.int64) * (int(lag.max(initial=0)) + 4 * half_window + 1) + lag
    order = np.argsort(key, kind="stable")
    key, values = key[order], snr[order]
    lo = np.searchsorted(key, key - half_window, side="left")
    hi = np.searchsorted(key, key + half_window, side="right")
    keep = np.empty(len(key), dtype=bool)
    for i in range(len(key)):  # few points: samples above an SNR threshold are rare in noise
        keep[i] = values[i] >= values[lo[i]:hi[i]].max()
    mask = np.empty(len(key), dtype=bool)
    mask[order] = keep
    return mask


def block_triggers(x: np.ndarray, spectra: torch.Tensor, n_fft: int, lo: int, hi: int, threshold: float,
                   half_window: int, batch: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Triggers (template, lag, snr) of one whitened block ``x`` (n_fft,) at lags ``[lo, hi)`` of the block:
    above ``threshold`` and the largest within ``half_window`` samples (looked for over ``[lo - hw, hi + hw)``)."""
    data_fft = torch.fft.rfft(torch.as_tensor(x, dtype=torch.float32))
    work = torch.zeros(min(batch, len(spectra)), n_fft, dtype=torch.complex64)  # negative frequencies stay 0
    found_t, found_k, found_s = [], [], []
    positive = slice(1, n_fft // 2)
    for first in range(0, len(spectra), batch):
        rows = spectra[first:first + batch]
        buf = work[:len(rows)]
        torch.mul(data_fft[None, positive], rows[:, positive].conj(), out=buf[:, positive])
        buf[:, positive] *= 2.0  # the analytic signal: z = a + i b (see fullbank.analytic_correlation)
        z = torch.fft.ifft(buf, dim=-1)[:, lo - half_window:hi + half_window]
        rho2 = z.real.square() + z.imag.square()
        t, k = torch.nonzero(rho2 > threshold**2, as_tuple=True)
        found_t.append(t.numpy() + first)
        found_k.append(k.numpy() + lo - half_window)
        found_s.append(rho2[t, k].sqrt().numpy())
    t, k, snr = np.concatenate(found_t), np.concatenate(found_k), np.concatenate(found_s)
    keep = local_maxima(t, k, snr, half_window) & (k >= lo) & (k < hi)
    return t[keep].astype(np.int32), k[keep].astype(np.int64), snr[keep].astype(np.float32)


def filter_triggers(x_all: np.ndarray, spectra: torch.Tensor, templates: "TemplateSet", fcfg: FilterConfig,
                    start: int, stop: int, sample_rate: float, progress=None) -> dict[str, np.ndarray]:
    """Triggers with merger samples in ``[start, stop)`` of the whitened series ``x_all`` (zero outside it),
    filtered with the whitened ``spectra`` in overlap-save blocks (module docstring)."""
    n_fft = templates.n_fft
    hw = int(round(fcfg.cluster_s / 2 * sample_rate))
    lo, hi = templates.pre + hw, n_fft - templates.post - hw  # block lags with a whole template and neighbours
    parts = []
    for out0 in range(start, stop, hi - lo):
        out1 = min(out0 + hi - lo, stop)
        b0 = out0 - lo
        block = np.zeros(n_fft, dtype=np.float32)
        s0, s1 = max(b0, 0), min(b0 + n_fft, len(x_all))
        block[s0 - b0:s1 - b0] = x_all[s0:s1]
        t, k, s = block_triggers(block, spectra, n_fft, lo, lo + out1 - out0, fcfg.snr_threshold, hw,
                                 fcfg.template_batch)
        parts.append((t, k + b0, s))
        if progress is not None:
            progress(out1 - out0)
    template, sample, snr = (np.concatenate(column) for column in zip(*parts)) if parts else (np.zeros(0),) * 3
    return {"template": template.astype(np.int32), "sample": sample.astype(np.int64), "snr": snr.astype(np.float32)}


def detector_triggers(seg: WhitenedSegment, det: str, templates: "TemplateSet", fcfg: FilterConfig, start: int,
                      stop: int, progress=None) -> dict[str, np.ndarray]:
    """Triggers of ``det`` with merger samples in ``[start, stop)`` of the segment."""
    return filter_triggers(seg.channels[det], templates.whitened(seg.fir[det]), templates, fcfg, start, stop,
                           seg.sample_rate, progress)


def coincidences(h: dict[str, np.ndarray], l: dict[str, np.ndarray], window: int) -> dict[str, np.ndarray]:
    """Same-template pairs with ``|sample_H - sample_L| <= window``, the loudest L1 partner per H1 trigger."""
    span = int(max(h["sample"].max(initial=0), l["sample"].max(initial=0))) + 2 * window + 1
    key_l = l["template"].astype(np.int64) * span + l["sample"]
    order = np.argsort(key_l)
    key_l = key_l[order]
    key_h = h["template"].astype(np.int64) * span + h["sample"]
    lo = np.searchsorted(key_l, key_h - window, side="left")
    hi = np.searchsorted(key_l, key_h + window, side="right")
    pairs_h, pairs_l = [], []
    for i in np.flatnonzero(hi > lo):  # few: a coincidence is rare in noise
        cand = order[lo[i]:hi[i]]
        pairs_h.append(i)
        pairs_l.append(cand[np.argmax(l["snr"][cand])])
    ih, il = np.asarray(pairs_h, dtype=np.int64), np.asarray(pairs_l, dtype=np.int64)
    return {"template": h["template"][ih], "sample_h": h["sample"][ih], "sample_l": l["sample"][il],
            "snr_h": h["snr"][ih], "snr_l": l["snr"][il],
            "stat": np.sqrt(h["snr"][ih].astype(np.float64) ** 2 + l["snr"][il].astype(np.float64) ** 2)}


def cache_key(data: StrainSet, k: int, det: str, bank_sha: str, fcfg: FilterConfig, search: SearchConfig) -> str:
    """Content key of one segment-detector's triggers: the data file (path, size, mtime), segment, bank, settings."""
    seg = data.segments[k]
    path = seg.sources[det][0]
    st = os.stat(path)
    ident = {"file": os.path.abspath(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
             "dataset": seg.sources[det][1], "start": seg.start, "n": seg.n_samples, "det": det, "bank": bank_sha, "filter": fcfg.key(),
             "conditioning": asdict(search.conditioning) | {"chunk_s": None}}
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:20]


def cached_triggers(cache_dir: Path, key: str, piece: int, compute) -> dict[str, np.ndarray]:
    """Triggers of one piece from the cache, or computed and cached atomically."""
    path = cache_dir / f"{key}_{piece}.npz"
    if path.is_file():
        with np.load(path) as z:
            return {k: z[k] for k in z.files}
    t0 = time.perf_counter()
    found = compute()
    found["seconds"] = np.array(time.perf_counter() - t0)  # what filtering the piece cost, when it was done
    buffer = io.BytesIO()
    np.savez(buffer, **found)
    atomic_write_bytes(path, buffer.getvalue())
    return found


def search_matched_filter(cfg: GWConfig, data_paths: Any, out: Path, search: SearchConfig = SearchConfig(),
                          fcfg: FilterConfig = FilterConfig(), bank_path: Path | None = None,
                          cache_dir: Path | None = None, timing: Path | None = None,
                          progress: bool = True) -> dict[str, Any]:
    """The matched-filter search (module docstring); writes ``out`` and ``out.json``, returns the summary."""
    t0 = time.perf_counter()
    if len(cfg.network) != 2:
        raise ValueError(f"the matched-filter search pairs two detectors; the config names {list(cfg.network)}")
    data = open_strain(data_paths)
    cond = search.conditioning
    check_data(data, cfg.network, cfg.sample_rate, max(cond.min_segment_s(fcfg.fft_s), fcfg.fft_s),
               "the matched-filter search")
    masses, record = load_full_bank(cfg, bank_path)
    templates = TemplateSet(cfg, masses, int(round(fcfg.fft_s * cfg.sample_rate)), record["sha256"])
    measured = read_timing(timing)
    offset = measured["offset_s"] if measured else 0.0
    var = measured["var_s"] if measured else LIGHT_TRAVEL_H1_L1_S + 0.02
    cache_dir = Path(cache_dir) if cache_dir else Path(out).parent / ".mf-cache"
    cache_dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".mfsearch-", dir=Path(out).parent))
    bar = _Bar(progress, data.duration * 2 * 2, "matched filter")
    cols: dict[str, list] = {"time": [], "stat": [], "slide": [], "snr_h1": [], "snr_l1": [], "template": []}
    n_triggers = {d: 0 for d in cfg.network}
    filter_s = 0.0  # seconds the per-detector filtering cost, cached pieces included (as measured then)
    try:
        segments = whiten_strain_set(data, cond, work, cfg.network, bar.advance_samples(data.sample_rate))
        t_cond = time.perf_counter()
        piece = int(round(fcfg.piece_s * data.sample_rate))
        for k, seg in enumerate(segments):
            trig = {}
            for det in cfg.network:
                key = cache_key(data, k, det, templates.sha256, fcfg, search)
                pieces = [cached_triggers(cache_dir, key, p0, lambda p0=p0: detector_triggers(
                    seg, det, templates, fcfg, p0, min(p0 + piece, seg.valid[1]),
                    bar.advance_samples(data.sample_rate))) for p0 in range(seg.valid[0], seg.valid[1], piece)]
                trig[det] = {n: np.concatenate([p[n] for p in pieces]) for n in ("template", "sample", "snr")}
                n_triggers[det] += len(trig[det]["snr"])
                filter_s += sum(float(p["seconds"]) for p in pieces)
            h, l = (trig[d] for d in cfg.network)
            window = int(np.ceil((LIGHT_TRAVEL_H1_L1_S + fcfg.coinc_margin_s) * seg.sample_rate))
            step = int(round(search.slide_step * seg.sample_rate))
            shifts = slide_shifts(search.slides, step, seg.n_valid, search.first_slide) if search.slides else \
                np.zeros(1, np.int64)
            for j, shift in enumerate(shifts):
                moved = dict(l, sample=unslid_index(l["sample"], seg.valid, int(shift)) if shift else l["sample"])
                c = coincidences(h, moved, window)
                times = seg.start + 0.5 * (c["sample_h"] + c["sample_l"]) / seg.sample_rate - offset
                keep = keep_loudest_within(times, c["stat"], search.cluster_s)
                for name, values in (("time", times), ("stat", c["stat"]), ("snr_h1", c["snr_h"]),
                                     ("snr_l1", c["snr_l"]), ("template", c["template"])):
                    cols[name].append(values[keep])
                cols["slide"].append(np.full(len(keep), j + search.first_slide if search.slides else 0))
    finally:
        bar.stop()
        shutil.rmtree(work, ignore_errors=True)
    cat = {k: np.concatenate(v) if v else np.zeros(0) for k, v in cols.items()}
    cat["var"] = np.full(len(cat["time"]), var)
    valid_s = sum(s.n_valid for s in segments) / data.sample_rate
    summary = _summary("matched_filter", search, data, valid_s, cat, time.perf_counter() - t0, t_cond - t0, {
        "n_templates": len(masses), "bank_sha256": record["sha256"], "filter_config": asdict(fcfg),
        "triggers_per_detector": n_triggers, "filter_seconds": filter_s,
        "compute_seconds_per_strain_second": (filter_s + t_cond - t0) / data.duration, "var_s": var,
        "timing_offset_s": offset,
        "timing_measured": bool(measured), "cache_dir": str(cache_dir), "data_paths": str(data_paths)})
    write_events(out, cat, {k: v for k, v in summary.items() if isinstance(v, (int, float, str))})
    atomic_write_bytes(Path(out).with_suffix(".json"), json_bytes(summary))
    return summary
