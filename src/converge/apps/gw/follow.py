"""``converge search gw --follow DIR``: analyse GWOSC files as they land, and measure the latency.

Files (one per detector and stretch, e.g. 4 s or 16 s, written atomically by rename) are taken in
GPS order once every detector's file for the next stretch has landed. The first ``psd_s`` seconds
set each detector's PSD and whitening filter (:mod:`.conditioning`; fixed from then on). Each step
whitens what the new data allows (the filter needs ``h`` samples ahead), analyses it, and writes the
events it can decide: the CNN closes an event once a window ``cluster_s`` past its last loud window
has been scored; the matched filter emits a coincidence once both detectors are filtered
``cluster_s`` past it, so that no louder one can still join it.

Latency of an event: the wall-clock time it is written, less the landing time (the file's mtime) of
the last file the step needed, i.e. of the stretch whose arrival let the event be decided. The first
analysis step works through the ``psd_s`` seconds that set the PSD: its events are marked ``warmup``
and left out of the latency statistics (a start-up cost, paid once). Events are rewritten atomically
after every step that adds some (time, stat, var, ``latency_s``, ``warmup``). The summary's
``busy_fraction`` (analysis time over wall time since the first file) says whether the search kept up.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from ...data.atomic import atomic_write_bytes, json_bytes
from .conditioning import fir_whiten, whitening_fir
from .datafile import _gwosc_header
from .events import cluster_in_time, keep_loudest_within, write_events
from .noise import welch_psd
from .strainfile import StrainFileError

PSD_S = 64.0  # s of data that set the PSD before the first analysis
POLL_S = 0.01  # s between looks at the folder


@dataclass
class Stream:
    """One detector's raw and whitened samples, kept from absolute sample ``raw0`` / ``white0`` on."""

    raw: np.ndarray = field(default_factory=lambda: np.zeros(0))
    raw0: int = 0
    white: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.float32))
    white0: int = 0
    fir: np.ndarray | None = None

    @property
    def raw_end(self) -> int:
        return self.raw0 + len(self.raw)

    @property
    def white_end(self) -> int:
        return self.white0 + len(self.white)

    def whiten_new(self, sample_rate: float, f_lower: float) -> None:
        """Set the filter from the data on first call, then whiten every sample the raw data now reaches."""
        if self.fir is None:
            freqs, psd = welch_psd(self.raw, sample_rate)
            self.fir = whitening_fir(freqs, psd, sample_rate, f_lower)
            self.white0 = self.raw0 + len(self.fir) // 2
        h = len(self.fir) // 2
        a, b = self.white_end, self.raw_end - h
        if b > a:
            new = fir_whiten(self.raw[a - h - self.raw0:b + h - self.raw0], self.fir).astype(np.float32)
            self.white = np.concatenate([self.white, new])

    def keep(self, raw_from: int, white_from: int) -> None:
        """Drop samples no later step needs (bounded memory)."""
        cut = max(0, min(raw_from - self.raw0, len(self.raw)))
        self.raw, self.raw0 = self.raw[cut:], self.raw0 + cut
        cut = max(0, min(white_from - self.white0, len(self.white)))
        self.white, self.white0 = self.white[cut:], self.white0 + cut


class Landing:
    """New GWOSC files in a folder, grouped into complete stretches (every detector) in GPS order."""

    def __init__(self, folder: Path, detectors: tuple[str, ...]) -> None:
        self.folder, self.detectors = Path(folder), detectors
        self.seen: set[str] = set()
        self.pending: dict[float, dict[str, tuple[Path, float]]] = {}
        self.next_gps: float | None = None

    def poll(self) -> list[tuple[float, dict[str, Path], float]]:
        """Complete stretches ready now: (GPS start, {detector: file}, landing time of the last file)."""
        for path in sorted(self.folder.iterdir()) if self.folder.is_dir() else []:
            if path.name in self.seen or path.name.startswith(".") or path.suffix not in (".hdf5", ".hdf", ".h5"):
                continue
            self.seen.add(path.name)
            det, gps, _, _ = _gwosc_header(path)
            if det in self.detectors:
                self.pending.setdefault(round(gps, 6), {})[det] = (path, path.stat().st_mtime)
        ready = []
        for gps in sorted(self.pending):
            group = self.pending[gps]
            if set(group) != set(self.detectors) or (self.next_gps is not None and gps != self.next_gps):
                break
            del self.pending[gps]
            ready.append((gps, {d: p for d, (p, _) in group.items()}, max(t for _, t in group.values())))
        return ready


def read_stretch(files: dict[str, Path], sample_rate: float) -> tuple[dict[str, np.ndarray], float]:
    """Samples of each detector's file of one stretch, and the stretch's duration [s]."""
    import h5py

    out, n = {}, set()
    for det, path in files.items():
        _, _, _, rate = _gwosc_header(path)
        if abs(rate - sample_rate) > 1e-6 * sample_rate:
            raise StrainFileError(f"{path}: {rate:g} Hz, but the search runs at {sample_rate:g} Hz")
        with h5py.File(path, "r") as f:
            out[det] = np.asarray(f["strain/Strain"][()], dtype=np.float64)
        if not np.isfinite(out[det]).all():
            raise StrainFileError(f"{path}: NaN/inf samples (a data gap); --follow needs gap-free stretches")
        n.add(len(out[det]))
    if len(n) != 1:
        raise StrainFileError(f"files of one stretch differ in length: {sorted(n)} samples")
    return out, n.pop() / sample_rate


def follow_loop(folder: Path, detectors: tuple[str, ...], sample_rate: float, f_lower: float,
                step: Callable[[dict[str, Stream], int, bool], tuple[list[tuple[float, float]], tuple[int, int]]],
                out: Path, var: float, idle_timeout: float, summary: dict[str, Any]) -> dict[str, Any]:
    """Feed landing stretches to ``step(streams, gps0_index, final)`` -> (events [(time, stat)], (raw_keep,
    white_keep)); record each event's latency; stop after ``idle_timeout`` s without a file."""
    landing = Landing(folder, detectors)
    streams = {d: Stream() for d in detectors}
    events: list[tuple[float, float, float, float]] = []  # time, stat, latency, warm-up
    gps0, last_new, processed_s, busy_s, t_first, warm = None, time.time(), 0.0, 0.0, None, True
    while time.time() - last_new < idle_timeout:
        ready = landing.poll()
        if not ready:
            time.sleep(POLL_S)
            continue
        for gps, files, landed in ready:
            last_new = time.time()
            t_step = time.perf_counter()
            data, duration = read_stretch(files, sample_rate)
            if gps0 is None:
                gps0, t_first = gps, time.time()
                for s in streams.values():
                    s.raw0 = 0
            landing.next_gps = gps + duration
            for det, s in streams.items():
                if int(round((gps - gps0) * sample_rate)) != s.raw_end:
                    raise StrainFileError(f"stretch at GPS {gps} does not follow the previous one: a gap")
                s.raw = np.concatenate([s.raw, data[det]])
            processed_s += duration
            if processed_s >= PSD_S:
                for s in streams.values():
                    s.whiten_new(sample_rate, f_lower)
                found, (raw_keep, white_keep) = step(streams, int(round(gps0 * sample_rate)), False)
                for s in streams.values():
                    s.keep(raw_keep, white_keep)
                if found:
                    new = len(events)
                    events += [(t, z, np.nan, float(warm)) for t, z in found]
                    _write(out, events, var, summary)
                    written = time.time()  # the events are on disk: their latency ends here
                    events[new:] = [(t, z, written - landed, w) for t, z, _, w in events[new:]]
                warm = False
            busy_s += time.perf_counter() - t_step
    if gps0 is not None and processed_s >= PSD_S:  # what the end of the data decides has no latency
        found, _ = step(streams, int(round(gps0 * sample_rate)), True)
        events += [(t, z, np.nan, 0.0) for t, z in found]
    _write(out, events, var, summary)
    latency = np.array([e[2] for e in events if np.isfinite(e[2]) and not e[3]]) * 1e3
    wall = time.time() - idle_timeout - t_first if t_first is not None else 0.0
    summary.update({"n_events": len(events), "analysed_s": processed_s, "background_s": 0.0,
                    "n_warmup_events": int(sum(e[3] for e in events)), "busy_fraction": busy_s / max(wall, 1e-9),
                    "seconds_per_strain_second": busy_s / max(processed_s, 1e-9),
                    "latency_ms": {"p50": float(np.percentile(latency, 50)) if len(latency) else None,
                                   "p99": float(np.percentile(latency, 99)) if len(latency) else None,
                                   "n": int(len(latency))}})
    atomic_write_bytes(Path(out).with_suffix(".json"), json_bytes(summary))
    return summary


def _write(out: Path, events: list, var: float, summary: dict) -> None:
    cols = np.array(events, dtype=np.float64).reshape(-1, 4)
    write_events(out, {"time": cols[:, 0], "stat": cols[:, 1], "var": np.full(len(cols), var),
                       "latency_s": cols[:, 2], "warmup": cols[:, 3]},
                 {"method": summary["method"], "kind": "foreground", "follow": 1})


def follow_cnn(run_dir: Path, folder: Path, out: Path, search, idle_timeout: float = 60.0,
               timing: Path | None = None) -> dict[str, Any]:
    """The CNN search in follow mode (module docstring)."""
    from ...config import from_dict
    from ...train.loop import load_model
    from .app import GWApp
    from .config import GWConfig
    from .search import default_var, inference_precision, windows_to_events
    from .timing import read_timing

    model, config = load_model(GWApp(), Path(run_dir))
    model = model.for_inference(copy_model=False)  # loaded for this search alone
    cfg = from_dict(GWConfig, config["app_config"], "app")
    measured = read_timing(Path(timing) if timing else Path(run_dir))
    offset = measured["offset_s"] if measured else 0.0
    var = measured["var_s"] if measured else default_var(cfg, search)
    n, stride = cfg.window_samples, max(1, int(round(search.stride * cfg.sample_rate)))
    merger = 0.5 * (cfg.merger_min + cfg.merger_max) - offset
    state = {"next": None, "t": [], "z": []}

    def step(streams: dict[str, Stream], gps0_index: int, final: bool):
        ends = [s.white_end for s in streams.values()]
        start = state["next"] if state["next"] is not None else max(s.white0 for s in streams.values())
        last = min(ends) - n
        found = []
        if last >= start:
            starts = np.arange(start, last + 1, stride)
            x = torch.stack([torch.from_numpy(np.ascontiguousarray(
                s.white[starts[0] - s.white0:starts[-1] + n - s.white0])).unfold(0, n, stride)
                for s in (streams[d] for d in cfg.network)], dim=1)  # (B, D, N)
            with torch.inference_mode(), inference_precision(search.precision):
                z = np.concatenate([model(b if cfg.coherent else b[:, 0]).float().numpy()
                                    for b in x.split(search.batch_size)])
            t = (gps0_index + starts) / cfg.sample_rate
            state["next"] = int(starts[-1]) + stride
            state["t_last"] = float(t[-1])
            above = z > search.threshold
            state["t"] += list(t[above])
            state["z"] += list(z[above])
        if state["t"]:
            t_all, z_all = np.array(state["t"]), np.array(state["z"])
            labels = cluster_in_time(t_all, z_all, search.cluster_s)
            still_open = not final and state["t_last"] - t_all[-1] <= search.cluster_s
            closed = labels < labels[-1] if still_open else np.ones(len(labels), bool)
            if closed.any():
                times, stats = windows_to_events(t_all[closed], z_all[closed], search.threshold,
                                                 search.cluster_s, merger)
                found = list(zip(times, stats))
            state["t"], state["z"] = list(t_all[~closed]), list(z_all[~closed])
        keep = state["next"] if state["next"] is not None else 0
        return found, (keep - 2 * n - 8 * cfg.sample_rate, keep)

    summary = {"method": "cnn", "kind": "foreground", "run": str(run_dir), "follow": str(folder), "var_s": var,
               "threads": torch.get_num_threads(), "psd_s": PSD_S}
    return follow_loop(Path(folder), cfg.network, cfg.sample_rate, search.f_lower, step, out, var, idle_timeout,
                       summary)


def follow_matched_filter(cfg, folder: Path, out: Path, search, fcfg, bank_path: Path | None = None,
                          idle_timeout: float = 60.0, timing: Path | None = None) -> dict[str, Any]:
    """The matched-filter search in follow mode (module docstring)."""
    from .fullbank import load_full_bank
    from .mfsearch import TemplateSet, coincidences, filter_triggers
    from .slides import LIGHT_TRAVEL_H1_L1_S
    from .timing import read_timing

    measured = read_timing(timing)
    offset = measured["offset_s"] if measured else 0.0
    var = measured["var_s"] if measured else LIGHT_TRAVEL_H1_L1_S + 0.02
    masses, record = load_full_bank(cfg, bank_path)
    templates = TemplateSet(cfg, masses, int(round(fcfg.fft_s * cfg.sample_rate)), record["sha256"])
    fs, hw = cfg.sample_rate, int(round(fcfg.cluster_s / 2 * cfg.sample_rate))
    window = int(np.ceil((LIGHT_TRAVEL_H1_L1_S + fcfg.coinc_margin_s) * fs))
    state: dict[str, Any] = {"done": {}, "spectra": {}, "trig": {d: [] for d in cfg.network}, "decided": set()}

    def step(streams: dict[str, Stream], gps0_index: int, final: bool):
        for det, s in streams.items():
            if det not in state["spectra"]:
                state["spectra"][det] = templates.whitened(s.fir)
                state["done"][det] = s.white0 + templates.pre
            stop = s.white_end - templates.post - hw
            start = state["done"][det]
            if stop > start:
                tr = filter_triggers(s.white, state["spectra"][det], templates, fcfg, start - s.white0,
                                     stop - s.white0, fs)
                tr["sample"] = tr["sample"] + s.white0
                state["trig"][det].append(tr)
                state["done"][det] = stop
        done = min(state["done"].values())
        h, l = ({k: np.concatenate([t[k] for t in state["trig"][d]]) if state["trig"][d] else np.zeros(0)
                 for k in ("template", "sample", "snr")} for d in cfg.network)
        found = []
        if len(h["snr"]) and len(l["snr"]):
            c = coincidences({**h, "template": h["template"].astype(np.int32)},
                             {**l, "template": l["template"].astype(np.int32)}, window)
            mid = 0.5 * (c["sample_h"] + c["sample_l"])
            ready = mid < done - window - int(fcfg.cluster_s * fs) if not final else np.ones(len(mid), bool)
            keys = list(zip(c["sample_h"].tolist(), c["template"].tolist()))
            loudest = set(keep_loudest_within(mid / fs, c["stat"], search.cluster_s).tolist())
            for i in np.flatnonzero(ready):  # each coincidence is decided once: emitted or outshone
                if keys[i] in state["decided"]:
                    continue
                state["decided"].add(keys[i])
                if i in loudest:
                    found.append(((gps0_index + mid[i]) / fs - offset, float(c["stat"][i])))
            cut = done - window - 2 * int(fcfg.cluster_s * fs)
            for d in cfg.network:  # triggers no undecided coincidence can use
                state["trig"][d] = [{k: v[t["sample"] >= cut] for k, v in t.items()} for t in state["trig"][d]]
            state["decided"] = {k for k in state["decided"] if k[0] >= cut - window}
        need = min(state["done"].values()) - templates.pre - hw
        return found, (need - int(8 * fs), need)

    summary = {"method": "matched_filter", "kind": "foreground", "follow": str(folder), "var_s": var,
               "n_templates": len(masses), "threads": torch.get_num_threads(), "psd_s": PSD_S}
    return follow_loop(Path(folder), cfg.network, cfg.sample_rate, search.f_lower, step, out, var, idle_timeout,
                       summary)


def feed_stretches(data, folder: Path, stretch_s: float, cadence_s: float, max_s: float | None = None,
                   start_s: float = 0.0) -> int:
    """Land a :class:`~.datafile.StrainSet`'s first segment in ``folder`` as GWOSC files of ``stretch_s``
    seconds, one stretch (every detector) every ``cadence_s`` wall-clock seconds (``stretch_s``: real time);
    files are written atomically (temp, rename), so a follower never sees half a file. Returns stretches fed."""
    from .strainfile import Strain, write_strain

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    seg = data.segments[0]
    n = int(round(stretch_s * seg.sample_rate))
    first = int(round(start_s * seg.sample_rate))
    last = seg.n_samples if max_s is None else min(seg.n_samples, first + int(round(max_s * seg.sample_rate)))
    fed, t_next = 0, time.time()
    for i in range(first, last - n + 1, n):
        gps = seg.start + i / seg.sample_rate
        for det in data.detectors:
            name = f"{det[0]}-{det}_CONVERGE-{gps:.0f}-{stretch_s:g}.hdf5"
            write_strain(folder / name, Strain(data.read(0, det, i, i + n), seg.sample_rate, gps, det))
        fed += 1
        t_next += cadence_s
        time.sleep(max(0.0, t_next - time.time()))
    return fed
